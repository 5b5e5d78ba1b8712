"""Content-header properties as row columns, both ways (on the codec's one property table and encoder).

The source turns a delivery's raw property bytes (flags + values, as `Delivery.properties_raw`) into the
property columns of the row schema (`to_columns`); `from_columns` is the inverse for one row, and the
reference the sink's column-wise encoder (`sink/columns.py`) is tested against. `headers` become two
columns, `headers` (natural text) and `header_types` (field types), by `headers.py`'s rule; `timestamp`
(AMQP: whole seconds since the epoch) is a Spark timestamp (UTC).
`cluster-id` is deprecated by the spec and is not a column.
"""

from __future__ import annotations

import datetime

from . import headers as header_text
from .codec import properties as amqp_properties
from .codec.properties import PropertyError

_EPOCH = datetime.datetime(1970, 1, 1)


def to_columns(raw: bytes) -> dict:
    """{column: value} for the properties present in `raw`."""
    values = amqp_properties.decode(raw)
    values.pop("cluster_id", None)
    if "timestamp" in values:
        values["timestamp"] = _EPOCH + datetime.timedelta(seconds=values["timestamp"])
    if "headers" in values:
        values["headers"], values["header_types"] = header_text.table_to_columns(values["headers"])
    return values


def from_columns(values: dict) -> bytes:
    """Property bytes from one row's {column: value}; None or a missing column means "not set"."""
    row = {name: value for name, value in values.items() if value is not None}
    types = row.pop("header_types", None)
    if "headers" in row:
        try:
            row["headers"] = header_text.columns_to_table(dict(row["headers"]), dict(types or {}))
        except header_text.HeaderError as exc:
            raise PropertyError(f"property 'headers': {exc}") from None
    return amqp_properties.encode(row)
