"""Queue mode over quorum queues, on every broker of `broker_url` (the embedded broker as RabbitMQ 4.3,
RabbitMQ 3.10 and RabbitMQ 4.3).

A quorum queue counts the times each message went back to it (`x-delivery-count`, and on 4.x
`x-acquired-count`) and dead-letters a message past its delivery limit. The source acks a batch at its
commit, so a batch that fails goes back whole; a query whose batch fails on one message (a poison message)
fails on every restart until the limit dead-letters that batch. What counts differs by version: 4.x counts
a channel close or a lost connection (the deliveries of a failed batch) and not the source's nack of the
deliveries it held in no batch; 3.10 counts both (docs/operations.md, "Poison messages").
"""

from __future__ import annotations

import pytest
from pyspark.errors import StreamingQueryException

from brokers import ALL_BROKERS
from source_helpers import checkpoint, needs_admission_control, stream
from waiting import wait_until

# 3.10 too: what a quorum queue counts differs by version.
pytestmark = pytest.mark.parametrize("broker_url", ALL_BROKERS, indirect=True)


def run_until_done(spark, env, queue: str, chk: str, process, runs: int, back, **options) -> int:
    """Start availableNow runs from checkpoint `chk` until one ends without error (at most `runs`);
    returns how many failed. After a failed run, the next starts once the queue holds `back()` messages
    ready and none unacked: a quorum queue applies the returns through its log, and RabbitMQ's queue
    counts lag behind it, so "none unacked" alone showed before every return was ready. A run that
    started earlier counted fewer, and ended without the rest."""
    failed = 0
    for _ in range(runs):
        query = (stream(spark, env.url, queue, **options).writeStream.foreachBatch(process)
                 .option("checkpointLocation", chk).trigger(availableNow=True).start())
        try:
            assert query.awaitTermination(90), "an availableNow run did not end"
            return failed
        except StreamingQueryException as exc:     # awaitTermination raises the query's error
            assert "poison" in str(exc), exc
            failed += 1
            wait_until(lambda: env.state(queue) == (back(), 0), 30, interval=0.5,
                       message=lambda: f"the failed run's deliveries back in the queue: (ready, unacked) "
                                       f"{env.state(queue)}, expected ({back()}, 0)")
    raise AssertionError(f"{runs} runs all failed")


@needs_admission_control      # each run reads to the end (PySpark 4.0/4.1: one batch per availableNow run)
def test_a_failed_batch_comes_back_redelivered_with_its_counts_and_is_acked_at_commit(spark, env, node_version,
                                                                                      tmp_path):
    q = env.quorum_queue("work")
    env.publish(q, [f"m{i}" for i in range(10)])
    seen: list[list] = []

    def process(df, batch_id):
        rows = df.collect()
        seen.append(rows)
        if len(seen) == 1:
            raise ValueError("poison: the first attempt fails")

    assert run_until_done(spark, env, q, checkpoint(tmp_path), process, runs=3, back=lambda: 10) == 1
    first, again = seen[0], seen[1]
    assert sorted(bytes(r.body) for r in again) == sorted(f"m{i}".encode() for i in range(10))
    assert not any(r.redelivered for r in first) and all(r.redelivered for r in again)
    # Both versions count the failed run's connection close; 4.x also counts every acquisition.
    assert {r.headers.get("x-delivery-count") for r in again} == {"1"}
    assert {r.headers.get("x-acquired-count") for r in again} == ({None} if node_version == "3.10" else {"1"})
    env.wait_state(q, (0, 0))


@needs_admission_control
def test_a_poison_message_is_dead_lettered_by_the_delivery_limit_and_the_query_goes_on(spark, env, tmp_path):
    """m7 fails its batch every time. With x-delivery-limit 2 the quorum queue dead-letters m7's batch
    (m5..m9) after the third failed run, and the fourth run ends without error. Every message ends in the
    output or in the dead-letter queue, none in both, none twice. The deliveries the source held in no
    batch (m10..m19) go back with a nack at each failed run (a return on 3.10, none on 4.x), and the next
    run reads them before the failing batch comes round again."""
    limit = 2
    dead = env.queue("dead")
    q = env.quorum_queue("work", **{"x-delivery-limit": limit, "x-dead-letter-exchange": "",
                                    "x-dead-letter-routing-key": dead})
    ids = [f"m{i}".encode() for i in range(20)]
    env.publish(q, ids)
    done: list[bytes] = []

    def process(df, batch_id):
        bodies = [bytes(r.body) for r in df.collect()]
        if b"m7" in bodies:
            raise ValueError("poison: m7")
        done.extend(bodies)

    def back():     # what neither reached the output nor was dead-lettered
        return len(ids) - len(done) - env.state(dead)[0]

    failed = run_until_done(spark, env, q, checkpoint(tmp_path), process, runs=limit + 3, back=back,
                            maxMessagesPerTrigger=5)
    assert failed == limit + 1

    ch = env.channel()
    dead_letters = []
    while (got := ch.basic_get(dead, auto_ack=True))[0] is not None:
        dead_letters.append(got)
    assert sorted(body for _m, _p, body in dead_letters) == sorted(ids[5:10])
    assert sorted(done) == sorted(ids[:5] + ids[10:])
    x_death = dead_letters[0][1].headers["x-death"][0]
    assert (x_death["reason"], x_death["queue"]) == ("delivery_limit", q)
    env.wait_state(q, (0, 0))
