"""The sink publishing to a super stream (`superStream`), on the embedded broker and on RabbitMQ 4.3 (whose
super streams its CLI makes): every row lands in exactly the partition RabbitMQ's stream clients would
send it to (`super_stream.partition_index` of its routing key), nothing lost, nothing twice; listed
partitions (`superStreamPartitions`) for a super stream made with binding keys; the stream filter value
from the option `filterValue` or the column `filter_value` as the stored messages' header; a partition
added while a streaming query runs is used from its next micro-batch; and the errors: a null routing key,
`exchange` with `superStream`."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from spark_amqp.super_stream import FILTER_VALUE_HEADER, partition_index


def expected_partitions(rows, partitions: list[str]) -> dict[str, Counter]:
    """{partition stream: Counter of bodies} as the stream clients route (body, routing key) rows."""
    out = {p: Counter() for p in partitions}
    for body, key in rows:
        out[partitions[partition_index(key, len(partitions))]][body] += 1
    return out


def read_partitions(admin, partitions: list[str], expected: dict[str, Counter]) -> dict[str, list]:
    return {p: admin.read_stream(p, sum(expected[p].values())) for p in partitions}


def assert_routed(got: dict[str, list], expected: dict[str, Counter]) -> None:
    for stream, messages in got.items():
        assert Counter(body.decode() for _, _, body in messages) == expected[stream], \
            f"{stream}: missing, misrouted or duplicated rows"
        assert {(m.exchange, m.routing_key) for m, _, _ in messages} <= {("", stream)}


def write(df, url, **options):
    writer = df.write.format("amqp").mode("append").option("uri", url)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.save()


def test_each_row_lands_in_the_partition_its_routing_key_hashes_to(spark, stream_broker_url, super_streams,
                                                                   unique_name):
    name = unique_name("orders")
    partitions = super_streams.create(name, partitions=3)
    assert partitions == [f"{name}-0", f"{name}-1", f"{name}-2"]
    rows = [(str(n), f"customer-{n % 41}") for n in range(600)]
    # An `exchange` column (a row the source read has one) is ignored: no exchange of that name exists.
    df = spark.createDataFrame([(b, k, "no-such-exchange") for b, k in rows],
                               "body string, routing_key string, exchange string").repartition(2)
    write(df, stream_broker_url, superStream=name)

    expected = expected_partitions(rows, partitions)
    assert all(sum(c.values()) > 100 for c in expected.values())     # every partition gets its share
    assert_routed(read_partitions(super_streams.admin, partitions, expected), expected)


def test_listed_partitions_of_a_super_stream_made_with_binding_keys(spark, stream_broker_url, super_streams,
                                                                    unique_name):
    name = unique_name("regions")
    partitions = super_streams.create(name, binding_keys=["eu", "us", "ap"])
    rows = [(str(n), f"k{n}") for n in range(200)]
    df = spark.createDataFrame(rows, "body string, routing_key string").coalesce(1)
    write(df, stream_broker_url, superStream=name, superStreamPartitions=",".join(partitions))
    # one row more, its key from the option routingKey: the column is overridden
    write(spark.createDataFrame([("200", "ignored")], "body string, routing_key string"), stream_broker_url,
          superStream=name, superStreamPartitions=",".join(partitions), routingKey="k200")

    expected = expected_partitions(rows + [("200", "k200")], partitions)
    assert_routed(read_partitions(super_streams.admin, partitions, expected), expected)


def test_the_filter_value_option_and_column_set_the_stream_filter_header(spark, stream_broker_url,
                                                                         super_streams, unique_name):
    name = unique_name("filtered")
    (partition,) = super_streams.create(name, partitions=1)
    df = spark.createDataFrame([("0", "k", "eu", {"a": "1"}), ("1", "k", None, {"a": "2"}),
                                ("2", "k", "us", None)],
                               "body string, routing_key string, filter_value string, headers map<string,string>")
    write(df.coalesce(1), stream_broker_url, superStream=name)
    write(df.coalesce(1).selectExpr("CAST(CAST(body AS INT) + 3 AS STRING) AS body", "routing_key",
                                    "filter_value", "headers"),
          stream_broker_url, superStream=name, filterValue="all")       # the option overrides the column

    got = super_streams.admin.read_stream(partition, 6)
    # (a stream consumer's deliveries also carry the header x-stream-offset, added by the broker)
    headers = {body.decode(): {k: v for k, v in props.headers.items() if k != "x-stream-offset"}
               for _, props, body in got}
    assert headers == {
        "0": {"a": "1", FILTER_VALUE_HEADER: "eu"}, "1": {"a": "2"}, "2": {FILTER_VALUE_HEADER: "us"},
        "3": {"a": "1", FILTER_VALUE_HEADER: "all"}, "4": {"a": "2", FILTER_VALUE_HEADER: "all"},
        "5": {FILTER_VALUE_HEADER: "all"},
    }
    assert len(got) == 6


def test_a_partition_added_while_a_query_runs_is_used_from_its_next_batch(spark, amqp_broker,
                                                                          embedded_super_streams, tmp_path,
                                                                          unique_name):
    made = embedded_super_streams
    name = unique_name("growing")
    two = made.create(name, partitions=2)
    src = tmp_path / "in"
    src.mkdir()

    def add_file(fname, numbers):
        with open(src / fname, "w") as fh:
            fh.writelines(json.dumps({"n": n}) + "\n" for n in numbers)

    add_file("a.json", range(0, 300))
    query = (spark.readStream.schema("n long").json(str(src))
             .selectExpr("CAST(n AS STRING) AS body", "concat('key-', CAST(n AS STRING)) AS routing_key")
             .writeStream.format("amqp").option("uri", amqp_broker.url).option("superStream", name)
             .option("checkpointLocation", str(tmp_path / "chk")).start())
    try:
        query.processAllAvailable()
        three = two + [made.add_partition(name, "2", 2)]
        add_file("b.json", range(300, 600))
        query.processAllAvailable()
    finally:
        query.stop()
    assert query.exception() is None

    first = expected_partitions([(str(n), f"key-{n}") for n in range(300)], two)
    second = expected_partitions([(str(n), f"key-{n}") for n in range(300, 600)], three)
    expected = {p: first.get(p, Counter()) + second[p] for p in three}
    assert sum(expected[three[2]].values()) > 50
    assert_routed(read_partitions(made.admin, three, expected), expected)


def test_a_null_routing_key_fails_the_write_naming_the_row_the_column_and_the_option(
        spark, amqp_broker, embedded_super_streams, unique_name):
    name = unique_name("nokey")
    embedded_super_streams.create(name, partitions=2)
    df = spark.createDataFrame([("0", "a"), ("1", None)], "body string, routing_key string").coalesce(1)
    with pytest.raises(Exception) as err:
        write(df, amqp_broker.url, superStream=name)
    msg = str(err.value)
    assert "row 1 has a null 'routing_key' column; with superStream=" in msg and "option routingKey" in msg


def test_exchange_and_super_stream_are_refused_together(spark, amqp_broker):
    df = spark.createDataFrame([("0", "a")], "body string, routing_key string")
    with pytest.raises(Exception) as err:
        write(df, amqp_broker.url, superStream="orders", exchange="x")
    assert "option 'exchange': got 'x'; contradicts superStream='orders'" in str(err.value)
