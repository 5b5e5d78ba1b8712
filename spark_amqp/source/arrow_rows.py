"""Deliveries to Arrow record batches in the row schema, and batches to bytes and back (Arrow IPC).

The driver builds one record batch per micro-batch and ships it to an executor inside the InputPartition;
`read()` only deserializes it. Property decoding is cached by the raw property bytes: messages of one
producer usually share their properties exactly, so most batches decode a handful of distinct headers.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from .. import properties as props
from ..codec.properties import EMPTY as EMPTY_PROPERTIES
from ..schema import ARROW_SCHEMA, PROPERTY_COLUMNS

_EMPTY: dict = {}
# A slice may exceed its bounds by this fraction rather than leave a small remainder to a task of its own.
SLICE_SLACK = 0.125
# Bytes of one record batch that an executor's Python worker hands to Spark's JVM, at most about. The JVM
# allocates each batch's Arrow buffers afresh, and whole slices of 8,192 x 4 KB bodies (a 32 MiB buffer,
# presumably at glibc's largest mmap threshold, so mapped and unmapped each time) cost it twice the system
# CPU. Floor drains of 250,000 x 4 KB (bench/spark_floor.py), four rounds alternating: whole slices 5.1-5.9
# us of the JVM's system CPU per row and 195-202 MB/s; 2,048 rows a batch (8 MiB) 2.3-2.9 us and 210-231
# MB/s; 4,096 (16 MiB) 2.5-2.6 us. The source end to end (same case, embedded broker, three rounds
# alternating): the JVM's CPU per row 27.4, 20.0, 14.7 -> 21.0, 16.5, 14.4 us, the rate unchanged (116,
# 109, 134 -> 116, 109, 135 MB/s: there the driver's build is the slower step). Batches of 100-byte
# messages (50,000 rows, about 10 MB) go whole.
JVM_BATCH_BYTES = 16 * 2**20
# Rows of one record batch an executor reads off a connection (batch reads, stream ranges), at most: with
# JVM_BATCH_BYTES, whichever bound comes first ends the batch.
ROWS_PER_RECORD_BATCH = 10_000


def to_record_batch(deliveries_by_queue: list[tuple[str, list]],
                    stream_offsets: list[int] | None = None,
                    stream_properties: list[bytes] | None = None, offset_first: bool = False) -> pa.RecordBatch:
    """One record batch from [(queue name, [Delivery, ...]), ...], rows in that order.

    Stream mode: `stream_offsets`, one per row, fills the `stream_offset` column (null in queue mode), and
    `stream_properties` are the rows' property bytes without their `x-stream-offset` header (which differs
    on every delivery, so that the decoding cache would never hit); the header is put back into `headers`
    (first if `offset_first`, else last) as the broker delivered it."""
    bodies, exchanges, keys, queues, tags, redelivered = [], [], [], [], [], []
    decoded = []
    cache: dict[bytes, dict] = {}
    raws = iter(stream_properties) if stream_properties is not None else None
    for queue, deliveries in deliveries_by_queue:
        bodies += [d.body for d in deliveries]
        exchanges += [d.exchange for d in deliveries]
        keys += [d.routing_key for d in deliveries]
        queues += [queue] * len(deliveries)
        tags += [d.delivery_tag for d in deliveries]
        redelivered += [d.redelivered for d in deliveries]
        for d in deliveries:
            raw = d.properties_raw if raws is None else next(raws)
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
    # One producer's messages usually share their properties: then every column is one value repeated.
    shared = next(iter(cache.values())) if len(cache) == 1 else None
    for name in PROPERTY_COLUMNS:
        if name == "headers":
            continue
        field = ARROW_SCHEMA.field(name)
        if shared is not None:
            value = shared.get(name)
            columns[name] = pa.nulls(n, field.type) if value is None else pa.array([value] * n, field.type)
        else:
            columns[name] = pa.array([v.get(name) for v in decoded], field.type)
    if shared is not None and stream_properties is not None:
        columns["headers"], columns["header_types"] = _shared_with_offset(
            shared.get("headers") or {}, shared.get("header_types") or {}, stream_offsets, offset_first)
        return pa.RecordBatch.from_arrays([columns[f.name] for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)
    if shared is not None:
        h, t = shared.get("headers"), shared.get("header_types")
        headers = [None if h is None else list(h.items())] * n
        types = [None if t is None else list(t.items())] * n
    else:
        headers = [None if v.get("headers") is None else list(v["headers"].items()) for v in decoded]
        types = [None if v.get("header_types") is None else list(v["header_types"].items()) for v in decoded]
    if stream_properties is not None:
        headers = _with_offset(headers, [str(o) for o in stream_offsets], offset_first)
        types = _with_offset(types, ["long"] * n, offset_first)
    columns["headers"] = pa.array(headers, ARROW_SCHEMA.field("headers").type)
    columns["header_types"] = pa.array(types, ARROW_SCHEMA.field("header_types").type)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)


def _shared_with_offset(headers: dict, types: dict, offsets: list[int], first: bool):
    """Stream mode, every row with the same other headers: the `headers` and `header_types` map columns
    built by Arrow (each row: those headers, and x-stream-offset first or last), no Python per row."""
    n, k = len(offsets), len(headers)
    order = np.empty((n, k + 1), dtype=np.int64)       # row r's entries, as indices into `values` below
    at = 0 if first else k
    others = [c for c in range(k + 1) if c != at]
    order[:, others] = np.arange(k)
    order[:, at] = k + np.arange(n)
    order = pa.array(order.reshape(-1))
    map_offsets = pa.array(np.arange(0, n * (k + 1) + 1, k + 1, dtype=np.int32))
    keys = pa.concat_arrays([pa.array(list(headers), pa.string()),
                             pa.array(["x-stream-offset"] * n, pa.string())]).take(order)
    texts = pa.concat_arrays([pa.array(list(headers.values()), pa.string()),
                              pa.array(offsets, pa.int64()).cast(pa.string())]).take(order)
    kinds = pa.concat_arrays([pa.array([types.get(name) for name in headers], pa.string()),
                              pa.array(["long"] * n, pa.string())]).take(order)
    return (pa.MapArray.from_arrays(map_offsets, keys, texts, ARROW_SCHEMA.field("headers").type),
            pa.MapArray.from_arrays(map_offsets, keys, kinds, ARROW_SCHEMA.field("header_types").type))


def _with_offset(items: list, texts: list, first: bool) -> list:
    """Each row's header items with ("x-stream-offset", text) put back (stream mode)."""
    if first:
        return [[("x-stream-offset", t), *(i or ())] for i, t in zip(items, texts)]
    return [[*(i or ()), ("x-stream-offset", t)] for i, t in zip(items, texts)]


def rows_per_slice(batch: pa.RecordBatch, max_rows: int, max_body_bytes: int) -> int:
    """Rows per slice of `batch` so that a slice holds at most `max_rows` rows and about `max_body_bytes`
    of bodies (by the batch's mean body size), the slices evenly sized: each slice is one Spark task, and a
    task costs ~0.1 s however few its rows (local[2], measured), so a remainder of a few rows must not get
    a task of its own (16,384 x 4 KB under 16 MiB made four slices of 4,092 rows and one of 16)."""
    return slice_rows(batch.num_rows, batch.column(ARROW_SCHEMA.get_field_index("body")).nbytes, max_rows,
                      max_body_bytes)


def slice_rows(n: int, body_bytes: int, max_rows: int, max_body_bytes: int) -> int:
    """`rows_per_slice` for `n` rows holding `body_bytes` of bodies in all (before they are a batch)."""
    most = max(1, min(max_rows, n if body_bytes <= max_body_bytes else max_body_bytes * n // body_bytes))
    if n <= most:
        return max(1, n)
    slices = math.ceil(n / most - SLICE_SLACK)     # at least 1: n > most
    return -(-n // slices)


def in_slices(deliveries_by_queue: list[tuple[str, list]], rows: int):
    """[(queue name, [Delivery, ...]), ...] in runs of `rows` rows (the last may be shorter), each in the
    same form and rows in the same order: a batch's slices, built one at a time."""
    run, left = [], rows
    for queue, deliveries in deliveries_by_queue:
        at = 0
        while at < len(deliveries):
            part = deliveries[at:at + left]
            run.append((queue, part))
            at += len(part)
            left -= len(part)
            if not left:
                yield run
                run, left = [], rows
    if run:
        yield run


def in_jvm_batches(batches):
    """Executor: the record batches of the iterable `batches`, each cut into zero-copy slices of at most
    about JVM_BATCH_BYTES (evenly sized, at least a row each), rows in the same order: what the Python
    worker hands to Spark's JVM."""
    for batch in batches:
        if batch.nbytes <= JVM_BATCH_BYTES:
            yield batch
            continue
        rows = -(-batch.num_rows // -(-batch.nbytes // JVM_BATCH_BYTES))
        for offset in range(0, batch.num_rows, rows):
            yield batch.slice(offset, rows)


def filesystem(path: str) -> tuple[pafs.FileSystem, str, bool]:
    """(filesystem, path within it, whether it is local) for a local path or any URI pyarrow's
    filesystems reach (`file://`, `s3://`, `hdfs://`, `gs://`)."""
    fs, root = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
    return fs, root, isinstance(fs, pafs.LocalFileSystem)


def write(sink, batch: pa.RecordBatch) -> None:
    """`batch` as an Arrow IPC stream into `sink` (a file object, or a pyarrow output stream), with no copy
    of the whole in between (the journal's 100,000 x 100 B batch: 9-17 ms into a file, against 25-99 ms
    serialized first)."""
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)


def serialize(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    write(sink, batch)
    return sink.getvalue().to_pybytes()


def deserialize(data: bytes) -> list[pa.RecordBatch]:
    return list(pa.ipc.open_stream(pa.py_buffer(data)))


def concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of `batches` (same schema), in order: a batch filled part by part, or read back
    from its parts' journal files. One batch is returned as it is."""
    if len(batches) == 1:
        return batches[0]
    combined = pa.Table.from_batches(batches).combine_chunks().to_batches()
    return combined[0] if combined else batches[0]
