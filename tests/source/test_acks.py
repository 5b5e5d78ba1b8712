"""Acks map to commits: a delivery is acked once Spark has committed the batch that holds it, not earlier,
and then promptly (docs/design.md, the ack semantics).

The probe is a foreachBatch sink: while batch N runs, it asks the broker how many of the queue's messages
it still holds (ready + unacked). Nothing of batch N or later may be acked yet, and every earlier batch
must be acked already (Spark committed it before planning N), so the broker holds exactly the messages
published minus those of batches before N.
"""

from __future__ import annotations

import time

import pytest

from spark_amqp.pyspark_versions import ADMISSION_CONTROL   # PySpark >= 4.2

from source_helpers import Collector, checkpoint, run_available_now, stream
from waiting import wait_until


def test_batch_is_unacked_while_it_runs_and_acked_after_its_commit(spark, env, tmp_path):
    total = 30
    q = env.queue("acktiming")
    env.publish(q, [f"m{i}" for i in range(total)])

    counts: dict[int, int] = {}         # batch id -> rows

    def probe(batch_id, rows):
        counts[batch_id] = len(rows)
        acked_before = sum(n for b, n in counts.items() if b < batch_id)
        expected = total - acked_before
        # The previous batch's ack is sent before this batch is planned; give the broker a moment to
        # have processed it, but a value below `expected` (this batch acked early) never comes back up.
        deadline = time.monotonic() + 5
        while True:
            ready, unacked = env.state(q)
            if ready + unacked == expected or time.monotonic() > deadline:
                return expected, ready, unacked

    sink = Collector(probe)
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=10).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds")
             .start())
    wait_until(lambda: len(sink.rows) >= total or query.exception(), 60, interval=0.1, message="all rows")
    assert query.exception() is None
    assert sorted(sink.bodies()) == sorted(f"m{i}".encode() for i in range(total))
    assert len([b for b in sink.batches if sink.batches[b]]) >= 3, "maxMessagesPerTrigger=10 gave <3 batches"

    for batch_id, (expected, ready, unacked) in sorted(sink.probes.items()):
        rows = len(sink.batches[batch_id])
        assert ready + unacked == expected, (
            f"batch {batch_id} ({rows} rows): the broker held {ready} ready + {unacked} unacked while it "
            f"ran; expected {expected} (acked exactly the {total - expected} rows of earlier batches)")
        assert unacked >= rows, f"batch {batch_id}: its own {rows} deliveries must be unacked while it runs"

    # After the last batch's commit the next trigger acks it while the query keeps running.
    env.wait_state(q, (0, 0), timeout=15, query=query)
    query.stop()


# The source's own timing, the same on every broker; RabbitMQ's state costs a rabbitmqctl call per probe.
@pytest.mark.parametrize("broker_url", ["embedded", "rabbitmq4"], indirect=True)
def test_with_a_journal_a_batch_is_acked_once_its_file_is_written_before_it_runs(spark, env, tmp_path):
    """ackAt=journal (journalPath's default on PySpark 4.2+): while batch N runs, the broker holds only the
    messages of later batches (N's own were acked when its journal file was durable); with ackAt=commit, N's
    too."""
    total = 30
    for ack_at in ("journal", "commit"):
        q = env.queue(f"ackat{ack_at}")
        env.publish(q, [f"m{i}" for i in range(total)])
        counts: dict[int, int] = {}

        def probe(batch_id, rows):
            counts[batch_id] = len(rows)
            acked = sum(n for b, n in counts.items() if b < batch_id or (ack_at == "journal" and b == batch_id))
            expected = total - acked
            deadline = time.monotonic() + 5
            while True:
                ready, unacked = env.state(q)
                if ready + unacked == expected or time.monotonic() > deadline:
                    return expected, ready + unacked

        sink = Collector(probe)
        query = (stream(spark, env.url, q, maxMessagesPerTrigger=10, journalPath=str(tmp_path / f"j-{ack_at}"),
                        ackAt=ack_at)
                 .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path, ack_at))
                 .trigger(processingTime="200 milliseconds").start())
        wait_until(lambda: len(sink.rows) >= total or query.exception(), 60, interval=0.1, message="all rows")
        query.stop()
        assert query.exception() is None
        assert sorted(sink.bodies()) == sorted(f"m{i}".encode() for i in range(total))
        assert len([b for b in sink.batches if sink.batches[b]]) >= 3
        for batch_id, (expected, held) in sorted(sink.probes.items()):
            assert held == expected, (f"ackAt={ack_at}, batch {batch_id}: the broker held {held} messages "
                                      f"while it ran; expected {expected}")


def test_idle_stream_acks_its_last_batch_while_the_query_runs(spark, env, tmp_path):
    q = env.queue("idle")
    env.publish(q, [f"i{i}" for i in range(6)])
    sink = Collector()
    query = (stream(spark, env.url, q).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="100 milliseconds")
             .start())
    wait_until(lambda: len(sink.rows) >= 6 or query.exception(), 60, interval=0.1, message="6 rows")
    batches_when_done = len(sink.order)
    # No new messages: the query idles; within a few triggers its last batch must be acked.
    env.wait_state(q, (0, 0), timeout=10, query=query)
    assert query.isActive
    assert len(sink.order) == batches_when_done, "an idle stream ran another batch with rows"
    assert sorted(sink.bodies()) == sorted(f"i{i}".encode() for i in range(6))
    query.stop()


def test_available_now_leaves_nothing_unacked_and_a_second_run_reads_no_duplicate(spark, env, tmp_path):
    q = env.queue("availnow")
    chk = checkpoint(tmp_path)
    env.publish(q, [f"a{i}" for i in range(10)])

    def run(collector):
        return lambda: (stream(spark, env.url, q, maxMessagesPerTrigger=4).writeStream.foreachBatch(collector)
                        .option("checkpointLocation", chk).trigger(availableNow=True).start())

    first = Collector()
    run_available_now(run(first))          # on PySpark 4.0/4.1: one run per batch, until one reads nothing
    assert sorted(first.bodies()) == sorted(f"a{i}".encode() for i in range(10))
    assert env.state(q) == (0, 0), "after an availableNow run nothing may stay ready or unacked"

    # Same checkpoint, nothing new: a second run must read nothing.
    second = Collector()
    assert run_available_now(run(second)) == 1
    assert second.bodies() == [], f"the second run re-read {second.bodies()}"

    # Same checkpoint, new messages: exactly those. (The finished run's consumer leaves just after
    # awaitTermination returns; a message published before that would reach it and come back redelivered.)
    env.wait_no_consumer(q)
    env.publish(q, [f"b{i}" for i in range(5)])
    third = Collector()
    run_available_now(run(third))
    assert sorted(third.bodies()) == sorted(f"b{i}".encode() for i in range(5))
    every_row = first.rows + third.rows
    assert len({bytes(r.body) for r in every_row}) == len(every_row), "a message was read twice"
    if ADMISSION_CONTROL:
        assert [bytes(r.body) for r in every_row if r.redelivered] == []
    # (On PySpark 4.0/4.1 a run's consumer receives more than its one batch; what it did not take comes
    # back to the next run with redelivered=true, though no run had read it.)
    assert env.state(q) == (0, 0)


@pytest.mark.skipif(not ADMISSION_CONTROL, reason="needs PySpark >= 4.2: acks at the journal write and "
                                                  "availableNow in batches")
@pytest.mark.parametrize("broker_url", ["embedded", "rabbitmq4"], indirect=True)
def test_with_a_journal_an_available_now_batch_fills_in_parts_past_the_prefetch(spark, env, tmp_path):
    """availableNow with journalPath: a batch fills part by part, each part journaled and acked as it comes,
    so a batch is not bounded by the prefetch (the most the broker lets this consumer hold unacked): with
    prefetch 1,000 a batch takes far more than 1,000 rows, every message is read once, nothing stays
    unacked, and the committed batches' journal files are gone."""
    total = 12_000
    q = env.queue("parts")
    env.publish_bulk(q, [f"p{i}".encode() for i in range(total)])
    sink = Collector()
    journal = tmp_path / "journal"
    run_available_now(lambda: stream(spark, env.url, q, prefetch=1000, journalPath=str(journal))
                      .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
                      .trigger(availableNow=True).start())
    assert sorted(sink.bodies()) == sorted(f"p{i}".encode() for i in range(total))
    sizes = [len(rows) for rows in sink.batches.values() if rows]
    assert max(sizes) > 2 * 1000, f"batch sizes {sizes}: a batch held no more than the prefetch allows"
    env.wait_state(q, (0, 0), timeout=10)
    left = sorted(p.name for p in journal.iterdir())
    assert all(name.startswith(("batch-", "committed-")) for name in left), left
    assert len({name.split("-")[1] for name in left}) <= 1, f"files of committed batches left: {left}"


@pytest.mark.skipif(not ADMISSION_CONTROL, reason="needs PySpark >= 4.2: acks at the journal write and "
                                                  "availableNow in batches")
@pytest.mark.parametrize("broker_url", ["embedded", "rabbitmq4"], indirect=True)
def test_with_a_journal_the_next_batch_fills_while_spark_runs_one(spark, env, tmp_path):
    """availableNow with journalPath: while Spark runs batch N, the source goes on taking, journaling and
    acking the deliveries of batch N + 1 (the prefill): 3 s into the first batch the broker holds (ready and
    unacked) far less than the messages after that batch; a consumer that waited for the next trigger would
    have taken at most its prefetch (1,000 here), still counted as unacked. Every message is read once, in
    batches of maxMessagesPerTrigger, and nothing stays unacked."""
    total, per_batch = 40_000, 10_000
    q = env.queue("prefill")
    env.publish_bulk(q, [f"p{i}".encode() for i in range(total)])

    def probe(batch_id, rows):     # what the broker holds 3 s into batch N
        time.sleep(3)
        return sum(env.state(q))

    sink = Collector(probe)
    run_available_now(lambda: stream(spark, env.url, q, prefetch=1000, maxMessagesPerTrigger=per_batch,
                                     journalPath=str(tmp_path / "journal"))
                      .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
                      .trigger(availableNow=True).start())
    assert sorted(sink.bodies()) == sorted(f"p{i}".encode() for i in range(total))
    sizes = [len(rows) for rows in sink.batches.values() if rows]
    assert sizes == [per_batch] * (total // per_batch), sizes
    held = sink.probes[min(sink.batches)]
    assert held < total - per_batch - 5 * 1000, f"3 s into the first batch the broker held {held} messages"
    env.wait_state(q, (0, 0), timeout=10)
