"""Stream queues (`x-queue-type=stream`) as RabbitMQ 3.10 serves them to AMQP 0-9-1 clients.

A stream is an append-only log that consumers read without removing anything; RabbitMQ keeps it in osiris,
and what a 0-9-1 client can see of osiris is modelled here, in memory:

- The log is a list of *segments*, each an append-only list of *chunks*; a chunk is the batch of messages
  that arrived together (osiris' writer writes one chunk per batch it takes from its mailbox; here one chunk
  per socket read of the broker, sealed when the core runs dispatch after the read). Every message has an
  offset: the first message is offset 0, messages of a chunk are contiguous.
- Before a chunk is written (or a consumer attaches: osiris' writer checks on every batch of commands it
  handles), a segment whose size (file header + chunks) has reached `x-stream-max-segment-size-bytes` is
  closed and a new one opened; osiris then first writes a *writer tracking snapshot* chunk (one offset
  that no consumer ever sees: the gaps a client sees after a roll), and evaluates retention, which removes whole old segments only, never the active one:
  `x-max-length-bytes` keeps the newest segments whose sizes fit, `x-max-age` removes segments whose last
  chunk is older than the age. Without a roll nothing is removed.
- A consumer reads from its own position (`x-stream-offset`: first, last = the start of the last chunk,
  next, an offset, a timestamp or an interval), one segment object at a time: a reader inside a segment
  that retention removed reads on to its end, as an osiris reader with the file open does.
- `basic.qos` prefetch is the consumer's credit: each delivery takes one, each ack gives one back; nothing
  is ever removed by an ack. Every delivery carries the header `x-stream-offset` (long), added to the content
  header once when the chunk is written, so deliveries to any number of consumers share the same bytes.
- With stream filtering (4.x), a chunk keeps the `x-stream-filter-value`s of its messages and a consumer's
  reader skips the chunks its `x-stream-filter` does not want, delivering the others whole (stream_filter.py).

Sizes (for segments and `x-max-length-bytes`) count osiris' 8-byte segment header, a 48-byte header per
chunk and a 4-byte header per record around the message's content header and body; RabbitMQ stores the
message converted to AMQP 1.0, a little larger, so byte limits agree with RabbitMQ's only roughly.
The log keeps (offset, timestamp, header bytes, body) per chunk and byte sizes per segment, so it could be
written to disk segment by segment later.
"""

from __future__ import annotations

import datetime
import struct

from spark_amqp.codec import fields, replies

from . import arguments, limits, policies, stream_filter
from .arguments import STREAM, Crash, erl_string, parse_max_age, rs, text, type_name

# osiris' on-disk layout (osiris_log.erl): a segment file starts with an 8-byte header, every chunk has a
# 48-byte header, every simple record a 4-byte size header.
LOG_HEADER_SIZE = 8
CHUNK_HEADER_SIZE = 48
RECORD_HEADER_SIZE = 4
# A writer tracking snapshot chunk: the chunk header and a small snapshot of one writer's sequence.
TRACKING_CHUNK_SIZE = CHUNK_HEADER_SIZE + 40
# osiris' default max_segment_size_bytes (500 MB) and max_segment_size_chunks (256,000).
DEFAULT_MAX_SEGMENT_SIZE_BYTES = 500_000_000
MAX_SEGMENT_SIZE_CHUNKS = 256_000
# rabbit.hrl MAX_STREAM_MAX_SEGMENT_SIZE: a larger x-stream-max-segment-size-bytes is refused.
MAX_STREAM_MAX_SEGMENT_SIZE = 3_000_000_000

_OFFSET_KEY = b"\x0fx-stream-offset"
_i64 = struct.Struct(">q")
_u32 = struct.Struct(">I")
_u16 = struct.Struct(">H")
_HEADERS_FLAG = 0x2000
_SHORTSTR_FLAGS = (0x8000, 0x4000)   # content-type, content-encoding: the properties before headers


class StreamArguments:
    """The values of a stream's declare arguments, already checked by `arguments.check_declare` (which
    refuses bad values and other queue types' arguments in RabbitMQ's order)."""

    def __init__(self, arguments: dict, behaviour):
        a = self.raw = dict(arguments or {})
        self.expires = None          # what the core's timers read of a queue's arguments
        self.overflow = "drop-head"
        self.dead_letter_exchange = None
        self.dead_letter_routing_key = None
        self.max_length = None
        self.max_length_bytes = a.get("x-max-length-bytes")
        self.max_age = (parse_max_age(a["x-max-age"], behaviour.max_age_needs_digits)
                        if "x-max-age" in a else None)
        self.max_segment_size = a.get("x-stream-max-segment-size-bytes")
        self.filter_size = a.get("x-stream-filter-size-bytes") or stream_filter.DEFAULT_FILTER_SIZE


def check_declare(name: str, durable: bool, exclusive: bool, auto_delete: bool, vhost: str) -> None:
    """rabbit_stream_queue:declare's property checks, in its order."""
    for refused, prop in ((auto_delete, "auto-delete"), (exclusive, "exclusive-owner"),
                          (not durable, "non-durable")):
        if refused:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        f"invalid property '{prop}' for {rs(name, vhost)}")


def with_offset_header(header: bytes, offset: int) -> bytes:
    """The content header `header` (class, weight, body size, flags, properties) with the table entry
    `x-stream-offset` = offset (type long) added to its headers, replacing one the publisher set (RabbitMQ's
    rabbit_basic:add_header), the table sorted by key as RabbitMQ, 3.10 and 4.3 alike, delivers a stream
    message's headers (it keeps the message as AMQP 1.0). Only a header with a non-empty table is decoded."""
    flags = _u16.unpack_from(header, 12)[0]
    pos = 14
    for flag in _SHORTSTR_FLAGS:
        if flags & flag:
            pos += 1 + header[pos]
    entry = _OFFSET_KEY + b"l" + _i64.pack(offset)
    if not flags & _HEADERS_FLAG:
        return b"".join((header[:12], _u16.pack(flags | _HEADERS_FLAG), header[14:pos],
                         _u32.pack(len(entry)), entry, header[pos:]))
    size = _u32.unpack_from(header, pos)[0]
    end = pos + 4 + size
    table = header[pos + 4:end]
    if table:
        items = [(k, v) for k, v in fields.table_items(header[pos:end]) if k != "x-stream-offset"]
        items = fields.sorted_items(items + [("x-stream-offset", entry[len(_OFFSET_KEY):])])
        return header[:pos] + fields.table_from_items(items) + header[end:]
    return b"".join((header[:pos], _u32.pack(len(entry)), entry, header[end:]))


class Record:
    """One message in the log, as every consumer gets it (the channel reads these attributes)."""

    __slots__ = ("offset", "exchange", "routing_key", "header", "body")
    redelivered = False   # RabbitMQ never sets it on stream deliveries
    pid = 0               # no per-message journal record: with a data_dir the whole log is kept (store.StreamLog)

    def __init__(self, offset, exchange, routing_key, header, body):
        self.offset = offset
        self.exchange = exchange
        self.routing_key = routing_key
        self.header = header
        self.body = body


def record_values(records) -> frozenset:
    """A chunk's filter from its records' headers (the publisher's x-stream-filter-value stays in them), so
    a log read back from disk gets the same filters without storing them."""
    return stream_filter.chunk_values(stream_filter.filter_value(r.header) for r in records)


class Chunk:
    """Messages written together. `records` is None for a writer tracking snapshot (one offset, never
    delivered)."""

    __slots__ = ("first_offset", "timestamp", "records", "size", "values")

    def __init__(self, first_offset: int, timestamp: int, records, size: int, values=frozenset()):
        self.first_offset = first_offset
        self.timestamp = timestamp        # epoch milliseconds when written
        self.records = records
        self.size = size
        self.values = values              # its filter: the x-stream-filter-values it holds (stream_filter)

    @property
    def count(self) -> int:
        return 1 if self.records is None else len(self.records)


class Segment:
    """An append-only list of chunks and its size in bytes; `next` is the segment opened after it (readers
    follow it, even from a segment retention has removed)."""

    __slots__ = ("chunks", "size", "next")

    def __init__(self):
        self.chunks: list[Chunk] = []
        self.size = LOG_HEADER_SIZE
        self.next: Segment | None = None


class Reader:
    """A consumer's position: the segment and chunk index it reads next (a chunk goes out whole), the
    first offset it may deliver (a numeric x-stream-offset starts inside a chunk), and the chunks it wants
    (a stream_filter.Matcher, None for all)."""

    __slots__ = ("segment", "chunk", "start", "matcher")

    def __init__(self, segment: Segment, chunk: int, start: int):
        self.segment = segment
        self.chunk = chunk
        self.start = start
        self.matcher = None


class StreamQueue:
    """A stream: the queue interface the channel, the virtual host and the core use (enqueue, dispatch,
    add/remove_consumer, message_count, take and purge refusing as RabbitMQ does), over an in-memory log."""

    is_stream = True
    declare_is_use = True
    queue_type = STREAM
    server_named = False
    journal = None   # store.StreamLog when the broker has a data_dir: chunks, rolls and retention go there

    def __init__(self, vhost, name: str, durable: bool, exclusive_owner, auto_delete: bool,
                 arguments: dict, now: float):
        self.args = StreamArguments(arguments, vhost.core.behaviour)
        check_declare(name, durable, exclusive_owner is not None, auto_delete, vhost.name)
        if self.args.max_segment_size is not None and self.args.max_segment_size > MAX_STREAM_MAX_SEGMENT_SIZE:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        "Exceeded max value for x-stream-max-segment-size-bytes")
        if vhost.core.behaviour.stream_filtering:
            reason = stream_filter.check_size(self.args.raw.get("x-stream-filter-size-bytes"))
            if reason:
                raise replies.channel_error(replies.PRECONDITION_FAILED, reason)
        self.vhost = vhost
        self.name = name
        self.durable = True
        self.exclusive_owner = None
        self.auto_delete = False
        self.arguments = self.args.raw
        self.consumers: list = []
        self.exclusive_consumer = None
        self.deleted = False
        self.last_used = now
        self.has_ttl = False
        self.max_segment_size = (DEFAULT_MAX_SEGMENT_SIZE_BYTES if self.args.max_segment_size is None
                                 else self.args.max_segment_size)
        self.segments: list[Segment] = [Segment()]
        self.next_offset = 0
        self.pending: list = []           # messages of the chunk being gathered (this read)
        self.readers: dict = {}           # consumer -> Reader
        self.bytes = LOG_HEADER_SIZE      # size of the segments kept

    def apply_policy(self, definition: dict) -> None:
        """The effective policy definition changed: retention and the segment size the policy sets take
        precedence over the arguments (rabbit_stream_queue:update_stream_conf) from the next roll on."""
        behaviour = self.vhost.core.behaviour
        effective = policies.effective(self.arguments, definition, STREAM, behaviour)
        self.args = StreamArguments(effective, behaviour)
        self.max_segment_size = (DEFAULT_MAX_SEGMENT_SIZE_BYTES if self.args.max_segment_size is None
                                 else self.args.max_segment_size)

    # --- declare -------------------------------------------------------------------------------

    # --- what RabbitMQ refuses -----------------------------------------------------------------

    def take(self, now: float, no_ack: bool = True):
        raise replies.connection_error(
            replies.NOT_IMPLEMENTED,
            f"basic.get not supported by stream queues {rs(self.name, self.vhost.name)}")

    def purge(self) -> int:
        raise replies.connection_error(
            replies.NOT_IMPLEMENTED,
            f"queue.purge not supported by stream queues {rs(self.name, self.vhost.name)}")

    def settle_refused(self) -> replies.AMQPError:
        return replies.connection_error(
            replies.NOT_IMPLEMENTED,
            f"basic.nack and basic.reject not supported by stream queues {rs(self.name, self.vhost.name)}")

    def consumer_timeout(self, consumer_arguments) -> None:
        """4.x never times out a stream's deliveries (3.10's channel does, whatever the queue)."""
        return None

    def check_consume(self, channel, m) -> None:
        """basic.consume on a stream, refused in RabbitMQ's order: consumer arguments (x-stream-offset's
        value, other queue types' argument names), then no prefetch (406), no-ack (540), global qos (540),
        then an offset osiris cannot take (541)."""
        where = rs(self.name, self.vhost.name)
        args = m.arguments or {}
        if "x-stream-offset" in args:
            spec = self._offset_spec(args["x-stream-offset"])
            if spec is None:
                v = args["x-stream-offset"]
                raise replies.channel_error(
                    replies.PRECONDITION_FAILED,
                    f"invalid arg 'x-stream-offset' for {where}: "
                    f"{{invalid_stream_offset_arg,{{{type_name(v)},<<{erl_string(text(v))}>>}}}}")
        arguments.check_consume(args, STREAM, self.name, self.vhost.name, self.vhost.core.behaviour,
                                skip=("x-stream-offset",))
        behaviour = self.vhost.core.behaviour
        if not channel.prefetch_consumer:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        behaviour.stream_no_prefetch_text.format(q=where))
        if m.no_ack:
            raise replies.connection_error(replies.NOT_IMPLEMENTED, behaviour.stream_no_ack_text.format(q=where))
        if channel.prefetch_global:
            raise replies.connection_error(replies.NOT_IMPLEMENTED, f"{where} does not support global qos")
        if "x-stream-offset" in args and self._offset_spec(args["x-stream-offset"])[0] == "crash":
            raise Crash()
        if behaviour.stream_filtering:
            stream_filter.matcher(args)    # a filter list without a string: osiris' matcher crashes (541)

    def _offset_spec(self, v):
        """rabbit_stream_queue:parse_offset_arg/1: ("first"|"last"|"next", None), ("offset", n),
        ("timestamp", epoch ms), ("age", ms before now), ("crash", v) for what osiris later fails on, or
        None for an interval string that is not one (406)."""
        name = text(v) if isinstance(v, (str, bytes, bytearray)) else None
        if name in ("first", "last", "next"):
            return (name, None)
        if isinstance(v, datetime.datetime):
            if v.tzinfo is None:
                v = v.replace(tzinfo=datetime.timezone.utc)
            return ("timestamp", int(v.timestamp()) * 1000)
        if isinstance(v, str):
            ms = parse_max_age(v, self.vhost.core.behaviour.max_age_needs_digits)
            return None if ms is None else ("age", ms)
        if isinstance(v, int) and not isinstance(v, bool):
            return ("offset", v)
        return ("crash", v)

    # --- the log -------------------------------------------------------------------------------

    def would_reject(self, m, channel=None) -> bool:
        """Never refused; but with filtering, a channel's publish (not a dead letter) whose
        x-stream-filter-value is not a valid string closes its connection with 541, before any queue
        takes it: RabbitMQ's publishing channel crashes on it (stream_filter)."""
        if (channel is not None and getattr(channel, "conn", None) is not None
                and self.vhost.core.behaviour.stream_filtering
                and stream_filter.filter_value(m.header) is stream_filter.INVALID):
            raise Crash()
        return False

    def timed(self) -> bool:
        return False

    def idle_expired(self, now: float) -> bool:
        return False

    def consumer_count(self) -> int:
        """A stream's declare-ok says 0 consumers, whatever consumes it (as RabbitMQ's)."""
        return 0

    def all_consumers(self) -> list:
        return self.consumers

    def check_delete(self, if_unused: bool, if_empty: bool) -> None:
        """RabbitMQ deletes a stream whatever if-unused and if-empty say."""

    def drop_all(self) -> None:
        self.drop_log()

    def enqueue(self, m, now: float) -> None:
        """A publish appends to the chunk of this read; the chunk is written when dispatch runs."""
        self.pending.append(m)
        self.vhost.core.wants_dispatch(self)

    tracks_settlement = False

    def settled(self, entries, outcome: str, now: float) -> None:
        """Unacked stream deliveries of a closed channel (and, on 4.x, nacked, rejected or recovered ones) go
        nowhere: the log still has them; settling only gave the consumer its credit back."""

    def requeue(self, msgs, now: float) -> None:
        """Unacked stream deliveries of a closed channel go nowhere: the log still has them."""

    def _write_pending(self) -> None:
        if not self.pending:
            return
        msgs, self.pending = self.pending, []
        wall = self._maybe_roll()
        offset = self.next_offset
        records = []
        size = CHUNK_HEADER_SIZE
        for m in msgs:
            records.append(Record(offset, m.exchange, m.routing_key, with_offset_header(m.header, offset),
                                  m.body))
            size += RECORD_HEADER_SIZE + len(m.header) + len(m.body)
            offset += 1
        values = frozenset()
        if self.vhost.core.behaviour.stream_filtering:
            values = record_values(records)
            size += stream_filter.filter_bytes(values, self.args.filter_size)
        self._append(Chunk(self.next_offset, wall, records, size, values))

    def _append(self, chunk: Chunk) -> None:
        segment = self.segments[-1]
        segment.chunks.append(chunk)
        if self.journal is not None:
            self.journal.chunk(chunk)
        segment.size += chunk.size
        self.bytes += chunk.size
        self.next_offset += chunk.count
        self.vhost.core.account(chunk.size)

    def _maybe_roll(self) -> int:
        """Roll a full active segment; the wall clock in ms. osiris' writer checks at every batch of
        commands it handles, a write or a consumer registering (evaluate_tracking_snapshot)."""
        wall = int(self.vhost.core.wall_clock() * 1000)
        active = self.segments[-1]
        if active.size >= self.max_segment_size or len(active.chunks) >= MAX_SEGMENT_SIZE_CHUNKS:
            self._roll(wall)
        return wall

    def _roll(self, wall: int) -> None:
        """Close the active segment: open a new one, write the writer tracking snapshot chunk into it (an
        offset no consumer sees), then apply retention (osiris_log:write_chunk, evaluate_tracking_snapshot,
        evaluate_retention)."""
        new = Segment()
        self.segments[-1].next = new
        self.segments.append(new)
        if self.journal is not None:
            self.journal.segment()
        self.bytes += LOG_HEADER_SIZE
        self._append(Chunk(self.next_offset, wall, None, TRACKING_CHUNK_SIZE))
        self._retention(wall)

    def _retention(self, wall: int) -> None:
        segs = self.segments
        keep = len(segs)
        if self.args.max_length_bytes is not None:
            # eval_max_bytes: the newest segment always stays; older ones stay while they fit.
            room = self.args.max_length_bytes - segs[-1].size
            keep = 1
            for seg in reversed(segs[:-1]):
                if seg.size > room:
                    break
                room -= seg.size
                keep += 1
        drop = len(segs) - keep
        if self.args.max_age is not None:
            # eval_age: oldest first, while its last chunk is older than the age, never the last segment.
            while drop < len(segs) - 1 and segs[drop].chunks and \
                    segs[drop].chunks[-1].timestamp < wall - self.args.max_age:
                drop += 1
        if drop:
            if self.journal is not None:
                self.journal.dropped(drop)
            gone, self.segments = segs[:drop], segs[drop:]
            freed = sum(s.size for s in gone)
            self.bytes -= freed
            self.vhost.core.account(-(freed - LOG_HEADER_SIZE * len(gone)))

    def first_offset(self) -> int:
        for seg in self.segments:
            if seg.chunks:
                return seg.chunks[0].first_offset
        return self.next_offset

    def message_count(self) -> int:
        """What RabbitMQ reports for a stream: committed offset + 1 - first offset (rabbit_osiris_metrics;
        tracking chunks count too). RabbitMQ refreshes it every 5 s; here it is current."""
        self._write_pending()
        return self.next_offset - self.first_offset()

    def drop_log(self) -> None:
        """The stream is deleted: its log goes."""
        self.pending = []
        self.vhost.core.account(-(self.bytes - LOG_HEADER_SIZE * len(self.segments)))
        self.segments = [Segment()]
        self.bytes = LOG_HEADER_SIZE

    # --- consumers -----------------------------------------------------------------------------

    def add_consumer(self, consumer) -> None:
        self._write_pending()
        if self.next_offset:
            self._maybe_roll()
        args = consumer.arguments or {}
        reader = self.readers[consumer] = self._reader(args.get("x-stream-offset", "next"))
        if self.vhost.core.behaviour.stream_filtering:
            reader.matcher = stream_filter.matcher(args)
        self.consumers.append(consumer)
        self.vhost.core.wants_dispatch(self)

    def remove_consumer(self, consumer) -> None:
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        self.readers.pop(consumer, None)

    def _chunks(self):
        for seg in self.segments:
            for i, chunk in enumerate(seg.chunks):
                yield seg, i, chunk

    def _reader(self, arg) -> Reader:
        """Where a new consumer starts (osiris_log:init_offset_reader and rabbit_stream_queue:begin_stream)."""
        kind, value = self._offset_spec(arg)
        tail = self.segments[-1]
        at_next = Reader(tail, len(tail.chunks), self.next_offset)
        if kind == "next":
            return at_next
        if kind == "first":
            return Reader(self.segments[0], 0, -1)
        if kind == "last":
            last = None
            for seg, i, chunk in self._chunks():
                if chunk.records is not None:
                    last = Reader(seg, i, -1)
            return last or at_next
        if kind == "age":
            kind, value = "timestamp", int(self.vhost.core.wall_clock() * 1000) - value
        if kind == "timestamp":
            for seg, i, chunk in self._chunks():
                if value <= chunk.timestamp:
                    return Reader(seg, i, -1)
            return at_next
        # A numeric offset: clamped to the first offset; past the end the reader waits at the end but still
        # delivers only offsets from the one asked for (begin_stream's start_offset filter).
        start = max(value, self.first_offset())
        for seg, i, chunk in self._chunks():
            if chunk.first_offset + chunk.count > start:
                return Reader(seg, i, value)
        at_next.start = value
        return at_next

    def dispatch(self, now: float) -> bool:
        """Write this read's chunk, then deliver to every consumer with credit from its own position."""
        self._write_pending()
        budget = limits.DISPATCH_BURST
        more = False
        for consumer in list(self.consumers):
            reader = self.readers.get(consumer)
            if reader is None:
                continue
            sent = self._feed(consumer, reader, budget, now)
            if sent >= budget:
                more = True
        return more

    def _feed(self, consumer, reader: Reader, budget: int, now: float) -> int:
        """Deliver whole chunks from the consumer's position while it has credit. As rabbit_stream_queue's
        stream_entries: once the credit is above zero the next chunk is read and every record in it from
        the consumer's start offset goes out, the credit going below zero if the chunk holds more (a
        consumer with prefetch 1 receives a whole chunk: RabbitMQ 3.10 sent both of two messages published
        back to back). The connection's high-water mark and the burst budget are checked between chunks."""
        sent = 0
        deliver = consumer.channel.deliver
        while sent < budget and consumer.can_take():
            seg = reader.segment
            if reader.chunk >= len(seg.chunks):
                if seg.next is None:
                    break
                reader.segment, reader.chunk = seg.next, 0
                continue
            chunk = seg.chunks[reader.chunk]
            records = chunk.records
            reader.chunk += 1
            if records is None or (reader.matcher is not None and not reader.matcher.matches(chunk.values)):
                continue
            start = reader.start
            for rec in records:
                if rec.offset >= start:
                    deliver(consumer, self, rec, now)
                    sent += 1
        return sent
