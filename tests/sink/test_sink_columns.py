"""The sink's column rules, checked without Spark or a broker: which schemas are accepted, what the errors
say, and that the per-row property bytes are those of `spark_amqp.properties.encode` (the reference that
the source's `decode` inverts)."""

from __future__ import annotations

import datetime

import pytest
from pyspark.sql.types import (BinaryType, IntegerType, LongType, MapType, ShortType, StringType, StructField,
                               StructType)

from spark_amqp import options as opts
from spark_amqp import properties
from spark_amqp.schema import PROPERTY_COLUMNS, SCHEMA
from spark_amqp.sink.columns import RowError, SinkSchemaError, encode_properties, plan, with_filter_values
from spark_amqp.sink.publisher import TaskIdentity, message_id

URI = "amqp://guest:secret-pw@127.0.0.1:5672/%2F"


def sink_options(**extra):
    return opts.parse({"uri": URI, "routingKey": "q", **extra}, "sink")


def schema(*fields):
    return StructType([StructField(n, t) for n, t in fields])


def test_the_source_schema_is_accepted_and_source_only_columns_are_ignored():
    p = plan(SCHEMA, opts.parse({"uri": URI}, "sink"))
    assert p.body == 0 and not p.body_is_string
    assert p.exchange == 1 and p.routing_key == 2
    assert [n for n, _ in p.properties] == ["content_type", "content_encoding", "headers", "delivery_mode",
                                            "priority", "correlation_id", "reply_to", "expiration",
                                            "message_id", "timestamp", "type", "user_id", "app_id",
                                            "header_types"]
    assert set(p.ignored) == {"queue", "delivery_tag", "redelivered", "stream_offset"}


def test_an_option_given_overrides_its_column():
    assert (plan(SCHEMA, sink_options()).exchange, plan(SCHEMA, sink_options()).routing_key) == (1, None)
    both = plan(SCHEMA, sink_options(exchange=""))       # '' (the default exchange) is an option given too
    assert (both.exchange, both.routing_key) == (None, None)


def test_body_may_be_a_string_and_integer_properties_any_integer_type():
    p = plan(schema(("BODY", StringType()), ("priority", LongType()), ("delivery_mode", ShortType())),
             sink_options())
    assert p.body_is_string
    assert dict(p.properties) == {"priority": 1, "delivery_mode": 2}


def test_body_is_required():
    with pytest.raises(SinkSchemaError) as err:
        plan(schema(("value", BinaryType()), ("routing_key", StringType())), sink_options())
    msg = str(err.value)
    assert "needs a column 'body' (binary or string)" in msg
    assert "value, routing_key" in msg


def test_unknown_columns_are_listed():
    with pytest.raises(SinkSchemaError) as err:
        plan(schema(("body", BinaryType()), ("foo", StringType()), ("bar", IntegerType())), sink_options())
    msg = str(err.value)
    assert "unknown column(s) for the amqp sink: 'foo', 'bar'" in msg
    assert "ignoreUnknownColumns" in msg


def test_unknown_columns_can_be_ignored():
    p = plan(schema(("body", BinaryType()), ("foo", StringType())), sink_options(ignoreUnknownColumns="true"))
    assert p.ignored == ("foo",)
    assert p.properties == ()


def test_wrong_types_name_the_column_and_the_expected_type():
    with pytest.raises(SinkSchemaError) as err:
        plan(schema(("body", IntegerType()), ("priority", StringType()),
                    ("headers", MapType(StringType(), IntegerType())), ("timestamp", LongType()),
                    ("routing_key", BinaryType())), sink_options())
    msg = str(err.value)
    assert "column 'body' has type int, expected binary or string" in msg
    assert "column 'priority' has type string, expected int" in msg
    assert "column 'headers' has type map<string,int>, expected map<string,string>" in msg
    assert "column 'timestamp' has type bigint, expected timestamp" in msg
    assert "column 'routing_key' has type binary, expected string" in msg


def test_a_destination_is_required():
    with pytest.raises(SinkSchemaError, match="nowhere to send the rows"):
        plan(schema(("body", BinaryType())), opts.parse({"uri": URI}, "sink"))
    plan(schema(("body", BinaryType())), opts.parse({"uri": URI, "exchange": "x"}, "sink"))
    plan(schema(("body", BinaryType()), ("routing_key", StringType())), opts.parse({"uri": URI}, "sink"))


def test_a_super_stream_routes_by_the_routing_key_and_ignores_an_exchange_column():
    p = plan(SCHEMA, opts.parse({"uri": URI, "superStream": "orders"}, "sink"))
    assert (p.exchange, p.routing_key) == (None, 2) and "exchange" in p.ignored
    with pytest.raises(SinkSchemaError) as err:
        plan(schema(("body", BinaryType()), ("exchange", StringType())),
             opts.parse({"uri": URI, "superStream": "orders"}, "sink"))
    msg = str(err.value)
    assert "superStream='orders'" in msg and "no 'routing_key' column" in msg and "'routingKey'" in msg
    plan(schema(("body", BinaryType())), opts.parse({"uri": URI, "superStream": "orders", "routingKey": "k"}, "sink"))


def test_filter_value_is_a_string_column_the_option_overrides():
    cols = schema(("body", BinaryType()), ("filter_value", StringType()))
    assert plan(cols, sink_options()).filter_value == 1
    assert plan(cols, sink_options(filterValue="eu")).filter_value is None
    with pytest.raises(SinkSchemaError, match="column 'filter_value' has type int, expected string"):
        plan(schema(("body", BinaryType()), ("filter_value", IntegerType())), sink_options())


def test_the_filter_value_is_merged_into_the_headers_as_a_string():
    props = {"headers": [[("a", "1"), ("x-stream-filter-value", "old")], None, {"b": "2"}, None],
             "header_types": [[("a", "long"), ("x-stream-filter-value", "long")], None, None, {"b": "int"}]}
    merged = with_filter_values(props, ["eu", "us", None, None], 4)
    assert merged["headers"] == [{"a": "1", "x-stream-filter-value": "eu"}, {"x-stream-filter-value": "us"},
                                 {"b": "2"}, None]
    assert merged["header_types"] == [{"a": "long"}, None, None, {"b": "int"}]
    raw = encode_properties(merged, 4)
    assert properties.to_columns(raw[0])["headers"] == {"a": "1", "x-stream-filter-value": "eu"}
    assert encode_properties(with_filter_values({}, ["ap"], 1), 1) == \
        [properties.from_columns({"headers": {"x-stream-filter-value": "ap"}})]


def test_errors_never_show_the_password():
    with pytest.raises(SinkSchemaError) as err:
        plan(schema(("foo", StringType())), sink_options())
    assert "secret-pw" not in str(err.value)


ROWS = [
    {"content_type": "application/json", "content_encoding": "gzip", "headers": {"a": "1", "b": "x"},
     "header_types": {"a": "long", "b": "string"}, "delivery_mode": 2, "priority": 9, "correlation_id": "c-1", "reply_to": "replies", "expiration": "60000",
     "message_id": "m-1", "timestamp": datetime.datetime(2024, 5, 1, 12, 0, 0), "type": "order",
     "user_id": "guest", "app_id": "tests"},
    {},
    {"headers": {}, "header_types": {}, "priority": 0, "message_id": "é" * 100},
    {"delivery_mode": 1, "timestamp": datetime.datetime(1970, 1, 1), "headers": {"v": None, "t": "true"},
     "header_types": {"v": "void", "t": "bool"}},
]


def test_property_bytes_are_those_of_properties_encode():
    n = len(ROWS)
    columns = {name: [row.get(name) for row in ROWS] for name in PROPERTY_COLUMNS + ("header_types",)}
    columns["timestamp"] = [int((v - datetime.datetime(1970, 1, 1)).total_seconds()) if v else None
                            for v in columns["timestamp"]]
    for name in ("headers", "header_types"):   # Arrow's form of a map: a list of pairs
        columns[name] = [list(v.items()) if v is not None else None for v in columns[name]]
    assert encode_properties(columns, n) == [properties.from_columns(row) for row in ROWS]
    # a single property column takes a shortcut: same bytes
    only = {"message_id": [r.get("message_id") for r in ROWS]}
    assert encode_properties(only, n) == [properties.from_columns({"message_id": r.get("message_id")}) for r in ROWS]
    assert encode_properties({}, 2) == [b"\x00\x00", b"\x00\x00"]
    for raw, row in zip(encode_properties(columns, n), ROWS):
        assert properties.to_columns(raw) == {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize("column, value, expected", [
    ("priority", 256, "column 'priority' of row 11 is 256; it must be 0..255"),
    ("delivery_mode", -1, "column 'delivery_mode' of row 11 is -1"),
    ("correlation_id", "x" * 256, "column 'correlation_id' of row 11 is 256 bytes long"),
    ("headers", {"n": "abc"}, "column 'headers' of row 11: header 'n': cannot read 'abc' as long"),
    ("timestamp", -5, "column 'timestamp' of row 11 is before 1970"),
])
def test_bad_values_name_the_column_and_the_row(column, value, expected):
    with pytest.raises(RowError) as err:
        encode_properties({column: [None, value], "header_types": [None, {"n": "long"}]}, 2, first_row=10)
    assert expected in str(err.value)


def test_deterministic_message_ids():
    stream = TaskIdentity(job="5f1c", batch=7, partition=1)
    batch = TaskIdentity(job="9a2b", batch=None, partition=0, attempt=3)
    assert message_id(stream, 42) == "5f1c:7:1:42"
    assert message_id(batch, 0) == "9a2b:0:0"   # the attempt is not part of it: a retry sends the same ids
