"""Deliveries to Arrow record batches in the row schema, and batches to bytes and back (Arrow IPC).

The driver builds one record batch per micro-batch and ships it to an executor inside the InputPartition;
`read()` only deserializes it. Property decoding is cached by the raw property bytes: messages of one
producer usually share their properties exactly, so most batches decode a handful of distinct headers.
"""

from __future__ import annotations

import pyarrow as pa

from .. import properties as props

ARROW_SCHEMA = pa.schema([
    ("body", pa.binary()),
    ("exchange", pa.string()),
    ("routing_key", pa.string()),
    ("queue", pa.string()),
    ("delivery_tag", pa.int64()),
    ("redelivered", pa.bool_()),
    ("content_type", pa.string()),
    ("content_encoding", pa.string()),
    ("headers", pa.map_(pa.string(), pa.string())),
    ("delivery_mode", pa.int32()),
    ("priority", pa.int32()),
    ("correlation_id", pa.string()),
    ("reply_to", pa.string()),
    ("expiration", pa.string()),
    ("message_id", pa.string()),
    ("timestamp", pa.timestamp("us", tz="UTC")),
    ("type", pa.string()),
    ("user_id", pa.string()),
    ("app_id", pa.string()),
    ("stream_offset", pa.int64()),
])

_PROPERTY_COLUMNS = props.COLUMNS    # content_type ... app_id, in schema order
_EMPTY: dict = {}


def to_record_batch(deliveries_by_queue: list[tuple[str, list]]) -> pa.RecordBatch:
    """One record batch from [(queue name, [Delivery, ...]), ...], rows in that order."""
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
                values = props.decode(raw) if raw != b"\x00\x00" else _EMPTY
                if len(cache) < 4096:
                    cache[raw] = values
            decoded.append(values)
    n = len(bodies)
    columns = {
        "body": pa.array(bodies, pa.binary()),
        "exchange": pa.array(exchanges, pa.string()),
        "routing_key": pa.array(keys, pa.string()),
        "queue": pa.array(queues, pa.string()),
        "delivery_tag": pa.array(tags, pa.int64()),
        "redelivered": pa.array(redelivered, pa.bool_()),
        "stream_offset": pa.nulls(n, pa.int64()),
    }
    for name in _PROPERTY_COLUMNS:
        field = ARROW_SCHEMA.field(name)
        if len(cache) == 1 and not next(iter(cache.values())):   # no properties at all: all null
            columns[name] = pa.nulls(n, field.type)
            continue
        values = [v.get(name) for v in decoded]
        if name == "headers":
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
