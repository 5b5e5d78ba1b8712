"""Content-header properties, read and rewritten without disturbing the bytes the broker does not own.

The broker passes content headers through byte-for-byte. It reads a few properties (priority, expiration,
headers for the headers exchange, user-id) and, when it dead-letters a message, rewrites two of them
(adds `x-death` to headers, removes `expiration`). Both are done on the raw encoding: each property is
kept as the exact bytes the publisher sent, and a headers table is split into (key, raw value) pairs, so
a header the broker does not touch is never decoded and re-encoded (which would change its field type).
"""

from __future__ import annotations

import datetime
import struct

from pamqp import decode as pamqp_decode

# Spec 1.8 (basic class properties), in flag order: bit 15 = content-type ... bit 2 = cluster-id.
PROPERTY_TYPES = (
    ("content_type", "s"), ("content_encoding", "s"), ("headers", "F"), ("delivery_mode", "o"),
    ("priority", "o"), ("correlation_id", "s"), ("reply_to", "s"), ("expiration", "s"),
    ("message_id", "s"), ("timestamp", "T"), ("type", "s"), ("user_id", "s"), ("app_id", "s"),
    ("cluster_id", "s"),
)
FLAG = {name: 1 << (15 - i) for i, (name, _) in enumerate(PROPERTY_TYPES)}
# Properties the broker itself needs to read; a header whose flags carry none of these is not parsed.
BROKER_READS = FLAG["headers"] | FLAG["priority"] | FLAG["expiration"] | FLAG["user_id"]

_u16 = struct.Struct(">H")
_u32 = struct.Struct(">I")
_u64 = struct.Struct(">Q")
_i64 = struct.Struct(">q")


def flags_of(header: bytes) -> int:
    """The first property-flags word (bytes 12-13 of a content header payload)."""
    return _u16.unpack_from(header, 12)[0]


def split(header: bytes) -> tuple[bytes, dict[str, bytes]]:
    """Split a content header payload into its 12-byte prefix and {property: raw encoded value}.

    Raises ValueError on a malformed header (the caller turns that into a frame error).
    """
    prefix = header[:12]
    flags = _u16.unpack_from(header, 12)[0]
    pos = 14
    if flags & 1:  # continuation flag word: no basic property uses it (spec 4.2.6.1)
        raise ValueError("property flags continuation is not used by the basic class")
    raw: dict[str, bytes] = {}
    for name, kind in PROPERTY_TYPES:
        if not flags & FLAG[name]:
            continue
        start = pos
        if kind == "s":
            pos += 1 + header[pos]
        elif kind == "F":
            pos += 4 + _u32.unpack_from(header, pos)[0]
        elif kind == "o":
            pos += 1
        else:
            pos += 8
        if pos > len(header):
            raise ValueError("content header properties are truncated")
        raw[name] = header[start:pos]
    return prefix, raw


def join(prefix: bytes, raw: dict[str, bytes]) -> bytes:
    flags = 0
    parts = []
    for name, _ in PROPERTY_TYPES:
        value = raw.get(name)
        if value is not None:
            flags |= FLAG[name]
            parts.append(value)
    return prefix + _u16.pack(flags) + b"".join(parts)


def decode_shortstr(raw: bytes) -> str:
    return raw[1:].decode("utf-8", "replace")


def decode_octet(raw: bytes) -> int:
    return raw[0]


def decode_table(raw: bytes) -> dict:
    return pamqp_decode.field_table(raw)[1]


# --- headers tables, raw -----------------------------------------------------------------------

_FIXED_SIZES = {b"t": 1, b"b": 1, b"B": 1, b"s": 2, b"u": 2, b"I": 4, b"i": 4, b"l": 8, b"L": 8,
                b"f": 4, b"d": 8, b"D": 5, b"T": 8, b"V": 0}


def _value_end(buf: bytes, pos: int) -> int:
    tag = buf[pos:pos + 1]
    pos += 1
    size = _FIXED_SIZES.get(tag)
    if size is not None:
        return pos + size
    if tag in (b"S", b"x", b"F", b"A"):
        return pos + 4 + _u32.unpack_from(buf, pos)[0]
    raise ValueError(f"unknown field type {tag!r}")


def table_items(raw: bytes) -> list[tuple[str, bytes]]:
    """A raw field table (with its 4-byte length) as [(key, raw tagged value)], in wire order."""
    end = 4 + _u32.unpack_from(raw, 0)[0]
    pos = 4
    items = []
    while pos < end:
        n = raw[pos]
        key = raw[pos + 1:pos + 1 + n].decode("utf-8", "replace")
        pos += 1 + n
        value_end = _value_end(raw, pos)
        items.append((key, raw[pos:value_end]))
        pos = value_end
    return items


def table_from_items(items: list[tuple[str, bytes]]) -> bytes:
    body = b"".join(bytes((len(k.encode()),)) + k.encode() + v for k, v in items)
    return _u32.pack(len(body)) + body


def enc_longstr(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return b"S" + _u32.pack(len(raw)) + raw


def enc_long(value: int) -> bytes:
    return b"l" + _i64.pack(value)


def enc_timestamp(value: datetime.datetime | int) -> bytes:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        value = int(value.timestamp())
    return b"T" + _u64.pack(value)


def enc_array(values: list[bytes]) -> bytes:
    body = b"".join(values)
    return b"A" + _u32.pack(len(body)) + body


def enc_table(items: list[tuple[str, bytes]]) -> bytes:
    return b"F" + table_from_items(items)


def encode_value(value) -> bytes:
    """Encode a value decoded by pamqp back with the type RabbitMQ uses for x-death fields."""
    if isinstance(value, bool):
        return b"t" + bytes((1 if value else 0,))
    if isinstance(value, int):
        return enc_long(value)
    if isinstance(value, (str, bytes)):
        return enc_longstr(value)
    if isinstance(value, datetime.datetime):
        return enc_timestamp(value)
    if isinstance(value, dict):
        return enc_table([(k, encode_value(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return enc_array([encode_value(v) for v in value])
    if value is None:
        return b"V"
    if isinstance(value, float):
        return b"d" + struct.pack(">d", value)
    import decimal
    if isinstance(value, decimal.Decimal):
        exponent = value.as_tuple().exponent
        scale = max(0, -exponent)
        return b"D" + bytes((scale,)) + struct.pack(">i", int(value.scaleb(scale)))
    raise TypeError(f"cannot encode {type(value).__name__} in a field table")


def decode_tagged(raw: bytes):
    """Decode one raw tagged value (as table_items returns it)."""
    return pamqp_decode.embedded_value(raw)[1]
