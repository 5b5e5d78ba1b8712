"""Methods: pamqp for all of them, and hand-written pairs for the few that run once per message.

Every method is (un)marshalled by pamqp (`unmarshal_method`, `frames.method_frame`), except the per-message
ones, where building and validating a pamqp object per message is most of what a Python broker or client
would spend its time on. Those are written here with `struct`, each as an encode/decode pair side by
side, and tested byte for byte against pamqp (tests/codec). Each is several times faster than pamqp's
object path: `python bench/codec_hot_paths.py` measures each against it, and docs/performance.md holds the
current figures. basic.publish and basic.ack are encoded by the client and decoded by the broker;
basic.deliver the other way round. The client takes a whole delivery off its receive buffer in one pass
(`client/events.py`, `_whole_deliveries`), not through `frames.FrameReader`; the broker writes a delivery
whose body fits one frame as one part (`deliver_frames`).

basic.get-ok and basic.return are decoded by hand too (the client reads them into the same `Delivery`
objects as deliveries); the broker encodes them with pamqp, as they are not per-message in bulk.
"""

from __future__ import annotations

import inspect
import struct
from typing import Any

from pamqp import commands

from . import fields, replies
from .frames import (CONTENT_HEAD as _CONTENT_HEAD, FRAME_BODY, FRAME_END_BYTE, FRAME_HEAD, FRAME_HEADER,
                     FRAME_METHOD, FRAME_OVERHEAD, content_frames, content_header)

_CLASS_METHOD = struct.Struct(">HH")
TAG_BITS = struct.Struct(">QB")     # delivery-tag longlong + the bits octet after it (read by client/events.py too)
_SHORT = struct.Struct(">H")
_U32 = struct.Struct(">I")
_ACK_FRAME = struct.Struct(">BHI4sQB")

# class-id/method-id prefixes of the methods on the hot paths (spec: class basic = 60).
PUBLISH = b"\x00\x3c\x00\x28"   # basic.publish (60, 40)
RETURN = b"\x00\x3c\x00\x32"    # basic.return (60, 50)
DELIVER = b"\x00\x3c\x00\x3c"   # basic.deliver (60, 60)
GET_OK = b"\x00\x3c\x00\x47"    # basic.get-ok (60, 71)
ACK = b"\x00\x3c\x00\x50"       # basic.ack (60, 80)
NACK = b"\x00\x3c\x00\x78"      # basic.nack (60, 120)

BASIC_PUBLISH = (60, 40)        # (class-id, method-id)
BASIC_ACK = (60, 80)
PUBLISH_ID = (BASIC_PUBLISH[0] << 16) | BASIC_PUBLISH[1]    # what method_index() gives for each
ACK_ID = (BASIC_ACK[0] << 16) | BASIC_ACK[1]

# Classes of AMQP 0-9-1 (connection, channel, exchange, queue, basic, confirm, tx): an unknown method of a
# known class is COMMAND_INVALID (503), of an unknown class NOT_IMPLEMENTED (540), as RabbitMQ answers.
KNOWN_CLASSES = frozenset({10, 20, 40, 50, 60, 85, 90})


# ------------------------------------------------------------------------------------------ pamqp side


def unchecked(cls: type, **kwargs: Any):
    """A pamqp method object without pamqp's name check, for names a peer chose.

    pamqp refuses queue and exchange names outside ``[a-zA-Z0-9-_.:@#,/+ ]``; RabbitMQ accepts any UTF-8
    short string (errata: names are shortstr), so a queue named "événements" must get its declare-ok and a
    client must be able to declare it. Length limits still hold: encoding a shortstr over 255 bytes raises.
    The subclass defines no __slots__, so pamqp's marshal still walks the method's own argument list.
    """
    sub = _UNCHECKED.get(cls)
    if sub is None:
        sub = _UNCHECKED[cls] = type(cls.__name__, (cls,), {"validate": lambda self: None})
    obj = sub.__new__(sub)
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
        found = _DEFAULTS[cls] = {n: p.default for n, p in params.items() if n != "self"}
    return found


def method_index(payload: bytes) -> int:
    """(class-id << 16) | method-id of a method frame's payload."""
    class_id, method_id = _CLASS_METHOD.unpack_from(payload, 0)
    return (class_id << 16) | method_id


def unmarshal_method(payload: bytes):
    """A pamqp method object from a method frame's payload.

    Unknown methods are COMMAND_INVALID or NOT_IMPLEMENTED, arguments that do not decode SYNTAX_ERROR
    (502), as RabbitMQ answers them; all three are connection errors (`replies.AMQPError`, hard).
    """
    if len(payload) < 4:
        raise replies.connection_error(replies.FRAME_ERROR, "method frame too short")
    class_id, method_id = _CLASS_METHOD.unpack_from(payload, 0)
    cls = commands.INDEX_MAPPING.get((class_id << 16) | method_id)
    if cls is None:
        raise replies.connection_error(
            replies.COMMAND_INVALID if class_id in KNOWN_CLASSES else replies.NOT_IMPLEMENTED,
            f"unknown method class {class_id} method {method_id}")
    method = cls.__new__(cls)
    for name, default in _defaults(cls).items():  # unmarshal only sets what the frame carries
        setattr(method, name, default)
    try:
        _check_table_depth(cls, payload)
    except fields.FieldError as exc:
        raise replies.AMQPError(replies.SYNTAX_ERROR, f"cannot decode {cls.name}: {exc}", hard=True,
                                class_id=class_id, method_id=method_id) from None
    try:
        method.unmarshal(payload[4:])
    except Exception as exc:  # truncated or malformed arguments: pamqp raises several kinds
        raise replies.AMQPError(replies.SYNTAX_ERROR, f"cannot decode {cls.name}: {exc}", hard=True,
                                class_id=class_id, method_id=method_id) from None
    return method


_ARG_SIZES = {"octet": 1, "short": 2, "long": 4, "longlong": 8, "timestamp": 8}
_TABLE_LAYOUTS: dict[type, tuple[str, ...] | None] = {}


def _check_table_depth(cls: type, payload: bytes) -> None:
    """FieldError if a field-table argument nests deeper than fields.MAX_DEPTH, found by walking the
    arguments as pamqp will (its argument types, bits packed in octets) without decoding them. Runs before
    pamqp, whose recursive decoder costs a copy of the frame per level (see fields.MAX_DEPTH). Malformed
    arguments stop the walk: pamqp reports them."""
    layout = _TABLE_LAYOUTS.get(cls, ())
    if layout == ():
        kinds = tuple(cls.amqp_type(a) for a in cls.__slots__)
        layout = _TABLE_LAYOUTS[cls] = kinds if "table" in kinds else None
    if layout is None:
        return
    pos, bits, n = 4, 0, len(payload)
    for kind in layout:
        if pos >= n:
            return
        if kind == "bit":
            if bits == 0 or bits == 8:
                pos, bits = pos + 1, 0
            bits += 1
            continue
        if bits:
            bits = 0
        if kind in _ARG_SIZES:
            pos += _ARG_SIZES[kind]
        elif kind == "shortstr":
            pos += 1 + payload[pos]
        elif kind in ("longstr", "table"):
            if pos + 4 > n:
                return
            if kind == "table":
                fields.check_depth(payload, pos)
            pos += 4 + _U32.unpack_from(payload, pos)[0]
        else:
            return


# ------------------------------------------------------------------------------------ short strings


def shortstr(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"{text[:40]!r}... is longer than 255 bytes (AMQP shortstr)")
    return bytes((len(raw),)) + raw


# Exchange names, routing keys and consumer tags recur in every message, so each distinct one is decoded
# (and encoded) once: a queue of a million messages with one routing key then holds one string, not a
# million (about 67 bytes a message). Bounded, so a peer inventing names cannot grow them without end.
_NAMES_MAX = 65536
NAMES: dict[bytes, str] = {}     # raw name -> text (read by the client's hot path too: events.py)
_shortstrs: dict[str, bytes] = {}


def name(raw: bytes) -> str:
    """A name from its UTF-8 bytes (a shortstr's content), decoded once per distinct name."""
    text = NAMES.get(raw)
    if text is None:
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise replies.connection_error(replies.SYNTAX_ERROR, f"name {raw[:40]!r} is not UTF-8") from None
        if len(NAMES) < _NAMES_MAX:
            NAMES[raw] = text
    return text


def name_shortstr(text: str) -> bytes:
    """`shortstr(text)`, encoded once per distinct name."""
    raw = _shortstrs.get(text)
    if raw is None:
        raw = shortstr(text)
        if len(_shortstrs) < _NAMES_MAX:
            _shortstrs[text] = raw
    return raw


def _shortstr_at(p: bytes, o: int) -> tuple[str, int]:
    if o >= len(p):
        raise replies.connection_error(replies.SYNTAX_ERROR, "method arguments are truncated")
    n = p[o]
    end = o + 1 + n
    if end > len(p):
        raise replies.connection_error(replies.SYNTAX_ERROR, "short string runs past the end of its method")
    return name(p[o + 1:end]), end


# --------------------------------------------------------------------------- per-message method pairs


def encode_publish(channel: int, exchange: bytes, routing_key: bytes, mandatory: bool,
                   immediate: bool = False) -> bytes:
    """basic.publish (spec 1.8.3.7): reserved-1 short, exchange shortstr, routing-key shortstr, mandatory
    and immediate bits. `exchange` and `routing_key` are shortstrs already (`name_shortstr`)."""
    args = b"".join((PUBLISH, b"\x00\x00", exchange, routing_key,
                     bytes(((1 if mandatory else 0) | (2 if immediate else 0),))))
    return FRAME_HEAD.pack(FRAME_METHOD, channel, len(args)) + args + FRAME_END_BYTE


def decode_publish(payload: bytes) -> tuple[str, str, bool, bool]:
    """(exchange, routing_key, mandatory, immediate) of a basic.publish payload."""
    exchange, o = _shortstr_at(payload, 6)
    routing_key, o = _shortstr_at(payload, o)
    if o >= len(payload):
        raise replies.connection_error(replies.SYNTAX_ERROR, "basic.publish is truncated")
    bits = payload[o]
    return exchange, routing_key, bool(bits & 1), bool(bits & 2)


def encode_deliver(channel: int, consumer_tag: bytes, delivery_tag: int, redelivered: bool,
                   exchange: bytes, routing_key: bytes) -> bytes:
    """basic.deliver (spec 1.8.3.9): consumer-tag shortstr, delivery-tag longlong, redelivered bit,
    exchange shortstr, routing-key shortstr; the names are shortstrs already."""
    args = b"".join((DELIVER, consumer_tag, TAG_BITS.pack(delivery_tag, 1 if redelivered else 0),
                     exchange, routing_key))
    return FRAME_HEAD.pack(FRAME_METHOD, channel, len(args)) + args + FRAME_END_BYTE


def deliver_frames(channel: int, consumer_tag: bytes, delivery_tag: int, redelivered: bool, exchange: bytes,
                   routing_key: bytes, header: bytes, body: bytes, frame_max: int) -> list[bytes]:
    """A whole delivery as parts to write: basic.deliver (encode_deliver), the content header frame
    carrying `header` byte for byte, and the body frame(s) (content_frames). The broker's per-message path:
    a body that fits one frame goes out as one part made by one join (the broker's write of a 100 B
    delivery took 0.84-0.90 us this way against 0.92-0.96 with the two helpers' parts, measured)."""
    method = encode_deliver(channel, consumer_tag, delivery_tag, redelivered, exchange, routing_key)
    n = len(body)
    if not n or (frame_max and n > frame_max - FRAME_OVERHEAD):
        return [method, *content_frames(channel, header, body, frame_max)]
    head = FRAME_HEAD.pack
    return [b"".join((method, head(FRAME_HEADER, channel, len(header)), header, FRAME_END_BYTE,
                      head(FRAME_BODY, channel, n), body, FRAME_END_BYTE))]


def decode_deliver(p: bytes) -> tuple[str, int, bool, str, str]:
    """(consumer_tag, delivery_tag, redelivered, exchange, routing_key) of a basic.deliver payload.

    The consumer's per-message path, so written out flat (no helper calls; names through the cache)."""
    names = NAMES
    try:
        o = 5 + p[4]
        raw = p[5:o]
        consumer_tag = names.get(raw) or name(raw)
        tag, bits = TAG_BITS.unpack_from(p, o)
        o += 9
        e = o + 1 + p[o]
        raw = p[o + 1:e]
        exchange = names.get(raw) or name(raw)
        o = e + 1 + p[e]
        raw = p[e + 1:o]
        routing_key = names.get(raw) or name(raw)
    except (IndexError, struct.error):
        o = len(p) + 1
    if o > len(p):
        raise replies.connection_error(replies.SYNTAX_ERROR, "basic.deliver is truncated")
    return consumer_tag, tag, bool(bits & 1), exchange, routing_key


def decode_get_ok(payload: bytes) -> tuple[int, bool, str, str, int]:
    """(delivery_tag, redelivered, exchange, routing_key, message_count) of basic.get-ok (1.8.3.11)."""
    tag, bits = TAG_BITS.unpack_from(payload, 4)
    exchange, o = _shortstr_at(payload, 13)
    routing_key, o = _shortstr_at(payload, o)
    return tag, bool(bits & 1), exchange, routing_key, int.from_bytes(payload[o:o + 4], "big")


def decode_return(payload: bytes) -> tuple[int, str, str, str]:
    """(reply_code, reply_text, exchange, routing_key) of basic.return (1.8.3.8)."""
    code = _SHORT.unpack_from(payload, 4)[0]
    n = payload[6]
    text = payload[7:7 + n].decode("utf-8", "replace")
    exchange, o = _shortstr_at(payload, 7 + n)
    routing_key, o = _shortstr_at(payload, o)
    return code, text, exchange, routing_key


def encode_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """basic.ack (spec 1.8.3.13): delivery-tag longlong, multiple bit. A consumer's ack and a broker's
    publisher confirm are the same method."""
    return _ACK_FRAME.pack(FRAME_METHOD, channel, 13, ACK, delivery_tag, 1 if multiple else 0) + FRAME_END_BYTE


def encode_nack(channel: int, delivery_tag: int, multiple: bool, requeue: bool = False) -> bytes:
    """basic.nack (RabbitMQ extension, 60/120): delivery-tag, multiple bit, requeue bit."""
    bits = (1 if multiple else 0) | (2 if requeue else 0)
    return _ACK_FRAME.pack(FRAME_METHOD, channel, 13, NACK, delivery_tag, bits) + FRAME_END_BYTE


def decode_ack(payload: bytes) -> tuple[int, bool]:
    """(delivery_tag, multiple) of a basic.ack or basic.nack payload (nack's requeue: `decode_nack`)."""
    if len(payload) < 13:
        raise replies.connection_error(replies.SYNTAX_ERROR, "basic.ack is truncated")
    tag, bits = TAG_BITS.unpack_from(payload, 4)
    return tag, bool(bits & 1)


def decode_nack(payload: bytes) -> tuple[int, bool, bool]:
    """(delivery_tag, multiple, requeue) of a basic.nack payload."""
    tag, bits = TAG_BITS.unpack_from(payload, 4)
    return tag, bool(bits & 1), bool(bits & 2)


def encode_publish_message(channel: int, exchange: bytes, routing_key: bytes, mandatory: bool,
                           properties: bytes, body: bytes, frame_max: int) -> bytes:
    """basic.publish with its content (header from property bytes, body frames), as one bytes object for
    one socket write: the publisher's per-message path, written out flat for a body that fits one frame
    (the common case); a larger body is split by `content_frames`."""
    method = b"".join((PUBLISH, b"\x00\x00", exchange, routing_key, b"\x01" if mandatory else b"\x00"))
    size = len(body)
    head = FRAME_HEAD.pack
    if size and (size <= frame_max - 8 or not frame_max):
        return b"".join((head(FRAME_METHOD, channel, len(method)), method, FRAME_END_BYTE,
                         head(FRAME_HEADER, channel, 12 + len(properties)), _CONTENT_HEAD.pack(60, 0, size),
                         properties, FRAME_END_BYTE, head(FRAME_BODY, channel, size), body, FRAME_END_BYTE))
    parts = content_frames(channel, content_header(size, properties), body, frame_max)
    parts.insert(0, head(FRAME_METHOD, channel, len(method)) + method + FRAME_END_BYTE)
    return b"".join(parts)
