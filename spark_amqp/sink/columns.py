"""Which DataFrame column becomes which part of an AMQP message, checked once on the driver.

`plan(schema, options)` runs when the writer is created (on the driver, while the query is planned), so a
DataFrame the sink cannot write fails the query at its start with an error that says what to change, not
in a task after half the rows were published:

- `body` is required, `binary` or `string` (a string is sent as its UTF-8 bytes; a null body is an empty
  body);
- `exchange` and `routing_key` (`string`) route each row where the options `exchange` and `routingKey` are
  not given; an option given overrides its column, as the `topic` option of Spark's Kafka sink overrides
  the `topic` column (a row read from queue `q` carries routing_key 'q': written with
  `.option("routingKey", "out")` it goes to "out", not back to `q`). A null value, or neither column nor
  option: the default exchange `""`, key `""`;
- with the option `superStream`, the routing key (column or option; required, never null) chooses the
  partition stream (`spark_amqp.super_stream`), and an `exchange` column is ignored;
- `filter_value` (`string`, optional; the option `filterValue` overrides it) is the stream filter value,
  merged into the row's headers as `x-stream-filter-value` (`with_filter_values`); a null sets nothing;
- the property columns (AMQP 0-9-1 section 1.8, basic properties): `content_type`, `content_encoding`,
  `correlation_id`, `reply_to`, `expiration`, `message_id`, `type`, `user_id`, `app_id` (`string`, at
  most 255 bytes), `delivery_mode` and `priority` (an integer type, 0..255), `timestamp` (`timestamp` or
  `timestamp_ntz`, whole seconds since the epoch on the wire), `headers` (`map<string,string>`) and,
  optionally, `header_types` (`map<string,string>`: each header's AMQP field type, by `spark_amqp.headers`'
  rule; a header without one is a string); a null is "not set";
- the source-only columns `queue`, `delivery_tag`, `redelivered` and `stream_offset` are accepted and
  ignored, so a row read by the source can be written unchanged;
- any other column is an error that lists them, unless `ignoreUnknownColumns=true`.

Names match case-insensitively, as Spark resolves columns by default.

The module also turns a chunk of rows (column-wise Python lists, from an Arrow batch or from Rows) into
what `Channel.publish` takes: the per-message property bytes are built column by column with the codec's
per-kind encoders, giving the same bytes `spark_amqp.properties.from_columns` gives for one row (tested
against it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from pyspark.sql.types import (BinaryType, ByteType, IntegerType, LongType, MapType, ShortType, StringType,
                               StructType, TimestampNTZType, TimestampType)

from .. import headers as header_text
from ..codec import properties as amqp_properties
from ..codec.properties import FLAG, KIND, PropertyError
from ..schema import PROPERTY_COLUMNS, SINK_ONLY, SOURCE_ONLY, WRITTEN
from ..super_stream import FILTER_VALUE_HEADER

OCTET_PROPERTIES = tuple(n for n in PROPERTY_COLUMNS if KIND[n] == "o")    # delivery_mode, priority

_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
_u16 = struct.Struct(">H")


class SinkSchemaError(ValueError):
    """The DataFrame cannot be written by the amqp sink: says which column and what is expected."""


def expected_type(name: str) -> str:
    if name == "body":
        return "binary or string"
    if name in OCTET_PROPERTIES:
        return "int (any integer type; values 0..255)"
    if name == "timestamp":
        return "timestamp (or timestamp_ntz)"
    if name in ("headers", "header_types"):
        return "map<string,string>"
    return "string"


def _type_ok(name: str, dt) -> bool:
    if name == "body":
        return isinstance(dt, (BinaryType, StringType))
    if name in OCTET_PROPERTIES:
        return isinstance(dt, _INTEGRAL)
    if name == "timestamp":
        return isinstance(dt, (TimestampType, TimestampNTZType))
    if name in ("headers", "header_types"):
        return (isinstance(dt, MapType) and isinstance(dt.keyType, StringType)
                and isinstance(dt.valueType, StringType))
    return isinstance(dt, StringType)


@dataclass(frozen=True)
class ColumnPlan:
    """Where each written column is in the input schema (an index), or None when absent. Pickled to tasks."""

    body: int
    body_is_string: bool
    exchange: int | None
    routing_key: int | None
    properties: tuple = ()          # ((column name, index), ...) in flag order
    filter_value: int | None = None
    ignored: tuple = ()             # names of columns present but not written
    names: tuple = field(default=())  # every input column name, in order

    def index(self, name: str) -> int | None:
        for n, i in self.properties:
            if n == name:
                return i
        return None


def plan(schema: StructType, options) -> ColumnPlan:
    """Check the DataFrame's schema against the sink's columns; raise `SinkSchemaError` if unusable."""
    names = [f.name for f in schema.fields]
    by_name: dict[str, int] = {}
    duplicates = []
    for i, name in enumerate(names):
        key = name.lower()
        if key in by_name:
            duplicates.append(name)
        by_name.setdefault(key, i)
    if duplicates:
        raise SinkSchemaError(f"the amqp sink got duplicate column(s) {', '.join(map(repr, duplicates))}; "
                              f"columns: {', '.join(names)}")
    if "body" not in by_name:
        raise SinkSchemaError(
            "the amqp sink needs a column 'body' (binary or string) holding the message body; the "
            f"DataFrame's columns are: {', '.join(names) or '(none)'}. E.g. "
            "df.selectExpr(\"to_json(struct(*)) AS body\") or df.withColumnRenamed('value', 'body')")
    unknown = [n for n in names if n.lower() not in WRITTEN and n.lower() not in SOURCE_ONLY]
    if unknown and not options.get("ignoreUnknownColumns"):
        raise SinkSchemaError(
            f"unknown column(s) for the amqp sink: {', '.join(map(repr, unknown))}. It writes body "
            f"(required), exchange, routing_key, the property columns {', '.join(PROPERTY_COLUMNS)}, "
            f"header_types and {', '.join(SINK_ONLY)} "
            f"(and ignores the source-only columns {', '.join(SOURCE_ONLY)}). Select only those columns, "
            "or set .option('ignoreUnknownColumns', 'true')")
    wrong = []
    for name in WRITTEN:
        i = by_name.get(name)
        if i is not None and not _type_ok(name, schema.fields[i].dataType):
            wrong.append(f"column {names[i]!r} has type {schema.fields[i].dataType.simpleString()}, "
                         f"expected {expected_type(name)}")
    if wrong:
        raise SinkSchemaError("the amqp sink cannot write " + "; ".join(wrong) +
                              " (cast it, e.g. col('priority').cast('int'), or drop it)")
    super_stream = options.get("superStream")
    if super_stream and "routing_key" not in by_name and options.get("routingKey") is None:
        raise SinkSchemaError(
            f"the amqp sink with superStream={super_stream!r} publishes each row to the partition its routing "
            "key hashes to, but there is no 'routing_key' column and the option 'routingKey' is not set. Add "
            "a routing_key column (e.g. df.withColumn('routing_key', col('customer_id'))), or set "
            ".option('routingKey', ...) to send every row to one partition")
    if (not super_stream and "exchange" not in by_name and not options.get("exchange")
            and "routing_key" not in by_name and options.get("routingKey") is None):
        raise SinkSchemaError(
            "the amqp sink has nowhere to send the rows: no 'exchange' or 'routing_key' column and neither "
            "the option 'exchange' nor 'routingKey' is set, so every message would go to the default "
            "exchange with an empty routing key and be dropped. Set .option('routingKey', '<queue>') to "
            "publish to a queue, or .option('exchange', '<exchange>')")
    return ColumnPlan(
        body=by_name["body"],
        body_is_string=isinstance(schema.fields[by_name["body"]].dataType, StringType),
        exchange=None if options.get("exchange") is not None or super_stream else by_name.get("exchange"),
        routing_key=None if options.get("routingKey") is not None else by_name.get("routing_key"),
        properties=tuple((n, by_name[n]) for n in PROPERTY_COLUMNS + ("header_types",) if n in by_name),
        filter_value=None if options.get("filterValue") is not None else by_name.get("filter_value"),
        ignored=tuple(n for n in names if n.lower() not in WRITTEN or super_stream and n.lower() == "exchange"),
        names=tuple(names),
    )


# ------------------------------------------------------------------ per-chunk encoding (executors)


class RowError(ValueError):
    """A value of one row that cannot be published; the message names the column and the row."""


def encode_properties(props: dict, n: int, first_row: int = 0) -> list[bytes]:
    """Property bytes for each of `n` rows from {column: list of n values} (None = not set).

    Values as `to_python` gives them: str for the string properties, int for delivery_mode/priority,
    int seconds or a datetime for timestamp, an ordered {name: text} (or list of pairs) for headers, and
    under "header_types" the rows' {name: type} maps (or None: every header a string).
    Same bytes as `spark_amqp.properties.from_columns` of each row's values.
    """
    encoded = []   # (flag, [bytes | None] * n) in flag order
    for name in PROPERTY_COLUMNS:
        values = props.get(name)
        if values is None:
            continue
        if name == "headers":   # each row's headers with its types: (headers, types or None)
            types = props.get("header_types") or [None] * n
            values = [(v, t) if v is not None else None for v, t in zip(values, types)]
            encode = _table
        else:
            encode = amqp_properties.ENCODERS[KIND[name]]
        try:
            col = [encode(v) if v is not None else None for v in values]
        except (PropertyError, header_text.HeaderError):
            raise _row_error(name, values, encode, first_row) from None
        encoded.append((FLAG[name], col))
    if not encoded:
        return [amqp_properties.EMPTY] * n
    if len(encoded) == 1:
        flag, col = encoded[0]
        head = _u16.pack(flag)
        return [head + v if v is not None else amqp_properties.EMPTY for v in col]
    out = []
    append = out.append
    pack = _u16.pack
    for i in range(n):
        flags = 0
        parts = []
        for flag, col in encoded:
            v = col[i]
            if v is not None:
                flags |= flag
                parts.append(v)
        append(pack(flags) + b"".join(parts))
    return out


def with_filter_values(props: dict, values: list, n: int) -> dict:
    """`props` (as `encode_properties` takes them) with each row's stream filter value (a str, or None:
    nothing set) merged into its headers as `x-stream-filter-value`, replacing a value the headers had, and
    published as a string (a `header_types` entry for it is dropped)."""
    headers = props.get("headers") or [None] * n
    types = props.get("header_types")
    merged = []
    for h, v in zip(headers, values):
        if v is not None:
            h = dict(h) if h is not None else {}
            h[FILTER_VALUE_HEADER] = v
        merged.append(h)
    out = {**props, "headers": merged}
    if types is not None:
        out["header_types"] = [{k: t for k, t in dict(ts).items() if k != FILTER_VALUE_HEADER}
                               if ts is not None and v is not None else ts for ts, v in zip(types, values)]
    return out


def _table(value_and_types) -> bytes:
    value, types = value_and_types
    return header_text.columns_to_table(value if isinstance(value, dict) else dict(value),
                                        types if types is None or isinstance(types, dict) else dict(types))


_HINTS = {"delivery_mode": " (1 = transient, 2 = persistent)"}


def _row_error(name: str, values: list, encode, first_row: int) -> RowError:
    """The error for the first row of a column whose value cannot be encoded (found again, row by row:
    only on the error path)."""
    for i, v in enumerate(values):
        if v is None:
            continue
        try:
            encode(v)
        except PropertyError as exc:
            return RowError(f"column {name!r} of row {first_row + i} {exc}{_HINTS.get(name, '')}")
        except header_text.HeaderError as exc:
            return RowError(f"column {name!r} of row {first_row + i}: {exc}")
    return RowError(f"column {name!r}: a value cannot be encoded")
