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

Sizes (for segments and `x-max-length-bytes`) count osiris' 8-byte segment header, a 48-byte header per
chunk and a 4-byte header per record around the message's content header and body; RabbitMQ stores the
message converted to AMQP 1.0, a little larger, so byte limits agree with RabbitMQ's only roughly.
The log keeps (offset, timestamp, header bytes, body) per chunk and byte sizes per segment, so it could be
written to disk segment by segment later.
"""

from __future__ import annotations

import datetime
import re
import struct

from spark_amqp.codec import fields, replies

from . import limits

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

# The arguments a stream takes (rabbit_stream_queue:capabilities/0); the other queue types' arguments are
# refused by name, arguments no queue type knows are ignored (rabbit_amqqueue:check_declare_arguments).
STREAM_ARGS = ("x-max-length-bytes", "x-queue-type", "x-max-age", "x-stream-max-segment-size-bytes",
               "x-initial-cluster-size", "x-queue-leader-locator")
OTHER_TYPES_ARGS = frozenset((
    "x-expires", "x-message-ttl", "x-dead-letter-exchange", "x-dead-letter-routing-key", "x-max-length",
    "x-max-priority", "x-overflow", "x-queue-mode", "x-queue-version", "x-single-active-consumer",
    "x-queue-master-locator", "x-dead-letter-strategy", "x-max-in-memory-length", "x-max-in-memory-bytes",
    "x-quorum-initial-group-size", "x-delivery-limit"))
# Consumer arguments of the other queue types, refused on a stream; the stream's own are x-stream-offset
# and x-credit (AMQP 1.0 only).
OTHER_TYPES_CONSUMER_ARGS = ("x-cancel-on-ha-failover", "x-priority")
LEADER_LOCATORS = ("client-local", "balanced", "random", "least-leaders")

# check_max_age units, in ms (rabbit_amqqueue:unit_value_in_ms).
_AGE_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "D": 86_400_000, "M": 30 * 86_400_000,
              "Y": 365 * 86_400_000}
_AGE = re.compile(r"([0-9]*)(.*)", re.S)

_OFFSET_KEY = b"\x0fx-stream-offset"
_i64 = struct.Struct(">q")
_u32 = struct.Struct(">I")
_u16 = struct.Struct(">H")
_HEADERS_FLAG = 0x2000
_SHORTSTR_FLAGS = (0x8000, 0x4000)   # content-type, content-encoding: the properties before headers


class Crash(replies.AMQPError):
    """Where RabbitMQ 3.10 crashes its channel on a bad argument (list_to_integer("") in check_max_age,
    osiris given an offset that is not an integer): the client sees connection.close 541 INTERNAL_ERROR."""

    def __init__(self):
        super().__init__(replies.INTERNAL_ERROR, "INTERNAL_ERROR", hard=True)
        self.text = "INTERNAL_ERROR"   # RabbitMQ's text for a crash: the name alone


def rs(name: str, vhost: str) -> str:
    """rabbit_misc:rs/1: how RabbitMQ names a queue in reply texts."""
    return f"queue '{name}' in vhost '{vhost}'"


def type_name(value) -> str:
    """The AMQP field type RabbitMQ names in texts, for a decoded value (pika and py-amqp send Python ints
    that fit 32 bits as signedint, larger ones as long)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "signedint" if -(1 << 31) <= value < (1 << 31) else "long"
    if isinstance(value, str):
        return "longstr"
    if isinstance(value, (bytes, bytearray)):
        return "binary"
    if isinstance(value, float):
        return "double"
    if isinstance(value, datetime.datetime):
        return "timestamp"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, (list, tuple)):
        return "array"
    if value is None:
        return "void"
    return "decimal"


def _text(v):
    return bytes(v).decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v


def parse_max_age(text: str) -> int | None:
    """rabbit_amqqueue:check_max_age/1: digits then one unit of Y M D h m s, more than zero; the age in ms,
    or None when invalid. No digits at all crashes RabbitMQ (list_to_integer("")): raises Crash."""
    digits, unit = _AGE.match(text).groups()
    if not digits:
        raise Crash()
    value = int(digits)
    if value <= 0 or unit not in _AGE_UNITS:
        return None
    return value * _AGE_UNITS[unit]


def _erl_binary(text: str) -> str:
    return '<<"' + text.replace("\\", "\\\\").replace('"', '\\"') + '">>'


class StreamArguments:
    """The declare arguments of a stream, checked in RabbitMQ's order: first the values of the arguments a
    stream takes (406 "invalid arg ... : reason"), then the names of other queue types' arguments (406 "...
    of queue type rabbit_stream_queue"), then durable / exclusive / auto-delete and the segment size limit
    (rabbit_stream_queue:declare)."""

    def __init__(self, arguments: dict, name: str, vhost: str):
        a = self.raw = dict(arguments or {})
        self.expires = None          # what the core's timers read of a queue's arguments
        self.overflow = "drop-head"
        self.dead_letter_exchange = None
        self.dead_letter_routing_key = None
        self.max_length = None

        def fail(key, reason):
            return replies.channel_error(replies.PRECONDITION_FAILED,
                                         f"invalid arg '{key}' for {rs(name, vhost)}: {reason}")

        def non_neg_int(key):
            if key not in a:
                return None
            v = a[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise fail(key, f'"expected integer, got {type_name(v)}"')
            if v < 0:
                raise fail(key, f"{{value_negative,{v}}}")
            return v

        self.max_length_bytes = non_neg_int("x-max-length-bytes")
        self.max_age = None
        if "x-max-age" in a:
            v = a["x-max-age"]
            if not isinstance(v, str):
                raise fail("x-max-age", f"{{unacceptable_type,{type_name(v)}}}")
            self.max_age = parse_max_age(v)
            if self.max_age is None:
                raise fail("x-max-age", "invalid_max_age")
        self.max_segment_size = non_neg_int("x-stream-max-segment-size-bytes")
        size = non_neg_int("x-initial-cluster-size")
        if size == 0:
            raise fail("x-initial-cluster-size", "{value_zero,0}")
        if "x-queue-leader-locator" in a:
            v = a["x-queue-leader-locator"]
            if not isinstance(v, str):
                raise fail("x-queue-leader-locator", f"{{unacceptable_type,{type_name(v)}}}")
            if v not in LEADER_LOCATORS:
                raise fail("x-queue-leader-locator", "invalid_queue_locator_arg")
        for key in a:
            if key in OTHER_TYPES_ARGS:
                raise replies.channel_error(
                    replies.PRECONDITION_FAILED,
                    f"invalid arg '{key}' for {rs(name, vhost)} of queue type rabbit_stream_queue")


def check_declare(name: str, durable: bool, exclusive: bool, auto_delete: bool, vhost: str) -> None:
    """rabbit_stream_queue:declare's property checks, in its order."""
    for refused, prop in ((auto_delete, "auto-delete"), (exclusive, "exclusive-owner"),
                          (not durable, "non-durable")):
        if refused:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        f"invalid property '{prop}' for {rs(name, vhost)}")


def _fmt_equiv(value) -> str:
    """rabbit_misc:equivalence_fail's val/1 for a value present on one side only."""
    if value is None:
        return "none"
    return f"the value '{_text(value)}' of type '{type_name(value)}'"


def with_offset_header(header: bytes, offset: int) -> bytes:
    """The content header `header` (class, weight, body size, flags, properties) with the table entry
    `x-stream-offset` = offset (type long) added to its headers, replacing one the publisher set (RabbitMQ's
    rabbit_basic:add_header). Only the bytes up to the headers table are walked; nothing is decoded unless
    the publisher's own headers already carry the name."""
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
    if b"x-stream-offset" in table:
        items = [(k, v) for k, v in fields.table_items(header[pos:end]) if k != "x-stream-offset"]
        table = fields.table_from_items(items)[4:]
    return b"".join((header[:pos], _u32.pack(len(table) + len(entry)), table, entry, header[end:]))


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


class Chunk:
    """Messages written together. `records` is None for a writer tracking snapshot (one offset, never
    delivered)."""

    __slots__ = ("first_offset", "timestamp", "records", "size")

    def __init__(self, first_offset: int, timestamp: int, records, size: int):
        self.first_offset = first_offset
        self.timestamp = timestamp        # epoch milliseconds when written
        self.records = records
        self.size = size

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
    """A consumer's position: the segment and chunk index it reads next (a chunk goes out whole), and the
    first offset it may deliver (a numeric x-stream-offset starts inside a chunk)."""

    __slots__ = ("segment", "chunk", "start")

    def __init__(self, segment: Segment, chunk: int, start: int):
        self.segment = segment
        self.chunk = chunk
        self.start = start


class StreamQueue:
    """A stream: the queue interface the channel, the virtual host and the core use (enqueue, dispatch,
    add/remove_consumer, message_count, take and purge refusing as RabbitMQ does), over an in-memory log."""

    is_stream = True
    journal = None   # store.StreamLog when the broker has a data_dir: chunks, rolls and retention go there

    def __init__(self, vhost, name: str, durable: bool, exclusive_owner, auto_delete: bool,
                 arguments: dict, now: float):
        self.args = StreamArguments(arguments, name, vhost.name)
        check_declare(name, durable, exclusive_owner is not None, auto_delete, vhost.name)
        if self.args.max_segment_size is not None and self.args.max_segment_size > MAX_STREAM_MAX_SEGMENT_SIZE:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        "Exceeded max value for x-stream-max-segment-size-bytes")
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

    # --- declare -------------------------------------------------------------------------------

    def check_equivalent(self, arguments: dict) -> None:
        """A redeclare (after the virtual host compared durable and auto-delete): the stream's arguments,
        in rabbit_stream_queue's order, with rabbit_misc:assert_args_equivalence's texts."""
        where = rs(self.name, self.vhost.name)
        for key in STREAM_ARGS:
            have, want = self.arguments.get(key), arguments.get(key)
            if _text(have) == _text(want) and isinstance(have, bool) == isinstance(want, bool):
                continue   # one type class for all integers, longstr and binary alike (type_class/1)
            if have is not None and want is not None:
                detail = f"received '{_text(want)}' but current is '{_text(have)}'"
            else:
                detail = f"received {_fmt_equiv(want)} but current is {_fmt_equiv(have)}"
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        f"inequivalent arg '{key}' for {where}: {detail}")

    # --- what RabbitMQ refuses -----------------------------------------------------------------

    def take(self, now: float):
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
                    f"{{invalid_stream_offset_arg,{{{type_name(v)},{_erl_binary(_text(v))}}}}}")
        for key in args:
            if key in OTHER_TYPES_CONSUMER_ARGS:
                raise replies.channel_error(
                    replies.PRECONDITION_FAILED,
                    f"invalid arg '{key}' for {where} of queue type rabbit_stream_queue")
        if not channel.prefetch_consumer:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        f"consumer prefetch count is not set for '{where}'")
        if m.no_ack:
            raise replies.connection_error(
                replies.NOT_IMPLEMENTED, f"automatic acknowledgement not supported by stream queues {where}")
        if channel.prefetch_global:
            raise replies.connection_error(replies.NOT_IMPLEMENTED, f"{where} does not support global qos")
        if "x-stream-offset" in args and self._offset_spec(args["x-stream-offset"])[0] == "crash":
            raise Crash()

    @staticmethod
    def _offset_spec(v):
        """rabbit_stream_queue:parse_offset_arg/1: ("first"|"last"|"next", None), ("offset", n),
        ("timestamp", epoch ms), ("age", ms before now), ("crash", v) for what osiris later fails on, or
        None for an interval string that is not one (406)."""
        text = _text(v) if isinstance(v, (str, bytes, bytearray)) else None
        if text in ("first", "last", "next"):
            return (text, None)
        if isinstance(v, datetime.datetime):
            if v.tzinfo is None:
                v = v.replace(tzinfo=datetime.timezone.utc)
            return ("timestamp", int(v.timestamp()) * 1000)
        if isinstance(v, str):
            ms = parse_max_age(v)
            return None if ms is None else ("age", ms)
        if isinstance(v, int) and not isinstance(v, bool):
            return ("offset", v)
        return ("crash", v)

    # --- the log -------------------------------------------------------------------------------

    def would_reject(self, size: int) -> bool:
        return False

    def enqueue(self, m, now: float) -> None:
        """A publish appends to the chunk of this read; the chunk is written when dispatch runs."""
        self.pending.append(m)
        self.vhost.core.wants_dispatch(self)

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
        self._append(Chunk(self.next_offset, wall, records, size))

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
        self.readers[consumer] = self._reader((consumer.arguments or {}).get("x-stream-offset", "next"))
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
            sent = self._feed(consumer, reader, budget)
            if sent >= budget:
                more = True
        return more

    def _feed(self, consumer, reader: Reader, budget: int) -> int:
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
            records = seg.chunks[reader.chunk].records
            reader.chunk += 1
            if records is None:
                continue
            start = reader.start
            for rec in records:
                if rec.offset >= start:
                    deliver(consumer, self, rec)
                    sent += 1
        return sent
