"""AMQP header tables as two `map<string,string>` columns, both ways: `headers` holds each value's natural
text, so that SQL can use it (`CAST(headers['retries'] AS INT)`), and `header_types` holds each value's
AMQP field type, so that nothing is lost: a row read by the source and written by the sink publishes the
same header bytes.

Text of each field type (docs/source.md's "Header values" table says the same):

| field type (letter) and its name in `header_types`                  | text in `headers`                    |
|----------------------------------------------------------------------|--------------------------------------|
| `string` (S)                                                         | the string                           |
| a string (S) that is not UTF-8: `longstr-base64`                     | base64                               |
| `byte` b, `ubyte` B, `short` s, `ushort` u, `int` I, `uint` i, `long` l, `ulong` L | decimal: `42`          |
| `float` f, `double` d                                                | Python's repr: `1.5`                 |
| `decimal` D                                                          | plain decimal, scale kept: `3.140`   |
| `bool` t                                                             | `true` / `false`                     |
| `timestamp` T                                                        | ISO-8601 UTC: `2024-05-01T12:00:00Z` (seconds past year 9999: the number) |
| `bytes` x                                                            | base64                               |
| `table` F, `array` A                                                 | JSON (below)                         |
| `void` V                                                             | null                                 |

Nested tables and arrays are JSON: integers, floats and booleans as JSON's own numbers and booleans, void
as null, every other value as its text above (a JSON string). Their `header_types` entry is `table` or
`array` when every nested value has the default type of its JSON kind (string: string, integer: long,
other number: double, boolean: bool, null: void); otherwise it is the JSON tree of the nested types, e.g.
`[{"count":"long","time":"timestamp",...}]` for RabbitMQ's `x-death`.

Writing, a header with no type (no `header_types` column, or no entry for that name) is published as a
string, and a null value as void.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import struct

from .codec import fields

STRING, VOID, TABLE, ARRAY = "string", "void", "table", "array"
LONGSTR_BASE64 = "longstr-base64"
TYPE_NAMES = tuple(fields.TYPE_NAMES.values()) + (LONGSTR_BASE64,)
_LETTERS = {**fields.TYPE_LETTERS, LONGSTR_BASE64: b"S"}
_INTS = {b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H", b"I": ">i", b"i": ">I", b"l": ">q", b"L": ">Q"}
_FLOATS = {b"f": ">f", b"d": ">d"}
_u32 = struct.Struct(">I")
_u64 = struct.Struct(">Q")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_ISO = "%Y-%m-%dT%H:%M:%SZ"


class HeaderError(ValueError):
    """A header value that cannot be read or written; the message names the header and its type."""


# --- reading: raw field table -> ({name: text}, {name: type}) -------------------------------------

def table_to_columns(raw: bytes) -> tuple[dict, dict]:
    """The `headers` and `header_types` values of a raw field table (with its 4-byte length)."""
    texts: dict[str, str | None] = {}
    types: dict[str, str] = {}
    for key, letter, value in fields.decode_table_typed(raw):
        if letter == b"F" or letter == b"A":
            doc, tree = _nested(letter, value)
            texts[key] = _json(doc)
            types[key] = fields.TYPE_NAMES[letter] if tree == _default_tree(doc) else _json(tree)
        else:
            texts[key], types[key] = _scalar_text(letter, value)
    return texts, types


def _scalar_text(letter: bytes, value) -> tuple[str | None, str]:
    """(text, type name) of a scalar field value."""
    if letter == b"S":
        try:
            return value.decode("utf-8"), STRING
        except UnicodeDecodeError:
            return base64.b64encode(value).decode(), LONGSTR_BASE64
    name = fields.TYPE_NAMES[letter]
    if letter == b"V":
        return None, name
    if letter == b"t":
        return ("true" if value else "false"), name
    if letter == b"x":
        return base64.b64encode(value).decode(), name
    if letter == b"T":
        try:
            return (_EPOCH + datetime.timedelta(seconds=value)).strftime(_ISO), name
        except OverflowError:      # past year 9999: the seconds themselves
            return str(value), name
    if letter == b"D":
        return f"{value:f}", name
    return (repr(value) if letter in _FLOATS else str(value)), name


def _nested(letter: bytes, value):
    """(JSON-able value, type tree) of a field value inside a table or an array."""
    if letter == b"F":
        pairs = [(k, _nested(t, v)) for k, t, v in value]
        return {k: d for k, (d, _) in pairs}, {k: t for k, (_, t) in pairs}
    if letter == b"A":
        pairs = [_nested(t, v) for t, v in value]
        return [d for d, _ in pairs], [t for _, t in pairs]
    text, name = _scalar_text(letter, value)
    if letter in _INTS:
        return int(text), name
    if letter in _FLOATS and math.isfinite(value):
        return value, name
    if letter == b"t":
        return value, name
    return text, name


def _json(doc) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def _default_tree(doc):
    """The type tree the writer assumes for nested JSON that has no tree of its own."""
    if isinstance(doc, dict):
        return {k: _default_tree(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_default_tree(v) for v in doc]
    if doc is None:
        return VOID
    if isinstance(doc, bool):
        return "bool"
    if isinstance(doc, int):
        return "long"
    if isinstance(doc, float):
        return "double"
    return STRING


# --- writing: ({name: text}, {name: type}) -> raw field table ----------------------------------------

def columns_to_table(texts: dict, types: dict | None = None) -> bytes:
    """The inverse of `table_to_columns`: a raw field table (with its length) from the two maps."""
    types = types or {}
    parts = []
    for key, text in texts.items():
        raw_key = str(key).encode("utf-8")
        if len(raw_key) > 255:
            raise HeaderError(f"header name {str(key)[:40]!r}... is longer than 255 bytes")
        kind = types.get(key)
        try:
            value = _encode(text, kind)
        except HeaderError as exc:
            raise HeaderError(f"header {key!r}: {exc}") from None
        except (ValueError, TypeError, struct.error, decimal.InvalidOperation, OverflowError) as exc:
            raise HeaderError(f"header {key!r}: cannot read {str(text)[:60]!r} as "
                              f"{kind if kind and len(kind) < 40 else 'its type'}: {exc}") from None
        parts += (bytes((len(raw_key),)), raw_key, value)
    body = b"".join(parts)
    return _u32.pack(len(body)) + body


def _encode(text, kind: str | None) -> bytes:
    if kind is None or kind == "":
        kind = VOID if text is None else STRING
    if kind[:1] in ("{", "["):                       # a type tree: a table or array with typed values
        tree = json.loads(kind)
        return _encode_nested(json.loads(text), tree) if text is not None else b"V"
    if kind not in _LETTERS:
        raise HeaderError(f"unknown header type {kind[:60]!r}; the types are {', '.join(TYPE_NAMES)}, or a "
                          "JSON tree of them for a table or an array")
    if kind in (TABLE, ARRAY):
        doc = json.loads(text)
        if not isinstance(doc, dict if kind == TABLE else list):
            raise HeaderError(f"a {kind} is a JSON {'object' if kind == TABLE else 'array'}, not {text[:60]!r}")
        return _encode_nested(doc, _default_tree(doc))
    if text is None:
        if kind == VOID:
            return b"V"
        raise HeaderError(f"a null value cannot be a {kind} (use the type void)")
    if not isinstance(text, str):
        raise HeaderError(f"value must be a string or null, not {type(text).__name__}")
    return _encode_scalar(kind, text)


def _encode_scalar(kind: str, text: str) -> bytes:
    letter = _LETTERS[kind]
    if kind == LONGSTR_BASE64:
        raw = base64.b64decode(text, validate=True)
        return b"S" + _u32.pack(len(raw)) + raw
    if letter == b"S":
        raw = text.encode("utf-8")
        return b"S" + _u32.pack(len(raw)) + raw
    if letter in _INTS:
        return letter + struct.pack(_INTS[letter], int(text))
    if letter in _FLOATS:
        return letter + struct.pack(_FLOATS[letter], float(text))
    if letter == b"t":
        if text not in ("true", "false"):
            raise HeaderError(f"a bool is true or false, not {text[:60]!r}")
        return b"t" + (b"\x01" if text == "true" else b"\x00")
    if letter == b"D":
        return fields.enc_decimal(decimal.Decimal(text))
    if letter == b"T":
        if text.isdigit():         # whole seconds since the epoch
            return b"T" + _u64.pack(int(text))
        stamp = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.timezone.utc)
        delta = stamp - _EPOCH
        return b"T" + _u64.pack(delta.days * 86400 + delta.seconds)
    if letter == b"x":
        raw = base64.b64decode(text, validate=True)
        return b"x" + _u32.pack(len(raw)) + raw
    if letter == b"V":
        return b"V"
    raise HeaderError(f"a {kind} is written from JSON, not {text[:60]!r}")


def _encode_nested(doc, tree) -> bytes:
    if isinstance(tree, dict):
        if not isinstance(doc, dict):
            raise HeaderError(f"expected a JSON object for {_json(tree)[:60]}, got {_json(doc)[:60]}")
        items = [(k, _encode_nested(v, tree.get(k, _default_tree(v)))) for k, v in doc.items()]
        return fields.enc_table(items)
    if isinstance(tree, list):
        if not isinstance(doc, list):
            raise HeaderError(f"expected a JSON array for {_json(tree)[:60]}, got {_json(doc)[:60]}")
        types = tree if len(tree) == len(doc) else [_default_tree(v) for v in doc]
        return fields.enc_array([_encode_nested(v, t) for v, t in zip(doc, types)])
    if doc is None:
        return b"V"
    if tree in (TABLE, ARRAY):
        return _encode_nested(doc, _default_tree(doc))
    if tree not in _LETTERS:
        raise HeaderError(f"unknown header type {str(tree)[:60]!r}")
    if isinstance(doc, bool):
        doc = "true" if doc else "false"
    return _encode_scalar(tree, doc if isinstance(doc, str) else repr(doc) if isinstance(doc, float) else str(doc))
