"""Basic-class content properties (spec 1.8, section 4.2.6.1): the one property table, raw split/join, and
the one encoder and decoder.

Property bytes are a flags word (bit 15 = content-type ... bit 2 = cluster-id; bit 0 = another flags word
follows, which the basic class never needs) and then the present properties' values in flag order. Both
sides keep them as the exact bytes the publisher sent: the broker passes them through and rewrites only
what it must (`split`/`join`, so a header it does not touch is never re-encoded); the client keeps them
raw on each `Delivery` and decodes on demand (`decode`, or pamqp's object through `to_pamqp`).
"""

from __future__ import annotations

import datetime
import struct

from pamqp import commands

from . import fields

# (property, kind) in flag order. Kinds: s = shortstr, F = field table, o = octet, T = timestamp.
PROPERTIES = (
    ("content_type", "s"), ("content_encoding", "s"), ("headers", "F"), ("delivery_mode", "o"),
    ("priority", "o"), ("correlation_id", "s"), ("reply_to", "s"), ("expiration", "s"),
    ("message_id", "s"), ("timestamp", "T"), ("type", "s"), ("user_id", "s"), ("app_id", "s"),
    ("cluster_id", "s"),
)
KIND = dict(PROPERTIES)
FLAG = {name: 1 << (15 - i) for i, (name, _) in enumerate(PROPERTIES)}
EMPTY = b"\x00\x00"          # a flags word with no property present

_u16 = struct.Struct(">H")
_u32 = struct.Struct(">I")
_u64 = struct.Struct(">Q")
_EPOCH_UTC = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


class PropertyError(ValueError):
    """A property value that cannot be encoded, or property bytes that cannot be read.

    The value encoders' messages read after the property's name: "is 256; it must be 0..255"."""


def flags_of(raw: bytes, offset: int = 0) -> int:
    """The first property-flags word of property bytes that start at `offset` (12 in a content header
    payload)."""
    return _u16.unpack_from(raw, offset)[0]


def headers_at(raw: bytes) -> int | None:
    """Where the headers table (its 4-byte length) starts in property bytes `raw`, None without headers:
    after the flags word and the content-type and content-encoding that precede it (short strings)."""
    flags = _u16.unpack_from(raw, 0)[0]
    if not flags & FLAG["headers"]:
        return None
    pos = 2
    for name in ("content_type", "content_encoding"):
        if flags & FLAG[name]:
            pos += 1 + raw[pos]
    return pos


def header_item(raw: bytes, name: str) -> bytes | None:
    """The raw tagged value of the header `name` in property bytes `raw` (e.g. b"S" + length + text), None
    without it or without headers; nothing else is decoded. Raises FieldError for a malformed table."""
    at = headers_at(raw)
    if at is None:
        return None
    for key, value in fields.table_items(raw[at:]):
        if key == name:
            return value
    return None


# The headers a broker adds to a message each time it delivers it (quorum queues: RabbitMQ 3.x x-delivery-count
# from the first delivery on; 4.x x-delivery-count and x-acquired-count on a redelivery).
DELIVERY_COUNT = "x-delivery-count"
ACQUIRED_COUNT = "x-acquired-count"
DELIVERY_COUNT_HEADERS = frozenset({DELIVERY_COUNT, ACQUIRED_COUNT})
_COUNT_NAMES = tuple(name.encode() for name in DELIVERY_COUNT_HEADERS)


def without_delivery_counts(raw: bytes) -> bytes:
    """Property bytes `raw` as the publisher sent them, as far as a broker delivering the message again
    changes them: the `DELIVERY_COUNT_HEADERS` taken out of the headers table (brokers keep the other
    entries' bytes and order), and a headers table left empty read as none (a copy whose only headers were
    counts). `raw` itself when neither applies. Raises FieldError for a malformed table."""
    at = headers_at(raw) if len(raw) >= 2 else None
    if at is None:
        return raw
    end = at + 4 + _u32.unpack_from(raw, at)[0]
    if end > at + 4 and not any(name in raw[at:end] for name in _COUNT_NAMES):
        return raw
    kept = [item for item in fields.table_items(raw[at:end]) if item[0] not in DELIVERY_COUNT_HEADERS]
    if not kept:
        return _u16.pack(_u16.unpack_from(raw, 0)[0] & ~FLAG["headers"]) + raw[2:at] + raw[end:]
    return raw[:at] + fields.table_from_items(kept) + raw[end:]


def split(raw: bytes) -> dict[str, bytes]:
    """{property: its encoded value, exactly as on the wire} for the properties present in `raw`."""
    if len(raw) < 2:
        raise PropertyError("content header property flags are truncated")
    flags = _u16.unpack_from(raw, 0)[0]
    if flags & 1:  # a continuation word: no basic property needs one (spec 4.2.6.1)
        raise PropertyError("property flags continuation is not used by the basic class")
    pos = 2
    size = len(raw)
    out: dict[str, bytes] = {}
    for name, kind in PROPERTIES:
        if not flags & FLAG[name]:
            continue
        start = pos
        if pos >= size:
            raise PropertyError("content header properties are truncated")
        if kind == "s":
            pos += 1 + raw[pos]
        elif kind == "F":
            if pos + 4 > size:
                raise PropertyError("content header properties are truncated")
            pos += 4 + _u32.unpack_from(raw, pos)[0]
        elif kind == "o":
            pos += 1
        else:
            pos += 8
        if pos > size:
            raise PropertyError("content header properties are truncated")
        out[name] = raw[start:pos]
    return out


def join(values: dict[str, bytes]) -> bytes:
    """The inverse of `split`: property bytes from {property: encoded value}."""
    flags = 0
    parts = []
    for name, _ in PROPERTIES:
        value = values.get(name)
        if value is not None:
            flags |= FLAG[name]
            parts.append(value)
    return _u16.pack(flags) + b"".join(parts)


def with_sorted_headers(raw: bytes) -> bytes:
    """Property bytes `raw` with the headers table as RabbitMQ 4.x delivers it (fields.sorted_items);
    `raw` itself when it has no headers or they are in that order already."""
    at = headers_at(raw)
    if at is None:
        return raw
    end = at + 4 + _u32.unpack_from(raw, at)[0]
    items = fields.table_items(raw[at:end])
    ordered = fields.sorted_items(items)
    if ordered == items:
        return raw
    return raw[:at] + fields.table_from_items(ordered) + raw[end:]


# --- one value of each kind -----------------------------------------------------------------------

def decode_shortstr(raw: bytes) -> str:
    return raw[1:].decode("utf-8", "replace")


def decode_octet(raw: bytes) -> int:
    return raw[0]


def decode_timestamp(raw: bytes) -> int:
    """Seconds since the epoch (AMQP timestamps are whole seconds)."""
    return _u64.unpack(raw)[0]


def encode_shortstr(value) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else str(value).encode("utf-8")
    if len(raw) > 255:
        raise PropertyError(f"is {len(raw)} bytes long; an AMQP property is at most 255 bytes "
                            f"(starts {raw[:40]!r})")
    return bytes((len(raw),)) + raw


def encode_octet(value) -> bytes:
    value = int(value)
    if not 0 <= value <= 255:
        raise PropertyError(f"is {value}; it must be 0..255")
    return bytes((value,))


def epoch_seconds(value: datetime.datetime) -> int:
    """Whole seconds since the epoch (floor); a naive datetime is taken as UTC."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    delta = value - _EPOCH_UTC
    return delta.days * 86400 + delta.seconds


def encode_timestamp(value) -> bytes:
    if isinstance(value, datetime.datetime):
        value = epoch_seconds(value)
    elif not isinstance(value, int) or isinstance(value, bool):
        if isinstance(value, float):
            value = int(value)
        else:
            raise PropertyError(f"is a {type(value).__name__}, not a timestamp")
    if value < 0:
        raise PropertyError("is before 1970; AMQP timestamps are unsigned seconds since the epoch")
    return _u64.pack(value)


def encode_table(value) -> bytes:
    """A headers value: raw field-table bytes pass through; a dict is encoded with RabbitMQ's types."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    try:
        return fields.encode_table(dict(value))
    except fields.FieldError as exc:
        raise PropertyError(f"is not a field table: {exc}") from None


ENCODERS = {"s": encode_shortstr, "o": encode_octet, "T": encode_timestamp, "F": encode_table}
DECODERS = {"s": decode_shortstr, "o": decode_octet, "T": decode_timestamp, "F": bytes}


# --- whole property lists -------------------------------------------------------------------------

def encode(properties) -> bytes:
    """Property bytes from None, pre-encoded bytes (passed through untouched), a pamqp
    `Basic.Properties`, or a dict {property: value} where None means "not set".

    Dict values: str for the string properties, int for delivery_mode and priority, a datetime or int
    seconds for timestamp, and for headers either a dict (encoded with `fields.encode_value`'s types) or
    raw field-table bytes. Errors name the property.
    """
    if properties is None:
        return EMPTY
    if isinstance(properties, (bytes, bytearray, memoryview)):
        return bytes(properties)
    if isinstance(properties, commands.Basic.Properties):
        return properties.marshal()
    if not isinstance(properties, dict):
        raise TypeError("properties must be None, bytes, a dict or pamqp.commands.Basic.Properties, "
                        f"not {type(properties).__name__}")
    unknown = set(properties) - set(KIND)
    if unknown:
        raise PropertyError(f"unknown propert{'y' if len(unknown) == 1 else 'ies'} {sorted(unknown)}")
    flags = 0
    parts = []
    for name, kind in PROPERTIES:
        value = properties.get(name)
        if value is None:
            continue
        try:
            parts.append(ENCODERS[kind](value))
        except PropertyError as exc:
            raise PropertyError(f"property {name!r} {exc}") from None
        flags |= FLAG[name]
    return _u16.pack(flags) + b"".join(parts)


def decode(raw: bytes) -> dict:
    """{property: value} for the properties present: str, int, int seconds (timestamp), and the raw
    field-table bytes for headers (callers choose how to read them)."""
    if raw == EMPTY:
        return {}
    return {name: DECODERS[KIND[name]](value) for name, value in split(raw).items()}


def to_pamqp(raw: bytes) -> commands.Basic.Properties:
    """pamqp's `Basic.Properties` object for property bytes (every value decoded by pamqp)."""
    split(raw)   # the length checks pamqp does not make (it reads a cut-short last string as shorter)
    flags, offset = 0, 0
    word_index = 0
    while True:
        if len(raw) < offset + 2:
            raise PropertyError("content header property flags are truncated")
        word = _u16.unpack_from(raw, offset)[0]
        offset += 2
        flags |= (word & 0xFFFE) << (16 * word_index)
        word_index += 1
        if not word & 1:
            break
    props = commands.Basic.Properties()
    try:
        props.unmarshal(flags, raw[offset:])
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as exc:
        raise PropertyError(f"malformed content header properties: {exc}") from None
    return props
