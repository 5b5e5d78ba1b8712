"""AMQP field tables and field values, kept as raw bytes until someone must read them.

A field table (spec 4.2.5.5; the errata's type letters, which RabbitMQ uses) is a long-uint byte count
followed by (shortstr name, tagged value) pairs. The broker must add `x-death` or drop `BCC` without
changing the bytes of any other header (re-encoding a header decoded by a generic library can change its
field type), so tables are split into (name, raw tagged value) pairs here and joined back unchanged.
Decoding to Python values is pamqp's (`decode_table`, `decode_value`); encoding a Python value picks the
type RabbitMQ itself uses for that kind of value (`encode_value`: int -> long `l`, str -> longstr `S`).
"""

from __future__ import annotations

import datetime
import decimal
import struct

from pamqp import decode as pamqp_decode

# Field type letters (errata: 's' is a signed 16-bit int, 'u' unsigned; RabbitMQ reads them so) and the
# names the connector shows for them in `header_types`.
TYPE_NAMES = {
    b"t": "bool", b"b": "byte", b"B": "ubyte", b"s": "short", b"u": "ushort", b"I": "int", b"i": "uint",
    b"l": "long", b"L": "ulong", b"f": "float", b"d": "double", b"D": "decimal", b"S": "string",
    b"T": "timestamp", b"x": "bytes", b"F": "table", b"A": "array", b"V": "void",
}
TYPE_LETTERS = {name: letter for letter, name in TYPE_NAMES.items()}
FIXED_SIZES = {b"t": 1, b"b": 1, b"B": 1, b"s": 2, b"u": 2, b"I": 4, b"i": 4, b"l": 8, b"L": 8,
               b"f": 4, b"d": 8, b"D": 5, b"T": 8, b"V": 0}
SIZED = (b"S", b"x", b"F", b"A")   # a long-uint byte count follows the letter

_u32 = struct.Struct(">I")
_u64 = struct.Struct(">Q")
_i64 = struct.Struct(">q")


class FieldError(ValueError):
    """A field table or value that cannot be read or written; says what was wrong."""


def value_end(buf: bytes, pos: int) -> int:
    """Position just after the tagged value that starts at `pos` (its type letter)."""
    tag = buf[pos:pos + 1]
    size = FIXED_SIZES.get(tag)
    if size is not None:
        end = pos + 1 + size
    elif tag in SIZED:
        if pos + 5 > len(buf):
            raise FieldError("field value length is truncated")
        end = pos + 5 + _u32.unpack_from(buf, pos + 1)[0]
    else:
        raise FieldError(f"unknown field type {tag!r}")
    if end > len(buf):
        raise FieldError("field value is truncated")
    return end


def table_items(raw: bytes) -> list[tuple[str, bytes]]:
    """A raw field table (with its 4-byte length) as [(name, raw tagged value)], in wire order."""
    if len(raw) < 4:
        raise FieldError("field table length is truncated")
    end = 4 + _u32.unpack_from(raw, 0)[0]
    if end > len(raw):
        raise FieldError("field table is truncated")
    pos = 4
    items = []
    while pos < end:
        n = raw[pos]
        key = raw[pos + 1:pos + 1 + n].decode("utf-8", "replace")
        pos += 1 + n
        after = value_end(raw, pos)
        if after > end:
            raise FieldError("field value runs past the end of its table")
        items.append((key, raw[pos:after]))
        pos = after
    return items


def table_from_items(items) -> bytes:
    """The inverse of `table_items`: a raw field table (with its length) from (name, raw value) pairs."""
    parts = []
    for key, value in items:
        raw_key = key.encode()
        if len(raw_key) > 255:
            raise FieldError(f"field name {key[:40]!r}... is longer than 255 bytes")
        parts += (bytes((len(raw_key),)), raw_key, value)
    body = b"".join(parts)
    return _u32.pack(len(body)) + body


def sorted_items(items) -> list[tuple[str, bytes]]:
    """(name, raw value) pairs as RabbitMQ 4.x keeps a headers table (mc_amqpl's usort): each name once,
    with its first value, sorted by the name's bytes."""
    first: dict[str, bytes] = {}
    for key, value in items:
        first.setdefault(key, value)
    return sorted(first.items(), key=lambda kv: kv[0].encode())


# Deepest nesting of tables and arrays (the outermost counts as 1) decoded into Python values. RabbitMQ
# has no such limit (it answered declare-ok to 18,000 levels), but pamqp decodes recursively and copies
# the rest of the buffer at every level: a 128 KiB frame of nested tables took ~124 MB and ended in a
# RecursionError. At 32 levels pamqp holds at most 32 copies (4 MiB for a 128 KiB frame); real tables
# (client properties, x-arguments, headers) nest two or three deep.
MAX_DEPTH = 32

# pamqp also reads a zero type octet as void (seen in the wild).
_SCAN_FIXED = {**FIXED_SIZES, b"\x00": 0}


def check_depth(buf: bytes, pos: int = 0, max_depth: int = MAX_DEPTH) -> None:
    """Raise FieldError if the field table at `pos` (its 4-byte length) nests tables or arrays deeper than
    `max_depth`. An iterative scan of the raw bytes that allocates nothing, run before pamqp decodes, so a
    deep table is refused without the recursion's memory. Bytes that are malformed in any other way pass:
    pamqp's decoder then says what is wrong, as it did before."""
    n = len(buf)
    if pos + 4 > n:
        return
    ends = [pos + 4 + _u32.unpack_from(buf, pos)[0]]
    in_table = [True]
    pos += 4
    while ends:
        end = ends[-1]
        if pos >= end:
            if pos > end or end > n:
                return
            ends.pop()
            in_table.pop()
            continue
        if pos >= n:
            return
        if in_table[-1]:
            pos += 1 + buf[pos]                  # the field name
            if pos >= end:
                return
        tag = buf[pos:pos + 1]
        size = _SCAN_FIXED.get(tag)
        if size is not None:
            pos += 1 + size
            continue
        if tag not in SIZED or pos + 5 > n:
            return
        length = _u32.unpack_from(buf, pos + 1)[0]
        if tag in (b"F", b"A"):
            if len(ends) >= max_depth:
                raise FieldError(f"field table nested deeper than {max_depth} levels")
            ends.append(pos + 5 + length)
            in_table.append(tag == b"F")
            pos += 5
        else:
            pos += 5 + length


def decode_table(raw: bytes) -> dict:
    """A raw field table (with its length) as a dict of Python values (pamqp's types); FieldError if it
    nests deeper than MAX_DEPTH (see `check_depth`)."""
    check_depth(raw)
    return pamqp_decode.field_table(raw)[1]


def decode_value(raw: bytes):
    """One raw tagged value (as `table_items` gives it) as a Python value; FieldError if it nests deeper
    than MAX_DEPTH."""
    if raw[:1] in (b"F", b"A"):
        # scanned as the only value of a one-entry table, so that arrays are covered too
        check_depth(_u32.pack(len(raw) + 1) + b"\x00" + raw)
    return pamqp_decode.embedded_value(raw)[1]


# --- encoding Python values with RabbitMQ's types ------------------------------------------------

def enc_longstr(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return b"S" + _u32.pack(len(raw)) + raw


def enc_long(value: int) -> bytes:
    if not -(1 << 63) <= value < (1 << 63):
        raise FieldError(f"{value} does not fit a long (signed 64-bit)")
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


def enc_table(items) -> bytes:
    return b"F" + table_from_items(items)


def enc_decimal(value: decimal.Decimal) -> bytes:
    """Decimal (spec 4.2.5.5): scale octet, then the unscaled value as a signed 32-bit integer."""
    if not value.is_finite():
        raise FieldError(f"decimal {value} is not a finite number")
    scale = max(0, -value.as_tuple().exponent)
    if scale > 255:
        raise FieldError(f"decimal scale {scale} is above 255")
    unscaled = int(value.scaleb(scale))
    if not -(1 << 31) <= unscaled < (1 << 31):
        raise FieldError(f"decimal {value} has more digits than a 32-bit unscaled value holds")
    return b"D" + bytes((scale,)) + struct.pack(">i", unscaled)


def encode_value(value) -> bytes:
    """A tagged value for a Python value, with the field type RabbitMQ uses (e.g. for `x-death`)."""
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
    if isinstance(value, decimal.Decimal):
        return enc_decimal(value)
    raise FieldError(f"cannot encode {type(value).__name__} in a field table")


def encode_table(values: dict) -> bytes:
    """A raw field table (with its length) from a dict of Python values (`encode_value`'s types)."""
    return table_from_items([(k, encode_value(v)) for k, v in values.items()])


# --- decoding with the type kept (lossless) ------------------------------------------------------

_SCALARS = {b"b": struct.Struct(">b"), b"B": struct.Struct(">B"), b"s": struct.Struct(">h"),
            b"u": struct.Struct(">H"), b"I": struct.Struct(">i"), b"i": struct.Struct(">I"),
            b"l": struct.Struct(">q"), b"L": struct.Struct(">Q"), b"f": struct.Struct(">f"),
            b"d": struct.Struct(">d"), b"T": struct.Struct(">Q")}
_i32 = struct.Struct(">i")


def decode_table_typed(raw: bytes) -> list[tuple[str, bytes, object]]:
    """A raw field table (with its length) as [(name, type letter, value)], values decoded exactly as sent:
    strings and byte arrays as bytes, timestamps as int seconds, decimals as Decimal with their scale,
    floats as the float the bits hold, nested tables as [(name, letter, value)] and arrays as
    [(letter, value)]. Unlike pamqp's decoder, nothing is guessed (pamqp reads a large timestamp as
    milliseconds), so the value and its letter re-encode to the same bytes."""
    if len(raw) < 4:
        raise FieldError("field table length is truncated")
    end = 4 + _u32.unpack_from(raw, 0)[0]
    if end > len(raw):
        raise FieldError("field table is truncated")
    return _typed_items(raw, 4, end)


def _typed_items(buf: bytes, pos: int, end: int) -> list:
    items = []
    while pos < end:
        n = buf[pos]
        key = buf[pos + 1:pos + 1 + n].decode("utf-8", "replace")
        letter, value, pos = _typed_value(buf, pos + 1 + n, end)
        items.append((key, letter, value))
    return items


def _typed_value(buf: bytes, pos: int, limit: int):
    after = value_end(buf, pos)
    if after > limit:
        raise FieldError("field value runs past the end of its table")
    letter = buf[pos:pos + 1]
    pos += 1
    scalar = _SCALARS.get(letter)
    if scalar is not None:
        return letter, scalar.unpack_from(buf, pos)[0], after
    if letter == b"t":
        return letter, buf[pos] != 0, after
    if letter == b"D":
        return letter, decimal.Decimal(_i32.unpack_from(buf, pos + 1)[0]).scaleb(-buf[pos]), after
    if letter == b"V":
        return letter, None, after
    if letter == b"F":
        return letter, _typed_items(buf, pos + 4, after), after
    if letter == b"A":
        values = []
        p = pos + 4
        while p < after:
            t, v, p = _typed_value(buf, p, after)
            values.append((t, v))
        return letter, values, after
    return letter, bytes(buf[pos + 4:after]), after      # S, x
