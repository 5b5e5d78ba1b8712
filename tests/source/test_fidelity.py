"""Every property and every header field type, from a real publisher to rows, as the docs say.

The expected rows are written out by hand from the documented text rule (spark_amqp/headers.py's
docstring and the README's "Header values" table), not computed with the connector's own code, and
compared with chispa against what `spark.readStream.format("amqp")` produced.
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
            "looks_typed": "5::long",          # a string ending like a typed value gets ::string
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
                type=None, user_id=None, app_id=None)
    base = dict(exchange="amq.direct", routing_key=q, queue=q, redelivered=False, stream_offset=None)
    expected_rows = [
        {**base, **none, "body": b'{"n": 1}', "delivery_tag": 1,
         "content_type": "application/json", "content_encoding": "gzip",
         "headers": {
             "str": "EUR",
             "unicode": "héllo ✓",
             "empty": "",
             "looks_typed": "5::long::string",
             "int": "42::int",
             "neg_int": "-7::int",
             "big": "1099511627776::long",
             "true": "true::bool",
             "false": "false::bool",
             "none": None,
             "bytes": "AP9oaQ==::bytes",
             "decimal": "3.14::decimal",
             "neg_decimal": "-0.5::decimal",
             "when": "2024-05-01T12:00:00Z::timestamp",
             "nested": '{"a":"1::int","b":"x","c":["1::int","y"],"d":{"e":"true::bool"}}::table',
             "list": '["1::int","two",null,["x"],{"k":"AQ==::bytes"}]::array',
         },
         "delivery_mode": 2, "priority": 7, "correlation_id": "corr-1", "reply_to": "replies",
         "expiration": "600000", "message_id": "m-1",
         "timestamp": datetime.datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC),
         "type": "order.created", "user_id": "guest", "app_id": "fidelity-test"},
        {**base, **none, "body": b"", "delivery_tag": 2},
        {**base, **none, "body": b"raw", "delivery_tag": 3,
         "headers": {"byte": "-1::byte", "ubyte": "255::ubyte", "short": "-300::short",
                     "ushort": "65535::ushort", "uint": "4294967295::uint", "float32": "0.25::float",
                     "double": "1.5::double",
                     "latin1": "//4=::longstr-base64"}},
    ]
    expected = spark.createDataFrame([tuple(r[f.name] for f in SCHEMA.fields) for r in expected_rows], SCHEMA)
    actual = spark.createDataFrame(sink.rows, SCHEMA)

    assert_df_equality(actual.orderBy("delivery_tag"), expected.orderBy("delivery_tag"))
    # user_id is the login user (both brokers refuse a publish whose user_id is someone else).
    assert sink.rows[0].user_id == env.url.split("//")[1].split(":")[0]
