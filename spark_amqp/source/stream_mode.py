"""Stream mode (`queueType=stream`): RabbitMQ stream queues read by offset range, on executors.

A stream keeps its messages; a consumer names where to start (`x-stream-offset`) and every delivery
carries its offset in the header `x-stream-offset`. So a micro-batch is a range of offsets per stream,
and re-running it reads exactly the same rows: there is nothing to ack on behalf of a commit.

Where things run: the driver (`StreamLog`, in the reader's `initialOffset` / `latestOffset` /
`partitions`) only learns where each stream begins and ends. AMQP 0-9-1 has no method that says so, so
it consumes from `first` / `last` / a timestamp and looks at the offsets of the first few deliveries (the
last chunk, for `last`: a few messages, not the stream). The message data is read by `read_range` on the
executors, one connection per partition (`StreamRange`: stream, from, to).

Offsets: `{"stream": next offset to read}` per stream; a batch reads [start, end) of each stream, as
Spark's Kafka source does. RabbitMQ's offsets can have gaps (one hidden offset where a segment rolls), so
a range may hold fewer rows than end - start, and a range whose first offset is gone is data loss only
when more than one offset is missing before the first message read.
"""

from __future__ import annotations

import bisect
import logging
import struct
import time

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition

from ..client import AMQPError, ChannelClosedError, Connection
from ..client.uri import redact
from ..codec.properties import headers_at
from ..options import connect_kwargs
from ..pyspark_versions import ADMISSION_CONTROL, SupportsTriggerAvailableNow, default_read_limit, max_rows
from . import arrow_rows

# PySpark >= 4.2: streaming stream mode needs its admission control (datasource.streamReader refuses it
# before); on 4.0 / 4.1 streams are read by batch reads only.
_READER_BASES: tuple = ((DataSourceStreamReader, SupportsTriggerAvailableNow) if ADMISSION_CONTROL
                        else (DataSourceStreamReader,))

log = logging.getLogger("spark_amqp.source")

# The header every stream delivery carries, as the broker encodes it: shortstr name, then type 'l' (long).
OFFSET_HEADER = b"\x0fx-stream-offsetl"
OFFSET_ENTRY = len(OFFSET_HEADER) + 8          # with its value
# Seconds without a further delivery after which the driver has seen the whole last chunk of a stream.
TAIL_IDLE = 0.2
# Seconds the driver waits for the first delivery of a probe before it takes the stream as empty there.
PROBE_WAIT = 1.0
# Deliveries a probe may receive: the last chunk of a stream (RabbitMQ's chunks hold what one write took).
PROBE_PREFETCH = 5000
# Executors: prefetch of a range read, and seconds without a delivery before a range read fails (the broker
# should be sending the range's messages as fast as it can). A range's record batches are bounded as batch
# reads' are (arrow_rows.ROWS_PER_RECORD_BATCH and JVM_BATCH_BYTES).
RANGE_PREFETCH = 5000
# Offsets one partition reads at most: a backlog of one stream is read by all the executors' cores (a
# range is read at ~100,000 rows/s by one Python worker; a partition's connection costs milliseconds).
MAX_RANGE = 100_000
RANGE_IDLE = 30.0


class StreamDataLossError(RuntimeError):
    """Retention removed offsets a query still had to read (failOnDataLoss=true)."""


def _offset_at(delivery) -> tuple[bytes, int]:
    """(raw properties, where the x-stream-offset entry starts in them)."""
    raw = delivery.properties_raw
    i = raw.rfind(OFFSET_HEADER)
    if i < 0:
        raise ValueError(f"a delivery from '{delivery.routing_key}' has no x-stream-offset header: is the "
                         "queue a stream (x-queue-type=stream)?")
    return raw, i


def offset_of(delivery) -> int:
    """The delivery's stream offset, from its raw content header (no property decoding)."""
    raw, i = _offset_at(delivery)
    return struct.unpack_from(">q", raw, i + len(OFFSET_HEADER))[0]


def split_offsets(deliveries) -> tuple[list[int], list[bytes], bool]:
    """Executor. Per delivery, its stream offset and its property bytes without the x-stream-offset entry
    (then messages of one producer share their property bytes, and a batch decodes them once:
    arrow_rows.to_record_batch puts the entry back); and whether that entry came first in the headers."""
    offsets, stripped = [], []
    shapes: dict[bytes, bytes] = {}     # property bytes less the entry (its table length not yet fixed)
    first = False
    unpack = struct.unpack_from
    for d in deliveries:
        raw, i = _offset_at(d)
        offsets.append(unpack(">q", raw, i + len(OFFSET_HEADER))[0])
        shape = raw[:i] + raw[i + OFFSET_ENTRY:]
        fixed = shapes.get(shape)
        if fixed is None:
            pos = headers_at(raw)           # the entry is in the headers: they are there
            length = struct.unpack_from(">I", raw, pos)[0] - OFFSET_ENTRY
            fixed = shapes[shape] = raw[:pos] + struct.pack(">I", length) + raw[pos + 4:i] + raw[i + OFFSET_ENTRY:]
            first = i == pos + 4
        stripped.append(fixed)
    return offsets, stripped, first


class StreamRange(InputPartition):
    """One partition: offsets [start, end) of one stream (made on the driver, read on an executor)."""

    def __init__(self, stream: str, start: int, end: int):
        super().__init__(None)
        self.stream = stream
        self.start = start
        self.end = end


class StreamLog:
    """Driver: where streams begin and end, learnt over one connection by short consumes."""

    def __init__(self, options):
        self.options = options
        self.conn: Connection | None = None
        self._tails: dict | None = None     # the ends the last probe found (watched_tails)
        self._watches: dict = {}            # per stream: a channel consuming from that end, prefetch 1

    def connection(self) -> Connection:
        if self.conn is None or not self.conn.is_open:
            self.conn = Connection.open(self.options["uri"], **connect_kwargs(self.options))
            ch = self.conn.channel()
            try:
                for stream in self.options["queue"]:
                    ch.queue_declare(stream, passive=True)
            except ChannelClosedError as exc:
                self.close()
                raise RuntimeError(f"stream not found on {redact(self.options['uri'])}: {exc.reply_text} "
                                   "(declare it with x-queue-type=stream first)") from None
            ch.close()
        return self.conn

    def close(self) -> None:
        self._watches = {}
        self._tails = None
        if self.conn is not None:
            try:
                self.conn.close(timeout=1.0)
            except Exception:
                pass
        self.conn = None

    def _probe(self, where, wanted: int, idle: float) -> dict[str, list[int]]:
        """Consume each stream from `where` (an x-stream-offset value) and return the offsets received: up to
        `wanted` per stream, until no delivery came for `idle` seconds (PROBE_WAIT for the first one)."""
        conn = self.connection()
        channels = {}
        for stream in self.options["queue"]:
            ch = conn.channel()
            ch.basic_qos(min(wanted, PROBE_PREFETCH))
            ch.basic_consume(stream, arguments={"x-stream-offset": where})
            channels[stream] = ch
        seen: dict[str, list[int]] = {s: [] for s in channels}
        deadline = time.monotonic() + PROBE_WAIT
        last_arrival = None
        while True:
            got_any = False
            for stream, ch in channels.items():
                if len(seen[stream]) < wanted:
                    got = ch.get_deliveries(wanted - len(seen[stream]), timeout=0.01)
                    if got:
                        got_any = True
                        seen[stream] += [offset_of(d) for d in got]
            now = time.monotonic()
            if got_any:
                last_arrival = now
            if all(len(v) >= wanted for v in seen.values()):
                break
            if last_arrival is None and now > deadline:
                break
            if last_arrival is not None and now - last_arrival > idle and (
                    now > deadline or all(seen.values())):
                break
        _close_quietly(channels.values())
        return seen

    def tails(self) -> dict[str, int | None]:
        """Per stream, the offset after its last message (None: the stream is empty)."""
        seen = self._probe("last", PROBE_PREFETCH, TAIL_IDLE)
        return {s: (max(v) + 1 if v else None) for s, v in seen.items()}

    def watched_tails(self) -> dict[str, int | None]:
        """Driver, every trigger of a stream query: `tails()`, probed again only once a watch (a consumer
        from the end the last probe found, prefetch 1) has received a message, or lost its channel. A probe
        reads the last chunk of every stream and waits TAIL_IDLE for it (PROBE_WAIT on an empty stream):
        probing on every trigger kept an idle query reading the streams' last chunks several times a second.
        A message published between the probe and the watch's start is at or after that end: the watch
        gets it."""
        if self._tails is None or not self._quiet():
            self._tails = self.tails()
            self._watch(self._tails)
        return dict(self._tails)

    def _quiet(self) -> bool:
        """Every stream has a watch, still open, that has received nothing."""
        return len(self._watches) == len(self.options["queue"]) and all(
            ch.is_open and not ch.pending_deliveries for ch in self._watches.values())

    def _watch(self, tails: dict) -> None:
        """Watches from `tails` (offset 0 for an empty stream: its first message wakes it). Without them
        (a channel refused or the connection lost) the next trigger probes again."""
        _close_quietly(self._watches.values())
        self._watches = {}
        try:
            conn = self.connection()
            for stream, tail in tails.items():
                ch = conn.channel()
                self._watches[stream] = ch
                ch.basic_qos(1)
                ch.basic_consume(stream, arguments={"x-stream-offset": tail or 0})
        except AMQPError as exc:
            log.warning("AMQP source: cannot watch the streams' ends (%s); probing them on every trigger", exc)
            self._watches = {}

    def firsts(self) -> dict[str, int | None]:
        """Per stream, the first offset still there (None: the stream is empty)."""
        seen = self._probe("first", 1, 0.0)
        return {s: (v[0] if v else None) for s, v in seen.items()}

    def at_timestamp(self, millis: int) -> dict[str, int | None]:
        """Per stream, the first offset stored at or after `millis` (None: nothing since then)."""
        from datetime import datetime, timezone
        when = datetime.fromtimestamp(millis // 1000, tz=timezone.utc)   # AMQP timestamps are whole seconds
        seen = self._probe(when, 1, 0.0)
        return {s: (v[0] if v else None) for s, v in seen.items()}

    def starting_offsets(self, default: str) -> dict[str, int]:
        """Where a new query or a batch read starts, per stream (options startingTimestamp,
        startingOffsets; `default` when neither is given)."""
        o = self.options
        streams = o["queue"]
        if o.get("startingTimestamp") is not None:
            at = self.at_timestamp(o["startingTimestamp"])
            tails = self.tails() if any(v is None for v in at.values()) else {}
            return {s: at[s] if at[s] is not None else (tails[s] or 0) for s in streams}
        spec = o.get("startingOffsets") or default
        wanted = {s: spec for s in streams} if isinstance(spec, str) else \
            {s: {-2: "earliest", -1: "latest"}.get(spec.get(s, -1), spec.get(s, -1)) for s in streams}
        firsts = self.firsts() if "earliest" in wanted.values() else {}
        tails = self.tails() if "latest" in wanted.values() else {}
        out = {}
        for s, w in wanted.items():
            if w == "earliest":
                out[s] = firsts[s] if firsts[s] is not None else 0
            elif w == "latest":
                out[s] = tails[s] if tails[s] is not None else 0
            else:
                out[s] = int(w)
        return out


def _close_quietly(channels) -> None:
    """Driver: close probe or watch channels; one already gone is closed either way."""
    for ch in channels:
        try:
            ch.close()
        except AMQPError:
            pass


def split_ranges(start: dict, end: dict, min_partitions: int | None) -> list[StreamRange]:
    """Driver. The ranges [start, end) of each stream with new offsets, split so that there are at least
    `min_partitions` partitions (larger ranges get more pieces) and none spans more than MAX_RANGE."""
    spans = {s: end[s] - start.get(s, end[s]) for s in end if end[s] > start.get(s, end[s])}
    total = sum(spans.values())
    parts = []
    for s, span in spans.items():
        pieces = -(-span // MAX_RANGE)
        if min_partitions and total:
            pieces = max(pieces, min(span, -(-min_partitions * span // total)))
        lo = start[s]
        for i in range(pieces):
            hi = end[s] if i == pieces - 1 else lo + span // pieces
            parts.append(StreamRange(s, lo, hi))
            lo = hi
    return parts


def read_range(options, part: StreamRange):
    """Executor. Yields the range's rows as Arrow record batches, read over a connection of its own."""
    conn = Connection.open(options["uri"], **connect_kwargs(options))
    try:
        ch = conn.channel()
        ch.basic_qos(min(RANGE_PREFETCH, max(1, part.end - part.start)))
        ch.basic_consume(part.stream, arguments={"x-stream-offset": part.start})
        checked = False
        while True:
            got = ch.get_deliveries(arrow_rows.ROWS_PER_RECORD_BATCH, timeout=RANGE_IDLE,
                                    max_bytes=arrow_rows.JVM_BATCH_BYTES)
            if not got:
                raise RuntimeError(f"stream '{part.stream}': no message arrived for {RANGE_IDLE:.0f} s while "
                                   f"reading offsets [{part.start}, {part.end})")
            ch.basic_ack(got[-1].delivery_tag, multiple=True)    # credit: streams remove nothing
            offsets, stripped, first = split_offsets(got)
            lo = bisect.bisect_left(offsets, part.start)   # a consumer may start at its chunk's beginning
            hi = bisect.bisect_left(offsets, part.end)
            if not checked and lo < len(offsets):
                checked = True
                _check_loss(options, part, offsets[lo])
            if hi > lo:
                yield arrow_rows.to_record_batch([(part.stream, got[lo:hi])], offsets[lo:hi], stripped[lo:hi],
                                                 first)
            if hi < len(offsets) or (offsets and offsets[-1] >= part.end - 1):
                return
    finally:
        conn.close(timeout=1.0)


def _check_loss(options, part: StreamRange, first: int) -> None:
    """Executor. The first offset read is past the range's start by more than one (gap) offset: retention
    removed what the range had to read."""
    if first <= part.start + 1:
        return
    lost_to = min(first, part.end)
    text = (f"stream '{part.stream}': offsets [{part.start}, {lost_to}) are gone (removed by the stream's "
            f"retention) before this query read them")
    if options.get("failOnDataLoss", True):
        raise StreamDataLossError(text + "; set failOnDataLoss=false to skip them and continue")
    log.warning("AMQP source: %s; skipped (failOnDataLoss=false)", text)


class StreamModeReader(*_READER_BASES):
    """`spark.readStream.format("amqp").option("queueType", "stream")` (PySpark >= 4.2). Offsets are the
    streams' own; `latestOffset(start, limit)` returns where each stream ends now, bounded by
    `maxMessagesPerTrigger` and, under availableNow, by the ends at the run's start."""

    def __init__(self, options):
        self.options = options
        self._log: StreamLog | None = None
        self._until: dict | None = None     # availableNow: the ends when the run started

    def __getstate__(self):
        """Executors get the options only: the driver's connection stays on the driver."""
        return {"options": self.options, "_log": None, "_until": None}

    def _driver(self) -> StreamLog:
        if self._log is None:
            self._log = StreamLog(self.options)
        return self._log

    def initialOffset(self) -> dict:
        """Driver, for a new query: startingTimestamp, startingOffsets, or the streams' ends (`latest`)."""
        return self._driver().starting_offsets("latest")

    def getDefaultReadLimit(self):
        """Driver. `maxMessagesPerTrigger` bounds each batch."""
        return default_read_limit(self.options)

    def prepareForTriggerAvailableNow(self) -> None:
        """Driver, at the start of an availableNow run: read up to where the streams end now."""
        tails = self._driver().tails()
        self._until = {s: t for s, t in tails.items() if t is not None}

    def latestOffset(self, start: dict, limit) -> dict:
        """Driver, every trigger: where the next batch ends per stream."""
        tails = self._driver().watched_tails()
        end = {}
        for s in self.options["queue"]:
            begin = start.get(s)
            tail = tails.get(s)
            if self._until is not None and tail is not None:
                tail = min(tail, self._until.get(s, tail))
            if tail is None:
                end[s] = begin if begin is not None else 0
            else:
                end[s] = tail if begin is None else max(begin, tail)
        most = max_rows(limit)
        return _bounded(start, end, most) if most else end

    def partitions(self, start: dict, end: dict):
        """Driver. The batch's ranges; the rows are read by the executors."""
        return split_ranges(start, end, self.options.get("minPartitions"))

    def read(self, partition: StreamRange):
        """Executor."""
        yield from read_range(self.options, partition)

    def commit(self, end: dict) -> None:
        """Driver. Nothing to ack: a stream keeps its messages; the checkpoint holds the offsets."""

    def stop(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _bounded(start: dict, end: dict, max_rows: int) -> dict:
    """`end` moved back so that the batch spans at most `max_rows` offsets, spread over the streams (a
    stream with fewer new offsets than its share leaves the rest to the others)."""
    want = {s: max(0, end[s] - start.get(s, end[s])) for s in end}
    share = dict.fromkeys(want, 0)
    left = max_rows
    while left > 0:
        open_ = [s for s in want if share[s] < want[s]]
        if not open_:
            break
        each = max(1, left // len(open_))
        for s in open_:
            take = min(each, want[s] - share[s], left)
            share[s] += take
            left -= take
            if left <= 0:
                break
    return {s: start.get(s, end[s]) + share[s] for s in end}   # a stream new to `start` has no share


class StreamBatchReader(DataSourceReader):
    """`spark.read.format("amqp").option("queueType", "stream")`: offsets [startingOffsets, endingOffsets)
    of each stream, read in parallel partitions."""

    def __init__(self, options):
        self.options = options

    def partitions(self):
        """Driver."""
        log_ = StreamLog(self.options)
        try:
            start = log_.starting_offsets("earliest")
            ending = self.options.get("endingOffsets") or "latest"
            tails = log_.tails()
            end = {}
            for s in self.options["queue"]:
                given = ending.get(s, -1) if isinstance(ending, dict) else -1   # "latest" or JSON
                end[s] = (tails[s] or 0) if given == -1 else given
            return split_ranges(start, end, self.options.get("minPartitions"))
        finally:
            log_.close()

    def read(self, partition: StreamRange):
        """Executor."""
        if not isinstance(partition, StreamRange):
            return   # nothing to read: PySpark plans one empty partition of its own
        yield from read_range(self.options, partition)
