"""AMQP header tables as `map<string,string>`: a documented, lossless text rule, both ways.

The rule (the README's "Header values" table says the same):

- A string (`S`, valid UTF-8) is its text, unchanged: `"EUR"` stays `EUR`.
- Every other field type is its value's text followed by `::` and the type's name:
  `42::long`, `7::int`, `true::bool`, `1.5::double`, `0.25::float`, `3.14::decimal`,
  `2024-05-01T12:00:00Z::timestamp`, `aGk=::bytes` (base64), `1::byte`, `1::short`, `1::ubyte`,
  `1::ushort`, `1::uint`; a nested table or array is JSON whose values follow the same rule, then
  `::table` / `::array`: `{"a":"1::long","b":"x"}::table`.
- Void (`V`) is a null map value.
- A string that itself ends in `::<one of those names>` gets `::string` appended, so it cannot be
  mistaken for a typed value; a string that is not valid UTF-8 is `<base64>::longstr-base64`.

Reading turns each header into that text; writing parses it back into the same field type (the same
type letter), so a row read by the source and written by the sink publishes the same header bytes.
Strings, the common case, read as themselves and can be compared and cast as they are.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import re
import struct

# AMQP 0-9-1 field types as RabbitMQ reads them (errata: 's' is a signed 16-bit int, not a shortstr).
TYPE_NAMES = {
    b"t": "bool", b"b": "byte", b"B": "ubyte", b"s": "short", b"u": "ushort", b"I": "int", b"i": "uint",
    b"l": "long", b"f": "float", b"d": "double", b"D": "decimal", b"T": "timestamp", b"x": "bytes",
    b"F": "table", b"A": "array",
}
TYPE_LETTERS = {name: letter for letter, name in TYPE_NAMES.items()}
TYPE_LETTERS["string"] = b"S"
TYPE_LETTERS["longstr-base64"] = b"S"
_SUFFIX = re.compile(r"::(" + "|".join(sorted(TYPE_LETTERS, key=len, reverse=True)) + r")\Z")

_INTS = {b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H", b"I": ">i", b"i": ">I", b"l": ">q"}
_FLOATS = {b"f": ">f", b"d": ">d"}
_u32 = struct.Struct(">I")


class HeaderError(ValueError):
    """A header value that does not follow the rule; the message names the header."""


# --- reading: raw field table -> {name: text} --------------------------------------------------

def table_to_text(raw: bytes) -> dict[str, str | None]:
    """A raw field table (with its 4-byte length prefix) as an ordered {name: text or None}."""
    out: dict[str, str | None] = {}
    for key, tag, value, _ in _items(raw, 4, 4 + _u32.unpack_from(raw, 0)[0]):
        out[key] = _scalar_text(tag, value, raw) if tag not in (b"F", b"A", b"V") else (
            None if tag == b"V" else _nested_text(tag, value))
    return out


def _items(buf: bytes, pos: int, end: int):
    """Yield (key, tag, decoded value, end) for each entry of a table body in buf[pos:end]."""
    while pos < end:
        n = buf[pos]
        key = buf[pos + 1:pos + 1 + n].decode("utf-8", "replace")
        pos += 1 + n
        tag, value, pos = _value(buf, pos)
        yield key, tag, value, pos


def _value(buf: bytes, pos: int):
    tag = buf[pos:pos + 1]
    pos += 1
    if tag in _INTS:
        fmt = _INTS[tag]
        size = struct.calcsize(fmt)
        return tag, struct.unpack_from(fmt, buf, pos)[0], pos + size
    if tag in _FLOATS:
        fmt = _FLOATS[tag]
        size = struct.calcsize(fmt)
        return tag, struct.unpack_from(fmt, buf, pos)[0], pos + size
    if tag == b"t":
        return tag, buf[pos] != 0, pos + 1
    if tag == b"D":
        scale = buf[pos]
        unscaled = struct.unpack_from(">i", buf, pos + 1)[0]
        return tag, decimal.Decimal(unscaled).scaleb(-scale), pos + 5
    if tag == b"T":
        return tag, struct.unpack_from(">Q", buf, pos)[0], pos + 8
    if tag in (b"S", b"x"):
        n = _u32.unpack_from(buf, pos)[0]
        return tag, bytes(buf[pos + 4:pos + 4 + n]), pos + 4 + n
    if tag == b"V":
        return tag, None, pos
    if tag == b"F":
        n = _u32.unpack_from(buf, pos)[0]
        return tag, [(k, t, v) for k, t, v, _ in _items(buf, pos + 4, pos + 4 + n)], pos + 4 + n
    if tag == b"A":
        n = _u32.unpack_from(buf, pos)[0]
        end = pos + 4 + n
        values = []
        p = pos + 4
        while p < end:
            t, v, p = _value(buf, p)
            values.append((t, v))
        return tag, values, end
    raise HeaderError(f"unknown AMQP field type {tag!r}")


def _scalar_text(tag: bytes, value, _buf=None) -> str:
    if tag == b"S":
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode() + "::longstr-base64"
        return text + "::string" if _SUFFIX.search(text) else text
    name = TYPE_NAMES[tag]
    if tag == b"t":
        return ("true" if value else "false") + "::bool"
    if tag == b"x":
        return base64.b64encode(value).decode() + "::bytes"
    if tag == b"T":
        stamp = datetime.datetime.fromtimestamp(value, tz=datetime.timezone.utc)
        return stamp.strftime("%Y-%m-%dT%H:%M:%SZ") + "::timestamp"
    if tag == b"D":
        return f"{value:f}::decimal"
    return f"{value!r}::{name}" if tag in _FLOATS else f"{value}::{name}"


def _nested_text(tag: bytes, value) -> str:
    return json.dumps(_nested(tag, value), ensure_ascii=False, separators=(",", ":")) + "::" + TYPE_NAMES[tag]


def _nested(tag: bytes, value):
    if tag == b"F":
        return {k: _nested(t, v) for k, t, v in value}
    if tag == b"A":
        return [_nested(t, v) for t, v in value]
    if tag == b"V":
        return None
    return _scalar_text(tag, value)


# --- writing: {name: text} -> raw field table ----------------------------------------------------

def text_to_table(headers: dict) -> bytes:
    """The inverse of table_to_text: a raw field table (with length prefix) from {name: text or None}."""
    body = b"".join(_entry(k, v) for k, v in headers.items())
    return _u32.pack(len(body)) + body


def _entry(key, text) -> bytes:
    raw_key = str(key).encode("utf-8")
    if len(raw_key) > 255:
        raise HeaderError(f"header name {str(key)[:40]!r}... is longer than 255 bytes")
    try:
        value = _encode_text(text)
    except HeaderError as exc:
        raise HeaderError(f"header {key!r}: {exc}") from None
    return bytes((len(raw_key),)) + raw_key + value


def _encode_text(text) -> bytes:
    if text is None:
        return b"V"
    if not isinstance(text, str):
        raise HeaderError(f"value must be a string or null, not {type(text).__name__}")
    m = _SUFFIX.search(text)
    if m is None:
        raw = text.encode("utf-8")
        return b"S" + _u32.pack(len(raw)) + raw
    name, body = m.group(1), text[:m.start()]
    try:
        return _encode_typed(name, body)
    except HeaderError:
        raise
    except (ValueError, TypeError, struct.error, decimal.InvalidOperation, json.JSONDecodeError) as exc:
        raise HeaderError(f"cannot read {text[:60]!r} as {name}: {exc}") from None


def _encode_typed(name: str, body: str) -> bytes:
    if name == "string":
        raw = body.encode("utf-8")
        return b"S" + _u32.pack(len(raw)) + raw
    if name == "longstr-base64":
        raw = base64.b64decode(body, validate=True)
        return b"S" + _u32.pack(len(raw)) + raw
    letter = TYPE_LETTERS[name]
    if letter in _INTS:
        return letter + struct.pack(_INTS[letter], int(body))
    if letter in _FLOATS:
        return letter + struct.pack(_FLOATS[letter], float(body))
    if letter == b"t":
        if body not in ("true", "false"):
            raise HeaderError(f"a bool is true or false, not {body!r}")
        return b"t" + (b"\x01" if body == "true" else b"\x00")
    if letter == b"D":
        d = decimal.Decimal(body)
        sign, digits, exponent = d.as_tuple()
        scale = max(0, -exponent)
        if scale > 255:
            raise HeaderError(f"decimal scale {scale} is above 255")
        return b"D" + bytes((scale,)) + struct.pack(">i", int(d.scaleb(scale)))
    if letter == b"T":
        stamp = datetime.datetime.strptime(body, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
        return b"T" + struct.pack(">Q", int(stamp.timestamp()))
    if letter == b"x":
        raw = base64.b64decode(body, validate=True)
        return b"x" + _u32.pack(len(raw)) + raw
    if letter == b"F":
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise HeaderError("a ::table value must be a JSON object")
        inner = b"".join(_entry(k, _json_text(v)) for k, v in doc.items())
        return b"F" + _u32.pack(len(inner)) + inner
    if letter == b"A":
        doc = json.loads(body)
        if not isinstance(doc, list):
            raise HeaderError("an ::array value must be a JSON array")
        inner = b"".join(_encode_text(_json_text(v)) for v in doc)
        return b"A" + _u32.pack(len(inner)) + inner
    raise HeaderError(f"unknown type name {name!r}")


def _json_text(v):
    """Nested JSON values: strings follow the text rule; objects and arrays recurse."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":")) + "::table"
    if isinstance(v, list):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":")) + "::array"
    if isinstance(v, bool):
        return ("true" if v else "false") + "::bool"
    if isinstance(v, int):
        return f"{v}::long"
    if isinstance(v, float):
        return f"{v!r}::double"
    raise HeaderError(f"unsupported JSON value {v!r}")
