"""Spark's floor for the queue-mode source: what Spark alone allows a Python streaming source that hands its
batches over as files, with no broker and no AMQP (bench/read_throughput.py's "floor" drain).

`FloorSource` (`format("amqp_bench_floor")`) serves the same Arrow files in every micro-batch: slices of
rows in the source's own schema, built by the source's own `to_record_batch` from deliveries like those the
benchmark publishes (empty properties), sized as the source sizes a full batch (`batch_shape`), and read on
the executors by the source's own `read_file`. So a floor drain pays what a source drain pays in Spark
(planning, offset and commit logs, tasks, the executors' Python workers, Arrow into the JVM) and nothing
on the AMQP side (the consumer, building the rows, writing the files): source / floor is the share of
Spark's own rate that the connector keeps.

Spark's Python workers import this module by name (it is pickled by reference): `read_throughput.py` puts
this directory on PYTHONPATH before Spark starts. PySpark 4.2 or newer (availableNow for Python sources).
"""

from __future__ import annotations

import os

from pyspark.sql.datasource import DataSource, DataSourceStreamReader
from pyspark.sql.streaming.datasource import ReadAllAvailable, SupportsTriggerAvailableNow

from spark_amqp.client.events import Delivery
from spark_amqp.options import BY_KEY
from spark_amqp.schema import SCHEMA
from spark_amqp.source import arrow_rows
from spark_amqp.source.bounds import DEFAULT_PREFETCH
from spark_amqp.source.handoff import FilePartition, HandoffDir, read_file
from spark_amqp.source.queue_mode import PARTITION_BYTES, ROWS_PER_PARTITION

NAME = "amqp_bench_floor"


def batch_shape(size: int) -> tuple[int, int]:
    """(rows per batch, rows per slice) of a full batch of the source with default options, for bodies of
    `size` bytes: half the default prefetch, and maxBytesPerTrigger of bodies (bounds.bounds);
    slices as `rows_per_slice` cuts them."""
    rows = max(1, min(DEFAULT_PREFETCH // 2, BY_KEY["maxbytespertrigger"].default // size))
    return rows, arrow_rows.slice_rows(rows, rows * size, ROWS_PER_PARTITION, PARTITION_BYTES)


def write_slices(directory: str, size: int) -> tuple[list[str], int]:
    """One full batch's slice files, written by the source's own HandoffDir under `directory`: (their
    paths, rows in the batch)."""
    rows, per_slice = batch_shape(size)
    deliveries = [Delivery(None, "bench", tag, False, "", "bench-floor") for tag in range(1, rows + 1)]
    body = os.urandom(size)
    for d in deliveries:
        d.body = body       # one bytes object shared: the files hold the copies
    slices = map(arrow_rows.to_record_batch, arrow_rows.in_slices([("bench-floor", deliveries)], per_slice))
    return [part.path for part in HandoffDir(directory).write(0, slices)], rows


class FloorSource(DataSource):
    """Options: `files` (comma-separated slice paths), `dir` (their directory), `batches` (how many)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self):
        return SCHEMA

    def streamReader(self, schema):
        return FloorReader(self.options)


class FloorReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Batch N is the same files for every N (driver), read as the source's files are (executors)."""

    def __init__(self, options):
        self.files = options["files"].split(",")
        self.directory = options["dir"]
        self.batches = int(options["batches"])

    def initialOffset(self) -> dict:
        return {"seq": 0}

    def getDefaultReadLimit(self):
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        pass

    def latestOffset(self, start: dict, limit) -> dict:
        """One batch per trigger, as the source plans them."""
        return {"seq": min(int(start["seq"]) + 1, self.batches)}

    def partitions(self, start: dict, end: dict) -> list:
        return [FilePartition(self.directory, path)
                for _ in range(int(start["seq"]), int(end["seq"])) for path in self.files]

    def commit(self, end: dict) -> None:
        pass

    def read(self, partition: FilePartition):
        yield from read_file(partition)
