"""The row schema of the `amqp` source, which is also what the sink reads (DESIGN.md, "Row schema").

Names are AMQP's own property names in snake_case; a row written by the sink and read back by the source
is the same row.
"""

from __future__ import annotations

from pyspark.sql.types import (BinaryType, BooleanType, IntegerType, LongType, MapType, StringType,
                               StructField, StructType, TimestampType)

SCHEMA = StructType([
    StructField("body", BinaryType()),
    StructField("exchange", StringType()),
    StructField("routing_key", StringType()),
    StructField("queue", StringType()),
    StructField("delivery_tag", LongType()),
    StructField("redelivered", BooleanType()),
    StructField("content_type", StringType()),
    StructField("content_encoding", StringType()),
    StructField("headers", MapType(StringType(), StringType(), valueContainsNull=True)),
    StructField("delivery_mode", IntegerType()),
    StructField("priority", IntegerType()),
    StructField("correlation_id", StringType()),
    StructField("reply_to", StringType()),
    StructField("expiration", StringType()),
    StructField("message_id", StringType()),
    StructField("timestamp", TimestampType()),
    StructField("type", StringType()),
    StructField("user_id", StringType()),
    StructField("app_id", StringType()),
    StructField("stream_offset", LongType()),
])

COLUMN_NAMES = tuple(f.name for f in SCHEMA.fields)
