"""Batches bounded in bytes (maxBytesPerTrigger), the prefetch fitted to large messages, and batches handed
to the executors as files (handoffPath)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pika
import pyarrow as pa
import pytest

from source_helpers import Collector, checkpoint, needs_admission_control, stream
from spark_amqp.client.events import Delivery
from spark_amqp.options import parse
from spark_amqp.schema import ARROW_SCHEMA
from spark_amqp.source import arrow_rows, queue_mode
from spark_amqp.source import handoff as handoff_module
from spark_amqp.source.consumer import QueueConsumer
from spark_amqp.source.handoff import HandoffDir, read_file
from waiting import wait_until

KB = b"k" * 1024


def test_large_messages_lower_the_prefetch_to_two_batches(env):
    """Driver side alone: 1 KB messages under maxBytesPerTrigger=100,000 make batches of under 100 rows, and
    the default prefetch (200,000) falls to 1,000 (two batches' worth, at least 1,000) once the first
    batch shows their size; the broker then sends no more than that to the new consumers."""
    q = env.queue("bigmsgs")
    env.publish_bulk(q, [KB] * 3000)
    consumer = QueueConsumer(parse({"uri": env.url, "queue": q, "maxBytesPerTrigger": "100000"}, "source"))
    consumer.connect()
    try:
        wait_until(lambda: consumer.pending() == 3000, 30, message="the 3,000 messages received")
        first = consumer.take(1, 100_000)
        assert first.count == 98, f"a batch of 1 KB messages under 100,000 bytes took {first.count}"
        assert consumer.prefetch == 1000
        assert consumer.batch_size(100_000) == 97
        consumer.ack_through(1)
        env.publish_bulk(q, [KB] * 5000)
        # Held from the first consumers: 2,902; the new ones may take 1,000 of the 5,000 new messages.
        env.wait_state(q, (4000, 3902), timeout=30)
        second = consumer.take(2, consumer.batch_size(100_000))
        assert second.count == 97
        consumer.ack_through(2)
        # Those 97 were held from the first consumers: acking them frees nothing for the new ones.
        env.wait_state(q, (4000, 3902 - 97), timeout=30)
    finally:
        consumer.close()


@pytest.mark.parametrize("prefetch", [None, 60000])
def test_rabbitmq_gets_a_smaller_default_prefetch(env, prefetch):
    """Without the `prefetch` option the consumer lets our broker push 200,000 deliveries and RabbitMQ
    40,000 (RABBITMQ_DEFAULT_PREFETCH: RabbitMQ's queue process does more work for every delivery held
    until its batch commits): of 50,000 small messages, RabbitMQ keeps 10,000 ready and our broker sends
    them all. A `prefetch` given is the prefetch on either broker."""
    q = env.queue("defaultprefetch")
    env.publish_bulk(q, [b"m"] * 50_000)
    options = {"uri": env.url, "queue": q} | ({"prefetch": str(prefetch)} if prefetch else {})
    consumer = QueueConsumer(parse(options, "source"))
    consumer.connect()
    try:
        expected = (10_000, 40_000) if env.broker is None and not prefetch else (0, 50_000)
        env.wait_state(q, expected, timeout=30)
        time.sleep(0.5)
        assert env.state(q) == expected
    finally:
        consumer.close()


@needs_admission_control
def test_max_bytes_per_trigger_bounds_each_batch(spark, env, tmp_path):
    total = 600
    q = env.queue("maxbytes")
    env.publish_bulk(q, [b"%04d" % i + KB[4:] for i in range(total)])
    sink = Collector()
    query = (stream(spark, env.url, q, maxBytesPerTrigger=50_000).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(120), "availableNow did not stop by itself"
    assert query.exception() is None
    sizes = [sum(len(r.body) for r in rows) for rows in sink.batches.values() if rows]
    assert all(size < 50_000 + 1024 for size in sizes), f"a batch went past maxBytesPerTrigger: {sizes}"
    assert len(sizes) >= total * 1024 // 50_000, sizes
    assert sorted(bytes(b)[:4] for b in sink.bodies()) == [b"%04d" % i for i in range(total)]
    assert env.state(q) == (0, 0)


@needs_admission_control
def test_handoff_path_hands_batches_over_as_files_and_removes_them(spark, env, tmp_path):
    total = 300
    q = env.queue("handoff")
    env.publish(q, [f"h{i:03d}" for i in range(total)],
                properties=[pika.BasicProperties(message_id=f"id-{i}", headers={"n": i}) for i in range(total)])
    handoff = tmp_path / "handoff"

    def files_now(batch_id, rows):
        return sorted(p.name for p in handoff.rglob("*.arrow"))

    sink = Collector(probe=files_now)
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=100, handoffPath=handoff)
             .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(120), "availableNow did not stop by itself"
    assert query.exception() is None
    assert [bytes(r.body) for r in sink.rows] == [f"h{i:03d}".encode() for i in range(total)]
    assert [(r.message_id, r.headers) for r in sink.rows] == [(f"id-{i}", {"n": str(i)}) for i in range(total)]
    # While a batch ran its file was there (the rows came from it); once the query stopped, nothing is left.
    with_rows = [b for b, rows in sink.batches.items() if rows]
    assert all(sink.probes[b] for b in with_rows), sink.probes
    # Each batch's files go at its commit; the run's directory at the query's stop, or else at the next run.
    assert list(Path(handoff).rglob("*.arrow")) == []
    first_runs = sorted(Path(handoff).iterdir())
    env.publish(q, ["again"])
    query = (stream(spark, env.url, q, handoffPath=handoff).writeStream.foreachBatch(Collector())
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(120) and query.exception() is None
    assert not set(first_runs) & set(Path(handoff).iterdir()), "an earlier run's directory was left"
    assert env.state(q) == (0, 0)


def test_a_sized_start_takes_few_messages_until_their_size_is_known(env):
    """The streaming source's consumer starts with a prefetch of 2,000 (FIRST_PREFETCH), so that large
    messages never arrive 200,000 at once; once the first batch shows 1 KB messages it rises to what two
    batches of 64 MiB take (131,072; on RabbitMQ its default, 40,000), and the rest of the backlog flows."""
    q = env.queue("sized")
    env.publish_bulk(q, [KB] * 5000)
    consumer = QueueConsumer(parse({"uri": env.url, "queue": q}, "source"), sized_start=True)
    consumer.connect()
    try:
        env.wait_state(q, (3000, 2000), timeout=30)
        first = consumer.take(1, consumer.batch_size())
        assert first.count == 1000
        assert consumer.prefetch == (2 * 64 * 2**20 // 1024 if env.broker else 40_000)
        env.wait_state(q, (0, 5000), timeout=30)
        consumer.ack_through(1)
        env.wait_state(q, (0, 4000), timeout=30)
    finally:
        consumer.close()


def test_handoff_path_under_a_processing_time_trigger(spark, env, tmp_path):
    """The same handoff on every PySpark (4.0 and 4.1 included, whose reader numbers batches by the clock):
    a running query reads its batches from files, and each batch's files go once it is committed."""
    total = 120
    q = env.queue("handoffpt")
    env.publish(q, [f"p{i:03d}" for i in range(total)])
    handoff = tmp_path / "handoff"
    sink = Collector(probe=lambda batch_id, rows: sorted(p.name for p in handoff.rglob("*.arrow")))
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=50, handoffPath=handoff)
             .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
             .trigger(processingTime="200 milliseconds").start())
    try:
        wait_until(lambda: len(sink.rows) >= total or query.exception(), 60, message=f"{total} rows")
        # The last batch with rows is acked (and its files removed) at a later trigger: wait for that.
        wait_until(lambda: env.state(q) == (0, 0), 30, message=lambda: f"every message acked: {env.state(q)}")
        wait_until(lambda: not list(handoff.rglob("*.arrow")), 10,
                   message=lambda: f"the committed batches' files removed: {list(handoff.rglob('*.arrow'))}")
    finally:
        query.stop()
    assert query.exception() is None
    assert sorted(bytes(r.body) for r in sink.rows) == [f"p{i:03d}".encode() for i in range(total)]
    with_rows = [b for b, rows in sink.batches.items() if rows]
    assert len(with_rows) >= 3 and all(sink.probes[b] for b in with_rows), sink.probes


def _local_dirs(spark) -> list[Path]:
    """Spark's local directories (its block manager's) in the shared SparkSession's JVM, where handoff=auto writes, as
    an executor's Python worker sees them."""
    dirs = spark.sparkContext.parallelize([0], 1).map(lambda _: os.environ["SPARK_LOCAL_DIRS"]).collect()[0]
    return [Path(d) for d in dirs.split(",")]


@pytest.mark.parametrize("handoff", ["auto", "inline"])
def test_without_handoff_path_local_mode_hands_batches_over_as_files(spark, env, tmp_path, handoff):
    """Without handoffPath, on local[2]: the first batch's rows go inside its tasks and tell the driver that
    the executors run in its JVM; every later batch is read from files under Spark's local directory, which
    are gone once it commits (handoff=auto, the default). handoff=inline keeps every batch inside the tasks."""
    total = 400
    q = env.queue(f"handoff{handoff}")
    env.publish(q, [f"a{i:03d}" for i in range(total)])
    local_dirs = _local_dirs(spark)

    def files_now(batch_id, rows):
        return sorted(p.name for d in local_dirs for p in d.glob("spark-amqp-handoff-*/**/*.arrow"))

    sink = Collector(probe=files_now)
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=100, handoff=handoff).writeStream
             .foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
             .trigger(processingTime="200 milliseconds").start())
    try:
        wait_until(lambda: len(sink.rows) >= total or query.exception(), 60, message=f"{total} rows")
        wait_until(lambda: env.state(q) == (0, 0), 30, message=lambda: f"every message acked: {env.state(q)}")
        wait_until(lambda: not files_now(None, None), 10, message="the committed batches' files removed")
    finally:
        query.stop()
    assert query.exception() is None
    assert sorted(bytes(r.body) for r in sink.rows) == [f"a{i:03d}".encode() for i in range(total)]
    with_rows = [b for b in sink.order if sink.batches[b]]
    assert len(with_rows) >= 3, sink.batches.keys()
    if handoff == "inline":
        assert not any(sink.probes[b] for b in with_rows), sink.probes
    else:
        # The first batch's tasks answered the probe. (Its rows went inside them; PySpark 4.0 may then plan
        # the same batch again, from files, before the batch ends, so the first batch is not asserted on.)
        assert all(sink.probes[b] for b in with_rows[1:]), sink.probes


def test_a_batch_is_sliced_into_even_partitions_without_a_small_remainder():
    """Each slice is one Spark task: a batch just over a whole number of slices is cut into that many
    slices, slightly larger, and otherwise into slices of even size (never a task for a few rows)."""
    def batch(rows: int, body_size: int) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays(
            [pa.array([b"b" * body_size] * rows, pa.binary()) if f.name == "body" else pa.nulls(rows, f.type)
             for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)

    sixteen_mib = 16 * 2**20
    assert arrow_rows.rows_per_slice(batch(16_384, 4096), 50_000, sixteen_mib) == 4096   # not 4 x 4,092 + 16
    assert arrow_rows.rows_per_slice(batch(17_000, 4096), 50_000, sixteen_mib) == 3400   # 5 even slices
    assert arrow_rows.rows_per_slice(batch(100_500, 10), 50_000, sixteen_mib) == 50_250
    assert arrow_rows.rows_per_slice(batch(60_000, 10), 50_000, sixteen_mib) == 30_000
    assert arrow_rows.rows_per_slice(batch(2, 4096), 50_000, 1000) == 1     # bodies larger than the bound
    assert arrow_rows.rows_per_slice(batch(0, 10), 50_000, sixteen_mib) == 1


def test_an_executor_hands_a_large_slice_to_the_jvm_in_even_batches(tmp_path, monkeypatch):
    """Executor side, no broker: a slice larger than JVM_BATCH_BYTES, read from its handoff file or from
    inside its partition, reaches Spark's JVM as even record batches of at most about that size, every row
    once and in order; a slice under it goes whole."""
    monkeypatch.setattr(arrow_rows, "JVM_BATCH_BYTES", 64 * 1024)
    deliveries = [Delivery(None, "", tag, False, "", "q") for tag in range(1, 101)]
    for d in deliveries:
        d.body = f"{d.delivery_tag:04d}".encode() * 1024          # 4 KB each: 400 KB in all
    slice_ = arrow_rows.to_record_batch([("q", deliveries)])
    [file] = HandoffDir(str(tmp_path)).write(1, [slice_])
    reader = queue_mode.QueueStreamReader(parse({"uri": "amqp://localhost", "queue": "q"}, "source"))
    for partition in (file, queue_mode.ArrowPartition(arrow_rows.serialize(slice_))):
        batches = list(reader.read(partition))
        assert [b.num_rows for b in batches] == [15] * 6 + [10], type(partition).__name__
        assert all(b.nbytes <= 64 * 1024 + 4200 for b in batches)
        assert pa.Table.from_batches(batches).column("body").to_pylist() == [d.body for d in deliveries]
    small = queue_mode.ArrowPartition(arrow_rows.serialize(slice_.slice(0, 10)))
    assert [b.num_rows for b in reader.read(small)] == [10]


def test_committed_handoff_files_are_written_over_by_later_batches(tmp_path):
    """Driver side, no broker: in the source's own directory (handoff=auto) a committed batch's file stays
    as a spare (not a batch file, at most SPARE_FILES of them) and a later batch is written over it, cut to
    its own length: it reads back exactly, whatever the spare held. The directory goes at close. Under a
    user's handoffPath committed files go, as before."""
    def slice_of(first_tag: int, rows: int, size: int) -> pa.RecordBatch:
        deliveries = [Delivery(None, "", tag, False, "", "q") for tag in range(first_tag, first_tag + rows)]
        for d in deliveries:
            d.body = f"{d.delivery_tag:06d}".encode() * (size // 6)
        return arrow_rows.to_record_batch([("q", deliveries)])

    handoff = HandoffDir(str(tmp_path / "own"), owned=True)
    large = slice_of(1, 200, 4096)
    handoff.write(1, [large] * (handoff_module.SPARE_FILES + 2))
    handoff.committed(1)
    assert list(tmp_path.rglob("*.arrow")) == []
    assert len(list(tmp_path.rglob("spare-*"))) == handoff_module.SPARE_FILES
    small = slice_of(1000, 10, 60)
    [written_over] = handoff.write(2, [small])
    fresh = HandoffDir(str(tmp_path / "fresh")).write(2, [small])[0]
    assert Path(written_over.path).stat().st_size == Path(fresh.path).stat().st_size
    assert pa.Table.from_batches(list(read_file(written_over))).equals(pa.Table.from_batches([small]))
    assert len(list(tmp_path.rglob("spare-*"))) == handoff_module.SPARE_FILES - 1
    handoff.close()
    assert not (tmp_path / "own").exists()

    users = HandoffDir(str(tmp_path / "handoff-path"))
    users.write(1, [large])
    users.committed(1)
    assert list((tmp_path / "handoff-path").rglob("*-*")) == [Path(users.root)]
    users.close()


def test_a_batch_handed_off_in_slices_keeps_its_rows_in_order_and_lets_its_bodies_go(env, tmp_path,
                                                                                     monkeypatch):
    """The driver's side alone, called as Spark calls it (no Spark here): a batch from two queues is
    written to handoffPath slice by slice, a slice crossing from one queue into the other; the executors'
    `read` of the files gives every row once, in the batch's order, with its queue; asked again, the
    driver gives the same files; the batch held for its acks no longer holds the bodies; its commit acks
    everything and removes the files."""
    monkeypatch.setattr(queue_mode, "ROWS_PER_PARTITION", 400)   # 900 rows: three slices of 300
    first, second = env.queue("slices-a"), env.queue("slices-b")
    env.publish(first, [f"a{i:03d}" for i in range(500)])
    env.publish(second, [f"b{i:03d}" for i in range(400)])
    handoff = tmp_path / "handoff"
    reader = queue_mode.QueueStreamReader(parse(
        {"uri": env.url, "queue": f"{first},{second}", "handoffPath": str(handoff), "prefetch": "5000"},
        "source"))
    try:
        start = reader.initialOffset()
        reader._session().start_consuming()
        env.wait_state(first, (0, 500), timeout=30)
        env.wait_state(second, (0, 400), timeout=30)
        end = {"seq": start["seq"] + 1}
        parts = reader.partitions(start, end)
        assert [type(p).__name__ for p in parts] == ["FilePartition"] * 3
        tables = [pa.Table.from_batches(list(reader.read(p))) for p in parts]
        assert [t.num_rows for t in tables] == [300, 300, 300]
        rows = pa.concat_tables(tables)
        assert rows.column("body").to_pylist() == ([f"a{i:03d}".encode() for i in range(500)] +
                                                   [f"b{i:03d}".encode() for i in range(400)])
        assert rows.column("queue").to_pylist() == [first] * 500 + [second] * 400
        assert [p.path for p in reader.partitions(start, end)] == [p.path for p in parts]
        held = reader._consumer.batches[end["seq"]]
        assert held.count == 900 and not any(d.body for _, ds in held.deliveries for d in ds)
        reader.commit(end)
        env.wait_state(first, (0, 0), timeout=30)
        env.wait_state(second, (0, 0), timeout=30)
        assert list(handoff.rglob("*.arrow")) == []
    finally:
        reader.stop()


def test_a_handoff_write_failing_part_way_puts_the_bodies_back_and_goes_inside_the_tasks(env, tmp_path,
                                                                                        monkeypatch):
    """The driver's side alone, with the directory handoff=auto makes of its own in local mode: a batch's
    second file cannot be written (a directory stands at its path). The first file's slice had let its
    bodies go; they are read back, and the whole batch goes inside its tasks, every row in order with its
    body; the directory is gone, and the commit acks everything."""
    monkeypatch.setattr(queue_mode, "ROWS_PER_PARTITION", 400)   # 900 rows: three slices of 300
    q = env.queue("putback")
    env.publish_bulk(q, [b"p%03d" % i for i in range(900)])
    reader = queue_mode.QueueStreamReader(parse({"uri": env.url, "queue": q, "prefetch": "5000"}, "source"))
    try:
        start = reader.initialOffset()
        reader._session().start_consuming()
        wait_until(lambda: reader._consumer.pending() == 900, 30, message="the 900 messages received")
        end = {"seq": start["seq"] + 1}
        reader._handoff = own = HandoffDir(str(tmp_path / "own"), owned=True)   # as local mode makes it
        os.makedirs(own.file_path(end["seq"], 1))
        parts = reader.partitions(start, end)
        assert {type(p).__name__ for p in parts} == {"ArrowPartition"}
        rows = pa.concat_tables([pa.Table.from_batches(list(reader.read(p))) for p in parts])
        assert rows.column("body").to_pylist() == [b"p%03d" % i for i in range(900)]
        assert reader._handoff is None and not (tmp_path / "own").exists()
        reader.commit(end)
        env.wait_state(q, (0, 0), timeout=30)
    finally:
        reader.stop()


def test_a_raised_prefetch_adds_consumers_so_the_broker_sends_no_more_than_it(env):
    """The consumer alone, 1 KB messages under maxBytesPerTrigger 4,000,000: the sized start's 2,000 rise
    to 7,812 after the first batch, and, with batches of 16,000,000 bytes, to 31,250 while the first
    consumers' deliveries are still unacked. Each raise starts consumers for the difference beside the
    running ones: the broker has the new prefetch unacked (31,252 as shared over the four channels of our
    broker's default 200,000; 31,250 on RabbitMQ's one of 40,000), not that beside what cancelled consumers
    had sent."""
    q = env.queue("raised")
    env.publish_bulk(q, [KB] * 40000)
    consumer = QueueConsumer(parse({"uri": env.url, "queue": q, "maxBytesPerTrigger": "4000000"}, "source"),
                             sized_start=True)
    consumer.connect()
    try:
        env.wait_state(q, (38000, 2000), timeout=30)
        first = consumer.take(1, consumer.batch_size())
        assert first.count == 1000 and consumer.prefetch == 7812
        env.wait_state(q, (40000 - 7812, 7812), timeout=30)
        consumer.options["maxBytesPerTrigger"] = 16_000_000
        consumer._fit_prefetch()
        assert consumer.prefetch == 31250
        held = 31252 if env.broker else 31250
        env.wait_state(q, (40000 - held, held), timeout=30)
        time.sleep(0.5)
        assert env.state(q) == (40000 - held, held)
        consumer.ack_through(1)
        env.wait_state(q, (40000 - held - 1000, held), timeout=30)   # acked: the first consumers take more
    finally:
        consumer.close()
