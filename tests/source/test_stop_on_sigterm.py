"""Spark ends its Python source runner with SIGTERM and never calls the reader's stop() itself: queue mode
stops on SIGTERM (docs/design.md, "Acks"). A process that installs the handler, as the runner does through
`_session()`, runs stop() once on SIGTERM and then ends as SIGTERM ends it, even when the signal came while
its main thread held a lock stop() needs; a stop already running is left to finish."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

SCRIPT = """
import os, signal, sys, threading, time
from spark_amqp.source.queue_mode import _stop_on_sigterm
lock = threading.Lock()

class Reader:
    stopping = False

    def stop(self):
        self.stopping = True
        with open(sys.argv[1], "a") as f:
            f.write("stop\\n")
        if sys.argv[2] == "blocked":
            with lock:                  # held by the main thread: this stop never finishes
                pass

reader = Reader()
_stop_on_sigterm(reader)
if sys.argv[2] == "blocked":
    lock.acquire()
if sys.argv[2] == "stopping":         # the runner's own stop, in its main thread, when the signals come
    reader.stopping = True
    print("ready", flush=True)
    time.sleep(1.0)
    with open(sys.argv[1], "a") as f:
        f.write("own stop done\\n")
    sys.exit(3)
print("ready", flush=True)
time.sleep(60)
"""


def run(tmp_path, mode: str) -> tuple[int, str, float]:
    marks = tmp_path / f"stops-{mode}"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(marks), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)     # Spark may send it twice
    code = proc.wait(timeout=30)
    return code, marks.read_text() if marks.exists() else "", time.monotonic() - started


def test_sigterm_stops_the_reader_once_then_ends_the_process(tmp_path):
    code, marks, took = run(tmp_path, "plain")
    assert (code, marks) == (-signal.SIGTERM, "stop\n")
    assert took < 3


def test_a_stop_that_cannot_finish_does_not_keep_the_process_alive(tmp_path):
    from spark_amqp.source.queue_mode import STOP_ON_SIGTERM_TIMEOUT

    code, marks, took = run(tmp_path, "blocked")
    assert (code, marks) == (-signal.SIGTERM, "stop\n")
    assert STOP_ON_SIGTERM_TIMEOUT - 0.5 < took < STOP_ON_SIGTERM_TIMEOUT + 5


def test_a_stop_already_running_is_left_to_finish(tmp_path):
    """The runner calls stop() itself when Spark closes its socket, as the SIGTERM comes: no second stop."""
    code, marks, took = run(tmp_path, "stopping")
    assert (code, marks) == (3, "own stop done\n")
