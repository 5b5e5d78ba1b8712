"""The hand-written per-message method pairs in `spark_amqp.codec.methods`, byte for byte against pamqp.

publish, deliver, ack/nack, get-ok, return and a whole publish message (method + header + body frames).
Names are passed to the encoders as shortstrs (`methods.name_shortstr`), as the broker and client do.

pamqp packs `longlong` as *signed* and refuses 2**63 and above, while a delivery tag is an unsigned 64-bit
number (spec 1.8.3.9: delivery-tag is a longlong; RabbitMQ treats it as unsigned). For tags pamqp can
encode the reference is pamqp's frame as it is; for larger tags it is pamqp's frame built with a
placeholder tag whose 8 bytes are then replaced by the unsigned tag (`pamqp_frame_with_tag`).
"""

from __future__ import annotations

import datetime
import struct

import pytest
from pamqp import body as pamqp_body
from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from spark_amqp.codec import frames, methods, properties, replies

CHANNELS = (1, 2, 65535)
TAGS = (0, 1, 2**63 - 1, 2**64 - 1)
NAMES = ("", "amq.direct", "événements.ü-队列", "x" * 255, "é" * 127 + "x")   # the last two: 255 bytes
NAME_IDS = ("empty", "ascii", "unicode", "255-ascii", "255-utf8")
PLACEHOLDER_TAG = 0x0102030405060708


def ss(text: str) -> bytes:
    return methods.name_shortstr(text)


def pamqp_frame_with_tag(cls, channel: int, delivery_tag: int, **kwargs) -> bytes:
    """pamqp's frame for `cls(**kwargs, delivery_tag=...)`, built without pamqp's name check."""
    if delivery_tag < 2**63:
        return pamqp_frame.marshal(methods.unchecked(cls, delivery_tag=delivery_tag, **kwargs), channel)
    data = pamqp_frame.marshal(methods.unchecked(cls, delivery_tag=PLACEHOLDER_TAG, **kwargs), channel)
    placeholder = struct.pack(">Q", PLACEHOLDER_TAG)
    assert data.count(placeholder) == 1
    return data.replace(placeholder, struct.pack(">Q", delivery_tag))


def payload_of(data: bytes) -> bytes:
    """The payload of the single method frame `data`, after checking the frame's own layout."""
    ftype, _channel, size = struct.unpack_from(">BHI", data)
    assert ftype == frames.FRAME_METHOD and len(data) == size + 8 and data[-1:] == b"\xce"
    return data[7:-1]


# --- short strings ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", NAMES, ids=NAME_IDS)
def test_shortstr(text):
    raw = text.encode()
    assert methods.shortstr(text) == methods.name_shortstr(text) == bytes((len(raw),)) + raw
    assert methods.name(raw) == text


def test_shortstr_over_255_bytes_raises():
    with pytest.raises(ValueError, match="255"):
        methods.shortstr("é" * 128)
    with pytest.raises(ValueError, match="255"):
        methods.name_shortstr("y" * 256)


def test_name_that_is_not_utf8_is_syntax_error():
    with pytest.raises(replies.AMQPError) as info:
        methods.name(b"caf\xe9")
    assert info.value.code == replies.SYNTAX_ERROR and info.value.hard


# --- basic.publish --------------------------------------------------------------------------------------

@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("mandatory,immediate", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("exchange,routing_key", list(zip(NAMES, reversed(NAMES))),
                         ids=[f"{a}/{b}" for a, b in zip(NAME_IDS, reversed(NAME_IDS))])
def test_publish(channel, mandatory, immediate, exchange, routing_key):
    data = methods.encode_publish(channel, ss(exchange), ss(routing_key), mandatory, immediate)
    reference = pamqp_frame.marshal(methods.unchecked(
        commands.Basic.Publish, exchange=exchange, routing_key=routing_key, mandatory=mandatory,
        immediate=immediate), channel)
    assert data == reference
    payload = payload_of(data)
    assert payload[:4] == methods.PUBLISH
    assert methods.method_index(payload) == methods.PUBLISH_ID
    assert methods.decode_publish(payload) == (exchange, routing_key, mandatory, immediate)
    # the generic path reads the hand-written bytes the same way
    decoded = methods.unmarshal_method(payload)
    assert (decoded.exchange, decoded.routing_key, decoded.mandatory, decoded.immediate) == \
        (exchange, routing_key, mandatory, immediate)


def test_publish_with_pamqps_own_constructor():
    data = methods.encode_publish(5, ss("amq.topic"), ss("a.b.c"), True)
    assert data == pamqp_frame.marshal(
        commands.Basic.Publish(exchange="amq.topic", routing_key="a.b.c", mandatory=True), 5)


def test_decode_publish_truncated_inside_a_name_or_the_bits_is_syntax_error():
    payload = payload_of(methods.encode_publish(1, ss("ex"), ss("rk"), True))
    # 4..6: class/method, reserved short; 6: exchange length; 7-8 exchange; 9: rk length; 10-11: rk; 12: bits
    for cut in (7, 8, 10, 11, 12):
        with pytest.raises(replies.AMQPError) as info:
            methods.decode_publish(payload[:cut])
        assert info.value.code == replies.SYNTAX_ERROR and info.value.hard, cut


@pytest.mark.parametrize("cut", [4, 5, 6, 9])
def test_decode_publish_truncated_at_a_length_octet_is_syntax_error(cut):
    payload = payload_of(methods.encode_publish(1, ss("ex"), ss("rk"), True))
    with pytest.raises(replies.AMQPError) as info:
        methods.decode_publish(payload[:cut])
    assert info.value.code == replies.SYNTAX_ERROR


# --- basic.deliver --------------------------------------------------------------------------------------

@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("delivery_tag", TAGS)
@pytest.mark.parametrize("redelivered", [False, True])
@pytest.mark.parametrize("consumer_tag,exchange,routing_key", [
    ("", "", ""),
    ("amq.ctag-abc", "amq.direct", "rk"),
    ("é" * 127 + "x", "x" * 255, "événements.ü-队列"),
    ("ctag", "é" * 127 + "x", "y" * 255),
], ids=["empty", "ascii", "255-unicode-1", "255-unicode-2"])
def test_deliver(channel, delivery_tag, redelivered, consumer_tag, exchange, routing_key):
    data = methods.encode_deliver(channel, ss(consumer_tag), delivery_tag, redelivered, ss(exchange),
                                  ss(routing_key))
    assert data == pamqp_frame_with_tag(commands.Basic.Deliver, channel, delivery_tag,
                                        consumer_tag=consumer_tag, redelivered=redelivered,
                                        exchange=exchange, routing_key=routing_key)
    payload = payload_of(data)
    assert payload[:4] == methods.DELIVER
    assert methods.decode_deliver(payload) == (consumer_tag, delivery_tag, redelivered, exchange, routing_key)


def test_decode_deliver_truncated_name_is_syntax_error():
    payload = payload_of(methods.encode_deliver(1, ss("ctag"), 7, True, ss("ex"), ss("rk")))
    for cut in (len(payload) - 1, len(payload) - 2, 6):   # inside routing key, inside consumer tag
        with pytest.raises(replies.AMQPError) as info:
            methods.decode_deliver(payload[:cut])
        assert info.value.code == replies.SYNTAX_ERROR


# --- basic.ack / basic.nack -----------------------------------------------------------------------------

@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("delivery_tag", TAGS)
@pytest.mark.parametrize("multiple", [False, True])
def test_ack(channel, delivery_tag, multiple):
    data = methods.encode_ack(channel, delivery_tag, multiple)
    assert data == pamqp_frame_with_tag(commands.Basic.Ack, channel, delivery_tag, multiple=multiple)
    payload = payload_of(data)
    assert payload[:4] == methods.ACK
    assert methods.method_index(payload) == methods.ACK_ID
    assert methods.decode_ack(payload) == (delivery_tag, multiple)


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("delivery_tag", TAGS)
@pytest.mark.parametrize("multiple", [False, True])
@pytest.mark.parametrize("requeue", [False, True])
def test_nack(channel, delivery_tag, multiple, requeue):
    data = methods.encode_nack(channel, delivery_tag, multiple, requeue)
    assert data == pamqp_frame_with_tag(commands.Basic.Nack, channel, delivery_tag, multiple=multiple,
                                        requeue=requeue)
    payload = payload_of(data)
    assert payload[:4] == methods.NACK
    assert methods.decode_nack(payload) == (delivery_tag, multiple, requeue)
    # a publisher reads confirms (ack or nack) with decode_ack
    assert methods.decode_ack(payload) == (delivery_tag, multiple)


def test_nack_requeue_defaults_to_false():
    assert methods.encode_nack(1, 5, True) == methods.encode_nack(1, 5, True, False)


def test_decode_ack_truncated_is_syntax_error():
    payload = payload_of(methods.encode_ack(1, 2**64 - 1, True))
    for cut in range(4, len(payload)):
        with pytest.raises(replies.AMQPError) as info:
            methods.decode_ack(payload[:cut])
        assert info.value.code == replies.SYNTAX_ERROR and info.value.hard, cut


# --- basic.get-ok and basic.return (decoded by hand, encoded by pamqp) ------------------------------------

@pytest.mark.parametrize("delivery_tag", TAGS)
@pytest.mark.parametrize("redelivered", [False, True])
@pytest.mark.parametrize("message_count", [0, 1, 2**32 - 1])
@pytest.mark.parametrize("exchange,routing_key", [("", ""), ("amq.direct", "q1"),
                                                  ("x" * 255, "é" * 127 + "x")],
                         ids=["empty", "ascii", "255"])
def test_decode_get_ok(delivery_tag, redelivered, message_count, exchange, routing_key):
    data = pamqp_frame_with_tag(commands.Basic.GetOk, 3, delivery_tag, redelivered=redelivered,
                                exchange=exchange, routing_key=routing_key, message_count=message_count)
    payload = payload_of(data)
    assert payload[:4] == methods.GET_OK
    assert methods.decode_get_ok(payload) == (delivery_tag, redelivered, exchange, routing_key, message_count)


@pytest.mark.parametrize("reply_code", [0, 312, 313, 65535])
@pytest.mark.parametrize("reply_text", ["", "NO_ROUTE", " pas de file « événements » ", "t" * 255],
                         ids=["empty", "ascii", "unicode", "255"])
@pytest.mark.parametrize("exchange,routing_key", [("", ""), ("amq.direct", "q1"),
                                                  ("é" * 127 + "x", "x" * 255)],
                         ids=["empty", "ascii", "255"])
def test_decode_return(reply_code, reply_text, exchange, routing_key):
    data = pamqp_frame.marshal(methods.unchecked(
        commands.Basic.Return, reply_code=reply_code, reply_text=reply_text, exchange=exchange,
        routing_key=routing_key), 9)
    payload = payload_of(data)
    assert payload[:4] == methods.RETURN
    assert methods.decode_return(payload) == (reply_code, reply_text, exchange, routing_key)


# --- a whole publish message ----------------------------------------------------------------------------

FRAME_MAXES = (4096, 131072)
PROPERTY_SETS = {
    "none": {},
    "some": {"content_type": "text/plain", "delivery_mode": 2, "message_id": "m-ü-1",
             "headers": {"a": "b", "c": True}, "timestamp": 1700000000},
}


def pamqp_properties(values: dict) -> commands.Basic.Properties:
    kwargs = dict(values)
    if "timestamp" in kwargs:
        kwargs["timestamp"] = datetime.datetime.fromtimestamp(kwargs["timestamp"], datetime.UTC)
    return commands.Basic.Properties(**kwargs)


def body_sizes(frame_max: int):
    return (0, 1, frame_max - 8, frame_max - 7, 100_000)


@pytest.mark.parametrize("props", sorted(PROPERTY_SETS))
@pytest.mark.parametrize("frame_max,size", [(fm, n) for fm in FRAME_MAXES for n in body_sizes(fm)],
                         ids=[f"fm{fm}-body{n}" for fm in FRAME_MAXES for n in body_sizes(fm)])
@pytest.mark.parametrize("channel", [1, 65535])
def test_publish_message(channel, frame_max, size, props):
    body = bytes(i % 251 for i in range(size))
    prop_bytes = properties.encode(PROPERTY_SETS[props])
    data = methods.encode_publish_message(channel, ss("amq.direct"), ss("rk.é"), True, prop_bytes, body,
                                          frame_max)

    # pamqp: publish method, content header, body frames of at most frame_max - 8 bytes
    chunk = frame_max - 8
    reference = [
        pamqp_frame.marshal(methods.unchecked(commands.Basic.Publish, exchange="amq.direct",
                                              routing_key="rk.é", mandatory=True), channel),
        pamqp_frame.marshal(pamqp_header.ContentHeader(0, size, pamqp_properties(PROPERTY_SETS[props])),
                            channel),
    ] + [pamqp_frame.marshal(pamqp_body.ContentBody(body[i:i + chunk]), channel)
         for i in range(0, size, chunk)]
    assert data == b"".join(reference)

    # read back with the same frame_max: nothing too large, and the message reassembles
    reader = frames.FrameReader(frame_max)
    reader.feed(data)
    got = list(reader.frames())
    assert reader.buffer == b""
    expected_body_frames = -(-size // chunk)
    assert [f[0] for f in got] == [frames.FRAME_METHOD, frames.FRAME_HEADER] + \
        [frames.FRAME_BODY] * expected_body_frames
    assert {f[1] for f in got} == {channel}
    assert all(len(f[2]) + 8 <= frame_max for f in got)
    assert methods.decode_publish(got[0][2]) == ("amq.direct", "rk.é", True, False)
    assert frames.decode_content_header(got[1][2]) == (60, size)
    assert got[1][2][12:] == prop_bytes
    assert b"".join(f[2] for f in got[2:]) == body
    assert {len(f[2]) for f in got[2:-1]} <= {chunk}


# --- a whole delivery (the broker's per-message path) ---------------------------------------------------

@pytest.mark.parametrize("props", sorted(PROPERTY_SETS))
@pytest.mark.parametrize("frame_max,size", [(fm, n) for fm in FRAME_MAXES for n in body_sizes(fm)],
                         ids=[f"fm{fm}-body{n}" for fm in FRAME_MAXES for n in body_sizes(fm)])
@pytest.mark.parametrize("channel,delivery_tag,redelivered", [(1, 1, False), (65535, 2**64 - 1, True)])
def test_deliver_frames(channel, delivery_tag, redelivered, frame_max, size, props):
    body = bytes(i % 251 for i in range(size))
    header = frames.content_header(size, properties.encode(PROPERTY_SETS[props]))
    parts = methods.deliver_frames(channel, ss("amq.ctag-é"), delivery_tag, redelivered, ss("amq.direct"),
                                   ss("rk.é"), header, body, frame_max)

    chunk = frame_max - 8
    reference = [
        pamqp_frame_with_tag(commands.Basic.Deliver, channel, delivery_tag, consumer_tag="amq.ctag-é",
                             redelivered=redelivered, exchange="amq.direct", routing_key="rk.é"),
        pamqp_frame.marshal(pamqp_header.ContentHeader(0, size, pamqp_properties(PROPERTY_SETS[props])),
                            channel),
    ] + [pamqp_frame.marshal(pamqp_body.ContentBody(body[i:i + chunk]), channel)
         for i in range(0, size, chunk)]
    assert b"".join(parts) == b"".join(reference)
    # one part for a body that fits one frame (one write, no list to grow), else one per frame part
    assert len(parts) == 1 if 0 < size <= chunk else len(parts) > 1
