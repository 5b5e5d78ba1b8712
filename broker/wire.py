"""Frames on the wire: splitting the byte stream, and the hot paths that skip pamqp.

AMQP 0-9-1 section 4.2.3: a frame is `type:octet channel:short size:long payload frame-end(0xCE)`.
Everything that is not hot is (un)marshalled by pamqp; the three methods that run once per message
(basic.publish in, basic.deliver out, basic.ack in) and content frames are done here by hand, because
building a pamqp object per message is what a Python broker would otherwise spend its time on.
"""

from __future__ import annotations

import struct

from pamqp import commands, frame as pamqp_frame

from . import replies

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

_frame_head = struct.Struct(">BHI")
_method_ids = struct.Struct(">HH")
_deliver_fixed = struct.Struct(">BHIHH")      # frame head + class/method ids
_u64 = struct.Struct(">Q")
_u64_bit = struct.Struct(">QB")
_content_head = struct.Struct(">HHQ")         # class-id, weight, body-size

HEARTBEAT_FRAME = _frame_head.pack(FRAME_HEARTBEAT, 0, 0) + FRAME_END_BYTE

PUBLISH_ID = (60 << 16) | 40
ACK_ID = (60 << 16) | 80
DELIVER_METHOD = _method_ids.pack(60, 60)


class FrameReader:
    """Splits a byte stream into frames; knows nothing of what frames mean.

    `frame_max` is the negotiated limit (spec 4.2.3: a peer MUST NOT send frames larger than it); a frame
    over it, or a frame-end octet other than 0xCE, is a FRAME_ERROR (501) that closes the connection.
    """

    __slots__ = ("buffer", "frame_max")

    def __init__(self, frame_max: int):
        self.buffer = b""     # bytes, not bytearray: slicing bytes copies a payload once, not twice
        self.frame_max = frame_max

    def feed(self, data: bytes) -> None:
        self.buffer = self.buffer + data if self.buffer else bytes(data)

    def frames(self):
        """Yield (type, channel, payload) for each complete frame buffered; leaves a partial one."""
        buf = self.buffer
        size = len(buf)
        pos = 0
        unpack = _frame_head.unpack_from
        frame_max = self.frame_max
        try:
            while size - pos >= 8:
                ftype, channel, length = unpack(buf, pos)
                if length + 8 > frame_max:
                    raise replies.connection_error(
                        replies.FRAME_ERROR,
                        f"frame size {length + 8} larger than negotiated maximum {frame_max}")
                end = pos + 7 + length
                if end >= size:
                    break
                if buf[end] != FRAME_END:
                    raise replies.connection_error(
                        replies.FRAME_ERROR, f"invalid frame end byte {buf[end]:#x}")
                yield ftype, channel, buf[pos + 7:end]
                pos = end + 1
        finally:
            if pos:
                self.buffer = buf[pos:]


_UNCHECKED: dict[type, type] = {}


def unchecked(cls, **kwargs):
    """A pamqp method object without pamqp's name check, for replies that echo a client's names.

    pamqp refuses queue and exchange names outside ``[a-zA-Z0-9-_.:@#,/+ ]``; RabbitMQ accepts any UTF-8
    short string (errata: names are shortstr), so a queue named "événements" must get its declare-ok.
    The subclass defines no __slots__, so pamqp's marshal still walks the method's own argument list.
    """
    sub = _UNCHECKED.get(cls)
    if sub is None:
        sub = _UNCHECKED[cls] = type(cls.__name__, (cls,), {"validate": lambda self: None})
    return sub(**kwargs)


def method_frame(channel: int, method) -> bytes:
    """Marshal a pamqp method object into one frame."""
    return pamqp_frame.marshal(method, channel)


def content_frames(channel: int, header: bytes, body: bytes, frame_max: int) -> list[bytes]:
    """Header frame from the raw header payload as received (byte-for-byte), then body frames.

    Spec 4.2.6.2: body frames carry at most frame_max - 8 octets each; an empty body has no body frame.
    """
    out = [_frame_head.pack(FRAME_HEADER, channel, len(header)), header, FRAME_END_BYTE]
    n = len(body)
    if n:
        chunk = frame_max - 8
        if n <= chunk:
            out += (_frame_head.pack(FRAME_BODY, channel, n), body, FRAME_END_BYTE)
        else:
            view = memoryview(body)
            for start in range(0, n, chunk):
                part = view[start:start + chunk]
                out += (_frame_head.pack(FRAME_BODY, channel, len(part)), bytes(part), FRAME_END_BYTE)
    return out


def shortstr(value: str) -> bytes:
    raw = value.encode()
    return bytes((len(raw),)) + raw


_shortstrs: dict[str, bytes] = {}


def name_shortstr(name: str) -> bytes:
    """shortstr of an exchange name or routing key on the delivery path: a few distinct names recur in
    every delivery, so each is encoded once (bounded like `_names`)."""
    raw = _shortstrs.get(name)
    if raw is None:
        raw = shortstr(name)
        if len(_shortstrs) < _NAMES_MAX:
            _shortstrs[name] = raw
    return raw


def deliver_frame(channel: int, ctag: bytes, delivery_tag: int, redelivered: bool,
                  exchange: bytes, routing_key: bytes) -> bytes:
    """basic.deliver (spec 1.8.3.9) without pamqp: ctag/exchange/routing_key are pre-encoded shortstrs."""
    args = b"".join((ctag, _u64_bit.pack(delivery_tag, 1 if redelivered else 0), exchange, routing_key))
    return b"".join((_frame_head.pack(FRAME_METHOD, channel, len(args) + 4), DELIVER_METHOD, args,
                     FRAME_END_BYTE))


_ACK_METHOD = _method_ids.pack(60, 80)
_NACK_METHOD = _method_ids.pack(60, 120)


def confirm_frame(channel: int, delivery_tag: int, multiple: bool, ack: bool) -> bytes:
    """basic.ack / basic.nack (requeue=false) from the broker to a publisher in confirm mode."""
    if ack:
        return b"".join((_frame_head.pack(FRAME_METHOD, channel, 13), _ACK_METHOD,
                         _u64_bit.pack(delivery_tag, 1 if multiple else 0), FRAME_END_BYTE))
    return b"".join((_frame_head.pack(FRAME_METHOD, channel, 13), _NACK_METHOD,
                     _u64_bit.pack(delivery_tag, 1 if multiple else 0), FRAME_END_BYTE))


# Decoded exchange names and routing keys, shared between messages: a queue of a million messages with
# the same routing key then holds one string, not a million (about 67 bytes per message).
_names: dict[bytes, str] = {}
_NAMES_MAX = 65536


def _name(raw: bytes) -> str:
    name = _names.get(raw)
    if name is None:
        name = raw.decode()
        if len(_names) < _NAMES_MAX:
            _names[raw] = name
    return name


def parse_publish(payload: bytes) -> tuple[str, str, bool, bool]:
    """basic.publish arguments (spec 1.8.3.7): reserved-1 short, exchange, routing-key, mandatory|immediate."""
    pos = 6
    n = payload[pos]
    exchange = _name(payload[pos + 1:pos + 1 + n])
    pos += 1 + n
    n = payload[pos]
    routing_key = _name(payload[pos + 1:pos + 1 + n])
    pos += 1 + n
    bits = payload[pos]
    return exchange, routing_key, bool(bits & 1), bool(bits & 2)


def parse_ack(payload: bytes) -> tuple[int, bool]:
    """basic.ack arguments (spec 1.8.3.13): delivery-tag longlong, multiple bit."""
    tag, bits = _u64_bit.unpack_from(payload, 4)
    return tag, bool(bits & 1)


def parse_content_header(payload: bytes) -> tuple[int, int]:
    """(class-id, body-size) of a content header payload (spec 4.2.6.1)."""
    class_id, _weight, body_size = _content_head.unpack_from(payload, 0)
    return class_id, body_size


def unmarshal_method(payload: bytes):
    """A pamqp method object from a method frame's payload (the non-hot path)."""
    class_id, method_id = _method_ids.unpack_from(payload, 0)
    index = (class_id << 16) | method_id
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        raise replies.connection_error(
            replies.COMMAND_INVALID if class_id in _KNOWN_CLASSES else replies.NOT_IMPLEMENTED,
            f"unknown method class {class_id} method {method_id}")
    method = cls()
    try:
        method.unmarshal(payload[4:])
    except Exception as exc:  # truncated or malformed arguments
        raise replies.AMQPError(replies.SYNTAX_ERROR, f"cannot decode {cls.name}: {exc}", hard=True,
                                class_id=class_id, method_id=method_id) from None
    return method


_KNOWN_CLASSES = {10, 20, 40, 50, 60, 85, 90}


def method_index(payload: bytes) -> int:
    class_id, method_id = _method_ids.unpack_from(payload, 0)
    return (class_id << 16) | method_id
