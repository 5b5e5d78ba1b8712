"""Stream mode (queueType=stream): offsets are the streams' own, ranges are read on executors, and a batch
re-run after a restart reads the same rows; nothing is acked or removed. Against both brokers. Streaming
reads of streams need PySpark 4.2+ (on 4.0/4.1 they fail at start with that reason: tested there);
batch reads work on every version."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pika


from source_helpers import Collector, checkpoint, needs_admission_control, run_available_now, stream
from waiting import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from socket_bytes import ReceivedBytes, received_now  # noqa: E402  (bench/: the stream benchmark measures the same way)


def _rows_of(sink) -> list[tuple[str, int, bytes]]:
    return [(r.queue, r.stream_offset, bytes(r.body)) for r in sink.rows]


@needs_admission_control
def test_stream_query_reads_from_earliest_in_bounded_batches_and_continues_after_a_restart(spark, env, tmp_path):
    s = env.stream()
    env.publish(s, [f"m{i}" for i in range(30)])
    chk = checkpoint(tmp_path)

    def start(sink):
        return (stream(spark, env.url, s, queueType="stream", startingOffsets="earliest", maxMessagesPerTrigger=10)
                .writeStream.foreachBatch(sink).option("checkpointLocation", chk)
                .trigger(processingTime="200 milliseconds").start())

    first = Collector()
    query = start(first)
    wait_until(lambda: len(first.rows) >= 30 or query.exception(), 60, interval=0.1, message="30 rows")
    query.stop()
    assert query.exception() is None
    assert _rows_of(first) == [(s, i, f"m{i}".encode()) for i in range(30)]
    assert max(len(rows) for rows in first.batches.values()) <= 10
    assert not any(r.redelivered for r in first.rows)

    # Nothing was removed: the stream still holds all 30. The restarted query re-runs the batch the stop
    # interrupted before its commit (if any) with exactly the same rows, then reads only what is new.
    env.publish(s, [f"n{i}" for i in range(7)])
    second = Collector()
    query = start(second)
    wait_until(lambda: any(b"n6" == bytes(r.body) for r in second.rows) or query.exception(), 60, interval=0.1,
               message="the 7 new rows")
    time.sleep(1.0)   # a few more triggers: nothing more may come
    query.stop()
    replayed = [b for b in second.batches if b in first.batches]
    for batch_id in replayed:
        assert second.batches[batch_id] == first.batches[batch_id], f"batch {batch_id} re-ran with other rows"
    new = [r for b in sorted(second.batches) if b not in first.batches for r in second.batches[b]]
    assert [(r.stream_offset, bytes(r.body)) for r in new] == [(30 + i, f"n{i}".encode()) for i in range(7)]


@needs_admission_control
def test_latest_start_reads_only_what_is_published_after_the_query_started(spark, env, tmp_path):
    s = env.stream()
    env.publish(s, [f"old{i}" for i in range(5)])
    sink = Collector()
    query = (stream(spark, env.url, s, queueType="stream").writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds").start())
    wait_until(lambda: query.recentProgress or query.exception(), 60, interval=0.1, message="a first trigger")
    env.publish(s, [f"new{i}" for i in range(5)])
    wait_until(lambda: len(sink.rows) >= 5 or query.exception(), 60, interval=0.1, message="5 rows")
    query.stop()
    assert [bytes(r.body) for r in sink.rows] == [f"new{i}".encode() for i in range(5)]


@needs_admission_control
def test_an_idle_stream_query_does_not_read_the_stream_on_every_trigger(spark, env, tmp_path):
    """The driver learns where a stream ends by reading its last chunk. While nothing new arrives, a consumer
    watching from that end says so without a read: over 3 s of triggers every 100 ms the driver's source
    process receives less than a tenth of the stream's 100 KB (each trigger read its last chunk before), and
    a message published then is still read at once."""
    s = env.stream()
    env.publish_bulk(s, [b"%06d" % i + b"x" * 994 for i in range(100)])
    sink = Collector()
    query = (stream(spark, env.url, s, queueType="stream").writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="100 milliseconds").start())
    wait_until(lambda: query.recentProgress or query.exception(), 60, interval=0.1, message="a first trigger")
    time.sleep(1.0)
    port = urlparse(env.url).port or 5672
    before = received_now(port, "streaming_source_runner")
    time.sleep(3.0)
    idle = received_now(port, "streaming_source_runner") - before
    env.publish(s, ["new"])
    wait_until(lambda: sink.rows or query.exception(), 30, interval=0.1, message="the new row")
    query.stop()
    assert query.exception() is None
    assert before > 0, "no bytes counted for the driver's source process: the measurement is broken"
    assert idle < 10_000, f"the driver's source process received {idle:,} B in 3 s of idle triggers"
    assert [bytes(r.body) for r in sink.rows] == [b"new"]


@needs_admission_control
def test_two_streams_in_one_query_with_per_stream_starting_offsets(spark, env, tmp_path):
    a, b = env.stream("a"), env.stream("b")
    env.publish(a, [f"a{i}" for i in range(10)])
    env.publish(b, [f"b{i}" for i in range(10)])
    sink = Collector()
    run_available_now(lambda: stream(spark, env.url, f"{a},{b}", queueType="stream",
                                     startingOffsets=f'{{"{a}": 4, "{b}": -2}}').writeStream.foreachBatch(sink)
                      .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    got = sorted(_rows_of(sink))
    assert got == sorted([(a, i, f"a{i}".encode()) for i in range(4, 10)] +
                         [(b, i, f"b{i}".encode()) for i in range(10)])


@needs_admission_control
def test_available_now_reads_to_the_end_the_run_started_with(spark, env, tmp_path):
    s = env.stream()
    env.publish(s, [f"m{i}" for i in range(25)])
    sink = Collector()
    query = (stream(spark, env.url, s, queueType="stream", startingOffsets="earliest", maxMessagesPerTrigger=10)
             .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(60)
    assert query.exception() is None
    assert [r.stream_offset for r in sink.rows] == list(range(25))
    assert sorted(len(rows) for rows in sink.batches.values() if rows) == [5, 10, 10]


@needs_admission_control
def test_message_data_does_not_flow_through_the_driver(spark, env, tmp_path):
    """The kernel's per-socket byte counts while a stream query reads 20,000 x 500 B in 4 partitions: the
    executors' Python workers receive the data; the driver's source process only its probes (the last
    chunk of the stream, a few times). The last 100 messages are published on their own, so that the last
    chunk holds only them (a broker's chunk is what one write took: RabbitMQ's grew to over 1,000 of the
    2,000 messages of a publish on a faster machine, and three probes of it were 7% of the data)."""
    s = env.stream()
    total, size, tail = 20_000, 500, 100
    bounds = [*range(0, total - tail, 2000), total - tail, total]
    for start, end in zip(bounds, bounds[1:]):
        env.publish_bulk(s, [b"%06d" % i + b"x" * (size - 6) for i in range(start, end)])
    with ReceivedBytes(urlparse(env.url).port or 5672) as received:
        query = (stream(spark, env.url, s, queueType="stream", startingOffsets="earliest", minPartitions=4)
                 .writeStream.format("noop").option("checkpointLocation", checkpoint(tmp_path))
                 .trigger(availableNow=True).start())
        assert query.awaitTermination(120)
    assert query.exception() is None
    assert sum(p["numInputRows"] for p in query.recentProgress) == total
    driver, _ = received.received_by("streaming_source_runner")
    executors, _ = received.received_by("pyspark.daemon")     # the executors' Python workers
    assert driver > 0, "no bytes counted for the driver's source process: the measurement is broken"
    data = total * size
    # With `ss -E` every socket is counted at its close, so all the bodies are seen (a fast task's connection
    # can open and close between two samples, and then no sample saw that it was a worker's: unattributed).
    # Without it (no CAP_NET_ADMIN) only samples count, and a short connection can fall between two whole.
    if received.sees_closes:
        assert executors + received.unattributed >= data, (
            f"the executors' Python workers received {executors:,} B (and {received.unattributed:,} B "
            f"unattributed) of the {data:,} B of bodies")
    assert driver < data // 20, f"the driver received {driver:,} B, {100 * driver / data:.1f}% of the data"


def test_batch_read_of_an_offset_range_in_parallel_partitions(spark, env):
    s = env.stream()
    env.publish(s, [f"m{i}" for i in range(40)])
    df = (spark.read.format("amqp").option("uri", env.url).option("queue", s).option("queueType", "stream")
          .option("startingOffsets", f'{{"{s}": 5}}').option("endingOffsets", f'{{"{s}": 35}}')
          .option("minPartitions", "3").load())
    assert df.rdd.getNumPartitions() == 3
    rows = sorted((r.stream_offset, bytes(r.body)) for r in df.collect())
    assert rows == [(i, f"m{i}".encode()) for i in range(5, 35)]
    # Read twice, the same rows: nothing was consumed away.
    again = (spark.read.format("amqp").option("uri", env.url).option("queue", s).option("queueType", "stream")
             .load())
    assert sorted(r.stream_offset for r in again.collect()) == list(range(40))


def test_rows_keep_their_headers_and_the_offset_header(spark, env):
    """The x-stream-offset header the broker adds is in `headers` beside the publisher's own, on rows whose
    other properties are all alike (decoded once per batch) and on rows that differ."""
    s = env.stream()
    env.publish(s, ["h0", "h1", "h2"], pika.BasicProperties(headers={"a": "x"}, content_type="text/plain"))
    env.publish(s, ["n3", "n4"])

    def read(**bounds):
        reader = (spark.read.format("amqp").option("uri", env.url).option("queue", s)
                  .option("queueType", "stream"))
        for k, v in bounds.items():
            reader = reader.option(k, v)
        return sorted(((r.stream_offset, r.headers, r.header_types, r.content_type)
                       for r in reader.load().collect()), key=lambda t: t[0])

    expected = [(i, {"a": "x", "x-stream-offset": str(i)}, {"a": "string", "x-stream-offset": "long"},
                 "text/plain") for i in range(3)]
    expected += [(i, {"x-stream-offset": str(i)}, {"x-stream-offset": "long"}, None) for i in (3, 4)]
    assert read() == expected
    assert read(endingOffsets=f'{{"{s}": 3}}') == expected[:3]


def test_starting_timestamp_starts_at_the_first_message_stored_since(spark, env):
    s = env.stream()
    env.publish(s, [f"before{i}" for i in range(5)])
    time.sleep(1.2 - time.time() % 1.0)          # into the next whole second (AMQP timestamps are seconds)
    since = int(time.time()) * 1000
    env.publish(s, [f"after{i}" for i in range(5)])
    df = (spark.read.format("amqp").option("uri", env.url).option("queue", s).option("queueType", "stream")
          .option("startingTimestamp", str(since)).load())
    assert sorted(bytes(r.body) for r in df.collect()) == sorted(f"after{i}".encode() for i in range(5))


def test_the_sink_writes_to_a_stream_and_the_source_reads_it_back(spark, env):
    s = env.stream()
    out = spark.range(20, numPartitions=2).selectExpr("CAST(id AS STRING) AS body")
    out.write.format("amqp").option("uri", env.url).option("routingKey", s).mode("append").save()
    df = (spark.read.format("amqp").option("uri", env.url).option("queue", s).option("queueType", "stream")
          .load())
    assert sorted(int(bytes(r.body)) for r in df.collect()) == list(range(20))


def test_offsets_removed_by_retention_fail_the_read_or_are_skipped_with_fail_on_data_loss_false(spark, env):
    from spark_amqp import options as opts
    from spark_amqp.source.stream_mode import StreamLog

    # 1000-byte bodies in 2500-byte segments: three messages a segment on both brokers; retention keeps
    # about two segments and removes whole segments when one rolls (RabbitMQ: shortly after).
    s = env.stream(**{"x-max-length-bytes": 5000, "x-stream-max-segment-size-bytes": 2500})
    env.publish(s, [f"{i:04d}".encode() * 250 for i in range(30)])
    stream_log = StreamLog(opts.parse({"uri": env.url, "queue": s, "queueType": "stream"}, "source"))
    try:
        wait_until(lambda: (stream_log.firsts()[s] or 0) > 1, 30, interval=0.5, message="retention to run")
        first = stream_log.firsts()[s]
    finally:
        stream_log.close()

    def read(**extra):
        reader = (spark.read.format("amqp").option("uri", env.url).option("queue", s)
                  .option("queueType", "stream").option("startingOffsets", f'{{"{s}": 0}}'))
        for k, v in extra.items():
            reader = reader.option(k, v)
        return reader.load().collect()

    try:
        read()
        raise AssertionError("reading offsets removed by retention did not fail")
    except Exception as exc:
        text = str(exc)
        assert f"stream '{s}'" in text and "are gone" in text and "failOnDataLoss=false" in text, text[-2000:]

    rows = read(failOnDataLoss="false")
    offsets = sorted(r.stream_offset for r in rows)
    assert offsets and offsets[0] == first, (offsets[:3], first)
    assert bytes(rows[-1].body)[:4] == b"0029"


def test_a_stream_query_on_pyspark_before_4_2_fails_at_start_with_the_reason(spark, env, tmp_path):
    from spark_amqp.pyspark_versions import ADMISSION_CONTROL
    if ADMISSION_CONTROL:
        import pytest
        pytest.skip("PySpark >= 4.2 reads streams as streams")
    s = env.stream()
    try:
        query = (stream(spark, env.url, s, queueType="stream").writeStream.foreachBatch(Collector())
                 .option("checkpointLocation", checkpoint(tmp_path)).start())
        query.awaitTermination(60)
        text = str(query.exception())
    except Exception as exc:
        text = str(exc)
    assert "needs PySpark 4.2 or newer" in text and "spark.read" in text, text[-2000:]


def test_an_executor_reads_a_range_of_large_messages_in_record_batches_the_jvm_takes(env):
    """Executor side alone: a range of 5,000 messages of 4 KB (20 MB) reaches Spark's JVM as record batches
    of at most about JVM_BATCH_BYTES of bodies, as a batch read's do, every offset once and in order."""
    from spark_amqp.options import parse
    from spark_amqp.source.arrow_rows import JVM_BATCH_BYTES
    from spark_amqp.source.stream_mode import StreamRange, read_range
    s = env.stream("large")
    env.publish_bulk(s, [b"%05d" % i + b"x" * 4091 for i in range(5000)])
    options = parse({"uri": env.url, "queue": s, "queueType": "stream"}, "source")
    batches = list(read_range(options, StreamRange(s, 0, 5000)))
    sizes = [sum(len(b) for b in batch.column("body").to_pylist()) for batch in batches]
    assert len(batches) >= 2 and max(sizes) <= JVM_BATCH_BYTES + 4096, sizes
    rows = [(o, b[:5]) for batch in batches
            for o, b in zip(batch.column("stream_offset").to_pylist(), batch.column("body").to_pylist())]
    assert rows == [(i, b"%05d" % i) for i in range(5000)]
