"""Batch sizes and triggers: maxMessagesPerTrigger, availableNow over a backlog, several queues."""

from __future__ import annotations

import threading
import time

from chispa import assert_df_equality

from proxies import Proxy
from source_helpers import Collector, checkpoint, needs_admission_control, stream
from spark_amqp.options import parse
from spark_amqp.pyspark_versions import ReadAllAvailable
from spark_amqp.source import queue_mode
from waiting import wait_until


def test_max_messages_per_trigger_bounds_each_batch(spark, env, tmp_path):
    q = env.queue("maxpertrigger")
    env.publish(q, [f"m{i}" for i in range(25)])
    sink = Collector()
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=10).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds")
             .start())
    # The progress of a batch is reported after its rows reached the sink: wait for the progress.
    wait_until(lambda: sum(p["numInputRows"] for p in query.recentProgress) >= 25 or query.exception(), 60,
               interval=0.1, message="25 rows in the query's progress")
    query.stop()
    assert query.exception() is None
    sizes = [p["numInputRows"] for p in query.recentProgress]
    assert sum(sizes) == 25, sizes
    assert all(n <= 10 for n in sizes), f"a batch exceeded maxMessagesPerTrigger=10: {sizes}"
    assert len([n for n in sizes if n]) >= 3, sizes
    assert sorted(len(rows) for rows in sink.batches.values() if rows) == sorted(n for n in sizes if n)


@needs_admission_control
def test_available_now_drains_a_backlog_and_stops(spark, env, tmp_path):
    total = 300
    q = env.queue("backlog")
    env.publish(q, [f"b{i:03d}" for i in range(total)])
    sink = Collector()
    # prefetch 40 is far below the backlog: the run must keep taking batches until the backlog is gone.
    query = (stream(spark, env.url, q, prefetch=40).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(90), "availableNow did not stop by itself"
    assert not query.isActive
    assert query.exception() is None
    assert sorted(sink.bodies()) == [f"b{i:03d}".encode() for i in range(total)]
    assert env.state(q) == (0, 0)


@needs_admission_control
def test_available_now_reads_a_backlog_larger_than_a_batch_in_one_run(spark, env, tmp_path):
    # The run counts the backlog before its consumers start. Counted while the broker pushes deliveries
    # (a prefetch of 70,000, spread over two channels), those on the wire would be missed and the run
    # would stop that many short.
    total = 70_000
    q = env.queue("bigbacklog")
    env.publish_bulk(q, [b"%06d" % i for i in range(total)])
    query = (stream(spark, env.url, q, prefetch=total).writeStream.format("noop")
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(180), "availableNow did not stop by itself"
    assert query.exception() is None
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    assert rows == total, f"one availableNow run read {rows} rows of a backlog of {total}"
    assert env.state(q) == (0, 0)


@needs_admission_control
def test_an_available_now_batch_keeps_filling_across_a_pause_of_the_broker(env):
    """The driver's side alone, called as Spark calls it (no Spark here): the deliveries of an availableNow
    run's first batch (8,000 x 4 KB) stop for 0.3 s part way, the link to the broker frozen, as RabbitMQ
    stops sending while its queue process collects garbage. The batch is planned whole once they resume,
    not cut at the pause: a backlog goes through Spark in full batches, each costing Spark its fixed ~0.3 s
    once (1,000,000 messages on RabbitMQ went in 56-58 batches when a 0.1 s gap ended one)."""
    q = env.queue("fillpause")
    env.publish_bulk(q, [b"x" * 4096] * 8000)
    with Proxy.to(env.url) as proxy:
        reader = queue_mode.QueueStreamReader(
            parse({"uri": proxy.url_for(env.url), "queue": q, "prefetch": "16000"}, "source"))
        paused = threading.Event()

        def pause_once():
            wait_until(lambda: reader._consumer.pending() > 0, 30, interval=0.001, message="the first deliveries")
            proxy.freeze()
            time.sleep(0.3)
            proxy.thaw()
            paused.set()

        try:
            start = reader.initialOffset()
            reader.prepareForTriggerAvailableNow()
            pausing = threading.Thread(target=pause_once, daemon=True)
            pausing.start()
            end = reader.latestOffset(start, ReadAllAvailable())
            pausing.join(30)
            assert paused.is_set(), "the link was never frozen"
            count = reader._consumer.batches[end["seq"]].count
            assert count == 8000, f"the batch was cut at the broker's pause: {count} of 8,000"
        finally:
            reader.stop()


def test_two_queues_in_one_query(spark, env, tmp_path):
    a = env.queue("qa")
    b = env.queue("qb")
    env.publish(a, [f"a{i}" for i in range(5)])
    env.publish(b, [f"b{i}" for i in range(7)])
    sink = Collector()
    query = (stream(spark, env.url, f"{a},{b}").writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(60)
    assert query.exception() is None

    actual = spark.createDataFrame([(r.queue, r.routing_key, bytes(r.body)) for r in sink.rows],
                                   "queue string, routing_key string, body binary")
    expected = spark.createDataFrame(
        [(a, a, f"a{i}".encode()) for i in range(5)] + [(b, b, f"b{i}".encode()) for i in range(7)],
        "queue string, routing_key string, body binary")
    assert_df_equality(actual, expected, ignore_row_order=True)
    assert env.state(a) == (0, 0)
    assert env.state(b) == (0, 0)
