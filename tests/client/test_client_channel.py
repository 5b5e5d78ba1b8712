"""Channel operations over real TCP, against the embedded broker and RabbitMQ (`broker_url`).

The round-trip test is differential twice over: each broker against the other (same assertions), and
our decoding against pika's for the very same message (one publish to a fanout exchange reaching a
queue we consume and a queue pika consumes).
"""

from __future__ import annotations

import datetime
import decimal
import time

import pika
import pytest

from client_helpers import field_table, raw_properties
from spark_amqp.client import ChannelClosedError, ConsumerCancelledError, Connection
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)

QUIET = 0.3  # how long to watch for deliveries that must NOT arrive

# Every field type of RabbitMQ's errata table (tag, value as encoded, value as pamqp decodes it).
HEADER_FIELDS = [
    ("bool", "t", 1, True),
    ("int8", "b", -7, -7),
    ("uint8", "B", 200, 200),
    ("int16", "s", -300, -300),
    ("uint16", "u", 60000, 60000),
    ("int32", "I", -70000, -70000),
    ("uint32", "i", 3_000_000_000, 3_000_000_000),
    ("int64", "l", -2**40, -2**40),
    ("float", "f", 1.5, 1.5),
    ("double", "d", 2.25, 2.25),
    ("decimal", "D", (2, 12345), decimal.Decimal("123.45")),
    ("longstr", "S", "héllo", "héllo"),
    ("timestamp", "T", 1_700_000_000, datetime.datetime(2023, 11, 14, 22, 13, 20, tzinfo=datetime.UTC)),
    ("table", "F", [("k", "S", "v"), ("n", "I", 1)], {"k": "v", "n": 1}),
    ("array", "A", [("I", 1), ("S", "two"), ("A", [("t", 0)])], [1, "two", [False]]),
    ("void", "V", None, None),
    ("bytes", "x", b"\x00\xffraw", b"\x00\xffraw"),
]

PROPERTIES = dict(content_type="application/json", content_encoding="gzip", delivery_mode=2, priority=7,
                  correlation_id="corr-1", reply_to="reply.q", expiration="60000", message_id="msg-1",
                  timestamp=1_700_000_000, type="evt.type", user_id="guest", app_id="spark-amqp-test")


def test_round_trip_every_property_and_header_type(broker_url, connect, unique_name):
    conn = connect()
    ch = conn.channel()
    exchange = unique_name("fan")
    ch.exchange_declare(exchange, "fanout", auto_delete=True)
    ours = ch.queue_declare(unique_name(), exclusive=True).name
    ch.queue_bind(ours, exchange)
    pconn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        pch = pconn.channel()
        theirs = pch.queue_declare(unique_name(), exclusive=True).method.queue
        pch.queue_bind(theirs, exchange)

        headers = field_table([(name, tag, wire) for name, tag, wire, _ in HEADER_FIELDS])
        raw = raw_properties(headers=headers, **PROPERTIES)
        body = bytes(range(256)) * 3
        ch.confirm_select()
        ch.publish(exchange, "any.key", body, raw)
        assert ch.wait_for_confirms(timeout=10) == 1

        ch.basic_consume(ours)
        (d,) = wait_until(lambda: ch.get_deliveries(10, timeout=0.5), message="a delivery")
        assert (d.exchange, d.routing_key, d.redelivered, d.delivery_tag, d.body) == \
            (exchange, "any.key", False, 1, body)
        assert d.properties_raw == raw  # both brokers pass content headers through byte for byte
        p = d.properties
        for name in ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
                     "reply_to", "expiration", "message_id", "user_id", "app_id"):
            assert getattr(p, name) == PROPERTIES[name], name
        assert p.message_type == "evt.type"
        assert p.timestamp == datetime.datetime.fromtimestamp(1_700_000_000, datetime.UTC)
        decoded = dict(p.headers)
        decoded["bytes"] = bytes(decoded["bytes"])  # pamqp gives bytearray for 'x'
        assert decoded == {name: value for name, _, _, value in HEADER_FIELDS}

        method, pprops, pbody = wait_until(lambda: _pika_get(pch, theirs), message="pika to get the message")
        assert pbody == body and method.exchange == exchange and method.routing_key == "any.key"
        for name in ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
                     "reply_to", "expiration", "message_id", "user_id", "app_id"):
            assert getattr(pprops, name) == getattr(p, name), name
        assert pprops.type == p.message_type
        assert pprops.timestamp == int(p.timestamp.timestamp())
        for name, tag, _, _ in HEADER_FIELDS:
            ours_value, pika_value = decoded[name], pprops.headers[name]
            if tag in "fd":  # pika 1.4.4 data.py decodes floats through long(): 1.5 arrives as 1
                assert pika_value == int(ours_value), name
            else:
                assert pika_value == ours_value, name
    finally:
        pconn.close()


def _pika_get(pch, queue):
    method, props, body = pch.basic_get(queue, auto_ack=True)
    return (method, props, body) if method is not None else None


def test_properties_from_dict_and_relay_of_raw_bytes(channel, unique_name):
    q = channel.queue_declare(unique_name(), exclusive=True).name
    channel.publish("", q, "texte", {"content_type": "text/plain", "headers": {"n": 1, "s": "x"}})
    first = wait_until(lambda: channel.basic_get(q, no_ack=True))
    assert first.body == "texte".encode() and first.properties.headers == {"n": 1, "s": "x"}
    channel.publish("", q, first.body, first.properties_raw)  # relay: the header bytes are reused as is
    second = wait_until(lambda: channel.basic_get(q, no_ack=True))
    assert second.properties_raw == first.properties_raw and second.body == first.body


def test_queue_declare_counts_purge_delete(channel, unique_name):
    name = unique_name()
    info = channel.queue_declare(name, auto_delete=False, arguments={"x-expires": 60000})
    assert info == (name, 0, 0)
    try:
        for i in range(3):
            channel.publish("", name, b"m%d" % i)
        assert wait_until(lambda: channel.queue_declare(name, passive=True).message_count == 3)
        other = channel.connection.channel()
        other.basic_qos(1)
        other.basic_consume(name)
        assert wait_until(lambda: channel.queue_declare(name, passive=True)) == (name, 2, 1)
        assert channel.queue_purge(name) == 2  # ready messages only; one is unacked at the consumer
        other.close()                          # ... and goes back to the queue
        assert wait_until(lambda: channel.queue_declare(name, passive=True)) == (name, 1, 0)
    finally:
        assert channel.queue_delete(name) == 1
    with pytest.raises(ChannelClosedError) as info:
        channel.queue_declare(name, passive=True)
    assert info.value.reply_code == 404 and info.value.method == "Queue.Declare"
    assert "NOT_FOUND" in info.value.reply_text


def test_a_later_declare_is_answered_in_channel_order_and_taken_when_needed(connect, unique_name):
    """queue_declare_later returns at once; the channel's next RPC takes its reply first (replies come in
    order), and wait() gives it then, or waits for it itself."""
    ch = connect().channel()
    first, second = unique_name(), unique_name()
    ch.queue_declare(first, exclusive=True)
    ch.queue_declare(second, exclusive=True)
    for _ in range(3):
        ch.publish("", first, b"m")
    assert wait_until(lambda: ch.queue_declare(first, passive=True).message_count == 3)
    later = ch.queue_declare_later(first)
    assert ch.queue_declare(second, passive=True) == (second, 0, 0)
    assert later.wait() == (first, 3, 0)
    assert later.wait() == (first, 3, 0)
    assert ch.queue_declare_later(second).wait() == (second, 0, 0)


def test_a_later_declare_of_a_missing_queue_raises_when_its_reply_is_taken(connect, unique_name):
    conn = connect()
    ch = conn.channel()
    later = ch.queue_declare_later(unique_name())       # nothing waited for, nothing raised yet
    with pytest.raises(ChannelClosedError) as info:
        later.wait()
    assert info.value.reply_code == 404 and "NOT_FOUND" in info.value.reply_text
    assert not ch.is_open and conn.is_open
    # Taken by the next RPC instead: that RPC finds the channel closed, and wait() gives the 404.
    ch = conn.channel()
    later = ch.queue_declare_later(unique_name())
    with pytest.raises(ChannelClosedError):
        ch.queue_declare(unique_name(), exclusive=True)
    with pytest.raises(ChannelClosedError) as info:
        later.wait()
    assert info.value.reply_code == 404


def test_channel_error_leaves_the_connection_usable(connect, unique_name):
    conn = connect()
    ch = conn.channel()
    with pytest.raises(ChannelClosedError) as info:
        ch.queue_declare(unique_name(), passive=True)
    assert info.value.reply_code == 404
    assert not ch.is_open and conn.is_open
    with pytest.raises(ChannelClosedError):  # the same error again, not a hang
        ch.basic_ack(1)
    ch2 = conn.channel()
    assert ch2.queue_declare(unique_name(), exclusive=True).message_count == 0
    # an ack for an unknown delivery tag: 406 PRECONDITION_FAILED closes the channel asynchronously
    ch2.basic_ack(99)
    with pytest.raises(ChannelClosedError) as info:
        ch2.queue_declare(unique_name(), exclusive=True)
        ch2.queue_declare(unique_name(), exclusive=True)
    assert info.value.reply_code == 406
    assert conn.is_open


def test_non_ascii_names(channel, unique_name):
    """RabbitMQ accepts any UTF-8 name up to 255 bytes; pamqp's own validation would refuse "é"."""
    name = unique_name("événements-ü")
    assert channel.queue_declare(name, exclusive=True).name == name
    channel.publish("", name, b"x")
    assert wait_until(lambda: channel.basic_get(name, no_ack=True)).routing_key == name


def test_bind_unbind_routes(channel, unique_name):
    exchange = unique_name("direct")
    channel.exchange_declare(exchange, "direct")  # not auto-delete: unbinding its last queue would delete it
    q = channel.queue_declare(unique_name(), exclusive=True).name
    channel.queue_bind(q, exchange, "k1")
    channel.publish(exchange, "k1", b"routed")
    channel.publish(exchange, "k2", b"dropped")
    assert wait_until(lambda: channel.basic_get(q, no_ack=True)).body == b"routed"
    channel.queue_unbind(q, exchange, "k1")
    channel.publish(exchange, "k1", b"after unbind")
    time.sleep(QUIET)
    assert channel.basic_get(q) is None
    channel.exchange_delete(exchange)


def test_basic_get(channel, unique_name):
    q = channel.queue_declare(unique_name(), exclusive=True).name
    assert channel.basic_get(q) is None
    channel.publish("", q, b"a", {"message_id": "id-a"})
    channel.publish("", q, b"b")
    wait_until(lambda: channel.queue_declare(q, passive=True).message_count == 2)
    got = channel.basic_get(q)
    assert (got.body, got.message_count, got.redelivered, got.consumer_tag) == (b"a", 1, False, None)
    assert got.properties.message_id == "id-a"
    channel.basic_reject(got.delivery_tag, requeue=True)
    again = wait_until(lambda: channel.basic_get(q, no_ack=True))
    assert (again.body, again.redelivered) == (b"a", True)


def test_prefetch_and_ack_nack_reject(channel, unique_name):
    q = channel.queue_declare(unique_name(), exclusive=True).name
    for i in range(20):
        channel.publish("", q, b"%d" % i)
    channel.basic_qos(prefetch_count=5)
    tag = channel.basic_consume(q)
    assert tag.startswith("amq.ctag-")
    wait_until(lambda: channel.pending_deliveries == 5)
    time.sleep(QUIET)
    assert channel.pending_deliveries == 5  # prefetch holds the rest back
    batch = channel.get_deliveries(100, timeout=1)
    assert [d.body for d in batch] == [b"%d" % i for i in range(5)]
    assert [d.delivery_tag for d in batch] == [1, 2, 3, 4, 5] and {d.consumer_tag for d in batch} == {tag}
    channel.basic_ack(batch[2].delivery_tag, multiple=True)     # 0, 1, 2 done
    channel.basic_nack(batch[3].delivery_tag, requeue=True)     # 3 comes back, redelivered
    channel.basic_reject(batch[4].delivery_tag, requeue=False)  # 4 is dropped
    seen, redelivered = [], set()
    deadline = time.monotonic() + 10
    while len(seen) < 16 and time.monotonic() < deadline:
        for d in channel.get_deliveries(100, timeout=0.5):
            seen.append(d.body)
            if d.redelivered:
                redelivered.add(d.body)
            channel.basic_ack(d.delivery_tag)
    assert sorted(seen) == sorted([b"3"] + [b"%d" % i for i in range(5, 20)])
    assert redelivered == {b"3"}
    channel.basic_cancel(tag)
    assert channel.queue_declare(q, passive=True) == (q, 0, 0)


def test_get_deliveries_timeout_and_cancel(channel, unique_name):
    q = channel.queue_declare(unique_name(), exclusive=True).name
    tag = channel.basic_consume(q, no_ack=True)
    started = time.monotonic()
    assert channel.get_deliveries(10, timeout=0.3) == []
    assert 0.25 < time.monotonic() - started < 2
    assert channel.get_deliveries(10) == []  # timeout 0: a poll
    channel.basic_cancel(tag)
    assert tag not in channel.consumer_tags
    channel.publish("", q, b"after cancel")
    time.sleep(QUIET)
    assert channel.get_deliveries(10) == []
    assert channel.queue_declare(q, passive=True).message_count == 1


def test_consume_nowait_delivers_under_its_own_tag_and_a_refusal_closes_the_channel(connect, unique_name):
    conn = connect()
    channel = conn.channel()
    q = channel.queue_declare(unique_name(), exclusive=True).name
    for i in range(3):
        channel.publish("", q, b"%d" % i)
    tag = channel.basic_consume(q, nowait=True)
    assert tag.startswith("spark-amqp-") and tag in channel.consumer_tags
    got = wait_until(lambda: channel.get_deliveries(10, timeout=0.5) or None, timeout=5)
    assert [d.body for d in got] == [b"0", b"1", b"2"] and {d.consumer_tag for d in got} == {tag}
    channel.basic_ack(got[-1].delivery_tag, multiple=True)
    channel.basic_cancel(tag)
    assert channel.queue_declare(q, passive=True) == (q, 0, 0)

    refused = conn.channel()
    refused.basic_consume(unique_name(), nowait=True)   # no such queue: the broker closes the channel
    with pytest.raises(ChannelClosedError) as info:
        wait_until(lambda: refused.get_deliveries(10, timeout=0.5) or None, timeout=5)
    assert info.value.reply_code == 404
    assert channel.is_open


def test_broker_cancels_consumer_when_queue_deleted(connect, unique_name):
    conn = connect()
    consumer, admin = conn.channel(), conn.channel()
    name = unique_name()
    consumer.queue_declare(name, arguments={"x-expires": 60000})
    tag = consumer.basic_consume(name)
    admin.queue_delete(name)
    with pytest.raises(ConsumerCancelledError) as info:
        wait_until(lambda: consumer.get_deliveries(10, timeout=0.5) or None, timeout=5)
    assert info.value.consumer_tags == [tag]
    assert consumer.is_open and tag not in consumer.consumer_tags


def test_large_messages_span_frames(broker_url, connect, unique_name):
    conn = connect(frame_max=4096)
    assert conn.frame_max == 4096
    ch = conn.channel()
    q = ch.queue_declare(unique_name(), exclusive=True).name
    bodies = [b"", b"x" * 4088, b"y" * 4089, bytes(range(256)) * 1000]
    ch.confirm_select()
    for body in bodies:
        ch.publish("", q, body)
    ch.wait_for_confirms(10)
    ch.basic_consume(q, no_ack=True)
    got = []
    deadline = time.monotonic() + 10
    while len(got) < len(bodies) and time.monotonic() < deadline:
        got += [d.body for d in ch.get_deliveries(10, timeout=0.5)]
    assert got == bodies


def test_connection_close_requeues_unacked(broker_url, connect, unique_name):
    conn = connect()
    ch = conn.channel()
    q = ch.queue_declare(unique_name(), auto_delete=False, arguments={"x-expires": 30000}).name
    ch.publish("", q, b"keep me")
    ch.basic_consume(q)
    (d,) = wait_until(lambda: ch.get_deliveries(1, timeout=0.5))
    assert not d.redelivered
    conn.close()
    with Connection.open(broker_url) as again:
        ch2 = again.channel()
        d2 = wait_until(lambda: ch2.basic_get(q, no_ack=True))
        assert (d2.body, d2.redelivered) == (b"keep me", True)
        ch2.queue_delete(q)
