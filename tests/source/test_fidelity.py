"""Every property and every header field type, from a real publisher to rows, as the docs say.

The expected rows are written out by hand from the documented rule (spark_amqp/headers.py's docstring and
docs/source.md's "Header values" table: natural text in `headers`, the field type in `header_types`), not
computed with the connector's own code, and compared with chispa against what
`spark.readStream.format("amqp")` produced.
"""

from __future__ import annotations

import datetime
import decimal
import struct

import pika
from chispa import assert_df_equality

from source_helpers import Collector, checkpoint, stream
from spark_amqp.client import Connection
from spark_amqp.schema import SCHEMA

UTC = datetime.timezone.utc
STAMP = 1714564800                              # 2024-05-01T12:00:00Z


def _raw_headers(entries: list[tuple[str, bytes, bytes]]) -> bytes:
    """Content-header property bytes with only `headers` set, from (name, type letter, value bytes)."""
    body = b"".join(bytes((len(k),)) + k.encode() + t + v for k, t, v in entries)
    return struct.pack(">H", 1 << 13) + struct.pack(">I", len(body)) + body


def test_every_property_and_header_type_reaches_the_row(spark, env, tmp_path):
    q = env.queue("fidelity")
    env.channel().queue_bind(q, "amq.direct", q)

    full = pika.BasicProperties(
        content_type="application/json", content_encoding="gzip",
        headers={
            "str": "EUR",
            "unicode": "héllo ✓",
            "empty": "",
            "looks_typed": "5::long",          # a string that looks typed is a string
            "int": 42,                         # pika: I (signed 32-bit)
            "neg_int": -7,
            "big": 2 ** 40,                    # pika: l (signed 64-bit)
            "true": True,
            "false": False,
            "none": None,                      # V (void) -> null map value
            "bytes": b"\x00\xffhi",            # x (byte array) -> base64
            "decimal": decimal.Decimal("3.14"),
            "neg_decimal": decimal.Decimal("-0.5"),
            "when": datetime.datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC),
            "nested": {"a": 1, "b": "x", "c": [1, "y"], "d": {"e": True}},
            "list": [1, "two", None, ["x"], {"k": b"\x01"}],
        },
        delivery_mode=2, priority=7, correlation_id="corr-1", reply_to="replies",
        expiration="600000", message_id="m-1", timestamp=STAMP, type="order.created",
        user_id="guest", app_id="fidelity-test")
    env.publish(q, [b'{"n": 1}', b""], [full, pika.BasicProperties()], exchange="amq.direct")

    # The field types pika never sends (8/16-bit, unsigned, float, double, a non-UTF-8 string), published
    # as raw property bytes through our own client.
    raw = _raw_headers([
        ("byte", b"b", struct.pack(">b", -1)),
        ("ubyte", b"B", struct.pack(">B", 255)),
        ("short", b"s", struct.pack(">h", -300)),
        ("ushort", b"u", struct.pack(">H", 65535)),
        ("uint", b"i", struct.pack(">I", 4294967295)),
        ("float32", b"f", struct.pack(">f", 0.25)),
        ("double", b"d", struct.pack(">d", 1.5)),
        ("latin1", b"S", struct.pack(">I", 2) + b"\xff\xfe"),
    ])
    with Connection.open(env.url) as conn:
        ch = conn.channel()
        ch.confirm_select()
        ch.publish("amq.direct", q, b"raw", properties=raw)
        ch.wait_for_confirms(timeout=10)

    sink = Collector()
    query = (stream(spark, env.url, q).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(60), "the availableNow run did not end"
    assert query.exception() is None

    none = dict(content_type=None, content_encoding=None, headers=None, delivery_mode=None, priority=None,
                correlation_id=None, reply_to=None, expiration=None, message_id=None, timestamp=None,
                type=None, user_id=None, app_id=None, header_types=None)
    base = dict(exchange="amq.direct", routing_key=q, queue=q, redelivered=False, stream_offset=None)
    expected_rows = [
        {**base, **none, "body": b'{"n": 1}', "delivery_tag": 1,
         "content_type": "application/json", "content_encoding": "gzip",
         "headers": {
             "str": "EUR",
             "unicode": "héllo ✓",
             "empty": "",
             "looks_typed": "5::long",
             "int": "42",
             "neg_int": "-7",
             "big": "1099511627776",
             "true": "true",
             "false": "false",
             "none": None,
             "bytes": "AP9oaQ==",
             "decimal": "3.14",
             "neg_decimal": "-0.5",
             "when": "2024-05-01T12:00:00Z",
             "nested": '{"a":1,"b":"x","c":[1,"y"],"d":{"e":true}}',
             "list": '[1,"two",null,["x"],{"k":"AQ=="}]',
         },
         "header_types": {
             "str": "string", "unicode": "string", "empty": "string", "looks_typed": "string",
             "int": "int", "neg_int": "int", "big": "long", "true": "bool", "false": "bool", "none": "void",
             "bytes": "bytes", "decimal": "decimal", "neg_decimal": "decimal", "when": "timestamp",
             # pika sends 1 as a 32-bit int, not the long a JSON integer defaults to: the tree is given
             "nested": '{"a":"int","b":"string","c":["int","string"],"d":{"e":"bool"}}',
             "list": '["int","string","void",["string"],{"k":"bytes"}]',
         },
         "delivery_mode": 2, "priority": 7, "correlation_id": "corr-1", "reply_to": "replies",
         "expiration": "600000", "message_id": "m-1",
         "timestamp": datetime.datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC),
         "type": "order.created", "user_id": "guest", "app_id": "fidelity-test"},
        {**base, **none, "body": b"", "delivery_tag": 2},
        {**base, **none, "body": b"raw", "delivery_tag": 3,
         "headers": {"byte": "-1", "ubyte": "255", "short": "-300", "ushort": "65535", "uint": "4294967295",
                     "float32": "0.25", "double": "1.5", "latin1": "//4="},
         "header_types": {"byte": "byte", "ubyte": "ubyte", "short": "short", "ushort": "ushort", "uint": "uint",
                          "float32": "float", "double": "double", "latin1": "longstr-base64"}},
    ]
    expected = spark.createDataFrame([tuple(r[f.name] for f in SCHEMA.fields) for r in expected_rows], SCHEMA)
    actual = spark.createDataFrame(sink.rows, SCHEMA)

    assert_df_equality(actual.orderBy("delivery_tag"), expected.orderBy("delivery_tag"))
    # user_id is the login user (both brokers refuse a publish whose user_id is someone else).
    assert sink.rows[0].user_id == env.url.split("//")[1].split(":")[0]


def test_sql_reads_header_values_as_they_are(spark, env, tmp_path):
    """The point of natural header text: CAST and comparisons work on integer, decimal, boolean, timestamp
    and JSON headers without any parsing (an integer once read as '3::long' gave null)."""
    q = env.queue("sql")
    headers = {"retries": 5, "amount": decimal.Decimal("12.50"), "urgent": True,
               "sent": datetime.datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC), "who": "ops",
               "trail": [{"hop": 1, "at": "a"}, {"hop": 2, "at": "b"}]}
    env.publish(q, [b"m"], [pika.BasicProperties(headers=headers)])
    sink = Collector()
    query = (stream(spark, env.url, q)
             .selectExpr("CAST(headers['retries'] AS INT) AS retries",
                         "headers['retries'] > 3 AS many",
                         "CAST(headers['amount'] AS DECIMAL(10,2)) AS amount",
                         "CAST(headers['urgent'] AS BOOLEAN) AS urgent",
                         "CAST(headers['sent'] AS TIMESTAMP) AS sent",
                         "headers['who'] AS who",
                         "CAST(get_json_object(headers['trail'], '$[1].hop') AS INT) AS hop",
                         "header_types['retries'] AS retries_type", "header_types['sent'] AS sent_type")
             .writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(availableNow=True).start())
    assert query.awaitTermination(60), "the availableNow run did not end"
    assert query.exception() is None
    (row,) = sink.rows
    assert row.asDict() == {"retries": 5, "many": True, "amount": decimal.Decimal("12.50"), "urgent": True,
                            "sent": datetime.datetime(2024, 5, 1, 12, 0, 0), "who": "ops", "hop": 2,
                            "retries_type": "int", "sent_type": "timestamp"}
