"""At-least-once across restarts: after query.stop(), and after the driver process is killed (kill -9),
a restart from the same checkpoint delivers every message at least once and the queue drains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from source_helpers import Collector, checkpoint, run_available_now, stream
from waiting import wait_until

JOB = Path(__file__).with_name("stream_job.py")


def _check_duplicates_are_redelivered(rows) -> None:
    """A message seen twice was redelivered by the broker: its later copies carry redelivered=true."""
    seen = Counter(bytes(r.body) for r in rows)
    for body, n in seen.items():
        if n > 1:
            assert any(r.redelivered for r in rows if bytes(r.body) == body), (
                f"{body!r} arrived {n} times, never flagged redelivered")


def test_restart_after_stop_delivers_everything_at_least_once(spark, env, tmp_path):
    total = 30
    q = env.queue("restart")
    chk = checkpoint(tmp_path)
    env.publish(q, [f"r{i}" for i in range(total)])

    first = Collector()
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=5).writeStream.foreachBatch(first)
             .option("checkpointLocation", chk).trigger(processingTime="300 milliseconds").start())
    wait_until(lambda: len(first.rows) >= 5 or query.exception(), 60, interval=0.1, message="a first batch")
    query.stop()
    assert query.exception() is None
    env.wait_no_consumer(q)
    # The stopped query's unacked deliveries are back in the queue; nothing is held unacked. (Its last
    # committed batch may be among them: it is acked only by the next trigger, which never came.)
    ready, unacked = env.state(q)
    assert unacked == 0 and total - len(first.rows) <= ready <= total, (ready, unacked, len(first.rows))

    env.publish(q, [f"s{i}" for i in range(5)])
    second = Collector()
    run_available_now(lambda: stream(spark, env.url, q, maxMessagesPerTrigger=15).writeStream
                      .foreachBatch(second).option("checkpointLocation", chk).trigger(availableNow=True).start(),
                      timeout=90)

    rows = first.rows + second.rows
    expected = {f"r{i}".encode() for i in range(total)} | {f"s{i}".encode() for i in range(5)}
    assert set(bytes(r.body) for r in rows) == expected, "messages lost across the restart"
    _check_duplicates_are_redelivered(rows)
    assert env.state(q) == (0, 0), "the queue did not drain"


def _job(env_url, queue, chk, out, mode) -> subprocess.Popen:
    """The job in its own driver process: small batches while it streams (so that it is killed between
    batches), larger ones to drain (on PySpark 4.0/4.1 an availableNow run reads one batch)."""
    child_env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    per_trigger = "5" if mode == "stream" else "20"
    return subprocess.Popen([sys.executable, str(JOB), env_url, queue, chk, str(out), mode, per_trigger],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                            start_new_session=True)


def _read_output(out: Path) -> list[tuple[bytes, bool]]:
    rows = []
    for f in sorted(out.glob("*.txt")):
        for line in f.read_text().splitlines():
            body, redelivered = line.split("\t")
            rows.append((body.encode(), redelivered == "True"))
    return rows


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill what is left of a job we started (its JVM and Python workers share its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)


def test_restart_after_killing_the_driver_delivers_everything_at_least_once(env, tmp_path):
    total = 60
    q = env.queue("kill")
    chk = checkpoint(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env.publish(q, [f"k{i}" for i in range(total)])

    job = _job(env.url, q, chk, out, "stream")
    try:
        wait_until(lambda: len(list(out.glob("*.txt"))) >= 2 or job.poll() is not None, 120, interval=0.1,
                   message="two batches from the first driver")
        assert job.poll() is None, f"the first job ended on its own:\n{job.stdout.read()}"
        os.kill(job.pid, signal.SIGKILL)               # the driver only, mid-stream
        job.wait(timeout=30)
        before = _read_output(out)
        assert len(before) < total, "the first driver finished before it was killed; nothing to test"
        # The driver is gone: its AMQP connection must go too, and what it held returns to the queue.
        # (The JVM may outlive the Python driver by a moment and ack a batch Spark had committed.)
        wait_until(lambda: env.state(q)[1] == 0, 30, interval=0.2,
                   message="the killed driver's unacked deliveries to return to the queue")
        env.wait_no_consumer(q, timeout=30)
    finally:
        _kill_group(job)

    job = _job(env.url, q, chk, out, "availableNow")
    try:
        log, _ = job.communicate(timeout=180)
    finally:
        _kill_group(job)
    assert job.returncode == 0, f"the restarted job failed:\n{log[-3000:]}"

    rows = _read_output(out)
    assert {b for b, _ in rows} == {f"k{i}".encode() for i in range(total)}, "messages lost after kill -9"
    for body, n in Counter(b for b, _ in rows).items():
        if n > 1:
            assert any(r for b, r in rows if b == body), f"{body!r} arrived {n} times, never redelivered"
    env.wait_state(q, (0, 0), timeout=10)
