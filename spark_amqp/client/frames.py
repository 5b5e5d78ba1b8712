"""Frame codecs: a sans-I/O frame parser and the hand-written hot paths.

Everything that is not per-message uses pamqp (one class per method, symmetric marshal/unmarshal). Per
message, pamqp costs: unmarshalling Basic.Deliver builds an object and runs its validation, a content
header decodes every property eagerly, and marshalling Basic.Publish validates and encodes field by field.
So the three per-message paths are written here with `struct` (measured in bench/client_hot_paths.py):

- consume: basic.deliver + content header + body  ->  `Delivery` (properties kept as raw bytes and
  decoded by pamqp only when asked for),
- confirms: basic.ack / basic.nack from the broker  ->  `Confirm`,
- publish: basic.publish + content header + body frames, from pre-encoded property bytes.

Wire format (spec 4.2.3): frame = type octet, channel short, size long, payload, frame-end octet 0xCE.
Method payload = class-id short, method-id short, arguments. Content header payload (4.2.6.1) = class-id
short, weight short (0), body-size longlong, property flags (short words, bit 0 = "more flags follow"),
property values. Body frames carry at most frame_max - 8 bytes (4.2.6.2). A zero-length body has no body
frames at all.
"""

from __future__ import annotations

import inspect
import struct
from typing import Any

from pamqp import commands, constants, frame as pamqp_frame

from .errors import ProtocolError

FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = 0xCE
FRAME_OVERHEAD = 8  # 7 bytes of frame header + the frame-end octet
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
EMPTY_PROPERTIES = b"\x00\x00"  # a flags word with no property present

_FRAME_HEAD = struct.Struct(">BHI")
_CLASS_METHOD = struct.Struct(">HH")
_HEADER_HEAD = struct.Struct(">HHQ")
_TAG_BITS = struct.Struct(">QB")
_SHORT = struct.Struct(">H")

# class-id/method-id prefixes of the methods on the hot paths (spec: class basic = 60).
DELIVER = b"\x00\x3c\x00\x3c"   # basic.deliver (60, 60)
ACK = b"\x00\x3c\x00\x50"       # basic.ack (60, 80)
NACK = b"\x00\x3c\x00\x78"      # basic.nack (60, 120)
RETURN = b"\x00\x3c\x00\x32"    # basic.return (60, 50)
GET_OK = b"\x00\x3c\x00\x47"    # basic.get-ok (60, 71)
_PUBLISH = b"\x00\x3c\x00\x28\x00\x00"  # basic.publish (60, 40) + reserved-1 (ticket) short 0


# ------------------------------------------------------------------------------------------ pamqp side


def build(cls: type, **kwargs: Any):
    """A pamqp method object that skips pamqp's client-side validation (in __init__ and in marshal).

    Why: pamqp refuses queue and exchange names outside ``[a-zA-Z0-9-_.:@#,/+ ]`` (e.g. "événements"),
    which RabbitMQ accepts (any UTF-8 up to 255 bytes). The broker is the authority on names and answers
    with a reply code the caller can act on; pamqp's ValueError would hide it. Length limits still hold:
    encoding a shortstr longer than 255 bytes raises.
    """
    unchecked = _UNCHECKED.get(cls)
    if unchecked is None:
        # No __slots__ in the subclass: `self.__slots__` still resolves to the pamqp class's argument list,
        # which is what marshal iterates over.
        unchecked = _UNCHECKED[cls] = type(cls.__name__, (cls,), {"validate": lambda self: None})
    obj = unchecked.__new__(unchecked)
    for name, default in _defaults(cls).items():
        setattr(obj, name, kwargs.pop(name) if name in kwargs else default)
    if kwargs:
        raise TypeError(f"{cls.name} has no argument(s) {sorted(kwargs)}")
    return obj


_UNCHECKED: dict[type, type] = {}
_DEFAULTS: dict[type, dict[str, Any]] = {}


def _defaults(cls: type) -> dict[str, Any]:
    found = _DEFAULTS.get(cls)
    if found is None:
        params = inspect.signature(cls.__init__).parameters
        found = {n: p.default for n, p in params.items() if n != "self"}
        _DEFAULTS[cls] = found
    return found


def method_frame(channel: int, method) -> bytes:
    return pamqp_frame.marshal(method, channel)


def unmarshal_method(payload: bytes):
    """A pamqp method object from a method frame's payload (the non-hot paths)."""
    index = int.from_bytes(payload[:4], "big")
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        raise ProtocolError(f"unknown method {index >> 16}.{index & 0xFFFF}")
    method = cls.__new__(cls)
    for name, default in _defaults(cls).items():  # unmarshal only sets what the frame carries
        setattr(method, name, default)
    try:
        method.unmarshal(payload[4:])
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed {cls.name}: {exc}") from None
    return method


# --------------------------------------------------------------------------------------- properties


def encode_properties(properties) -> bytes:
    """Content-header property bytes (flags + values) from None, bytes, a dict or Basic.Properties.

    Pre-encoded bytes pass through untouched: the sink encodes a row's properties once, and a relay can
    forward `Delivery.properties_raw` byte-for-byte.
    """
    if properties is None:
        return EMPTY_PROPERTIES
    if isinstance(properties, (bytes, bytearray, memoryview)):
        return bytes(properties)
    if isinstance(properties, dict):
        properties = commands.Basic.Properties(**properties)
    if isinstance(properties, commands.Basic.Properties):
        return properties.marshal()
    raise TypeError("properties must be None, bytes, a dict or pamqp.commands.Basic.Properties, "
                    f"not {type(properties).__name__}")


def decode_properties(raw: bytes) -> commands.Basic.Properties:
    """pamqp Basic.Properties from content-header property bytes (flags words + values)."""
    flags, offset, word_index = 0, 0, 0
    while True:
        if len(raw) < offset + 2:
            raise ProtocolError("content header property flags are truncated")
        word = _SHORT.unpack_from(raw, offset)[0]
        offset += 2
        flags |= (word & 0xFFFE) << (16 * word_index)
        word_index += 1
        if not word & 1:
            break
    props = commands.Basic.Properties()
    props.unmarshal(flags, raw[offset:])
    return props


# ------------------------------------------------------------------------------------------- messages


class Delivery:
    """A message from basic.deliver or basic.get-ok (then `consumer_tag` is None, `message_count` set).

    `properties_raw` is the content header's property bytes exactly as the broker sent them;
    `properties` decodes them with pamqp on first access (most consumers never look at most properties).
    """

    __slots__ = ("channel", "consumer_tag", "delivery_tag", "redelivered", "exchange", "routing_key",
                 "message_count", "properties_raw", "body", "_properties")

    def __init__(self, channel, consumer_tag, delivery_tag, redelivered, exchange, routing_key,
                 message_count=None):
        self.channel = channel
        self.consumer_tag = consumer_tag
        self.delivery_tag = delivery_tag
        self.redelivered = redelivered
        self.exchange = exchange
        self.routing_key = routing_key
        self.message_count = message_count
        self.properties_raw = EMPTY_PROPERTIES
        self.body = b""
        self._properties = None

    @property
    def properties(self) -> commands.Basic.Properties:
        if self._properties is None:
            self._properties = decode_properties(self.properties_raw)
        return self._properties

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} tag={self.delivery_tag} exchange={self.exchange!r} "
                f"routing_key={self.routing_key!r} redelivered={self.redelivered} "
                f"body={len(self.body)} bytes>")


class Returned(Delivery):
    """A mandatory message the broker could not route (basic.return), with its reply code and text."""

    __slots__ = ("reply_code", "reply_text")


class Confirm:
    """basic.ack / basic.nack from the broker in confirm mode (publisher confirms)."""

    __slots__ = ("channel", "delivery_tag", "multiple", "ack")

    def __init__(self, channel, delivery_tag, multiple, ack):
        self.channel = channel
        self.delivery_tag = delivery_tag
        self.multiple = multiple
        self.ack = ack


_STR_CACHE: dict[bytes, str] = {}


def _text(raw: bytes) -> str:
    """Exchange names, routing keys and consumer tags repeat: decode each distinct one once."""
    text = _STR_CACHE.get(raw)
    if text is None:
        text = raw.decode("utf-8", "surrogateescape")
        if len(_STR_CACHE) < 4096:
            _STR_CACHE[raw] = text
    return text


def parse_deliver(channel: int, p: bytes) -> Delivery:
    """basic.deliver: consumer-tag shortstr, delivery-tag longlong, redelivered bit, exchange shortstr,
    routing-key shortstr (spec 1.8.3.9)."""
    n = p[4]
    o = 5 + n
    tag, bits = _TAG_BITS.unpack_from(p, o)
    o += 9
    ne = p[o]
    o += 1
    exchange = p[o:o + ne]
    o += ne
    nr = p[o]
    return Delivery(channel, _text(p[5:5 + n]), tag, bool(bits & 1), _text(exchange),
                    _text(p[o + 1:o + 1 + nr]))


def parse_get_ok(channel: int, p: bytes) -> Delivery:
    """basic.get-ok: delivery-tag, redelivered, exchange, routing-key, message-count long (1.8.3.11)."""
    tag, bits = _TAG_BITS.unpack_from(p, 4)
    o = 13
    ne = p[o]
    exchange = p[o + 1:o + 1 + ne]
    o += 1 + ne
    nr = p[o]
    routing_key = p[o + 1:o + 1 + nr]
    o += 1 + nr
    count = int.from_bytes(p[o:o + 4], "big")
    return Delivery(channel, None, tag, bool(bits & 1), _text(exchange), _text(routing_key), count)


def parse_return(channel: int, p: bytes) -> Returned:
    """basic.return: reply-code short, reply-text shortstr, exchange, routing-key (1.8.3.7)."""
    code = _SHORT.unpack_from(p, 4)[0]
    n = p[6]
    text = p[7:7 + n]
    o = 7 + n
    ne = p[o]
    exchange = p[o + 1:o + 1 + ne]
    o += 1 + ne
    nr = p[o]
    msg = Returned(channel, None, None, False, _text(exchange), _text(p[o + 1:o + 1 + nr]))
    msg.reply_code = code
    msg.reply_text = text.decode("utf-8", "replace")
    return msg


def parse_confirm(channel: int, p: bytes, ack: bool) -> Confirm:
    """basic.ack / basic.nack: delivery-tag longlong, then multiple (bit 0) [, requeue (bit 1)]."""
    tag, bits = _TAG_BITS.unpack_from(p, 4)
    return Confirm(channel, tag, bool(bits & 1), ack)


# --------------------------------------------------------------------------------------------- parser


_QWORD = struct.Struct(">Q")


def _whole_delivery(buf: bytes, pos: int, ch: int, end: int, size_all: int, limit: int, append) -> int:
    """The consume hot path: a basic.deliver whose content header and single body frame (or no body) are
    already in `buf`, as brokers write them, parsed in one go into a `Delivery` (no per-frame slices, no
    `_Content`). Returns the position after its last frame, or 0 to let the general path take the frames
    one by one (anything unusual: a partial delivery, several body frames, another channel's frame in
    between, a malformed frame, which the general path then reports)."""
    h = end + 1
    if size_all - h < 8:
        return 0
    htype, hch, hsize = _FRAME_HEAD.unpack_from(buf, h)
    hend = h + 7 + hsize
    if htype != FRAME_HEADER or hch != ch or hsize < 14 or hend >= size_all or buf[hend] != FRAME_END \
            or (limit and hsize + FRAME_OVERHEAD > limit):
        return 0
    body_size = _QWORD.unpack_from(buf, h + 11)[0]
    if body_size:
        b = hend + 1
        if size_all - b < 8:
            return 0
        btype, bch, bsize = _FRAME_HEAD.unpack_from(buf, b)
        bend = b + 7 + bsize
        if btype != FRAME_BODY or bch != ch or bsize != body_size or bend >= size_all \
                or buf[bend] != FRAME_END:
            return 0
        body = buf[b + 7:bend]
        after = bend + 1
    else:
        body = b""
        after = hend + 1
    # basic.deliver arguments (spec 1.8.3.9): consumer-tag shortstr, delivery-tag longlong, redelivered
    # bit, exchange shortstr, routing-key shortstr.
    o = pos + 11
    n = buf[o]
    ctag = _text(buf[o + 1:o + 1 + n])
    o += 1 + n
    tag, bits = _TAG_BITS.unpack_from(buf, o)
    o += 9
    n = buf[o]
    exchange = _text(buf[o + 1:o + 1 + n])
    o += 1 + n
    n = buf[o]
    if o + 1 + n > end:
        return 0
    msg = Delivery(ch, ctag, tag, bool(bits & 1), exchange, _text(buf[o + 1:o + 1 + n]))
    props = buf[h + 19:hend]
    msg.properties_raw = EMPTY_PROPERTIES if props == EMPTY_PROPERTIES else props
    msg.body = body
    append(msg)
    return after


class _Content:
    __slots__ = ("message", "remaining", "chunks")

    def __init__(self, message):
        self.message = message
        self.remaining = -1  # -1 until the content header arrives
        self.chunks = None


class FrameParser:
    """Sans-I/O: `feed(bytes)` returns the events those bytes complete, in wire order.

    Events are `Delivery` (deliver or get-ok with its content), `Returned`, `Confirm`, pamqp method
    objects as ``(channel, method)`` tuples, and `HEARTBEAT`. Content frames are assembled per channel
    (spec 4.2.6: a content's frames are contiguous on its channel but may interleave across channels).
    """

    HEARTBEAT = "heartbeat"

    def __init__(self, frame_max: int = 131072):
        self.frame_max = frame_max
        self._rest = b""
        self._content: dict[int, _Content] = {}

    def feed(self, data: bytes) -> list:
        buf = self._rest + data if self._rest else data
        events: list = []
        append = events.append
        unpack_head = _FRAME_HEAD.unpack_from
        content = self._content
        limit = self.frame_max
        pos, size_all = 0, len(buf)
        while size_all - pos >= 8:
            ftype, ch, size = unpack_head(buf, pos)
            if limit and size + FRAME_OVERHEAD > limit:
                raise ProtocolError(f"frame of {size} bytes exceeds frame_max {limit} (spec 4.2.3)")
            end = pos + 7 + size
            if end >= size_all:
                break
            if buf[end] != FRAME_END:
                raise ProtocolError("frame-end octet missing (spec 4.2.3: the frame is malformed)")
            if ftype == FRAME_METHOD and ch not in content and buf.startswith(DELIVER, pos + 7):
                done = _whole_delivery(buf, pos, ch, end, size_all, limit, append)
                if done:
                    pos = done
                    continue
            payload = buf[pos + 7:end]
            pos = end + 1
            if ftype == FRAME_METHOD:
                prefix = payload[:4]
                if prefix == DELIVER:
                    self._start(ch, parse_deliver(ch, payload))
                elif prefix == ACK:
                    append(parse_confirm(ch, payload, True))
                elif prefix == NACK:
                    append(parse_confirm(ch, payload, False))
                elif prefix == GET_OK:
                    self._start(ch, parse_get_ok(ch, payload))
                elif prefix == RETURN:
                    self._start(ch, parse_return(ch, payload))
                else:
                    if ch in content:
                        raise ProtocolError(f"method frame on channel {ch} while content was expected "
                                            "(spec 4.2.6)")
                    append((ch, unmarshal_method(payload)))
            elif ftype == FRAME_HEADER:
                pending = content.get(ch)
                if pending is None or pending.remaining != -1:
                    raise ProtocolError(f"unexpected content header on channel {ch}")
                body_size = _HEADER_HEAD.unpack_from(payload, 0)[2]
                msg = pending.message
                msg.properties_raw = payload[12:]
                if body_size == 0:
                    del content[ch]
                    append(msg)
                else:
                    pending.remaining = body_size
            elif ftype == FRAME_BODY:
                pending = content.get(ch)
                if pending is None or pending.remaining <= 0:
                    raise ProtocolError(f"unexpected content body on channel {ch}")
                remaining = pending.remaining - len(payload)
                if remaining == 0 and pending.chunks is None:
                    pending.message.body = payload  # the common case: one body frame
                elif remaining < 0:
                    raise ProtocolError(f"content body on channel {ch} exceeds its declared size")
                else:
                    if pending.chunks is None:
                        pending.chunks = []
                    pending.chunks.append(payload)
                    if remaining == 0:
                        pending.message.body = b"".join(pending.chunks)
                if remaining == 0:
                    del content[ch]
                    append(pending.message)
                else:
                    pending.remaining = remaining
            elif ftype == FRAME_HEARTBEAT:
                append(self.HEARTBEAT)
            else:
                raise ProtocolError(f"unknown frame type {ftype} (spec 4.2.3)")
        self._rest = buf[pos:] if pos < size_all else b""
        return events

    def _start(self, ch: int, message) -> None:
        if ch in self._content:
            raise ProtocolError(f"new content on channel {ch} before the previous one completed")
        self._content[ch] = _Content(message)

    def forget_channel(self, ch: int) -> None:
        self._content.pop(ch, None)


# ------------------------------------------------------------------------------------------- publish


def shortstr(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"{text[:40]!r}... is longer than 255 bytes (AMQP shortstr)")
    return bytes((len(raw),)) + raw


def encode_publish(channel: int, exchange: bytes, routing_key: bytes, mandatory: bool,
                   properties: bytes, body: bytes, frame_max: int) -> bytes:
    """basic.publish + content header + body frame(s), as one bytes object for one sendall.

    `exchange` and `routing_key` are already shortstr-encoded (`shortstr()`; callers cache them).
    """
    method = _PUBLISH + exchange + routing_key + (b"\x01" if mandatory else b"\x00")
    size = len(body)
    header = _HEADER_HEAD.pack(60, 0, size) + properties
    head = _FRAME_HEAD.pack
    parts = [head(FRAME_METHOD, channel, len(method)), method, b"\xce",
             head(FRAME_HEADER, channel, len(header)), header, b"\xce"]
    chunk = frame_max - FRAME_OVERHEAD if frame_max else size or 1
    if size <= chunk:
        if size:
            parts += (head(FRAME_BODY, channel, size), body, b"\xce")
    else:
        view = memoryview(body)
        for start in range(0, size, chunk):
            piece = view[start:start + chunk]
            parts += (head(FRAME_BODY, channel, len(piece)), piece, b"\xce")
    return b"".join(parts)


def pamqp_publish(channel: int, exchange: str, routing_key: str, mandatory: bool,
                  properties: commands.Basic.Properties, body: bytes, frame_max: int) -> bytes:
    """The same frames through pamqp objects: the reference for tests and the benchmark's baseline."""
    from pamqp import body as pamqp_body, header as pamqp_header

    out = [pamqp_frame.marshal(commands.Basic.Publish(exchange=exchange, routing_key=routing_key,
                                                      mandatory=mandatory), channel),
           pamqp_frame.marshal(pamqp_header.ContentHeader(0, len(body), properties), channel)]
    chunk = frame_max - FRAME_OVERHEAD
    for start in range(0, len(body), chunk):
        out.append(pamqp_frame.marshal(pamqp_body.ContentBody(body[start:start + chunk]), channel))
    return b"".join(out)


assert constants.FRAME_END == FRAME_END


_ACK_FRAME = struct.Struct(">BHI4sQB")


def encode_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """basic.ack (60, 80): delivery-tag longlong, multiple bit; cheap enough to send per message."""
    return _ACK_FRAME.pack(FRAME_METHOD, channel, 13, ACK, delivery_tag, 1 if multiple else 0) + b"\xce"
