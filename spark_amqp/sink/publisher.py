"""The per-task publish loop (runs on executors): one connection, confirms, a bounded window, clear errors.

A task (one partition of one write, or of one micro-batch) does, in `TaskPublisher.run`:

1. open one connection (lazily, at its first row: an empty partition connects to nothing) and one channel,
   `confirm.select` (RabbitMQ's publisher confirms), with at most `publishWindow` unconfirmed messages;
2. publish every row, pipelined (the client blocks only while the window is full);
3. wait for every confirm (`confirmTimeout`) before it returns its commit message: a task that returns has
   had every one of its messages accepted by the broker (for a durable queue and persistent messages,
   written to disk: RabbitMQ confirms persistent messages once they are persisted);
4. fail the task with an error that says what happened on a nack (how many, which exchange), on a
   returned message with `mandatory=true` (exchange and routing key), on a lost connection (how many
   messages were published and confirmed before it), or on a confirm timeout.

With `superStream`, the task finds the super stream's partitions when it opens its connection
(`super_stream.find_partitions`: passive declares, here on the executor, once per task), and publishes each
row through the default exchange `""` with the routing key set to the name of the partition stream its
routing key hashes to (`super_stream.partition_streams`): the row reaches that stream whatever the super
stream's binding keys are. A row with a null routing key fails the task, naming the row.

Delivery is at-least-once: Spark re-runs a failed task, which publishes the partition again. With
`messageId=deterministic`, each row without a `message_id` gets one derived from its position
(`message_id()`), identical in every attempt, so consumers can drop the duplicates.
Errors never contain credentials: the client only formats redacted URIs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

from ..client import (AMQPError, AMQPTimeoutError, ChannelClosedError, Connection, ConnectionClosedError,
                      PublishNackedError, UnroutableError, redact)
from ..options import connect_kwargs
from ..super_stream import SuperStreamNotFound, find_partitions, partition_streams
from .columns import ColumnPlan, RowError, encode_properties, with_filter_values

log = logging.getLogger("spark_amqp.sink")


class SinkError(RuntimeError):
    """A task of the amqp sink could not publish (nack, return, lost connection, timeout, bad value)."""


@dataclass
class Chunk:
    """Rows of one Arrow batch (or of a run of Rows) as column lists, ready to publish."""

    size: int
    bodies: list                    # bytes | None
    exchanges: list | None          # str | None per row, or None when there is no exchange column
    routing_keys: list | None
    properties: dict                # {property column: list of values}; values as columns.encode_properties takes
    filter_values: list | None = None   # str | None per row, or None when there is no filter_value column


@dataclass(frozen=True)
class TaskIdentity:
    """Who publishes: the stable parts of a deterministic message id, and a name for the connection."""

    job: str                 # streaming: the query id; batch write: an id drawn once per write on the driver
    batch: int | None        # streaming: the micro-batch id; batch write: None
    partition: int
    attempt: int = 0

    def message_id_prefix(self) -> str:
        if self.batch is None:
            return f"{self.job}:{self.partition}:"
        return f"{self.job}:{self.batch}:{self.partition}:"

    def describe(self) -> str:
        where = f"batch {self.batch}, " if self.batch is not None else ""
        return f"{where}partition {self.partition}, attempt {self.attempt}"


def message_id(identity: TaskIdentity, row: int) -> str:
    """The deterministic message id of row `row` (0-based, within the task's partition):
    `<query id>:<batch id>:<partition>:<row>` for a stream, `<write id>:<partition>:<row>` for a batch
    write. The same in every attempt of the task, so a consumer can drop the copies a retry sends."""
    return identity.message_id_prefix() + str(row)


class TaskPublisher:
    """Publishes one task's rows. Not thread-safe; one per task (created in `write`)."""

    def __init__(self, options, plan: ColumnPlan, identity: TaskIdentity):
        self.options = options
        self.plan = plan
        self.identity = identity
        self.default_exchange = options.get("exchange") or ""
        self.default_routing_key = options.get("routingKey") or ""
        self.mandatory = bool(options.get("mandatory"))
        self.confirm_timeout = float(options["confirmTimeout"])      # options.parse gives every default
        self.window = int(options["publishWindow"])
        self.deterministic = options.get("messageId") == "deterministic"
        self.filter_value = options.get("filterValue")
        self.super_stream = options.get("superStream")
        self.partitions: list[str] | None = None     # with superStream: found in _open
        self.uri = options["uri"]
        self.published = 0
        self.confirmed = 0
        self.exchanges_seen: dict[str, None] = {}
        self._conn: Connection | None = None
        self._channel = None

    # ------------------------------------------------------------------------------------- lifecycle

    def _open(self) -> None:
        opts = self.options
        name = f"spark-amqp sink {self.identity.job} {self.identity.describe()}"
        try:
            self._conn = Connection.open(self.uri, client_properties={"connection_name": name},
                                         **connect_kwargs(opts))
            if self.super_stream:
                self.partitions = find_partitions(self._conn, opts)
            self._channel = self._conn.channel()
            self._channel.confirm_select(window=self.window)
        except SuperStreamNotFound as exc:
            self.close()
            raise SinkError(f"amqp sink ({self.identity.describe()}): {exc}") from None
        except AMQPError as exc:
            self.close()
            raise SinkError(f"amqp sink ({self.identity.describe()}): cannot open a publishing channel "
                            f"to {redact(self.uri)}: {exc}") from None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close(timeout=2.0)
            except Exception:  # never hide the task's own error behind a failed close
                pass
            self._conn = None
            self._channel = None

    # ------------------------------------------------------------------------------------ publishing

    def run(self, chunks: Iterable[Chunk]) -> int:
        """Publish every chunk, wait for all confirms, close; returns the number of messages published."""
        started = time.monotonic()
        try:
            for chunk in chunks:
                if chunk.size:
                    self._publish_chunk(chunk)
            if self._channel is not None:
                self._wait_confirms()
        except AMQPError as exc:
            raise self._explain(exc) from None
        finally:
            self.close()
        if self.published:
            log.info("amqp sink %s: %d message(s) published and confirmed in %.3f s", self.identity.describe(),
                     self.published, time.monotonic() - started)
        return self.published

    def _wait_confirms(self) -> None:
        self._channel.wait_for_confirms(timeout=self.confirm_timeout)
        self.confirmed = self.published

    def _publish_chunk(self, chunk: Chunk) -> None:
        if self._channel is None:
            self._open()
        n = chunk.size
        first = self.published
        bodies = chunk.bodies
        props = chunk.properties
        if self.deterministic:
            ids = props.get("message_id")
            prefix = self.identity.message_id_prefix()
            if ids is None:
                ids = [prefix + str(first + i) for i in range(n)]
            else:
                ids = [v if v is not None else prefix + str(first + i) for i, v in enumerate(ids)]
            props = {**props, "message_id": ids}
        filter_values = [self.filter_value] * n if self.filter_value is not None else chunk.filter_values
        if filter_values is not None:
            props = with_filter_values(props, filter_values, n)
        try:
            encoded = encode_properties(props, n, first) if props else None
        except RowError as exc:
            raise SinkError(f"amqp sink ({self.identity.describe()}): {exc}") from None
        ex_default, rk_default = self.default_exchange, self.default_routing_key
        exchanges, keys = chunk.exchanges, chunk.routing_keys
        if self.partitions is not None:
            keys, rk_default = self._partition_streams(keys, first)
        publish = self._channel.publish
        mandatory = self.mandatory
        timeout = self.confirm_timeout
        empty = b""
        done = 0   # a local counter (cheaper than an attribute per message); self.published in `finally`
        try:
            if exchanges is None:
                self.exchanges_seen.setdefault(ex_default)
            if exchanges is None and keys is None:
                # The common case (the benchmark's): every row to the same exchange and routing key.
                # publish_many writes 64 messages at a time; slices keep `done` accurate if it fails.
                publish_many = self._channel.publish_many
                for start in range(0, n, 1024):
                    done += publish_many(ex_default, rk_default, bodies[start:start + 1024],
                                         None if encoded is None else encoded[start:start + 1024],
                                         mandatory, timeout)
                return
            if encoded is None:
                encoded = [b"\x00\x00"] * n
            if exchanges is None:
                exchanges = [None] * n
            if keys is None:
                keys = [None] * n
            seen = self.exchanges_seen
            for body, ex, rk, p in zip(bodies, exchanges, keys, encoded):
                if ex is None:
                    ex = ex_default
                elif ex not in seen and len(seen) < 10:
                    seen[ex] = None
                if rk is None:
                    rk = rk_default
                try:
                    publish(ex, rk, body if body is not None else empty, p, mandatory, timeout)
                except ValueError as exc:  # a name longer than 255 bytes (AMQP shortstr)
                    raise SinkError(f"amqp sink ({self.identity.describe()}): row {first + done}: "
                                    f"exchange or routing_key: {exc}") from None
                done += 1
        finally:
            self.published = first + done

    def _partition_streams(self, keys: list | None, first: int) -> tuple[list | None, str]:
        """With superStream: (the partition stream of each row, or None when the option routingKey gives one
        key to all; the partition stream of the option's key)."""
        if keys is None:
            return None, partition_streams([self.default_routing_key], self.partitions)[0]
        if None in keys:
            raise SinkError(
                f"amqp sink ({self.identity.describe()}): row {first + keys.index(None)} has a null "
                f"'routing_key' column; with superStream={self.super_stream!r} each row goes to the partition "
                "its routing key hashes to, so every row needs one: fill the column (e.g. coalesce(...)), "
                "filter those rows out, or set the option routingKey")
        return partition_streams(keys, self.partitions), ""

    # ----------------------------------------------------------------------------------------- errors

    def _exchanges(self) -> str:
        names = [repr(e) + (" (the default exchange)" if e == "" else "") for e in self.exchanges_seen]
        return ", ".join(names) if names else repr(self.default_exchange)

    def _explain(self, exc: AMQPError) -> SinkError:
        who = f"amqp sink ({self.identity.describe()})"
        if isinstance(exc, PublishNackedError):
            return SinkError(
                f"{who}: the broker nacked {exc.nacked} of {exc.published} message(s) published to exchange "
                f"{self._exchanges()}: it refused them (e.g. a queue with x-overflow=reject-publish is at its "
                f"x-max-length or x-max-length-bytes). The task fails so that Spark retries it; delivery is "
                f"at-least-once")
        if isinstance(exc, UnroutableError):
            return SinkError(
                f"{who}: {exc.count} message(s) could not be routed and came back (mandatory=true): "
                f"{exc.reply_code} {exc.reply_text}: exchange {exc.exchange!r}, routing key "
                f"{exc.routing_key!r}: no queue is bound to that exchange with that key")
        unconfirmed = self._unconfirmed()
        progress = (f"{self.published} message(s) published in this task, "
                    f"{self.published - unconfirmed} of them confirmed by the broker")
        if isinstance(exc, AMQPTimeoutError):
            return SinkError(f"{who}: {exc} ({progress}; confirmTimeout={self.confirm_timeout} s)")
        if isinstance(exc, ChannelClosedError):
            return SinkError(f"{who}: the broker closed the publishing channel: {exc} (exchange "
                             f"{self._exchanges()}; {progress})")
        if isinstance(exc, ConnectionClosedError):
            return SinkError(f"{who}: the connection to {redact(self.uri)} failed while publishing: {exc} "
                             f"({progress}; the task fails so that Spark retries it)")
        return SinkError(f"{who}: {exc} ({progress})")

    def _unconfirmed(self) -> int:
        try:
            return self._channel.unconfirmed if self._channel is not None else 0
        except Exception:
            return 0


# ------------------------------------------------------------------------------------ chunk sources


def arrow_chunks(plan: ColumnPlan, batches: Iterator) -> Iterator[Chunk]:
    """Chunks from pyarrow RecordBatches (the Arrow writer's input): columns converted in bulk."""
    import pyarrow as pa

    for batch in batches:
        n = batch.num_rows
        if not n:
            continue
        body = batch.column(plan.body)
        if pa.types.is_string(body.type):
            body = body.cast(pa.binary())
        elif pa.types.is_large_string(body.type):
            body = body.cast(pa.large_binary())
        props = {}
        for name, i in plan.properties:
            col = batch.column(i)
            if name == "timestamp":
                unit = {"s": 1, "ms": 1000, "us": 1_000_000, "ns": 1_000_000_000}[col.type.unit]
                values = col.cast(pa.int64()).to_pylist()
                props[name] = [v // unit if v is not None else None for v in values] if unit != 1 else values
            else:
                props[name] = col.to_pylist()
        yield Chunk(
            size=n,
            bodies=body.to_pylist(),
            exchanges=batch.column(plan.exchange).to_pylist() if plan.exchange is not None else None,
            routing_keys=batch.column(plan.routing_key).to_pylist() if plan.routing_key is not None else None,
            properties=props,
            filter_values=batch.column(plan.filter_value).to_pylist() if plan.filter_value is not None else None,
        )


def row_chunks(plan: ColumnPlan, rows: Iterator, size: int = 10_000) -> Iterator[Chunk]:
    """Chunks from Spark Rows (the row writer's input), `size` rows at a time."""
    import itertools

    from ..codec.properties import epoch_seconds

    while True:
        block = list(itertools.islice(rows, size))
        if not block:
            return
        bodies = [r[plan.body] for r in block]
        if plan.body_is_string:
            bodies = [b.encode("utf-8") if b is not None else None for b in bodies]
        props = {}
        for name, i in plan.properties:
            values = [r[i] for r in block]
            if name == "timestamp":
                # Spark hands Python a naive datetime in the worker's local time zone.
                values = [(int(v.timestamp()) if v.tzinfo is None else epoch_seconds(v)) if v is not None
                          else None for v in values]
            props[name] = values
        yield Chunk(
            size=len(block),
            bodies=bodies,
            exchanges=[r[plan.exchange] for r in block] if plan.exchange is not None else None,
            routing_keys=[r[plan.routing_key] for r in block] if plan.routing_key is not None else None,
            properties=props,
            filter_values=[r[plan.filter_value] for r in block] if plan.filter_value is not None else None,
        )
