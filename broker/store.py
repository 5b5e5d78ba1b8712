"""Persistence (`data_dir`): an append-only journal of durable events, replayed at start-up.

Why a journal: every durable change (declare/delete of a durable exchange or queue, a binding between
durable ends, a persistent message entering a durable queue, its delivery, its removal) is one small
record appended to `journal.log`; nothing is ever rewritten in place, so a crash (`kill -9`, power loss)
can only leave a torn *last* record, which the CRC detects. Each record is

    u32 length | u32 CRC32 of payload | payload (one type byte, then the record)

The protocol core stays sans-I/O: its hooks only call this object's `exchange_declared`, `enqueued`,
`removed`, ... which encode a record into an in-memory buffer. The server calls `commit()` once per read
cycle and timer tick, before it writes any connection's output: one `write` and, when a persistent
message was enqueued since the last commit, one `fsync` for the whole batch (RabbitMQ's group commit).
Publisher confirms are written to sockets only after that, so a confirm is never sent for a message that
is not on disk.

Compaction rewrites only what is live (the metadata, then each live message record copied from the old
journal, then a delivered mark where one was recorded) into `journal.new`, fsyncs it and renames it over
`journal.log`: at every start, and when the journal grows past `COMPACT_FACTOR` x the live bytes.

What RabbitMQ 3.10 does and this follows: transient messages, non-durable queues and exclusive queues
are gone after a restart; a persistent message that had been delivered and not acked comes back with
redelivered=true (the classic queue index records deliveries); one never delivered comes back
redelivered=false. A stream queue's declaration is in the journal and its log in a file of its own
(`streams/<n>.log`, see StreamLog): chunks, segment rolls and retention, so it comes back with the same
offsets.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib

from spark_amqp.codec import fields, properties, replies

from .message import Message
from .stream import LOG_HEADER_SIZE, TRACKING_CHUNK_SIZE, Chunk, Record, Segment, record_values

log = logging.getLogger("broker.store")

JOURNAL = "journal.log"
COMPACT_FACTOR = 4
COMPACT_MIN_BYTES = 8 << 20        # never compact a journal smaller than this at run time

_head = struct.Struct(">II")       # length, crc32
_u64 = struct.Struct(">Q")
_msg = struct.Struct(">QHHHHI")    # pid, len(vhost), len(queue), len(exchange), len(rk), len(header)
_returned = struct.Struct(">QII")  # pid, acquired count, delivery count

# record types
EXCHANGE, EXCHANGE_DEL = b"X", b"x"
QUEUE, QUEUE_DEL = b"Q", b"q"
BIND, UNBIND = b"B", b"b"
MESSAGE, DELIVERED, REMOVED = b"M", b"D", b"A"
RETURNED = b"R"                    # a quorum queue took a message back: its counts (quorum.py)
POLICY, POLICY_CLEARED = b"P", b"p"  # a policy or operator policy set / cleared at run time (Broker.set_policy)
# stream log records (streams/<n>.log)
STREAMS_DIR = "streams"
SEGMENT, CHUNK, TRACKING, DROP = b"S", b"C", b"K", b"D"
_chunk = struct.Struct(">QQII")    # first offset, timestamp ms, chunk size, record count
_rec = struct.Struct(">HHII")      # len(exchange), len(rk), len(header), len(body)
_tracking = struct.Struct(">QQ")   # offset, timestamp ms
_u32 = struct.Struct(">I")

_DM_FLAG = properties.FLAG["delivery_mode"]
_BEFORE_DM = properties.FLAG["content_type"] | properties.FLAG["content_encoding"] | properties.FLAG["headers"]


def is_persistent(header: bytes) -> bool:
    """delivery_mode=2 in a content header payload, without parsing the other properties when it can."""
    flags = properties.flags_of(header, 12)
    if not flags & _DM_FLAG:
        return False
    if not flags & _BEFORE_DM:
        return header[14] == 2
    try:
        return properties.split(header[12:]).get("delivery_mode") == b"\x02"
    except properties.PropertyError:
        return False


def _frame(payload: bytes) -> bytes:
    return _head.pack(len(payload), zlib.crc32(payload)) + payload


def _meta(record_type: bytes, **values) -> bytes:
    return record_type + fields.encode_table(values)


def _binding_key(vhost, source, dest_kind, dest, key, args_raw) -> tuple:
    return (vhost, source, dest_kind, dest, key, args_raw)


class Store:
    """The journal of one data directory and the live state it describes (see the module docstring)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, JOURNAL)
        self.exchanges: dict[tuple, bytes] = {}   # (vhost, name) -> record payload
        self.queues: dict[tuple, bytes] = {}      # (vhost, name) -> record payload
        self.bindings: dict[tuple, bytes] = {}    # _binding_key -> record payload
        self.policies: dict[tuple, bytes] = {}    # (kind, vhost, name) -> the last set or clear record
        # pid -> [(vhost, queue), offset, length, delivered, (acquired, delivery count) or None]
        self.messages: dict[int, list] = {}
        self.live_bytes = 0
        self.next_pid = 1
        self.pending = bytearray()
        self.sync_needed = False
        self.muted = False                        # while the recovered state is applied to the core
        self.streams: dict[tuple, StreamLog] = {}  # (vhost, name) -> the log file of a kept stream
        self.dirty_streams: set = set()
        self.fh = None
        self.size = 0

    # --- start-up ------------------------------------------------------------------------------

    @classmethod
    def open(cls, data_dir: str) -> "Store":
        """Read (and repair) the journal in `data_dir`, creating the directory if needed, and compact it.
        Errors are ValueErrors naming `data_dir` and the value."""
        try:
            os.makedirs(data_dir, exist_ok=True)
            if not os.access(data_dir, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as exc:
            raise ValueError(f"data_dir: cannot use {data_dir!r} as the data directory "
                             f"({exc.strerror or exc})") from None
        store = cls(data_dir)
        store._lock()
        store._replay()
        store.compact()
        return store

    def _lock(self) -> None:
        """Two brokers appending to one journal would interleave records: the second one is refused. The
        lock is an flock, released by the OS when the process dies, so `kill -9` leaves no stale lock."""
        path = os.path.join(self.data_dir, "LOCK")
        self.lock_fh = open(path, "a")
        try:
            fcntl.flock(self.lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_fh.close()
            raise ValueError(f"data_dir: {self.data_dir!r} is in use by another broker "
                             f"(its {path!r} is locked)") from None

    def _replay(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ValueError(f"data_dir: cannot read {self.path!r} ({exc.strerror or exc})") from None
        self._old = data
        pos, n, end = 0, 0, len(data)
        while pos < end:
            if end - pos < _head.size:
                self._torn(pos, end, "a truncated record header")
                break
            length, crc = _head.unpack_from(data, pos)
            start = pos + _head.size
            if start + length > end:
                self._torn(pos, end, f"a record of {length} bytes with only {end - start} written")
                break
            payload = data[start:start + length]
            if zlib.crc32(payload) != crc:
                self._torn(pos, end, "a record whose CRC32 does not match")
                break
            try:
                self._apply(payload, pos, _head.size + length)
            except Exception as exc:   # a record we cannot read: treat like a torn tail
                self._torn(pos, end, f"an unreadable record ({type(exc).__name__}: {exc})")
                break
            pos = start + length
            n += 1
        log.info("data_dir %s: recovered %d durable exchanges, %d durable queues, %d bindings, "
                 "%d persistent messages from %d journal records",
                 self.data_dir, len(self.exchanges), len(self.queues), len(self.bindings),
                 len(self.messages), n)

    def _torn(self, pos: int, end: int, what: str) -> None:
        log.warning("data_dir %s: %s ends in %s at byte %d; recovered everything before it and dropped "
                    "the last %d bytes (a write torn by a crash)", self.data_dir, self.path, what, pos,
                    end - pos)

    def _apply(self, payload: bytes, offset: int, length: int) -> None:
        """One record into the live state (replay and run time share it)."""
        kind = payload[:1]
        if kind == MESSAGE:
            pid, lv, lq, _lx, _lk, _lh = _msg.unpack_from(payload, 1)
            p = 1 + _msg.size
            vhost = payload[p:p + lv].decode()
            queue = payload[p + lv:p + lv + lq].decode()
            self.messages[pid] = [(vhost, queue), offset, length, False, None]
            self.live_bytes += length
            self.next_pid = max(self.next_pid, pid + 1)
        elif kind == RETURNED:
            pid, acquired, delivery = _returned.unpack_from(payload, 1)
            entry = self.messages.get(pid)
            if entry is not None:
                entry[3] = False      # back in its queue: no longer delivered
                entry[4] = (acquired, delivery)
        elif kind in (DELIVERED, REMOVED):
            for (pid,) in _u64.iter_unpack(memoryview(payload)[1:]):
                entry = self.messages.get(pid) if kind == DELIVERED else self.messages.pop(pid, None)
                if entry is None:
                    continue
                if kind == DELIVERED:
                    entry[3] = True
                else:
                    self.live_bytes -= entry[2]
        else:
            v = fields.decode_table(payload[1:])
            if kind == EXCHANGE:
                self.exchanges[(v["vhost"], v["name"])] = payload
            elif kind == EXCHANGE_DEL:
                key = (v["vhost"], v["name"])
                self.exchanges.pop(key, None)
                for b in [b for b in self.bindings if b[0] == key[0] and
                          (b[1] == key[1] or (b[2] == "x" and b[3] == key[1]))]:
                    del self.bindings[b]
            elif kind == QUEUE:
                self.queues[(v["vhost"], v["name"])] = payload
                if "log" in v:
                    self.next_pid = max(self.next_pid, v["log"] + 1)
            elif kind == QUEUE_DEL:
                key = (v["vhost"], v["name"])
                self.queues.pop(key, None)
                for b in [b for b in self.bindings if b[0] == key[0] and b[2] == "q" and b[3] == key[1]]:
                    del self.bindings[b]
                for pid in [pid for pid, e in self.messages.items() if e[0] == key]:
                    self.live_bytes -= self.messages.pop(pid)[2]
            elif kind in (POLICY, POLICY_CLEARED):
                self.policies[(v["kind"], v["vhost"], v["name"])] = payload
            elif kind in (BIND, UNBIND):
                key = _binding_key(v["vhost"], v["source"], v["kind"], v["dest"], v["key"], v["args"])
                if kind == BIND:
                    self.bindings[key] = payload
                else:
                    self.bindings.pop(key, None)
            else:
                raise ValueError(f"unknown record type {kind!r}")

    def compact(self) -> None:
        """Rewrite the live state into a new journal and swap it in (fsync file, rename, fsync dir)."""
        self._write_pending()
        old = getattr(self, "_old", None)
        if old is None and self.fh is not None:
            self.fh.flush()
            with open(self.path, "rb") as fh:
                old = fh.read()
        tmp = os.path.join(self.data_dir, "journal.new")
        out = bytearray()
        for payload in (*self.policies.values(), *self.exchanges.values(), *self.queues.values(),
                        *self.bindings.values()):
            out += _frame(payload)
        delivered = []
        for pid, entry in self.messages.items():
            start = len(out)
            out += old[entry[1]:entry[1] + entry[2]]
            entry[1] = start
            if entry[4] is not None:
                out += _frame(RETURNED + _returned.pack(pid, *entry[4]))
            if entry[3]:
                delivered.append(pid)
        if delivered:
            out += _frame(DELIVERED + b"".join(_u64.pack(p) for p in delivered))
        with open(tmp, "wb") as fh:
            fh.write(out)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._fsync_dir()
        if self.fh is not None:
            self.fh.close()
        self.fh = open(self.path, "ab")
        self.size = len(out)
        self._old = None

    def _fsync_dir(self) -> None:
        fd = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- applying the recovered state to the core ------------------------------------------------

    def restore(self, core) -> None:
        """Declare the recovered exchanges, queues and bindings in the core and enqueue the recovered
        messages in publish order; a vhost no longer configured, or a declaration the broker now
        refuses, is logged at WARNING and left out (its journal records stay until it is deleted)."""
        self.muted = True
        try:
            self._restore_policies(core)
            for (vname, name), payload in self.exchanges.items():
                v = fields.decode_table(payload[1:])
                self._restore_one(core, vname, f"exchange '{name}'", lambda vh: vh.declare_exchange(
                    name, v["type"], False, True, v["auto_delete"], v["internal"], v["args"]))
            for (vname, name), payload in self.queues.items():
                v = fields.decode_table(payload[1:])
                self._restore_one(core, vname, f"queue '{name}'", lambda vh: vh.declare_queue(
                    name, False, True, False, v["auto_delete"], v["args"], None))
            for (vname, source, kind, dest, key, _raw), payload in self.bindings.items():
                args = fields.decode_table(payload[1:])["arguments"]
                if kind == "q":
                    def bind(vh):
                        vh.bind_queue(vh.get_queue(dest), source, key, args)
                else:
                    def bind(vh):
                        vh.bind_exchange(dest, source, key, args)
                self._restore_one(core, vname, f"binding '{source}' -> '{dest}'", bind)
            self._restore_messages(core)
            self._restore_streams(core)
        finally:
            self.muted = False
        self._adopt(core)

    def _restore_policies(self, core) -> None:
        """Policies set or cleared at run time, over those the configuration gave, in the order they happened."""
        import json
        from . import policies
        for (kind, vname, name), payload in self.policies.items():
            if vname not in core.vhosts:
                log.warning("data_dir %s: %s '%s' of vhost '%s' not restored: the vhost is not configured",
                            self.data_dir, kind.replace("_", " "), name, vname)
                continue
            v = fields.decode_table(payload[1:])
            if payload[:1] == POLICY_CLEARED:
                core.policies.clear(kind, vname, name)
                continue
            try:
                core.policies.set(policies.validate(kind, vname, name, v["pattern"], json.loads(v["definition"]),
                                                    json.loads(v["priority"]), v["apply_to"],
                                                    behaviour=core.behaviour))
            except policies.PolicyError as exc:
                log.warning("data_dir %s: %s '%s' of vhost '%s' not restored: %s", self.data_dir,
                            kind.replace("_", " "), name, vname, exc)
        for vh in core.vhosts.values():
            vh.refresh_policies()

    def _restore_streams(self, core) -> None:
        """Each kept stream's log file read back into its StreamQueue; files of streams no longer kept
        (deleted before a crash removed the file) are removed."""
        live = set()
        for (vname, name), payload in self.queues.items():
            number = fields.decode_table(payload[1:]).get("log")
            if number is None:
                continue
            live.add(f"{number}.log")
            slog = StreamLog(self, number)
            segments = slog.load()
            vh = core.vhosts.get(vname)
            q = vh.queues.get(name) if vh is not None else None
            if q is None or not q.is_stream:
                continue
            slog.apply(q, segments)
            self.streams[(vname, name)] = q.journal = slog
        folder = os.path.join(self.data_dir, STREAMS_DIR)
        for fname in os.listdir(folder) if os.path.isdir(folder) else ():
            if fname.endswith(".log") and fname not in live:
                os.unlink(os.path.join(folder, fname))

    def _adopt(self, core) -> None:
        """Durable exchanges, queues and bindings the core has that the journal lacks (declared from a
        definitions file at this start) are journaled now, so persistent messages on them are kept."""
        for vh in core.vhosts.values():
            for x in vh.exchanges.values():
                if x.name and not x.name.startswith("amq.") and (vh.name, x.name) not in self.exchanges:
                    self.exchange_declared(vh.name, x)
            for q in vh.queues.values():
                if (vh.name, q.name) not in self.queues:
                    self.queue_declared(vh.name, q)
            for x in vh.exchanges.values():
                if not x.name:
                    continue
                for (dest, key, _frozen), arguments in list(x.bindings.items()):
                    self.bound(vh.name, x, dest, key, arguments, True)

    def _restore_one(self, core, vname, what, fn) -> None:
        vh = core.vhosts.get(vname)
        if vh is None:
            log.warning("data_dir %s: %s of vhost '%s' not restored: the vhost is not configured",
                        self.data_dir, what, vname)
            return
        try:
            fn(vh)
        except replies.AMQPError as exc:
            log.warning("data_dir %s: %s in vhost '%s' not restored: %s", self.data_dir, what, vname, exc)

    def _restore_messages(self, core) -> None:
        if not self.messages:
            return
        with open(self.path, "rb") as fh:
            data = fh.read()
        now = core.now()
        for pid, ((vname, qname), offset, length, delivered, counts) in sorted(self.messages.items()):
            vh = core.vhosts.get(vname)
            q = vh.queues.get(qname) if vh is not None else None
            if q is None or q.is_stream:
                continue
            m = decode_message(data[offset + _head.size:offset + length])
            m.pid = pid
            m.redelivered = delivered
            props = m.read_properties()
            if "priority" in props:
                m.priority = props["priority"]
            if props.get("expiration", "").isdigit():
                m.ttl = int(props["expiration"])
            q.restore(m, now, delivered, counts)

    # --- hooks called by the core (encode only; no I/O) --------------------------------------------

    def _add(self, payload: bytes) -> int:
        """Buffer one record; returns its offset in the journal-to-be."""
        offset = self.size + len(self.pending)
        self.pending += _frame(payload)
        return offset

    def exchange_declared(self, vhost: str, x) -> None:
        if self.muted or not x.durable:
            return
        payload = _meta(EXCHANGE, vhost=vhost, name=x.name, type=x.type_name, auto_delete=x.auto_delete,
                        internal=x.internal, args=x.arguments or {})
        self.exchanges[(vhost, x.name)] = payload
        self._add(payload)

    def _deleted(self, record_type: bytes, kept: dict, vhost: str, name: str) -> bool:
        """Journal the delete of a kept exchange or queue (and what goes with it); False if not kept."""
        if self.muted or (vhost, name) not in kept:
            return False
        payload = _meta(record_type, vhost=vhost, name=name)
        self._apply(payload, 0, 0)
        self._add(payload)
        return True

    def policy_set(self, policy) -> None:
        import json
        payload = _meta(POLICY, kind=policy.kind, vhost=policy.vhost, name=policy.name, pattern=policy.pattern,
                        apply_to=policy.apply_to, priority=json.dumps(policy.priority),
                        definition=json.dumps(policy.definition))
        self.policies[(policy.kind, policy.vhost, policy.name)] = payload
        self._add(payload)
        self.sync_needed = True

    def policy_cleared(self, kind: str, vhost: str, name: str) -> None:
        payload = _meta(POLICY_CLEARED, kind=kind, vhost=vhost, name=name)
        self.policies[(kind, vhost, name)] = payload
        self._add(payload)
        self.sync_needed = True

    def exchange_deleted(self, vhost: str, name: str) -> None:
        self._deleted(EXCHANGE_DEL, self.exchanges, vhost, name)

    def queue_declared(self, vhost: str, q) -> None:
        if self.muted or not q.durable or q.exclusive_owner is not None:
            return
        extra = {}
        if q.is_stream:   # its log goes to a file of its own, named by a number never reused
            extra["log"] = self.next_pid
            self.next_pid += 1
            q.journal = self.streams[(vhost, q.name)] = StreamLog(self, extra["log"])
            q.journal.segment()
        payload = _meta(QUEUE, vhost=vhost, name=q.name, auto_delete=q.auto_delete, args=q.arguments or {},
                        **extra)
        self.queues[(vhost, q.name)] = payload
        self._add(payload)

    def queue_deleted(self, vhost: str, name: str) -> None:
        if not self._deleted(QUEUE_DEL, self.queues, vhost, name):
            return
        slog = self.streams.pop((vhost, name), None)
        if slog is not None:
            slog.deleted = True
            self.dirty_streams.add(slog)   # its file goes once the delete record is written

    def bound(self, vhost: str, source, dest, key: str, arguments, added: bool) -> None:
        """A binding from exchange `source` to `dest` (a queue or exchange) was added or removed; kept
        only when both ends are kept."""
        if self.muted:
            return
        kind = "q" if hasattr(dest, "is_stream") else "x"
        if added and not ((vhost, source.name) in self.exchanges or source.name.startswith("amq.")):
            return
        if added and (kind == "q" and (vhost, dest.name) not in self.queues
                      or kind == "x" and (vhost, dest.name) not in self.exchanges):
            return
        args = fields.encode_table(arguments or {}).hex()
        bkey = _binding_key(vhost, source.name, kind, dest.name, key, args)
        if (bkey in self.bindings) == added:
            return   # already kept (a repeated bind), or not kept (an unbind of something never kept)
        payload = _meta(BIND if added else UNBIND, vhost=vhost, source=source.name, kind=kind,
                        dest=dest.name, key=key, args=args, arguments=arguments or {})
        self._apply(payload, 0, 0)
        self._add(payload)

    def enqueued(self, q, m: Message) -> None:
        """A message entered queue q: journaled when q is kept and the message is persistent."""
        if self.muted or m.pid or (q.vhost.name, q.name) not in self.queues or not (
                q.persists_all or is_persistent(m.header)):
            return
        pid = self.next_pid
        self.next_pid = pid + 1
        m.pid = pid
        payload = encode_message(pid, q.vhost.name, q.name, m)
        offset = self._add(payload)
        length = _head.size + len(payload)
        self.messages[pid] = [(q.vhost.name, q.name), offset, length, m.redelivered, None]
        self.live_bytes += length
        self.sync_needed = True

    def delivered(self, m: Message) -> None:
        entry = self.messages.get(m.pid)
        if entry is not None and not entry[3]:
            entry[3] = True
            self._add(DELIVERED + _u64.pack(m.pid))

    def returned(self, m) -> None:
        """A quorum queue took a delivered message back: its counts, so that a restart keeps them."""
        entry = self.messages.get(m.pid)
        if entry is not None:
            entry[3] = False
            entry[4] = (m.acquired_count, m.delivery_count)
            if not self.muted:
                self._add(RETURNED + _returned.pack(m.pid, m.acquired_count, m.delivery_count))

    def removed(self, msgs) -> None:
        """Messages gone for good (acked, auto-acked, rejected, expired, dropped, purged)."""
        pids = [m.pid for m in msgs if m.pid]
        live = [p for p in pids if p in self.messages]
        if not live:
            return
        for p in live:
            self.live_bytes -= self.messages.pop(p)[2]
        self._add(REMOVED + b"".join(_u64.pack(p) for p in live))

    # --- I/O, called by the server ---------------------------------------------------------------

    def _write_pending(self) -> None:
        if self.pending and self.fh is not None:
            self.fh.write(self.pending)
            self.size += len(self.pending)
            self.pending = bytearray()

    def commit(self) -> None:
        """Write what was buffered; fsync when a persistent message (or a stream chunk) was written (one
        fsync per file per batch); compact when the journal has grown past COMPACT_FACTOR x the live data.
        A deleted stream's file is removed only after its delete record is written."""
        if self.fh is None:
            return
        dirty, self.dirty_streams = self.dirty_streams, set()
        for slog in dirty:
            if not slog.deleted:
                slog.flush()
        if self.pending:
            self._write_pending()
            self.fh.flush()
            if self.sync_needed or dirty:
                os.fsync(self.fh.fileno())
                self.sync_needed = False
        for slog in dirty:
            if slog.deleted:
                slog.remove()
        if self.size > COMPACT_MIN_BYTES and self.size > COMPACT_FACTOR * (self.live_bytes + 4096):
            self.compact()

    def close(self) -> None:
        if self.fh is None:
            return
        self.commit()
        for slog in self.streams.values():
            slog.close()
        self._write_pending()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        self.fh = None
        self.lock_fh.close()


def encode_message(pid: int, vhost: str, queue: str, m: Message) -> bytes:
    v, q, x, k = vhost.encode(), queue.encode(), m.exchange.encode(), m.routing_key.encode()
    return b"".join((MESSAGE, _msg.pack(pid, len(v), len(q), len(x), len(k), len(m.header)),
                     v, q, x, k, m.header, m.body))


def decode_message(payload: bytes) -> Message:
    _pid, lv, lq, lx, lk, lh = _msg.unpack_from(payload, 1)
    p = 1 + _msg.size + lv + lq
    exchange = payload[p:p + lx].decode()
    p += lx
    rk = payload[p:p + lk].decode()
    p += lk
    header = payload[p:p + lh]
    return Message(exchange, rk, header, payload[p + lh:])


class StreamLog:
    """One kept stream's log, append-only in `streams/<n>.log` with the journal's framing. Records: S (a
    segment starts), C (a chunk: first offset, timestamp, size, its messages), K (a writer tracking chunk),
    D (retention removed the n oldest segments). Read back, they rebuild the stream's segments exactly, so
    offsets, chunk boundaries and timestamps are what they were. Rewritten at start when something was
    dropped (torn tail, retention)."""

    def __init__(self, store: Store, number: int):
        self.store = store
        self.number = number
        self.path = os.path.join(store.data_dir, STREAMS_DIR, f"{number}.log")
        self.pending = bytearray()
        self.fh = None
        self.deleted = False

    # hooks (encode only)

    def _add(self, payload: bytes) -> None:
        self.pending += _frame(payload)
        self.store.dirty_streams.add(self)

    def segment(self) -> None:
        self._add(SEGMENT)

    def chunk(self, chunk: Chunk) -> None:
        if chunk.records is None:
            self._add(TRACKING + _tracking.pack(chunk.first_offset, chunk.timestamp))
            return
        parts = [CHUNK, _chunk.pack(chunk.first_offset, chunk.timestamp, chunk.size, len(chunk.records))]
        for r in chunk.records:
            x, k = r.exchange.encode(), r.routing_key.encode()
            parts += (_rec.pack(len(x), len(k), len(r.header), len(r.body)), x, k, r.header, r.body)
        self._add(b"".join(parts))

    def dropped(self, n: int) -> None:
        self._add(DROP + _u32.pack(n))

    # I/O

    def flush(self) -> None:
        if not self.pending:
            return
        if self.fh is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fh = open(self.path, "ab")
        self.fh.write(self.pending)
        self.pending = bytearray()
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.flush()
        if self.fh is not None:
            self.fh.close()
            self.fh = None

    def remove(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def load(self) -> list:
        """The segments (lists of Chunks) the file holds, up to a torn tail (WARNING)."""
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return []
        segments: list = []
        rewrite = False
        pos, end = 0, len(data)
        while pos < end:
            length, crc = _head.unpack_from(data, pos) if end - pos >= _head.size else (None, None)
            start = pos + _head.size
            if length is None or start + length > end or zlib.crc32(data[start:start + length]) != crc:
                log.warning("data_dir %s: %s ends in a torn record at byte %d; recovered everything before "
                            "it and dropped the last %d bytes (a write torn by a crash)",
                            self.store.data_dir, self.path, pos, end - pos)
                rewrite = True
                break
            p = data[start:start + length]
            kind = p[:1]
            if kind == SEGMENT:
                segments.append([])
            elif kind == TRACKING:
                first, ts = _tracking.unpack_from(p, 1)
                segments[-1].append(Chunk(first, ts, None, TRACKING_CHUNK_SIZE))
            elif kind == DROP:
                del segments[:_u32.unpack_from(p, 1)[0]]
                rewrite = True
            else:
                first, ts, size, count = _chunk.unpack_from(p, 1)
                at = 1 + _chunk.size
                records = []
                for i in range(count):
                    lx, lk, lh, lb = _rec.unpack_from(p, at)
                    at += _rec.size
                    x = p[at:at + lx].decode()
                    at += lx
                    k = p[at:at + lk].decode()
                    at += lk
                    header = p[at:at + lh]
                    at += lh
                    records.append(Record(first + i, x, k, header, p[at:at + lb]))
                    at += lb
                # The filter is read back from the records' headers: the log's format has no field for it.
                segments[-1].append(Chunk(first, ts, records, size, record_values(records)))
            pos = start + length
        if rewrite:
            self._rewrite(segments)
        return segments

    def _rewrite(self, segments: list) -> None:
        for chunks in segments or [[]]:
            self.segment()
            for chunk in chunks:
                self.chunk(chunk)
        tmp = self.path + ".new"
        with open(tmp, "wb") as fh:
            fh.write(self.pending)
            fh.flush()
            os.fsync(fh.fileno())
        self.pending = bytearray()
        self.store.dirty_streams.discard(self)
        os.replace(tmp, self.path)

    def apply(self, q, segments: list) -> None:
        """Put the loaded segments into the StreamQueue q (declared empty a moment ago)."""
        if not segments:
            return
        q.segments = []
        total = 0
        for chunks in segments:
            seg = Segment()
            seg.chunks = chunks
            seg.size += sum(c.size for c in chunks)
            total += seg.size - LOG_HEADER_SIZE
            if q.segments:
                q.segments[-1].next = seg
            q.segments.append(seg)
        last = next((c for seg in reversed(q.segments) for c in reversed(seg.chunks)), None)
        q.next_offset = 0 if last is None else last.first_offset + last.count
        q.bytes = sum(seg.size for seg in q.segments)
        q.vhost.core.account(total)
