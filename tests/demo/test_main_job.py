"""The README's main job runs end to end on a fresh install: broker, producer, pipeline, report."""

import subprocess
import sys

import pytest


@pytest.mark.own_spark
def test_demo_pipeline_delivers_every_event():
    proc = subprocess.run([sys.executable, "-m", "spark_amqp_demo", "--events", "600", "--rate", "0",
                           "--timeout", "240"],
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\nSTDOUT:\n{out[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    assert "== done: 600 events in, 600 results out" in out, out[-3000:]
    assert "batch" in out and "rows/s" in out      # live progress was shown
