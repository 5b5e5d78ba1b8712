"""Super streams as a source (`superStream`): every partition stream read as one stream-mode query, offsets
per partition, a partition added while the query runs read from its first offset. Against the embedded
broker (`Broker.add_super_stream`) and RabbitMQ 4.3 (`rabbitmq-streams add_super_stream`); 3.10 has no
super streams."""

from __future__ import annotations

import json

import pytest

from source_helpers import Collector, checkpoint, needs_admission_control, run_available_now
from waiting import wait_until

pytestmark = pytest.mark.parametrize("broker_url", ["embedded", "rabbitmq4"], indirect=True)


def _super(spark, env, name, streaming=True, **options):
    reader = (spark.readStream if streaming else spark.read).format("amqp").option("uri", env.url) \
        .option("superStream", name)
    for k, v in options.items():
        reader = reader.option(k, v if isinstance(v, str) else json.dumps(v))
    return reader.load()


def _publish_keyed(env, name, keys, prefix):
    """Messages `<prefix><key>-<i>` through the super stream's exchange, by routing key."""
    for key in keys:
        env.publish(key, [f"{prefix}{key}-{i}" for i in range(5)], exchange=name)


def _rows(rows):
    return sorted((r.queue, r.stream_offset, bytes(r.body)) for r in rows)


def _expected(name, keys, prefix, first=0):
    return sorted((f"{name}-{k}", first + i, f"{prefix}{k}-{i}".encode()) for k in keys for i in range(5))


@needs_admission_control
def test_a_super_stream_is_read_once_and_restarts_from_its_checkpoint(spark, env, tmp_path):
    name = env.super_stream(3)
    _publish_keyed(env, name, "012", "a")
    chk = checkpoint(tmp_path)

    def run(sink):
        return run_available_now(lambda: _super(spark, env, name, startingOffsets="earliest",
                                                maxMessagesPerTrigger="8").writeStream.foreachBatch(sink)
                                 .option("checkpointLocation", chk).trigger(availableNow=True).start())

    first = Collector()
    run(first)
    assert _rows(first.rows) == _expected(name, "012", "a")
    assert max(len(rows) for rows in first.batches.values()) <= 8

    _publish_keyed(env, name, "12", "b")
    second = Collector()
    run(second)
    assert _rows(second.rows) == _expected(name, "12", "b", first=5)


def test_a_batch_read_of_a_super_stream_is_exact_and_repeatable(spark, env):
    name = env.super_stream(3)
    _publish_keyed(env, name, "012", "m")
    df = _super(spark, env, name, streaming=False, startingOffsets={f"{name}-0": 2, f"{name}-1": -2},
                endingOffsets={f"{name}-1": 4}, minPartitions="4")
    once, again = _rows(df.collect()), _rows(df.collect())
    assert once == again
    want = [r for r in _expected(name, "012", "m")
            if (r[0] == f"{name}-0" and r[1] >= 2) or (r[0] == f"{name}-1" and r[1] < 4)]
    # NAME-2 starts at latest (-1, the default of a key left out) and ends there: nothing.
    assert once == want


@needs_admission_control
def test_a_partition_added_while_the_query_runs_is_read_from_its_first_offset(spark, env, tmp_path):
    name = env.super_stream(2)
    sink = Collector()
    query = (_super(spark, env, name).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds").start())
    wait_until(lambda: query.recentProgress or query.exception(), 60, interval=0.1, message="a first trigger")
    _publish_keyed(env, name, "01", "a")
    env.add_partition(name, "2", 2)
    _publish_keyed(env, name, "2", "a")        # routed there before the query can have noticed the partition
    wait_until(lambda: len(sink.rows) >= 15 or query.exception(), 60, interval=0.1, message="15 rows")
    query.stop()
    assert query.exception() is None
    assert _rows(sink.rows) == _expected(name, "012", "a")


def test_listed_partitions_are_read(spark, env):
    name = env.super_stream(binding_keys=["eu", "us"])
    _publish_keyed(env, name, ["eu", "us"], "m")
    df = _super(spark, env, name, streaming=False, superStreamPartitions=f"{name}-eu,{name}-us")
    assert _rows(df.collect()) == _expected(name, ["eu", "us"], "m")


def test_a_missing_super_stream_fails_naming_it(spark, env, unique_name):
    name = unique_name("nosuch")
    with pytest.raises(Exception, match=f"super stream '{name}' not found"):
        _super(spark, env, name, streaming=False).collect()
