"""Stream filtering (`streamFilter`, `streamMatchUnfiltered`): exactly the rows whose x-stream-filter-value is
one of the values (and, with streamMatchUnfiltered, the rows without one). RabbitMQ 4.3 and the embedded
broker skip chunks without the values and send matching chunks whole; RabbitMQ 3.10 sends everything: the
rows must be the same on all, and a range whose last messages do not match must still end at once."""

from __future__ import annotations

import time

import pytest

from spark_amqp.codec.properties import encode
from spark_amqp.source.stream_filter import RowFilter

from source_helpers import Collector, checkpoint, needs_admission_control, run_available_now, stream

brokers = pytest.mark.parametrize("broker_url", ["embedded", "rabbitmq4"], indirect=True)

# Runs published one write each (RabbitMQ: chunks of their own), the last one with the empty string (which
# RabbitMQ takes as no value).
RUNS = [("red", 20), (None, 20), ("blue", 20), ("red", 5), ("green", 20), ("", 20)]


def _publish_runs(env, s, runs):
    rows, n = [], 0
    for value, count in runs:
        run = [(b"%d:%s" % (n + i, (value or "-").encode()), value) for i in range(count)]
        env.publish_filtered(s, run)
        rows += run
        n += count
    return rows


def _read(spark, env, s, **options):
    reader = spark.read.format("amqp").option("uri", env.url).option("queue", s).option("queueType", "stream") \
        .option("startingOffsets", "earliest")
    for k, v in options.items():
        reader = reader.option(k, str(v))
    started = time.monotonic()
    rows = reader.load().collect()
    return sorted((r.stream_offset, bytes(r.body)) for r in rows), time.monotonic() - started


def _want(rows, values, unfiltered=False):
    return [(i, b) for i, (b, v) in enumerate(rows) if (v in values if v else unfiltered)]


@brokers
@pytest.mark.parametrize("values,unfiltered", [("red", False), ("red", True), ("blue,red", False),
                                               ("green", True)])
def test_runs_of_values_are_filtered_exactly_and_the_range_ends_at_once(spark, env, values, unfiltered):
    """The last run has no value (and, with green, the runs after the last match do not match): the broker
    sends nothing for the range's last chunks, and the read still ends within a few seconds (not the 30 s
    a range read waits for a delivery)."""
    s = env.stream()
    rows = _publish_runs(env, s, RUNS)
    everything, _took = _read(spark, env, s)     # also warms Spark up: a session's first read takes 20 s here
    assert len(everything) == len(rows)
    got, took = _read(spark, env, s, streamFilter=values, streamMatchUnfiltered=str(unfiltered).lower())
    assert got == _want(rows, values.split(","), unfiltered)
    assert took < 10, f"the filtered read took {took:.1f} s"


@pytest.mark.parametrize("broker_url", ["embedded", "rabbitmq", "rabbitmq4"], indirect=True)
def test_interleaved_values_in_one_chunk_are_filtered_by_the_source(spark, env):
    """Also on RabbitMQ 3.10, which ignores the filter's consumer arguments and sends everything."""
    s = env.stream()
    values = ["red", "blue", None, "green", "red", ""]
    rows = [(b"m%d" % i, values[i % len(values)]) for i in range(300)]
    env.publish_filtered(s, rows)
    for wanted, unfiltered in (("red,green", False), ("blue", True)):
        got, _took = _read(spark, env, s, streamFilter=wanted, streamMatchUnfiltered=str(unfiltered).lower(),
                           minPartitions=3)
        assert got == _want(rows, wanted.split(","), unfiltered)


@brokers
def test_a_range_where_nothing_matches_ends_empty_at_once(spark, env):
    s = env.stream()
    _publish_runs(env, s, [("red", 50), (None, 50)])
    assert len(_read(spark, env, s)[0]) == 100
    got, took = _read(spark, env, s, streamFilter="blue")
    assert got == []
    assert took < 10, f"the filtered read took {took:.1f} s"


@brokers
@needs_admission_control
def test_a_filtered_stream_query_reads_the_matching_rows_once(spark, env, tmp_path):
    s = env.stream()
    rows = _publish_runs(env, s, RUNS)
    sink = Collector()
    chk = checkpoint(tmp_path)
    run_available_now(lambda: stream(spark, env.url, s, queueType="stream", startingOffsets="earliest",
                                     streamFilter="red", maxMessagesPerTrigger=50)
                      .writeStream.foreachBatch(sink).option("checkpointLocation", chk)
                      .trigger(availableNow=True).start())
    assert sorted((r.stream_offset, bytes(r.body)) for r in sink.rows) == _want(rows, ["red"])
    assert all(dict(r.headers)["x-stream-filter-value"] == "red" for r in sink.rows)


def test_row_filter_reads_the_header_exactly():
    """No broker: the raw-bytes test against headers that only look like a filter value."""
    keep = RowFilter(["red"], match_unfiltered=False)
    assert keep.keeps(encode({"headers": {"x-stream-filter-value": "red", "a": 1}}))
    assert not keep.keeps(encode({"headers": {"x-stream-filter-value": "blue"}}))
    assert not keep.keeps(encode({"headers": {"a": 1}}))
    assert not keep.keeps(encode({}))
    # The header's name and type inside another header's value: no filter value.
    assert not keep.keeps(encode({"headers": {"z": "\x15x-stream-filter-valueS\x00\x00\x00\x03red"}}))
    # A filter value that is not a long string (RabbitMQ refuses such a message): no filter value.
    assert RowFilter(["red"], match_unfiltered=True).keeps(encode({"headers": {"x-stream-filter-value": 7}}))
    assert RowFilter(["red"], True).consumer_arguments() == {"x-stream-filter": ["red"],
                                                             "x-stream-match-unfiltered": True}
    # With the value of the range's last chunk (its first message's), or match-unfiltered for none.
    assert RowFilter(["red"], False).consumer_arguments(also=b"blue") == {"x-stream-filter": ["blue", "red"],
                                                                          "x-stream-match-unfiltered": False}
    assert RowFilter(["red"], False).consumer_arguments(also_unfiltered=True)["x-stream-match-unfiltered"]
    # The empty string is RabbitMQ's "unfiltered".
    assert RowFilter(["red"], True).keeps(encode({"headers": {"x-stream-filter-value": ""}}))
    assert not RowFilter(["red"], False).keeps(encode({"headers": {"x-stream-filter-value": ""}}))


@brokers
def test_the_safety_net_reads_a_non_matching_tail_unfiltered_and_emits_no_offset_twice(env):
    """No Spark: the two consumers of `_read_filtered`'s safety net, as an executor runs them. The filtered
    consumer (without the range's last-chunk value added) falls silent before the range's end (both
    brokers skip chunks); the unfiltered one reads on from the last offset sent, and together they give
    each wanted row once."""
    from spark_amqp.client import Connection
    from spark_amqp.options import parse
    from spark_amqp.source import stream_mode

    s = env.stream()
    rows = _publish_runs(env, s, RUNS)
    options = parse({"uri": env.url, "queue": s, "queueType": "stream", "streamFilter": "red"}, "source")
    part, keep = stream_mode.StreamRange(s, 0, len(rows)), RowFilter(["red"], False)
    progress = stream_mode._Progress(part)
    with Connection.open(env.url) as conn:
        filtered = list(stream_mode._consume(conn, options, part, progress, 0.5, keep.consumer_arguments(), keep))
        silent_at = progress.seen
        rest = list(stream_mode._consume(conn, options, part, progress, keep=keep))
    got = [(o, bytes(b)) for batch in filtered + rest
           for o, b in zip(batch.column("stream_offset").to_pylist(), batch.column("body").to_pylist())]
    assert got == _want(rows, ["red"])
    assert progress.done
    assert silent_at < len(rows) - 1, "the broker sent the non-matching tail: nothing to test"
