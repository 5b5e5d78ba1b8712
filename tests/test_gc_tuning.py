"""The collector thresholds the streaming source sets in its driver process (`gc_tuning`): raised to
THRESHOLDS, never lowered, checked in a fresh interpreter of its own."""

from __future__ import annotations

import subprocess
import sys

from spark_amqp.gc_tuning import THRESHOLDS


def thresholds_after(before: tuple[int, int, int]) -> tuple[int, ...]:
    code = ("import gc; gc.set_threshold(%d, %d, %d); from spark_amqp import gc_tuning; "
            "gc_tuning.for_message_holding_process(); print(*gc.get_threshold())" % before)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return tuple(int(v) for v in out.split())


def test_the_defaults_are_raised_to_the_tuned_thresholds():
    assert thresholds_after((700, 10, 10)) == THRESHOLDS


def test_thresholds_already_higher_are_kept():
    assert thresholds_after((500_000, 5, 1000)) == (500_000, THRESHOLDS[1], 1000)
