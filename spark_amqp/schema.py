"""The row schema of the `amqp` source, which is also what the sink reads (docs/design.md; users: docs/source.md, "Row schema").

Defined once, here: `COLUMNS` lists every column with its type, and the Spark schema (`SCHEMA`, what the
data source reports), the Arrow schema (`ARROW_SCHEMA`, what the reader's record batches carry) and the
column groups the source and the sink use are all derived from it; the sink's own columns, which the source
never fills, are `SINK_ONLY`. Names are AMQP's own property names in snake_case, so a row written by the
sink and read back by the source is the same row.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.types import (BinaryType, BooleanType, IntegerType, LongType, MapType, StringType,
                               StructField, StructType, TimestampType)

from .codec import properties as amqp_properties

# (column, type) in schema order; each type name maps to a Spark and an Arrow type below.
COLUMNS = (
    ("body", "binary"),
    ("exchange", "string"),
    ("routing_key", "string"),
    ("queue", "string"),
    ("delivery_tag", "long"),
    ("redelivered", "boolean"),
    ("content_type", "string"),
    ("content_encoding", "string"),
    ("headers", "map"),
    ("delivery_mode", "int"),
    ("priority", "int"),
    ("correlation_id", "string"),
    ("reply_to", "string"),
    ("expiration", "string"),
    ("message_id", "string"),
    ("timestamp", "timestamp"),
    ("type", "string"),
    ("user_id", "string"),
    ("app_id", "string"),
    ("stream_offset", "long"),
    ("header_types", "map"),
)

_SPARK_TYPES = {
    "binary": BinaryType(), "string": StringType(), "long": LongType(), "boolean": BooleanType(),
    "int": IntegerType(), "timestamp": TimestampType(),
    "map": MapType(StringType(), StringType(), valueContainsNull=True),
}
_ARROW_TYPES = {
    "binary": pa.binary(), "string": pa.string(), "long": pa.int64(), "boolean": pa.bool_(),
    "int": pa.int32(), "timestamp": pa.timestamp("us", tz="UTC"), "map": pa.map_(pa.string(), pa.string()),
}

SCHEMA = StructType([StructField(name, _SPARK_TYPES[kind]) for name, kind in COLUMNS])
ARROW_SCHEMA = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in COLUMNS])
COLUMN_NAMES = tuple(name for name, _ in COLUMNS)

# The AMQP basic properties that are columns, in property-flag order (as on the wire). cluster-id is
# deprecated by the spec (errata) and is not a column.
PROPERTY_COLUMNS = tuple(name for name, _ in amqp_properties.PROPERTIES if name != "cluster_id")
# Columns the source fills that mean nothing to a publish; the sink accepts and ignores them.
SOURCE_ONLY = ("queue", "delivery_tag", "redelivered", "stream_offset")
# Columns only the sink reads (strings; not in the source's rows): `filter_value` is the stream filter value,
# published as the header `x-stream-filter-value` (sink/columns.py).
SINK_ONLY = ("filter_value",)
# Columns the sink publishes; `header_types` types the `headers` values (headers.py).
WRITTEN = ("body", "exchange", "routing_key") + PROPERTY_COLUMNS + ("header_types",) + SINK_ONLY

assert set(WRITTEN) | set(SOURCE_ONLY) == set(COLUMN_NAMES) | set(SINK_ONLY)
