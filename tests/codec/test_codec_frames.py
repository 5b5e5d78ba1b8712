"""Frames (`spark_amqp.codec.frames`): the sans-I/O `FrameReader`, content frames, and reply errors.

Streams are built from the codec's writers and checked against pamqp's frames where pamqp writes them.
"""

from __future__ import annotations

import random
import struct

import pytest
from pamqp import body as pamqp_body
from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header
from pamqp import heartbeat as pamqp_heartbeat

from spark_amqp.codec import frames, methods, properties, replies
from spark_amqp.codec.frames import (
    FRAME_BODY,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FrameReader,
)

FRAME_MAXES = (4096, 131072)


def ss(text: str) -> bytes:
    return methods.name_shortstr(text)


def frame(ftype: int, channel: int, payload: bytes, end: bytes = b"\xce") -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + end


def deliver_message(channel: int, body: bytes, frame_max: int, tag: int = 1, props: bytes = b"\0\0"):
    """(bytes, [frames as FrameReader yields them one by one]) for a basic.deliver with its content."""
    method = methods.encode_deliver(channel, ss("ctag"), tag, False, ss("ex"), ss("rk"))
    header = frames.content_header(len(body), props)
    data = method + b"".join(frames.content_frames(channel, header, body, frame_max))
    chunk = frame_max - 8
    expected = [(FRAME_METHOD, channel, method[7:-1]), (FRAME_HEADER, channel, header)]
    expected += [(FRAME_BODY, channel, body[i:i + chunk]) for i in range(0, len(body), chunk)]
    return data, expected


def read_all(reader: FrameReader, data: bytes) -> list:
    reader.feed(data)
    return list(reader.frames())


def read_in_pieces(reader: FrameReader, data: bytes, sizes) -> list:
    out, pos = [], 0
    for size in sizes:
        if pos >= len(data):
            break
        reader.feed(data[pos:pos + size])
        out += reader.frames()
        pos += size
    assert pos >= len(data)
    return out


def mixed_stream(frame_max: int):
    """A stream of many kinds of frames on several channels, and the frames it holds."""
    parts, expected = [], []

    def add(data: bytes, frames_in_it):
        parts.append(data)
        expected.extend(frames_in_it)

    add(frames.HEARTBEAT_FRAME, [(FRAME_HEARTBEAT, 0, b"")])
    tune = frames.method_frame(0, commands.Connection.Tune(channel_max=2047, frame_max=frame_max, heartbeat=60))
    add(tune, [(FRAME_METHOD, 0, tune[7:-1])])
    for channel, size in ((1, 0), (2, 1), (1, frame_max - 8), (3, frame_max - 7), (65535, 3 * frame_max)):
        add(*deliver_message(channel, bytes(range(256)) * (size // 256) + b"b" * (size % 256), frame_max,
                             props=properties.encode({"content_type": "x", "priority": channel % 10})))
    ack = methods.encode_ack(7, 2**64 - 1, True)
    add(ack, [(FRAME_METHOD, 7, ack[7:-1])])
    publish = methods.encode_publish_message(4, ss("e"), ss("r"), False, b"\0\0", b"p" * 10, frame_max)
    publish_method = methods.encode_publish(4, ss("e"), ss("r"), False)
    assert publish.startswith(publish_method)
    add(publish, [(FRAME_METHOD, 4, publish_method[7:-1]), (FRAME_HEADER, 4, frames.content_header(10, b"\0\0")),
                  (FRAME_BODY, 4, b"p" * 10)])
    return b"".join(parts), expected


# --- frame reader ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("frame_max", FRAME_MAXES)
def test_byte_by_byte_equals_all_at_once(frame_max):
    data, expected = mixed_stream(frame_max)
    at_once = read_all(FrameReader(frame_max), data)
    assert at_once == expected
    if frame_max <= 4096:
        # one byte at a time (each feed copies the buffer, so the large-frame stream is only cut coarsely)
        one_by_one = read_in_pieces(FrameReader(frame_max), data, [1] * len(data))
        assert one_by_one == expected
    rng = random.Random(frame_max)
    for _ in range(5):
        sizes = iter(lambda: rng.randint(1, 3 * frame_max), None)   # endless; read_in_pieces stops at the end
        reader = FrameReader(frame_max)
        assert read_in_pieces(reader, data, sizes) == expected
        assert reader.buffer == b""


def test_partial_frame_is_kept():
    first = methods.encode_ack(1, 1, False)
    second = methods.encode_ack(1, 2, True)
    reader = FrameReader(4096)
    reader.feed(first + second[:10])
    assert list(reader.frames()) == [(FRAME_METHOD, 1, first[7:-1])]
    assert reader.buffer == second[:10]
    assert list(reader.frames()) == []                # nothing new: nothing yielded, nothing lost
    reader.feed(second[10:-1])                         # everything but the frame-end octet
    assert list(reader.frames()) == []
    reader.feed(second[-1:])
    assert list(reader.frames()) == [(FRAME_METHOD, 1, second[7:-1])]
    assert reader.buffer == b""
    assert reader.data == b""      # everything taken: the received bytes are let go, not kept until the next feed


def test_empty_payload_frame():
    data = frame(FRAME_BODY, 3, b"") + frames.HEARTBEAT_FRAME
    assert read_all(FrameReader(4096), data) == [(FRAME_BODY, 3, b""), (FRAME_HEARTBEAT, 0, b"")]


def test_payloads_are_bytes():
    reader = FrameReader(4096)
    reader.feed(bytearray(methods.encode_ack(1, 5, False)))
    ((_, _, payload),) = list(reader.frames())
    assert type(payload) is bytes


# --- frame errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("frame_max", FRAME_MAXES)
def test_frame_over_frame_max(frame_max):
    ok = frame(FRAME_BODY, 1, b"x" * (frame_max - 8))
    assert read_all(FrameReader(frame_max), ok) == [(FRAME_BODY, 1, b"x" * (frame_max - 8))]
    too_big = frame(FRAME_BODY, 1, b"x" * (frame_max - 7))
    # refused as soon as the frame's head is in, before its payload arrives
    for data in (too_big, too_big[:8]):
        reader = FrameReader(frame_max)
        reader.feed(data)
        with pytest.raises(replies.AMQPError) as info:
            list(reader.frames())
        assert info.value.code == replies.FRAME_ERROR == 501
        assert info.value.hard
        assert str(frame_max) in info.value.text and str(frame_max + 1) in info.value.text


def test_frame_over_frame_max_after_good_frames():
    good = methods.encode_ack(1, 1, False)
    reader = FrameReader(4096)
    reader.feed(good + frame(FRAME_BODY, 1, b"x" * 5000))
    got = []
    with pytest.raises(replies.AMQPError) as info:
        for f in reader.frames():
            got.append(f)  # noqa: PERF402 - the frames before the error, collected one by one
    assert got == [(FRAME_METHOD, 1, good[7:-1])]
    assert info.value.code == 501


def test_frame_max_zero_means_no_limit():
    big = frame(FRAME_BODY, 1, b"x" * 300_000)
    assert read_all(FrameReader(0), big) == [(FRAME_BODY, 1, b"x" * 300_000)]


@pytest.mark.parametrize("end", [b"\x00", b"\xcd", b"\xff"])
def test_bad_frame_end(end):
    reader = FrameReader(4096)
    reader.feed(frame(FRAME_METHOD, 1, methods.encode_ack(1, 1, False)[7:-1], end=end))
    with pytest.raises(replies.AMQPError) as info:
        list(reader.frames())
    assert info.value.code == replies.FRAME_ERROR and info.value.hard
    assert "frame end" in info.value.text and f"{end[0]:#x}" in info.value.text


def test_frames_already_yielded_are_not_repeated_after_stopping_early():
    acks = [methods.encode_ack(1, tag, False) for tag in (1, 2, 3)]
    reader = FrameReader(4096)
    reader.feed(b"".join(acks))
    for f in reader.frames():
        assert methods.decode_ack(f[2]) == (1, False)
        break
    assert [methods.decode_ack(f[2])[0] for f in reader.frames()] == [2, 3]


# --- writing frames ------------------------------------------------------------------------------------

@pytest.mark.parametrize("frame_max", FRAME_MAXES)
@pytest.mark.parametrize("size", ["0", "1", "fm-8", "fm-7", "100000"])
def test_content_frames(frame_max, size):
    n = {"0": 0, "1": 1, "fm-8": frame_max - 8, "fm-7": frame_max - 7, "100000": 100_000}[size]
    body = bytes(i % 253 for i in range(n))
    props = properties.encode({"content_type": "application/octet-stream", "delivery_mode": 1})
    header = frames.content_header(n, props)
    parts = frames.content_frames(9, header, body, frame_max)
    data = b"".join(parts)
    chunk = frame_max - 8
    pieces = [body[i:i + chunk] for i in range(0, n, chunk)]
    assert len(pieces) == {"0": 0, "1": 1, "fm-8": 1, "fm-7": 2, "100000": -(-100_000 // chunk)}[size]
    reference = pamqp_frame.marshal(pamqp_header.ContentHeader(
        0, n, commands.Basic.Properties(content_type="application/octet-stream", delivery_mode=1)), 9)
    reference += b"".join(pamqp_frame.marshal(pamqp_body.ContentBody(p), 9) for p in pieces)
    assert data == reference
    if n == 0:
        assert parts == [struct.pack(">BHI", FRAME_HEADER, 9, len(header)), header, b"\xce"]
    got = read_all(FrameReader(frame_max), data)
    assert got == [(FRAME_HEADER, 9, header)] + [(FRAME_BODY, 9, p) for p in pieces]
    assert all(len(p) + 8 <= frame_max for _, _, p in got)


def test_content_frames_without_frame_max():
    body = b"z" * 300_000
    data = b"".join(frames.content_frames(1, frames.content_header(len(body), b"\0\0"), body, 0))
    assert read_all(FrameReader(0), data)[1:] == [(FRAME_BODY, 1, body)]


def test_content_header():
    props = properties.encode({"app_id": "a", "timestamp": 5})
    payload = frames.content_header(2**40, props)
    assert payload == struct.pack(">HHQ", 60, 0, 2**40) + props
    reference = pamqp_header.ContentHeader(
        0, 2**40, properties.to_pamqp(props)).marshal()
    assert payload == reference
    assert frames.decode_content_header(payload) == (60, 2**40)
    assert frames.decode_content_header(struct.pack(">HHQ", 70, 0, 0) + b"\0\0") == (70, 0)


@pytest.mark.parametrize("size", [0, 1, 13])
def test_content_header_too_short(size):
    with pytest.raises(replies.AMQPError) as info:
        frames.decode_content_header(frames.content_header(1, b"\0\0")[:size])
    assert info.value.code == replies.FRAME_ERROR and info.value.hard


def test_constants_match_pamqp():
    assert frames.HEARTBEAT_FRAME == pamqp_frame.marshal(pamqp_heartbeat.Heartbeat(), 0)
    assert frames.PROTOCOL_HEADER == pamqp_header.ProtocolHeader().marshal()
    assert frames.FRAME_OVERHEAD == 8
    method = commands.Channel.Open()
    assert frames.method_frame(3, method) == pamqp_frame.marshal(method, 3)


# --- reply errors ------------------------------------------------------------------------------------

def test_amqp_error_text_and_levels():
    err = replies.channel_error(replies.NOT_FOUND, "no queue 'q'")
    assert (err.code, err.hard, err.text, str(err)) == (404, False, "NOT_FOUND - no queue 'q'",
                                                       "NOT_FOUND - no queue 'q'")
    err = replies.connection_error(replies.FRAME_ERROR, "x")
    assert (err.code, err.hard, err.class_id, err.method_id) == (501, True, 0, 0)
    err = replies.AMQPError(999, "y" * 400, hard=True, class_id=60, method_id=40)
    assert err.text.startswith("999 - ") and len(err.text) == 255
    assert (err.class_id, err.method_id) == (60, 40)
    assert set(replies.REPLY_NAMES) == {200, 311, 312, 313, 320, 402, 403, 404, 405, 406, 501, 502, 503, 504,
                                        505, 506, 530, 540, 541}
