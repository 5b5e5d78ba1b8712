"""Content-header properties as row columns, both ways (AMQP 0-9-1 section 1.8, basic properties).

The source turns a delivery's raw property bytes (flags + values, as `Delivery.properties_raw`) into the
property columns of the row schema; the sink turns a row's property columns back into property bytes.
`headers` go through `headers.py`'s text rule; `timestamp` (AMQP: seconds since the epoch) is a Spark
timestamp. `cluster-id` is deprecated by the spec and is not a column.
"""

from __future__ import annotations

import datetime
import struct

from . import headers as header_text

# (property, column, kind) in flag order: bit 15 = content-type ... bit 2 = cluster-id.
PROPERTIES = (
    ("content_type", "s"), ("content_encoding", "s"), ("headers", "F"), ("delivery_mode", "o"),
    ("priority", "o"), ("correlation_id", "s"), ("reply_to", "s"), ("expiration", "s"),
    ("message_id", "s"), ("timestamp", "T"), ("type", "s"), ("user_id", "s"), ("app_id", "s"),
    ("cluster_id", "s"),
)
FLAGS = {name: 1 << (15 - i) for i, (name, _) in enumerate(PROPERTIES)}
COLUMNS = tuple(name for name, _ in PROPERTIES if name != "cluster_id")

_u16 = struct.Struct(">H")
_u32 = struct.Struct(">I")
_u64 = struct.Struct(">Q")
_EPOCH = datetime.datetime(1970, 1, 1)


class PropertyError(ValueError):
    """A property value that cannot be sent; the message names the column."""


def decode(raw: bytes) -> dict:
    """{column: value} for the properties present in `raw` (flags word(s) + values)."""
    flags = _u16.unpack_from(raw, 0)[0]
    pos = 2
    while raw[pos - 1] & 1:          # continuation flag words (unused by the basic class): skip
        pos += 2
    out = {}
    if not flags:
        return out
    for name, kind in PROPERTIES:
        if not flags & FLAGS[name]:
            continue
        if kind == "s":
            n = raw[pos]
            value = raw[pos + 1:pos + 1 + n].decode("utf-8", "replace")
            pos += 1 + n
        elif kind == "o":
            value = raw[pos]
            pos += 1
        elif kind == "T":
            seconds = _u64.unpack_from(raw, pos)[0]
            value = _EPOCH + datetime.timedelta(seconds=seconds)
            pos += 8
        else:
            n = _u32.unpack_from(raw, pos)[0]
            value = header_text.table_to_text(raw[pos:pos + 4 + n])
            pos += 4 + n
        if name != "cluster_id":
            out[name] = value
    return out


def encode(values: dict) -> bytes:
    """Property bytes from {column: value}; None or a missing column means "not set"."""
    flags = 0
    parts = []
    for name, kind in PROPERTIES:
        value = values.get(name)
        if value is None:
            continue
        flags |= FLAGS[name]
        if kind == "s":
            raw = str(value).encode("utf-8")
            if len(raw) > 255:
                raise PropertyError(f"column {name!r}: at most 255 bytes, got {len(raw)}")
            parts.append(bytes((len(raw),)) + raw)
        elif kind == "o":
            if not 0 <= int(value) <= 255:
                raise PropertyError(f"column {name!r}: must be 0..255, got {value}")
            parts.append(bytes((int(value),)))
        elif kind == "T":
            parts.append(_u64.pack(_seconds(value)))
        else:
            try:
                parts.append(header_text.text_to_table(dict(value)))
            except header_text.HeaderError as exc:
                raise PropertyError(f"column 'headers': {exc}") from None
    return _u16.pack(flags) + b"".join(parts)


def _seconds(value) -> int:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
        return int((value - _EPOCH).total_seconds())
    if isinstance(value, (int, float)):
        return int(value)
    raise PropertyError(f"column 'timestamp': expected a timestamp, got {type(value).__name__}")
