"""At-least-once across restarts: after query.stop(), and after the driver process is killed (kill -9),
a restart from the same checkpoint delivers every message at least once and the queue drains.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from source_helpers import (Collector, checkpoint, job_rows, job_spec, kill_group, run_available_now, start_job,
                            stream)
from waiting import wait_until


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
    # committed batch may be among them: it is acked only by the next trigger, which never came.) The
    # consumers go first, then the connection with what they held.
    ready, unacked = wait_until(lambda: (s := env.state(q))[1] == 0 and s, 10, interval=0.1,
                                message=lambda: f"the stopped query's deliveries back in {q}: {env.state(q)}")
    assert total - len(first.rows) <= ready <= total, (ready, unacked, len(first.rows))

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


# RabbitMQ only: the embedded broker is killed under (and with) a journal in test_faults.py, whose driver
# restarts cost as much as this test's.
@pytest.mark.own_spark
@pytest.mark.parametrize("broker_url", ["rabbitmq"], indirect=True)
def test_restart_after_killing_the_driver_delivers_everything_at_least_once(env, tmp_path):
    total = 60
    q = env.queue("kill")
    chk = checkpoint(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env.publish(q, [f"k{i}" for i in range(total)])

    job = start_job("stream", 5, job_spec(env.url, q, chk, out))
    try:
        wait_until(lambda: len(list(out.glob("*.txt"))) >= 2 or job.poll() is not None, 120, interval=0.1,
                   message="two batches from the first driver")
        assert job.poll() is None, f"the first job ended on its own:\n{job.stdout.read()}"
        os.kill(job.pid, signal.SIGKILL)               # the driver only, mid-stream
        job.wait(timeout=30)
        before = job_rows(out)
        assert len(before) < total, "the first driver finished before it was killed; nothing to test"
        # The driver is gone: its AMQP connection must go too, and what it held returns to the queue.
        # (The JVM may outlive the Python driver by a moment and ack a batch Spark had committed.)
        wait_until(lambda: env.state(q)[1] == 0, 30, interval=0.2,
                   message="the killed driver's unacked deliveries to return to the queue")
        env.wait_no_consumer(q, timeout=30)
    finally:
        kill_group(job)

    # (On PySpark 4.0/4.1 an availableNow run reads one batch: larger ones drain in fewer runs.)
    job = start_job("availableNow", 20, job_spec(env.url, q, chk, out))
    try:
        log, _ = job.communicate(timeout=180)
    finally:
        kill_group(job)
    assert job.returncode == 0, f"the restarted job failed:\n{log[-3000:]}"

    rows = job_rows(out)
    assert {b for b, _ in rows} == {f"k{i}".encode() for i in range(total)}, "messages lost after kill -9"
    for body, n in Counter(b for b, _ in rows).items():
        if n > 1:
            assert any(r for b, r in rows if b == body), f"{body!r} arrived {n} times, never redelivered"
    env.wait_state(q, (0, 0), timeout=10)
