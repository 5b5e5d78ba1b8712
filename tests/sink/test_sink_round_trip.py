"""Every property and every header field type through the sink, on every broker (RabbitMQ 3.10 included).

1. Rows with every property column and a header of every AMQP field type, written with
   `df.write.format("amqp")`, consumed with pika (values as pika decodes them) and with our client (the
   property bytes, compared with `spark_amqp.properties.from_columns` of the row: the reference the
   source's `to_columns` inverts).
2. A message published by pika (and one by raw property bytes with every field type), read back, turned
   into a row exactly as the source does (`properties.to_columns` of the raw property bytes, plus the
   source-only columns), written unchanged: the message that arrives has byte-identical properties, the
   same body and the same routing key.
"""

from __future__ import annotations

import datetime
import decimal

import pika
import pytest

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from spark_amqp import properties
from spark_amqp.client import Connection
from spark_amqp.codec import properties as codec_properties
from spark_amqp.schema import SCHEMA

from brokers import ALL_BROKERS

# 3.10 too: RabbitMQ 3.10 delivers the headers table as published, 4.x sorted by key.
pytestmark = pytest.mark.parametrize("broker_url", ALL_BROKERS, indirect=True)


def arrow_df(spark, rows: list[dict], schema):
    """A DataFrame built from Arrow, as the source builds its rows: header maps keep their order (a Python
    dict given to createDataFrame goes through a java.util.HashMap and loses it; AMQP tables are ordered)."""
    import pyarrow as pa

    if isinstance(schema, str):
        schema = StructType.fromDDL(schema)
    try:
        arrow_schema = to_arrow_schema(schema, timezone="UTC")
    except TypeError:   # PySpark 4.0: no timezone argument (timestamps are UTC there)
        arrow_schema = to_arrow_schema(schema)
    maps = [n for n in ("headers", "header_types") if n in schema.fieldNames()]
    fixed = [{**r, **{n: list(r[n].items()) if r.get(n) is not None else None for n in maps}} for r in rows]
    table = pa.Table.from_pylist([{n: r.get(n) for n in schema.fieldNames()} for r in fixed], arrow_schema)
    return spark.createDataFrame(table, schema)

HEADERS = {
    "text": "EUR",
    "byte": "-5",
    "ubyte": "200",
    "short": "-300",
    "ushort": "60000",
    "int": "-70000",
    "uint": "4000000000",
    "long": "9007199254740993",
    "float": "0.25",
    "double": "1.5",
    "decimal": "3.14",
    "timestamp": "2024-05-01T12:00:00Z",
    "bytes": "aGk=",
    "bool": "true",
    "void": None,
    "table": '{"a":1,"b":"x","c":{"d":false}}',
    "array": '[1,"y",[2]]',
    "untyped": "a::long",
    "not-utf8": "/w==",
}
HEADER_TYPES = {   # "untyped" has no entry: a string
    "text": "string", "byte": "byte", "ubyte": "ubyte", "short": "short", "ushort": "ushort", "int": "int",
    "uint": "uint", "long": "long", "float": "float", "double": "double", "decimal": "decimal",
    "timestamp": "timestamp", "bytes": "bytes", "bool": "bool", "void": "void", "table": "table",
    "array": '["long","string",["int"]]', "not-utf8": "longstr-base64",
}
PIKA_VALUES = {   # the same headers as pika decodes them (the raw bytes are checked below)
    "text": "EUR", "byte": -5, "ubyte": 200, "short": -300, "ushort": 60000, "int": -70000,
    "uint": 4000000000, "long": 9007199254740993,
    "float": 0, "double": 1,   # pika 1.4.4 truncates floats and doubles to integers when it decodes them
    "decimal": decimal.Decimal("3.14"),
    "timestamp": datetime.datetime(2024, 5, 1, 12, 0, 0, tzinfo=datetime.timezone.utc),
    "bytes": b"hi", "bool": True, "void": None, "table": {"a": 1, "b": "x", "c": {"d": False}},
    "array": [1, "y", [2]], "untyped": "a::long", "not-utf8": b"\xff",
}
PROPS = {
    "content_type": "application/json", "content_encoding": "identity", "delivery_mode": 2, "priority": 7,
    "correlation_id": "corr-1", "reply_to": "replies", "expiration": "600000", "message_id": "msg-1",
    "timestamp": datetime.datetime(2024, 5, 1, 12, 30, 15), "type": "order.created", "user_id": "guest",
    "app_id": "sink-tests",
}
WRITE_SCHEMA = "body binary, routing_key string, content_type string, content_encoding string, " \
               "headers map<string,string>, delivery_mode int, priority int, correlation_id string, " \
               "reply_to string, expiration string, message_id string, timestamp timestamp, type string, " \
               "user_id string, app_id string, header_types map<string,string>"


def get_raw(url: str, queue: str, count: int, timeout: float = 10.0):
    """`count` messages from `queue` with our client: (routing key, raw property bytes, body), acked."""
    out = []
    with Connection.open(url) as conn:
        ch = conn.channel()
        import time
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            d = ch.basic_get(queue, no_ack=True)
            if d is None:
                time.sleep(0.02)
                continue
            out.append((d.exchange, d.routing_key, d.properties_raw, d.body))
    assert len(out) == count, f"expected {count} message(s) in {queue}, got {len(out)}"
    return out


def as_delivered(raw: bytes, broker_kind: str) -> bytes:
    """Property bytes `raw` as the broker delivers them: RabbitMQ 4.x (and the embedded broker, 4.3 by
    default) sorts the headers table by key; RabbitMQ 3.10 keeps the publisher's bytes."""
    return raw if broker_kind == "rabbitmq" else codec_properties.with_sorted_headers(raw)


def test_every_property_and_header_type_written_by_the_sink(spark, broker_url, broker_kind, admin, unique_name):
    queue = admin.queue(unique_name("rt"))
    row = dict(body=b"\x00\x01binary body\xff", routing_key=queue, headers=HEADERS, header_types=HEADER_TYPES,
               **PROPS)
    sparse = dict(body=b"", routing_key=queue, headers={}, priority=0)   # nulls: "not set"
    df = arrow_df(spark, [row, sparse], WRITE_SCHEMA).coalesce(1)
    df.write.format("amqp").mode("append").option("uri", broker_url).option("exchange", "").save()

    got = admin.drain(queue)
    assert len(got) == 2
    method, props, body = got[0]
    assert body == row["body"]
    assert method.routing_key == queue and method.exchange == ""
    for name, value in PROPS.items():
        assert getattr(props, name) == (int(value.replace(tzinfo=datetime.timezone.utc).timestamp())
                                        if name == "timestamp" else value), name
    assert props.headers == PIKA_VALUES
    method, props, body = got[1]
    assert body == b"" and props.headers == {} and props.priority == 0
    assert props.content_type is None and props.message_id is None and props.timestamp is None

    # byte level: exactly properties.from_columns of the row's values (every field type letter as written)
    df.write.format("amqp").mode("append").option("uri", broker_url).option("exchange", "").save()
    (_, _, raw1, body1), (_, _, raw2, _) = get_raw(broker_url, queue, 2)
    assert raw1 == as_delivered(properties.from_columns({**PROPS, "headers": HEADERS, "header_types": HEADER_TYPES}),
                                broker_kind)
    assert raw2 == properties.from_columns({"headers": {}, "priority": 0})
    assert body1 == row["body"]


def source_row(exchange, routing_key, raw, body, queue, tag):
    """The row the source builds from a delivery (docs/source.md, "Row schema")."""
    values = dict.fromkeys(SCHEMA.fieldNames())
    values.update(body=body, exchange=exchange, routing_key=routing_key, queue=queue, delivery_tag=tag,
                  redelivered=False, stream_offset=None)
    values.update(properties.to_columns(raw))
    return values


def test_a_row_read_from_a_queue_and_written_unchanged_is_the_same_message(spark, broker_url, broker_kind, admin,
                                                                           unique_name):
    queue = admin.queue(unique_name("src"))
    # 1. pika publishes with every property and the header types pika can produce
    pika_headers = {"s": "text", "i": 42, "big": 2 ** 40, "neg": -7, "t": True, "n": None,   # (no floats in pika)
                    "d": decimal.Decimal("-12.345"), "ts": datetime.datetime(2023, 1, 2, 3, 4, 5),
                    "x": b"\x00\xff", "tbl": {"k": "v", "n": 1, "inner": {"z": [1, "two"]}},
                    "arr": [1, "a", None, {"q": False}], "weird::long": "v::bool", "empty": "",
                    "x-death": [{"count": 2, "time": datetime.datetime(2024, 1, 1), "routing-keys": ["a"]}]}
    admin.ch.basic_publish("", queue, b"from pika", pika.BasicProperties(
        headers=pika_headers, timestamp=1700000000, **{k: v for k, v in PROPS.items() if k != "timestamp"}))
    # 2. raw property bytes with every field type letter (b B s u I i l f d D T x t V S F A)
    raw_every = properties.from_columns({"headers": HEADERS, "header_types": HEADER_TYPES,
                                         "content_type": "text/plain", "priority": 1})
    with Connection.open(broker_url) as conn:
        ch = conn.channel()
        ch.confirm_select()
        ch.publish("", queue, b"raw every type", raw_every)
        ch.publish("", queue, b"", b"\x00\x00")    # no properties at all, empty body
        ch.wait_for_confirms(10)
    originals = get_raw(broker_url, queue, 3)
    assert originals[1][2] == as_delivered(raw_every, broker_kind)

    rows = [source_row(ex, rk, raw, body, queue, i + 1) for i, (ex, rk, raw, body) in enumerate(originals)]
    df = arrow_df(spark, rows, SCHEMA).coalesce(1)   # the source's schema, source-only columns included
    df.write.format("amqp").mode("append").option("uri", broker_url).save()

    again = get_raw(broker_url, queue, 3)   # routed by the rows' own exchange and routing key
    for (ex0, rk0, raw0, body0), (ex1, rk1, raw1, body1) in zip(originals, again):
        assert (ex1, rk1, body1) == (ex0, rk0, body0)
        assert raw1 == raw0, f"{properties.to_columns(raw1)} != {properties.to_columns(raw0)}"


def test_the_row_path_publishes_the_same_bytes_as_the_arrow_path(spark, broker_url, broker_kind, admin, unique_name):
    """PySpark 4.0's streaming writes get Rows (`publisher.row_chunks`): fed the same rows, that path must
    publish exactly what the Arrow path does. A batch writer fed Rows, defined here, runs it on any PySpark."""
    from pyspark.sql.datasource import DataSourceWriter

    from spark_amqp import options as opts
    from spark_amqp.datasource import AMQPDataSource
    from spark_amqp.sink.writer import _BatchBase

    class RowWriter(_BatchBase, DataSourceWriter):
        _arrow = False

    class RowsDataSource(AMQPDataSource):   # defined here: cloudpickle ships both to the workers by value
        @classmethod
        def name(cls):
            return "amqprows"

        def writer(self, schema, overwrite):
            return RowWriter(opts.parse(self.options, "sink"), schema)

    spark.dataSource.register(RowsDataSource)
    queue = admin.queue(unique_name("rows"))
    rows = [dict(body=b"full", routing_key=queue, headers=HEADERS, header_types=HEADER_TYPES, **PROPS),
            dict(body=None, routing_key=queue, headers=None, priority=3)]
    df = arrow_df(spark, rows, WRITE_SCHEMA).coalesce(1)
    df.write.format("amqp").mode("append").option("uri", broker_url).save()
    df.write.format("amqprows").mode("append").option("uri", broker_url).save()
    got = get_raw(broker_url, queue, 4)
    assert got[:2] == got[2:]
    assert got[0][2] == as_delivered(properties.from_columns({**PROPS, "headers": HEADERS,
                                                              "header_types": HEADER_TYPES}), broker_kind)
    assert got[0][3] == b"full"
    assert got[1][2] == properties.from_columns({"priority": 3}) and got[1][3] == b""   # a null body is empty


def test_batch_writes_get_deterministic_ids_per_write(spark, broker_url, admin, unique_name):
    """messageId=deterministic in a batch write: `<write id>:<partition>:<row>` where a row has no message_id,
    one write id for every task of a write, a new one for the next write; a row's own message_id is kept."""
    import re

    queue = admin.queue(unique_name("ids"))
    df = spark.range(6, numPartitions=2).selectExpr(
        "CAST(id AS STRING) AS body", "CASE WHEN id = 4 THEN 'own-id' END AS message_id")
    for _ in range(2):
        df.write.format("amqp").mode("append").option("uri", broker_url).option("routingKey", queue) \
            .option("messageId", "deterministic").save()
    got = admin.drain(queue)
    assert len(got) == 12
    by_write: dict[str, dict] = {}
    for _, props, body in got:
        if body == b"4":
            assert props.message_id == "own-id"
            continue
        m = re.fullmatch(r"([0-9a-f]{32}):([01]):(\d)", props.message_id)
        assert m, props.message_id
        by_write.setdefault(m.group(1), {})[(int(m.group(2)), int(m.group(3)))] = int(body)
    assert len(by_write) == 2                       # two writes, two ids
    for ids in by_write.values():                   # spark.range(6, 2 partitions): 0,1,2 | 3,4,5
        assert ids == {(0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 0): 3, (1, 2): 5}
