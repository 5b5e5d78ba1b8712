"""The hand-written hot-path codecs agree with pamqp byte for byte (no broker needed).

pamqp is the reference here: the fast publish encoder must produce exactly pamqp's frames, and the fast
parser must read pamqp's frames into the same values pamqp reads. Fed one byte at a time, the parser
must give the same events as fed at once (frames split anywhere by TCP).
"""

from __future__ import annotations

import datetime

import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp import heartbeat as pheartbeat

from spark_amqp.client import Delivery, ProtocolError, Returned, encode_properties
from spark_amqp.client.events import Confirm, EventParser
from spark_amqp.codec.methods import encode_publish_message, shortstr, unchecked
from spark_amqp.codec.properties import to_pamqp as decode_properties

PROPS = C.Basic.Properties(
    content_type="application/json", content_encoding="gzip",
    headers={"a": 1, "b": "two", "c": [1, "x"], "d": {"n": True}, "e": 1.5},
    delivery_mode=2, priority=3, correlation_id="c-1", reply_to="r", expiration="1000",
    message_id="m-1", timestamp=datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    message_type="t", user_id="guest", app_id="app")


def pamqp_publish(channel: int, exchange: str, routing_key: str, mandatory: bool,
                  properties: C.Basic.Properties, body: bytes, frame_max: int) -> bytes:
    """The same frames through pamqp objects: the reference."""
    out = [pframe.marshal(C.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory),
                          channel),
           pframe.marshal(pheader.ContentHeader(0, len(body), properties), channel)]
    chunk = frame_max - 8
    for start in range(0, len(body), chunk):
        out.append(pframe.marshal(pbody.ContentBody(body[start:start + chunk]), channel))
    return b"".join(out)


def content(channel: int, method, body: bytes, props=PROPS, frame_max: int = 131072) -> bytes:
    out = [pframe.marshal(method, channel),
           pframe.marshal(pheader.ContentHeader(0, len(body), props), channel)]
    step = frame_max - 8
    out += [pframe.marshal(pbody.ContentBody(body[i:i + step]), channel) for i in range(0, len(body), step)]
    return b"".join(out)


@pytest.mark.parametrize("body_size, frame_max", [(0, 4096), (1, 4096), (4088, 4096), (4089, 4096),
                                                  (100_000, 4096), (100_000, 131072)])
@pytest.mark.parametrize("exchange, routing_key, mandatory", [("", "q", False), ("ex/1", "rk:2#", True)])
def test_encode_publish_matches_pamqp(body_size, frame_max, exchange, routing_key, mandatory):
    body = bytes(range(256)) * (body_size // 256) + bytes(body_size % 256)
    fast = encode_publish_message(7, shortstr(exchange), shortstr(routing_key), mandatory, encode_properties(PROPS),
                          body, frame_max)
    assert fast == pamqp_publish(7, exchange, routing_key, mandatory, PROPS, body, frame_max)


def test_encode_publish_non_ascii_names():
    """pamqp's constructor refuses "é" in names (RabbitMQ does not); `unchecked` skips that check."""
    fast = encode_publish_message(1, shortstr("ex.é"), shortstr("rk/ü"), False, b"\x00\x00", b"", 4096)
    method = pframe.marshal(unchecked(C.Basic.Publish, exchange="ex.é", routing_key="rk/ü"), 1)
    assert fast.startswith(method)
    with pytest.raises(ValueError):
        C.Basic.Publish(exchange="ex.é")


def test_encode_properties_inputs():
    assert encode_properties(None) == C.Basic.Properties().marshal() == b"\x00\x00"
    raw = PROPS.marshal()
    assert encode_properties(raw) == raw                       # pre-encoded: passed through
    assert encode_properties({"content_type": "text/plain"}) == \
        C.Basic.Properties(content_type="text/plain").marshal()
    with pytest.raises(TypeError):
        encode_properties(42)


def test_decode_properties_matches_pamqp():
    assert decode_properties(PROPS.marshal()) == PROPS
    assert decode_properties(b"\x00\x00") == C.Basic.Properties()


def stream() -> bytes:
    big = bytes(range(256)) * 40  # 10,240 bytes: three body frames at frame_max 4096
    return b"".join([
        pframe.marshal(C.Basic.ConsumeOk(consumer_tag="ctag"), 1),
        content(1, C.Basic.Deliver("ctag", 1, False, "ex", "rk.1"), b"hello"),
        pheartbeat.Heartbeat().marshal(),
        # a multi-frame body on channel 2 interleaved with a whole message on channel 1 (spec 4.2.6)
        pframe.marshal(C.Basic.Deliver("c2", 9, True, "", "q2"), 2),
        pframe.marshal(pheader.ContentHeader(0, len(big), C.Basic.Properties()), 2),
        pframe.marshal(pbody.ContentBody(big[:4088]), 2),
        content(1, C.Basic.Deliver("ctag", 2, True, "ex", "rk.é"), b""),
        pframe.marshal(pbody.ContentBody(big[4088:8176]), 2),
        pframe.marshal(pbody.ContentBody(big[8176:]), 2),
        content(3, C.Basic.GetOk(5, False, "amq.direct", "k", 41), b"got"),
        content(3, C.Basic.Return(312, "NO_ROUTE", "ex", "nowhere"), b"back"),
        pframe.marshal(C.Basic.Ack(7, True), 3),
        pframe.marshal(C.Basic.Nack(8, False, False), 3),
    ])


def check_events(events):
    events = [e for e in events if e != EventParser.HEARTBEAT]
    kinds = [type(e).__name__ if not isinstance(e, tuple) else e[1].name for e in events]
    assert kinds == ["Basic.ConsumeOk", "Delivery", "Delivery", "Delivery", "Delivery", "Returned",
                     "Confirm", "Confirm"]
    consume_ok = events[0][1]
    assert events[0][0] == 1 and consume_ok.consumer_tag == "ctag"
    d1, d2, d3, got, ret, ack, nack = events[1:]
    assert (d1.channel, d1.consumer_tag, d1.delivery_tag, d1.redelivered, d1.exchange, d1.routing_key,
            d1.body) == (1, "ctag", 1, False, "ex", "rk.1", b"hello")
    assert d1.properties == PROPS and d1.properties_raw == PROPS.marshal()
    assert (d2.delivery_tag, d2.redelivered, d2.routing_key, d2.body) == (2, True, "rk.é", b"")
    assert (d3.channel, d3.consumer_tag, d3.delivery_tag, d3.exchange, d3.routing_key) == \
        (2, "c2", 9, "", "q2")
    assert d3.body == bytes(range(256)) * 40 and d3.properties == C.Basic.Properties()
    assert isinstance(got, Delivery) and got.consumer_tag is None
    assert (got.delivery_tag, got.exchange, got.routing_key, got.message_count, got.body) == \
        (5, "amq.direct", "k", 41, b"got")
    assert isinstance(ret, Returned)
    assert (ret.reply_code, ret.reply_text, ret.exchange, ret.routing_key, ret.body) == \
        (312, "NO_ROUTE", "ex", "nowhere", b"back")
    assert isinstance(ack, Confirm)
    assert (ack.channel, ack.delivery_tag, ack.multiple, ack.ack) == (3, 7, True, True)
    assert (nack.delivery_tag, nack.multiple, nack.ack) == (8, False, False)


def test_parser_whole_stream():
    check_events(EventParser(frame_max=4096).feed(stream()))


def test_parser_byte_by_byte():
    parser, events = EventParser(frame_max=4096), []
    for i, byte in enumerate(stream()):
        events += parser.feed(bytes([byte]))
    check_events(events)


@pytest.mark.parametrize("bad, message", [
    (pframe.marshal(C.Basic.Qos(0, 1, False), 1)[:-1] + b"\x00", "invalid frame end byte"),
    (b"\x09\x00\x01\x00\x00\x00\x00\xce", "unknown frame type"),
    (pframe.marshal(pbody.ContentBody(b"x"), 1), "unexpected content body"),
    (pframe.marshal(pheader.ContentHeader(0, 1, C.Basic.Properties()), 1), "unexpected content header"),
    (b"\x01\x00\x01\x00\x01\x00\x00" + bytes(65536) + b"\xce", "larger than negotiated maximum"),
    (pframe.marshal(C.Basic.Deliver("c", 1, False, "", "q"), 1)
     + pframe.marshal(C.Basic.QosOk(), 1), "while content was expected"),
])
def test_parser_rejects_malformed(bad, message):
    with pytest.raises(ProtocolError, match=message):
        EventParser(frame_max=4096).feed(bad)


# --- the consume hot path (whole deliveries taken off the buffer) against the frame path ---------------

def outcome(pieces) -> list | str:
    """What a fresh parser makes of `pieces` fed in turn: its events as plain values, or its error's text.
    Fed one byte at a time, a parser never holds a whole delivery, so every frame takes the frame path:
    the reference the hot path must agree with."""
    parser, events = EventParser(frame_max=4096), []
    try:
        for piece in pieces:
            events += parser.feed(piece)
    except ProtocolError as exc:
        return f"ProtocolError: {exc}"
    return [values(e) for e in events]


def values(event) -> tuple:
    if isinstance(event, Delivery):
        return (type(event).__name__, event.channel, event.consumer_tag, event.delivery_tag, event.redelivered,
                event.exchange, event.routing_key, event.message_count, event.properties_raw, event.body)
    if isinstance(event, Confirm):
        return ("Confirm", event.channel, event.delivery_tag, event.multiple, event.ack)
    if isinstance(event, tuple):
        return (event[0], event[1].name, dict(event[1]))
    return (event,)


def byte_by_byte(data: bytes) -> list:
    return [data[i:i + 1] for i in range(len(data))]


def test_parser_split_anywhere():
    """Cut once at every offset (TCP may cut anywhere): the hot path hands over to the frame path and back."""
    data = stream()
    for cut in range(1, len(data)):
        parser = EventParser(frame_max=4096)
        check_events(parser.feed(data[:cut]) + parser.feed(data[cut:]))


@pytest.mark.parametrize("size", [0, 1, 100, 4088])
def test_whole_deliveries_match_the_frame_path(size):
    body = bytes(range(256)) * (size // 256) + b"b" * (size % 256)
    data = b"".join(content(5, C.Basic.Deliver("ctag", tag, tag == 2, "ex", "rk"), body, frame_max=4096,
                            props=PROPS if tag == 1 else C.Basic.Properties())
                    for tag in (1, 2, 3))
    got = outcome([data])
    assert got == outcome(byte_by_byte(data))
    assert [g[3:5] for g in got] == [(1, False), (2, True), (3, False)]
    assert {g[9] for g in got} == {body}
    assert got[0][8] == PROPS.marshal() and got[1][8] == b"\x00\x00"


def deliver(channel: int = 1, tag: int = 1) -> bytes:
    return pframe.marshal(C.Basic.Deliver("c", tag, False, "", "q"), channel)


def frame(ftype: int, channel: int, payload: bytes, end: bytes = b"\xce") -> bytes:
    return bytes([ftype]) + channel.to_bytes(2, "big") + len(payload).to_bytes(4, "big") + payload + end


HEADER = pheader.ContentHeader(0, 3, C.Basic.Properties()).marshal()     # a content header payload
IRREGULAR = {
    "header on another channel": deliver() + frame(2, 2, HEADER) + frame(3, 1, b"abc"),
    "body on another channel": deliver() + frame(2, 1, HEADER) + frame(3, 2, b"abc"),
    "body shorter than body-size": deliver() + frame(2, 1, HEADER) + frame(3, 1, b"ab"),
    "body longer than body-size": deliver() + frame(2, 1, HEADER) + frame(3, 1, b"abcd"),
    "body frame is a method": deliver() + frame(2, 1, HEADER) + pframe.marshal(C.Basic.Ack(1, False), 1),
    "no header": deliver() + pframe.marshal(C.Basic.Ack(1, False), 1),
    "short header": deliver() + frame(2, 1, HEADER[:13]) + frame(3, 1, b"abc"),
    "bad frame end in the body": deliver() + frame(2, 1, HEADER) + frame(3, 1, b"abc", end=b"\x00"),
    "bad frame end in the header": deliver() + frame(2, 1, HEADER, end=b"\x00") + frame(3, 1, b"abc"),
    "body over frame_max": deliver() + frame(2, 1, pheader.ContentHeader(0, 5000, C.Basic.Properties())
                                             .marshal()) + frame(3, 1, b"x" * 5000),
    "truncated deliver": frame(1, 1, deliver()[7:-3]) + frame(2, 1, HEADER) + frame(3, 1, b"abc"),
    "header over frame_max": deliver() + frame(2, 1, HEADER + bytes(4100)) + frame(3, 1, b"abc"),
    "routing key cut short": frame(1, 1, deliver()[7:-2]) + frame(2, 1, HEADER) + frame(3, 1, b"abc"),
    "deliver over frame_max": frame(1, 1, deliver()[7:-1] + bytes(4100)) + frame(2, 1, HEADER) + frame(3, 1, b"abc"),
    "deliver without arguments": frame(1, 1, deliver()[7:11]) + frame(2, 1, HEADER) + frame(3, 1, b"abc"),
    "consumer tag not UTF-8": frame(1, 1, deliver()[7:12] + b"\xff" + deliver()[13:-1]) + frame(2, 1, HEADER)
    + frame(3, 1, b"abc"),
    "two bodies on one channel": deliver() + frame(2, 1, HEADER) + frame(3, 1, b"abc") + frame(3, 1, b"d"),
}


@pytest.mark.parametrize("case", IRREGULAR)
def test_the_hot_path_leaves_the_irregular_to_the_frame_path(case):
    """Whatever the hot path does not take whole (irregular or malformed), after a regular delivery that it
    does take, comes out exactly as from the frame path: the same events, or the same error."""
    data = content(1, C.Basic.Deliver("c", 7, False, "", "q"), b"ok", frame_max=4096) + IRREGULAR[case]
    assert outcome([data]) == outcome(byte_by_byte(data))
