"""Deliveries to Arrow record batches in the row schema, and batches to bytes and back (Arrow IPC).

The driver builds one record batch per micro-batch and ships it to an executor inside the InputPartition;
`read()` only deserializes it. Property decoding is cached by the raw property bytes: messages of one
producer usually share their properties exactly, so most batches decode a handful of distinct headers.
"""

from __future__ import annotations

import pyarrow as pa

from .. import properties as props
from ..codec.properties import EMPTY as EMPTY_PROPERTIES
from ..schema import ARROW_SCHEMA, PROPERTY_COLUMNS

_EMPTY: dict = {}


def to_record_batch(deliveries_by_queue: list[tuple[str, list]],
                    stream_offsets: list[int] | None = None) -> pa.RecordBatch:
    """One record batch from [(queue name, [Delivery, ...]), ...], rows in that order; `stream_offsets`,
    one per row, fills the `stream_offset` column (stream mode; null in queue mode)."""
    bodies, exchanges, keys, queues, tags, redelivered = [], [], [], [], [], []
    decoded = []
    cache: dict[bytes, dict] = {}
    for queue, deliveries in deliveries_by_queue:
        bodies += [d.body for d in deliveries]
        exchanges += [d.exchange for d in deliveries]
        keys += [d.routing_key for d in deliveries]
        queues += [queue] * len(deliveries)
        tags += [d.delivery_tag for d in deliveries]
        redelivered += [d.redelivered for d in deliveries]
        for d in deliveries:
            raw = d.properties_raw
            values = cache.get(raw)
            if values is None:
                values = props.to_columns(raw) if raw != EMPTY_PROPERTIES else _EMPTY
                if len(cache) < 4096:
                    cache[raw] = values
            decoded.append(values)
    n = len(bodies)
    columns = {
        "body": pa.array(bodies, pa.binary()),
        "exchange": pa.array(exchanges, pa.string()),
        "routing_key": pa.array(keys, pa.string()),
        "queue": pa.array(queues, pa.string()),
        # Stream mode: no tag (nothing is acked on a row's behalf, and a re-read must give the same rows).
        "delivery_tag": pa.array(tags, pa.int64()) if stream_offsets is None else pa.nulls(n, pa.int64()),
        "redelivered": pa.array(redelivered, pa.bool_()),
        "stream_offset": pa.nulls(n, pa.int64()) if stream_offsets is None else pa.array(stream_offsets, pa.int64()),
    }
    for name in PROPERTY_COLUMNS:
        field = ARROW_SCHEMA.field(name)
        if len(cache) == 1 and not next(iter(cache.values())):   # no properties at all: all null
            columns[name] = pa.nulls(n, field.type)
            if name == "headers":
                columns["header_types"] = pa.nulls(n, field.type)
            continue
        values = [v.get(name) for v in decoded]
        if name == "headers":
            columns["header_types"] = pa.array(
                [None if v.get("header_types") is None else list(v["header_types"].items()) for v in decoded],
                ARROW_SCHEMA.field("header_types").type)
            values = [None if h is None else list(h.items()) for h in values]
        columns[name] = pa.array(values, field.type)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)


def serialize(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def deserialize(data: bytes) -> list[pa.RecordBatch]:
    return list(pa.ipc.open_stream(pa.py_buffer(data)))
