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

Super streams (`superStream`): the streams are the super stream's partitions, found on the driver when the
query starts and looked for again at every trigger (`StreamLog.refresh`); a partition found later joins
the offsets at its first offset, so nothing routed to it before is skipped. Stream filtering
(`streamFilter`): executors ask the broker to skip chunks without the values and drop the other rows of
the chunks it sends (`RowFilter`); how a filtered range still ends is `_read_filtered`'s docstring.
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
from ..super_stream import find_partitions, stream_exists
from ..pyspark_versions import ADMISSION_CONTROL, SupportsTriggerAvailableNow, default_read_limit, max_rows
from . import arrow_rows
from .stream_filter import RowFilter, filter_value

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
# Executors, filtered range reads: seconds without a delivery after which the rest of the range is read
# unfiltered (the broker sends nothing for chunks it skips, so silence cannot tell "done" from "slow"; a
# safety net: the range's last chunk is made to match, see _read_filtered).
FILTER_IDLE = 1.0


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
    """Driver: where streams begin and end, learnt over one connection by short consumes. `streams` are
    the streams read: options['queue'], or a super stream's partitions (found at the first connection,
    extended by `refresh`); the options are never changed."""

    def __init__(self, options):
        self.options = options
        self.streams: list[str] = list(options.get("queue") or [])
        self.conn: Connection | None = None
        self._tails: dict | None = None     # the ends the last probe found (watched_tails)
        self._watches: dict = {}            # per stream: a channel consuming from that end, prefetch 1
        self._found_now = False             # find_partitions ran on this trigger's connection

    def connection(self) -> Connection:
        if self.conn is None or not self.conn.is_open:
            self.conn = Connection.open(self.options["uri"], **connect_kwargs(self.options))
            if self.options.get("superStream") and not self.streams:
                try:
                    self.streams = find_partitions(self.conn, self.options)
                except Exception:
                    self.close()
                    raise
                self._found_now = True
                return self.conn
            ch = self.conn.channel()
            try:
                for stream in self.streams:
                    ch.queue_declare(stream, passive=True)
            except ChannelClosedError as exc:
                self.close()
                raise RuntimeError(f"stream not found on {redact(self.options['uri'])}: {exc.reply_text} "
                                   "(declare it with x-queue-type=stream first)") from None
            ch.close()
        return self.conn

    def stream_names(self) -> list[str]:
        """The streams read (a super stream's partitions once the connection has found them)."""
        self.connection()
        return self.streams

    def refresh(self) -> list[str]:
        """Driver, every trigger: a super stream's partitions, with any added since the last trigger. By
        the naming convention the next name (`NAME-<count>`) is declared passively, one declare a trigger
        while none appears; listed partitions (`superStreamPartitions`) are fixed."""
        conn = self.connection()
        o = self.options
        if o.get("superStream") and not o.get("superStreamPartitions") and not self._found_now:
            while stream_exists(conn, f"{o['superStream']}-{len(self.streams)}"):
                self.streams.append(f"{o['superStream']}-{len(self.streams)}")
                log.info("AMQP source: super stream '%s' has a new partition %s", o["superStream"],
                         self.streams[-1])
        self._found_now = False
        return self.streams

    def close(self) -> None:
        self._watches = {}
        self._tails = None
        if self.conn is not None:
            try:
                self.conn.close(timeout=1.0)
            except Exception:
                pass
        self.conn = None

    def _probe(self, where, wanted: int, idle: float, streams=None) -> dict[str, list[int]]:
        """Consume each stream (`streams`, default all) from `where` (an x-stream-offset value) and return
        the offsets received: up to `wanted` per stream, until no delivery came for `idle` seconds
        (PROBE_WAIT for the first one). Never filtered: probes find where streams end."""
        conn = self.connection()
        channels = {}
        for stream in self.streams if streams is None else streams:
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
        return len(self._watches) == len(self.streams) and all(
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

    def firsts(self, streams=None) -> dict[str, int | None]:
        """Per stream (of `streams`, default all), the first offset still there (None: the stream is
        empty)."""
        seen = self._probe("first", 1, 0.0, streams)
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
        streams = self.stream_names()
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
        keep = RowFilter.of(options)
        if keep is None:
            yield from _consume(conn, options, part, _Progress(part))
        else:
            yield from _read_filtered(conn, options, part, keep)
    finally:
        conn.close(timeout=1.0)


class _Progress:
    """Executor: how far a range read has got. `seen`: the highest offset of the range the broker has
    accounted for (sent, or skipped as a chunk without the filter's values); rows are emitted only past it,
    so a second consumer over the same offsets emits nothing twice."""

    def __init__(self, part: StreamRange):
        self.seen = part.start - 1
        self.done = False           # the broker sent an offset at or past the range's last one
        self.checked = False        # the range's first offset was checked for retention's losses


def _consume(conn, options, part: StreamRange, progress: _Progress, idle: float | None = None,
             arguments=None, keep=None):
    """Executor. One consumer from `progress.seen + 1`, yielding the range's rows past `progress.seen` (those
    `keep` keeps) as record batches, until an offset at or past the range's end arrives (`progress.done`).
    No delivery for `idle` seconds: return (the caller reads on); without `idle`, fail after RANGE_IDLE
    (the broker should be sending the range as fast as it can)."""
    frm = progress.seen + 1
    ch = conn.channel()
    try:
        ch.basic_qos(min(RANGE_PREFETCH, max(1, part.end - frm)))
        ch.basic_consume(part.stream, arguments={"x-stream-offset": frm, **(arguments or {})})
        while True:
            got = ch.get_deliveries(arrow_rows.ROWS_PER_RECORD_BATCH, timeout=idle or RANGE_IDLE,
                                    max_bytes=arrow_rows.JVM_BATCH_BYTES)
            if not got:
                if idle:
                    return
                raise RuntimeError(f"stream '{part.stream}': no message arrived for {RANGE_IDLE:.0f} s while "
                                   f"reading offsets [{part.start}, {part.end})")
            ch.basic_ack(got[-1].delivery_tag, multiple=True)    # credit: streams remove nothing
            offsets, stripped, first = split_offsets(got)
            lo = bisect.bisect_right(offsets, progress.seen)   # a consumer may start at its chunk's beginning
            hi = bisect.bisect_left(offsets, part.end)
            if not progress.checked and lo < len(offsets):
                progress.checked = True
                _check_loss(options, part, offsets[lo])
            if keep is None:
                if hi > lo:
                    yield arrow_rows.to_record_batch([(part.stream, got[lo:hi])], offsets[lo:hi],
                                                     stripped[lo:hi], first)
            else:
                rows = [i for i in range(lo, hi) if keep.keeps(stripped[i])]
                if rows:
                    yield arrow_rows.to_record_batch([(part.stream, [got[i] for i in rows])],
                                                     [offsets[i] for i in rows], [stripped[i] for i in rows],
                                                     first)
            progress.seen = max(progress.seen, min(offsets[-1], part.end - 1))
            if offsets[-1] >= part.end - 1:
                progress.done = True
                return
    finally:
        try:
            ch.close()
        except AMQPError:
            pass


def _read_filtered(conn, options, part: StreamRange, keep: RowFilter):
    """Executor. A range read with `streamFilter`. The broker (RabbitMQ 3.13+) skips the chunks whose
    Bloom filter has none of the values and sends nothing for them, so when the range's last chunks do
    not match, no delivery of the filtered consumer would reach the range's last offset, and AMQP 0-9-1
    has no message that says "skipped up to here".

    The signal used instead: one unfiltered delivery from offset end - 1 is the first message of the chunk
    that holds end - 1 (a stream consumer starts at its offset's chunk). Its filter value (or, without
    one, match-unfiltered) is added to the consumer's filter, so the broker must send that chunk (a Bloom
    filter has no false negatives), and the read ends on its deliveries as an unfiltered one does. The
    added value's rows are dropped like any other (`RowFilter` tests the asked values only); the cost is
    one delivery and the chunks that hold the added value.

    A safety net that needs no such reasoning about the broker: when no delivery has come for FILTER_IDLE
    and the range is not done, that consumer is closed and the rest of the range, after the last offset
    the broker sent, is read unfiltered on a new one, filtered by the same test, never emitting an offset
    twice. However slow the broker, the rows are the same: the idle time costs speed, never rows. An older
    broker or ours ignores the filter and sends everything.

    Retention's losses are checked by one unfiltered delivery from the range's start (a filtered
    consumer's first delivery may be far past it legitimately)."""
    progress = _Progress(part)
    first = _first_delivery(conn, part, part.start)
    progress.checked = True
    _check_loss(options, part, offset_of(first))
    last = filter_value(_first_delivery(conn, part, part.end - 1).properties_raw)
    arguments = keep.consumer_arguments(also=last, also_unfiltered=last is None)
    yield from _consume(conn, options, part, progress, FILTER_IDLE, arguments, keep)
    if not progress.done:
        log.info("AMQP source: stream '%s' [%d, %d): no delivery for %.1f s under streamFilter; reading "
                 "the rest from %d unfiltered", part.stream, part.start, part.end, FILTER_IDLE,
                 progress.seen + 1)
        yield from _consume(conn, options, part, progress, keep=keep)


def _first_delivery(conn, part: StreamRange, offset: int):
    """Executor. The first delivery of an unfiltered consumer from `offset` (prefetch 1): the first message
    of the chunk that holds `offset`, or of the first chunk after it."""
    ch = conn.channel()
    try:
        ch.basic_qos(1)
        ch.basic_consume(part.stream, arguments={"x-stream-offset": offset})
        got = ch.get_deliveries(1, timeout=RANGE_IDLE)
        if not got:
            raise RuntimeError(f"stream '{part.stream}': no message arrived for {RANGE_IDLE:.0f} s while "
                               f"reading offsets [{part.start}, {part.end})")
        return got[0]
    finally:
        try:
            ch.close()
        except AMQPError:
            pass


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
        """Driver, every trigger: where the next batch ends per stream. A super stream's partition new to
        `start` (added since the query started, or while it was stopped) enters at its first offset, with
        nothing read this batch: the next batch reads it from there, and the offsets logged say so, so a
        re-run plans the same ranges."""
        log_ = self._driver()
        streams = log_.refresh()
        tails = log_.watched_tails()
        new = [s for s in streams if s not in start] if self.options.get("superStream") else []
        firsts = log_.firsts(new) if new else {}
        end = {}
        for s in streams:
            begin = start.get(s)
            tail = tails.get(s)
            if self._until is not None and tail is not None:
                tail = min(tail, self._until.get(s, tail))
            if s in firsts:
                end[s] = firsts[s] or 0
            elif tail is None:
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
            for s in log_.streams:
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
