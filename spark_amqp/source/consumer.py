"""The driver's side of queue mode: one connection, manual-ack consumers on each queue (one channel per
65,535 of prefetch, basic.qos's limit), batches of deliveries taken from them, and acks when Spark says a
batch is committed (or, with a journal, once its rows are durable).

Knows nothing of Spark. `take()` hands out deliveries already received (the consumers' prefetch keeps them
flowing while Spark runs a batch), `take_more()` adds to a batch that fills part by part;
`ack_through(seq)` acks every batch numbered `seq` or lower with one `basic.ack(multiple)` per channel,
`ack_taken(seq)` the parts of a filling batch taken so far. A lost channel or connection is reopened with
backoff on the next call; deliveries taken on a dead channel are never acked (their tags mean nothing on a
new channel): the broker redelivers them, which is the at-least-once promise.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from ..client import (AMQPError, AuthenticationError, ChannelClosedError, ConnectError, Connection,
                      ConsumerCancelledError)
from ..client.uri import parse_uri, redact
from ..options import connect_kwargs
from .bounds import bounds

log = logging.getLogger("spark_amqp.source")

RECONNECT_BACKOFF = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
# Seconds to wait for the close-ok of a connection that is being replaced after a loss.
ABANDON_TIMEOUT = 0.5


class SourceError(RuntimeError):
    """A problem the user must fix (missing queue, refused credentials, unreachable broker)."""


class QueueMissingError(SourceError):
    """A queue to read is not there (404). At the start and after a reconnect alike this fails the query:
    retrying would run empty batches for ever (a deleted queue, or a broker restarted without it)."""


class OptionRefusedError(SourceError):
    """The broker refused what an option asked of a consumer (`consumerTimeout` on a queue type without
    consumer timeouts). At the start and after a reconnect alike this fails the query."""


@dataclass
class ConsumerTimeout:
    """The broker timed out a consumer of `queue` (a delivery stayed unacked longer than it allows):
    `returned` deliveries this query had received went back to the queue with it."""
    queue: str
    cause: str
    returned: int


def consumer_timeout_cause(error) -> str | None:
    """The broker's own words if `error` (why a channel closed) is RabbitMQ's consumer timeout: channel.close
    406 "delivery acknowledgement on channel N timed out" (RabbitMQ 3.x; 4.x for a client without
    consumer_cancel_notify), else None."""
    if (isinstance(error, ChannelClosedError) and error.reply_code == 406
            and "delivery acknowledgement" in error.reply_text and "timed out" in error.reply_text):
        return f"{error.reply_code} {error.reply_text}"
    return None


@dataclass
class QueueState:
    """One queue and the channels consuming it (one per bounds.PREFETCH_MAX of prefetch)."""
    name: str
    channels: list = field(default_factory=list)

    @property
    def channel(self):
        return self.channels[0] if self.channels else None


@dataclass
class Part:
    """What one channel gave a batch: the deliveries that are rows, and the highest tag to ack."""
    queue: str
    channel: object
    deliveries: list
    last_tag: int
    body_bytes: int = 0           # the deliveries' bodies, as take() counted them
    keys: list | None = None      # the journal's keys of `deliveries` (journalPath), set by the reader
    acked: bool = False           # its ack went out (`ack_taken` while its batch fills, or `ack_through`)


@dataclass
class Batch:
    """Deliveries of one micro-batch, by the channel they came on."""
    seq: int
    parts: list = field(default_factory=list)
    handed_off: bool = False    # its rows are in handoff files, and its deliveries' bodies were let go

    @property
    def deliveries(self) -> list:
        """[(queue name, [Delivery, ...]), ...], rows in that order."""
        return deliveries_by_queue(self.parts)

    def body_bytes(self) -> int:
        """The bodies' bytes in all, as taken (a handoff lets the bodies themselves go)."""
        return sum(p.body_bytes for p in self.parts)

    @property
    def count(self) -> int:
        return sum(len(p.deliveries) for p in self.parts)


def deliveries_by_queue(parts: list[Part]) -> list[tuple[str, list]]:
    """[(queue name, [Delivery, ...]), ...] of `parts` (of a batch, or some of its parts), rows in that order."""
    return [(p.queue, p.deliveries) for p in parts]


def let_go_bodies(deliveries_by_queue: list[tuple[str, list]]) -> None:
    """Driver: these deliveries' rows are in a handoff file, so their bodies go (the deliveries stay, for the
    count, the acks and the backlog), and the next deliveries arrive into the memory they held."""
    for _, deliveries in deliveries_by_queue:
        for d in deliveries:
            d.body = b""


def put_back_bodies(deliveries_by_queue: list[tuple[str, list]], bodies: list[bytes]) -> None:
    """Driver: the bodies `let_go_bodies` let go, read back from their file, in the rows' order."""
    at = 0
    for _, deliveries in deliveries_by_queue:
        for d in deliveries:
            d.body = bodies[at]
            at += 1


class QueueConsumer:
    def __init__(self, options, journal=None, sized_start: bool = False):
        """`sized_start`: without the `prefetch` option, consume with bounds.FIRST_PREFETCH until the first
        batch shows the messages' size (`_fit_prefetch`), so that large messages never arrive 200,000 at
        once. Not for a reader whose first batch is the whole run (PySpark 4.0/4.1 under availableNow)."""
        self.options = options
        self.journal = journal      # BatchJournal (journalPath): redelivered copies it holds are dropped
        self.queues = [QueueState(name) for name in options["queue"]]
        self.sized_start = sized_start
        self.rabbitmq = False       # the broker said it is RabbitMQ (at the first connect)
        self.conn: Connection | None = None
        self.batches: dict[int, Batch] = {}
        self._acks_unconfirmed: list = []   # journal: (what, parts by batch, failed channels, answers) per ack
        self.consuming = False      # consumers started (connect() or the first take())
        self.taken: dict[str, int] = {}     # deliveries taken into batches so far, per queue
        self._ready: dict[str, tuple[int, int]] = {}   # per queue: (broker's ready count, received then)
        self._failures = 0
        self._next_attempt = 0.0
        self.generation = 0         # connections opened so far (the current one's number)
        self.fresh_in: dict[str, int] = {}   # per queue: the last generation that delivered a message not redelivered
        self._taken_bytes = 0       # body bytes taken into batches so far (with `taken`: their mean size)
        self.copies_dropped = 0     # journal: redelivered copies acked and left out of the rows (_drop_copies)
        self._pending_mean: float | None = None  # the mean body size received, before any take (availableNow)
        self.timeouts: list[ConsumerTimeout] = []   # the broker's consumer timeouts not yet reported
        self.prefetch = self.bounds().prefetch      # per queue, as the consumers run now: _fit_prefetch

    # --- session ---------------------------------------------------------------------------------

    def connect(self, consume: bool = True) -> None:
        """Open the connection and a channel per queue (declaring/binding as asked), and start the
        consumers if `consume` (else the first `take()` starts them: until then nothing is prefetched).

        User errors (bad credentials, missing queue, unreachable broker on the first connect) raise
        SourceError with a message that names the problem and never the password."""
        uri = self.options["uri"]
        try:
            self.conn = Connection.open(uri, **connect_kwargs(self.options))
        except AuthenticationError as exc:
            raise SourceError(f"the broker refused the credentials for {redact(uri)}: {exc}") from None
        except ConnectError as exc:
            raise SourceError(f"cannot reach the AMQP broker: {exc}") from None
        if not self.generation:     # before any consumer starts: RabbitMQ's default prefetch differs
            self.rabbitmq = str(self.conn.server_properties.get("product", "")) == "RabbitMQ"
            self.prefetch = self.bounds().prefetch
        self.consuming = self.consuming or consume
        try:
            for q in self.queues:
                self._open_queue(q)
            if self.consuming:
                for q in self.queues:
                    self._consume(q)
        except ChannelClosedError as exc:
            self.close()
            if exc.reply_code == 404:
                raise QueueMissingError(
                    f"queue or exchange not found on {redact(uri)} (vhost '{parse_uri(uri).vhost}', "
                    f"queue(s) {', '.join(q.name for q in self.queues)}): {exc.reply_text} (declare it "
                    "first, or set option declare=declare)") from None
            raise SourceError(f"cannot consume from {self.options['queue']} on {redact(uri)}: {exc}") from None
        self._failures = 0
        self.generation += 1

    def bounds(self, max_rows: int | None = None, in_parts: bool = False):
        """Driver: `bounds.bounds()` for this consumer now (prefetch, channels per queue, the next batch's
        size), from the options, the broker and the mean size of what it has taken so far."""
        return bounds(self.options, rabbitmq=self.rabbitmq, mean_size=self._mean_size(),
                      current=self.prefetch if self.consuming else None,
                      sized_start=self.sized_start, max_rows=max_rows, in_parts=in_parts)

    @property
    def batch_bytes(self) -> int:
        """maxBytesPerTrigger: the bodies' bytes a batch takes, at most about."""
        return self.options["maxBytesPerTrigger"]

    @property
    def channels_per_queue(self) -> int:
        """Consuming channels per queue: one per bounds.PREFETCH_MAX of the ceiling (basic.qos's limit)."""
        return self.bounds().channels

    def _open_queue(self, q: QueueState) -> None:
        o = self.options
        ch = self.conn.channel()
        q.channels = [ch]
        mode = o.get("declare", "passive")
        if mode == "declare":
            arguments = dict(o.get("queueArguments") or {})
            if o.get("queueType") == "quorum":
                arguments.setdefault("x-queue-type", "quorum")
            ch.queue_declare(q.name, durable=o.get("durable", True), arguments=arguments)
            if o.get("exchange"):
                for key in o.get("bindingKeys") or [q.name]:
                    ch.queue_bind(q.name, o["exchange"], key)
        elif mode == "passive":
            ch.queue_declare(q.name, passive=True)

    def _consume(self, q: QueueState, nowait: bool = False, prefetch: int | None = None) -> None:
        """Manual-ack consumers on the queue, `prefetch` (default: the whole prefetch) shared among its
        channels (`nowait`: without waiting for consume-ok, for consumers restarted where they ran before)."""
        share = -(-(prefetch or self.prefetch) // self.channels_per_queue)
        while len(q.channels) < self.channels_per_queue:
            q.channels.append(self.conn.channel())
        # Every qos before any consume: a qos-ok comes behind the deliveries sent before it on the
        # connection, so a qos after another channel's new consumer waited for that consumer's prefetch to be
        # read (three such waits held the first batch after the sized start back by 0.27 s, py-spy).
        for ch in q.channels:
            ch.basic_qos(share)
        timeout = self.options.get("consumerTimeout")
        arguments = {"x-consumer-timeout": timeout} if timeout else None
        for ch in q.channels:
            try:
                ch.basic_consume(q.name, arguments=arguments, nowait=nowait)
            except ChannelClosedError as exc:
                if arguments and exc.reply_code == 406 and "x-consumer-timeout" in exc.reply_text:
                    raise OptionRefusedError(
                        f"option 'consumerTimeout': got {timeout}; the broker refused it for queue {q.name!r} "
                        f"({exc.reply_text}): RabbitMQ 4.x times out consumers of quorum queues only, and "
                        "a classic queue's never, so leave the option unset for this queue") from None
                raise

    def start_consuming(self) -> None:
        """Start the consumers (once; a reconnect restarts them by itself)."""
        if not self.consuming and self.ensure_connected():
            self.consuming = True
            for q in self.queues:
                try:
                    self._consume(q)
                except AMQPError as exc:
                    log.warning("AMQP source: cannot consume from %s (%s); reconnecting", q.name, exc)
                    self._drop(q)

    def ensure_connected(self) -> bool:
        """Reconnect after a loss, with backoff; False while waiting for the next attempt."""
        if self.conn is not None and self.conn.is_open and all(
                q.channels and all(ch.is_open for ch in q.channels) for q in self.queues):
            return True
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        for q in self.queues:
            self._note_closed(q)
        # A connection being replaced is broken: waiting for its close-ok (up to 5 s, and 5 s more for its
        # reader thread) would stall the trigger whenever the peer takes our bytes and never answers.
        self.close(timeout=ABANDON_TIMEOUT)
        try:
            self.connect(consume=self.consuming)
        except (QueueMissingError, OptionRefusedError):
            raise
        except (SourceError, AMQPError, OSError) as exc:
            delay = RECONNECT_BACKOFF[min(self._failures, len(RECONNECT_BACKOFF) - 1)]
            self._failures += 1
            self._next_attempt = now + delay
            log.warning("AMQP source: reconnect failed (%s); retrying in %.1f s", exc, delay)
            return False
        log.info("AMQP source: connected to %s", redact(self.options["uri"]))
        return True

    def release_held(self, timeout: float = 5.0) -> int:
        """Driver, at the query's stop: deliveries received and in no batch go back to their queues
        uncounted (Channel.release_pending: on RabbitMQ 4.x a quorum queue's delivery limit then counts
        only the batches Spark was given). Returns how many; a broken connection releases nothing (the
        broker returns them when it notices)."""
        released = 0
        for q in self.queues:
            for ch in q.channels:
                try:
                    released += ch.release_pending(timeout)
                except (AMQPError, OSError, TimeoutError):
                    pass
        return released

    def pause(self) -> int:
        """Driver, between triggers far apart: stop the consumers and hand back what they sent that no batch
        has taken (`release_held`), so that nothing waits unacked here until the next trigger, nearer the
        broker's consumer timeout; the next `start_consuming()` starts them again. Returns how many went
        back."""
        released = self.release_held()
        self.consuming = False
        return released

    def close(self, timeout: float = 5.0) -> None:
        """Close the connection, waiting up to `timeout` s for the broker's close-ok (the query's stop)."""
        if self.conn is not None:
            try:
                self.conn.close(timeout)
            except Exception:
                pass
        self.conn = None
        for q in self.queues:
            q.channels = []

    # --- batches -----------------------------------------------------------------------------------

    def take(self, seq: int, max_count: int, wait: float = 0.0) -> Batch:
        """Record batch `seq` from deliveries already received (up to max_count in all, and bodies of
        about maxBytesPerTrigger: the delivery that reaches it is the last; waits up to `wait` seconds for
        the first one). A batch of zero deliveries is still recorded."""
        batch = Batch(seq)
        self._take_into(batch, max_count, wait)
        self.batches[seq] = batch
        self._fit_prefetch()
        return batch

    def take_more(self, seq: int, max_count: int, wait: float = 0.0) -> list[Part]:
        """Add to batch `seq` (recorded by `take`) up to `max_count` more deliveries already received, within
        what is left of maxBytesPerTrigger; returns the new parts. For a batch that fills part by part."""
        batch = self.batches[seq]
        before = len(batch.parts)
        self._take_into(batch, max_count, wait)
        self._fit_prefetch()
        return batch.parts[before:]

    def _take_into(self, batch: Batch, max_count: int, wait: float) -> None:
        self.start_consuming()
        if self.ensure_connected():
            remaining = max_count
            bytes_left = self.batch_bytes - batch.body_bytes()
            deadline = time.monotonic() + wait
            channels = [(q, ch) for q in self.queues for ch in q.channels]
            for q, ch in channels:
                if remaining <= 0 or bytes_left <= 0:
                    break
                try:
                    timeout = max(0.0, deadline - time.monotonic()) if remaining == max_count else 0.0
                    got = ch.get_deliveries(remaining, timeout=timeout / len(channels), max_bytes=bytes_left)
                except ConsumerCancelledError:
                    self._broker_cancelled(q, ch)
                    continue
                except AMQPError as exc:
                    log.warning("AMQP source: lost channel for %s (%s); reconnecting", q.name, exc)
                    self._drop(q)
                    continue
                if got and not got[-1].redelivered:
                    # The broker puts redelivered messages back at the head of the queue: once one that is
                    # not redelivered arrives, the copies released by earlier connections have all come.
                    self.fresh_in[q.name] = self.generation
                if got and self.journal is not None:
                    got = self._drop_copies(q.name, ch, got)
                if got:
                    size = sum(len(d.body) for d in got)
                    bytes_left -= size
                    self._taken_bytes += size
                    self.taken[q.name] = self.taken.get(q.name, 0) + len(got)
                    batch.parts.append(Part(q.name, ch, got, got[-1].delivery_tag, size))
                    remaining -= len(got)

    def _drop_copies(self, queue: str, ch, got: list) -> list:
        """Journal: the redelivered copies of journaled messages are acked now, one by one (a multiple ack
        would ack this batch's own deliveries before their commit), and left out of the rows."""
        kept = []
        claimed = []
        for d in got:
            key = self.journal.claim(queue, d) if d.redelivered else None
            if key is None:
                kept.append(d)
                continue
            claimed.append(key)
            try:
                ch.basic_ack(d.delivery_tag)
            except AMQPError:
                pass        # the channel is gone: the round trip below fails too
        if claimed:
            try:
                self._acks_taken(ch, queue)
            except AMQPError:
                for key in claimed:
                    self.journal.release(key)   # comes back again, and is matched again
            else:
                self.journal.acked_copies(claimed)
                self.copies_dropped += len(claimed)
        return kept

    def _acks_taken(self, channel, queue: str) -> None:
        """Driver, journal only: a round trip on `channel` after its acks (a passive declare of `queue`), so
        that an ack counts as done only once the broker has answered behind it. Writing an ack raises
        nothing when the broker is already dead or never reads it (killed a moment after, or stopped), and
        the message, redelivered after its restart, would be read twice. The embedded broker answers only
        after the ack is in its journal; RabbitMQ, after its queue has taken the ack (channel order). Raises
        AMQPError when no answer comes: the acks are then in doubt, and their keys stay expected."""
        channel.queue_declare(queue, passive=True)

    def _mean_size(self) -> float | None:
        count = sum(self.taken.values())
        return self._taken_bytes / count if count and self._taken_bytes else self._pending_mean

    def fit_prefetch_to_pending(self) -> bool:
        """Driver, before an availableNow run's first batch, once its first deliveries are here: with nothing
        taken yet, the size of those received (the sized start's FIRST_PREFETCH) sets the prefetch now
        (`_fit_prefetch`), so that the first batch is a full one, not half the sized start's (a cold run of
        300,000 x 100 B spent a whole trigger, the costliest of the run, on 1,000 rows). True if it did."""
        if sum(self.taken.values()) or self.options.get("prefetch"):
            return False
        count = self.pending()
        size = sum(ch.pending_body_bytes for q in self.queues for ch in q.channels)
        if not count or not size:
            return False
        self._pending_mean = size / count
        self._fit_prefetch()
        return True

    def batch_size(self, max_rows: int | None = None, in_parts: bool = False) -> int:
        """Driver: how many deliveries the next batch takes (half the prefetch, or bounds.PARTS_BATCH for a
        batch that fills part by part; at most `max_rows` and maxBytesPerTrigger by the mean body size so
        far: `bounds.bounds`)."""
        return self.bounds(max_rows, in_parts).batch

    def _fit_prefetch(self) -> None:
        """Driver, after each take, without the `prefetch` option: once message sizes are known, the
        prefetch `bounds()` gives (two batches of maxBytesPerTrigger, within a factor of two of the current
        one, at most the ceiling) replaces the current one: 4 KB messages lower it, the sized start's
        FIRST_PREFETCH (or messages that shrank) raise it. RabbitMQ applies a channel's basic.qos to consumers started after it: to
        lower it, each consumer is cancelled and started again (the deliveries it already sent stay unacked
        on the channel, acked with their batches); to raise it, more consumers start beside the running
        ones, for the difference. (Restarted at the higher prefetch, the new consumers would fill it beside
        what the cancelled ones had sent: the sized start's 2,000 raised to 7,812 left 9,812 unacked.)"""
        mean = self._mean_size()
        if self.options.get("prefetch") or mean is None or not self.consuming:
            return
        fitted = self.bounds().prefetch
        if fitted == self.prefetch:
            return
        log.info("AMQP source: prefetch %d -> %d per queue (messages of %.0f bytes, maxBytesPerTrigger %d)",
                 self.prefetch, fitted, mean, self.batch_bytes)
        more = fitted - self.prefetch
        self.prefetch = fitted
        for q in self.queues:
            try:
                if more < 0:
                    for ch in q.channels:
                        for tag in ch.consumer_tags:
                            ch.basic_cancel(tag)
                # RabbitMQ answers a consume after serving the consumers started before it: waiting
                # for each consume-ok held the first batch back by ~0.45 s (measured, 4 channels).
                self._consume(q, nowait=True, prefetch=more if more > 0 else None)
            except AMQPError as exc:
                log.warning("AMQP source: lost channel for %s while changing its prefetch (%s); reconnecting",
                            q.name, exc)
                self._drop(q)

    def reading_paused(self):
        """Driver: a block in which the connection's reader thread leaves the socket alone
        (`Connection.reading_paused`), for work on deliveries already taken; nothing if not connected."""
        if self.conn is None or not self.conn.is_open:
            return contextlib.nullcontext()
        return self.conn.reading_paused()

    def pending(self) -> int:
        """Deliveries received and not yet in a batch."""
        return sum(ch.pending_deliveries for q in self.queues for ch in q.channels)

    def wait_pending(self, count: int, timeout: float, idle: float = 0.1) -> int:
        """Wait up to `timeout` seconds until `count` deliveries are pending, while they keep arriving (once
        the first is here, at most `idle` seconds without one). Returns how many are pending."""
        deadline = time.monotonic() + timeout
        last, last_change = self.pending(), time.monotonic()
        while last < count:
            now = time.monotonic()
            if now > deadline or (last and now - last_change > idle):
                break
            time.sleep(0.01)
            current = self.pending()
            if current != last:
                last, last_change = current, time.monotonic()
        return last

    @staticmethod
    def _queue_exists(channel, queue: str) -> bool:
        """Driver: whether `queue` is still there (a passive declare on `channel`, which a 404 closes)."""
        try:
            channel.queue_declare(queue, passive=True)
            return True
        except AMQPError:
            return False

    def _timed_out(self, q: QueueState, cause: str) -> None:
        """Driver: the broker timed out a consumer of `q`; everything this query holds unacked from `q`
        (deliveries in planned batches and received ones) goes back to the queue as the channels are
        dropped. Recorded in `timeouts` for the reader to report (it decides whether the query fails)."""
        in_batches = sum(len(part.deliveries) for batch in self.batches.values() for part in batch.parts
                         if part.queue == q.name and part.channel in q.channels and not part.acked)
        held = sum(ch.pending_deliveries for ch in q.channels)
        self.timeouts.append(ConsumerTimeout(q.name, cause, in_batches + held))

    def check_timeouts(self) -> None:
        """Driver, as a trigger starts, before any ack: a queue whose consumer the broker has timed out since
        (a channel closed with RabbitMQ 3.x's 406, or on 4.x a consumer cancelled while its queue exists) is
        recorded in `timeouts` and its channels dropped, so that nothing is acked or taken on them (RabbitMQ
        4.x has already put the timed-out deliveries back: an ack of their tags removes nothing, and serves
        the cancelled consumer again, which then receives their copies: read twice, silently)."""
        for q in self.queues:
            cancelled = next((ch for ch in q.channels if ch.cancelled_by_broker and ch.is_open), None)
            if cancelled is not None:
                self._broker_cancelled(q, cancelled)
            elif any(consumer_timeout_cause(ch.closed_by) for ch in q.channels):
                self._drop(q)       # notes the timeout

    def _broker_cancelled(self, q: QueueState, channel) -> None:
        """Driver: the broker cancelled a consumer of `q` on `channel` (basic.cancel). While the queue
        exists that is RabbitMQ 4.x's consumer timeout on a quorum queue (recorded, `_timed_out`); else the
        queue is gone. Either way `q`'s channels are dropped (the reconnect reports a missing queue)."""
        if self._queue_exists(channel, q.name):
            self._timed_out(q, "the broker cancelled the consumer while the queue exists (RabbitMQ 4.x does "
                               "so at a quorum queue's consumer timeout)")
        else:
            log.warning("AMQP source: the broker cancelled the consumer on %s; reconnecting", q.name)
        self._drop(q)

    def _note_closed(self, q: QueueState) -> None:
        """Driver, before `q`'s channels are forgotten: the broker's consumer timeout, if that is why one of
        them closed, is recorded (`_timed_out`)."""
        cause = next(filter(None, (consumer_timeout_cause(ch.closed_by) for ch in q.channels)), None)
        if cause is not None:
            self._timed_out(q, cause)

    def _drop(self, q: QueueState) -> None:
        """Forget a queue's channels (the next call reconnects everything)."""
        self._note_closed(q)
        for ch in q.channels:
            try:
                if ch.is_open:
                    ch.close()
            except Exception:
                pass
        q.channels = []

    def ack_through(self, seq: int) -> int:
        """Ack every batch numbered <= seq (Spark committed them, or their journal files are durable), those
        parts that `ack_taken` acked already aside. Returns the number of messages acked. With the journal,
        the round trip behind the acks (see `_acks_taken`) is sent here and its answer taken by
        `confirm_acks`, at the next commit: by then the answer has come behind the deliveries the broker sent
        meanwhile, which waiting for it here would have the driver parse first."""
        done = sorted(s for s in self.batches if s <= seq)
        if not done:
            return 0
        return self._ack({s: self.batches.pop(s) for s in done}, f"through batch {seq}", final=True)

    def ack_taken(self, seq: int) -> int:
        """Driver, journal only: ack the parts of batch `seq` taken so far and not acked yet, while the batch
        goes on filling (each part's journal file is durable). Returns the number of messages acked."""
        batch = self.batches.get(seq)
        return self._ack({seq: batch}, f"in batch {seq}", final=False) if batch is not None else 0

    def _ack(self, batches: dict, what: str, final: bool) -> int:
        """Ack the parts of `batches` not acked yet, one `basic.ack(multiple)` per channel up to its highest
        tag: every lower tag on the channel is in a batch acked already or in these parts (deliveries are
        taken in order; redelivered copies are acked one by one as they are dropped). `final`: the batches
        get no more parts (their journal counts may then be dropped whole: `confirm_acks`)."""
        highest: dict = {}
        queue_of: dict = {}
        count = 0
        live_parts = {}
        for s, batch in batches.items():
            parts = [part for part in batch.parts if not part.acked]
            live = [part for part in parts if part.channel.is_open]
            # (batch, the parts acked here on live channels, whether these are all of its parts)
            live_parts[s] = (batch, live, final and len(parts) == len(batch.parts))
            for part in live:
                highest[part.channel] = max(part.last_tag, highest.get(part.channel, 0))
                queue_of[part.channel] = part.queue
            for part in parts:
                part.acked = True
                count += len(part.deliveries)
        failed = set()
        answers = {}
        for channel, tag in highest.items():
            try:
                channel.basic_ack(tag, multiple=True)
                if self.journal is not None:
                    answers[channel] = channel.queue_declare_later(queue_of[channel])
            except AMQPError as exc:
                failed.add(channel)
                log.warning("AMQP source: could not ack %s (%s); the broker will redeliver what it did not "
                            "take", what, exc)
        if self.journal is not None:
            self._acks_unconfirmed.append((what, live_parts, failed, answers))
        return count

    def confirm_acks(self) -> None:
        """Driver, journal only: take the answers to the round trips `ack_through` and `ack_taken` sent
        behind their acks and tell the journal which batches' deliveries the broker took. A channel that
        closed before its answer leaves its deliveries' keys expected: the broker redelivers what it did not
        take."""
        for what, live_parts, failed, answers in self._acks_unconfirmed:
            for channel, answer in answers.items():
                try:
                    answer.wait()
                except AMQPError as exc:
                    failed.add(channel)
                    log.warning("AMQP source: could not learn that the broker took the acks %s (%s); it will "
                                "redeliver what it did not take", what, exc)
            for s, (batch, live, all_parts) in live_parts.items():
                acked = [part for part in live if part.channel not in failed]
                self.journal.acked_batch(s, [part.keys for part in acked if part.keys],
                                         whole=all_parts and len(acked) == len(batch.parts))
        self._acks_unconfirmed = []

    def ready_count(self) -> int:
        """Messages ready in the queues now plus those received and not yet in a batch. Exact before the
        consumers start; afterwards it misses deliveries the broker has sent and we have not received."""
        total = 0
        if not self.ensure_connected():
            return 0
        for q in self.queues:
            try:
                total += q.channel.queue_declare(q.name, passive=True).message_count
                total += sum(ch.pending_deliveries for ch in q.channels)
            except AMQPError:
                self._drop(q)
        return total


    def backlog(self, ask_broker: bool) -> dict:
        """Per queue, what is not yet acked: `ready` in the broker, `unacked` (delivered to this source and
        not acked: in planned batches or held) and `held` (received, not yet in a batch). For the query's
        progress; never raises (a queue whose channel is lost reads ready = None).

        `ready` is the broker's own count (a passive queue.declare) when `ask_broker`; otherwise the last
        count less what has been received since. The round trip's reply waits behind the deliveries already
        on the wire, so the caller asks only now and then while batches flow (in the read benchmark, asking
        on every trigger and every 5 s gave the same throughput within noise)."""
        out = {}
        in_batches: dict[str, int] = {}
        for batch in self.batches.values():
            for part in batch.parts:
                if not part.acked:
                    in_batches[part.queue] = in_batches.get(part.queue, 0) + len(part.deliveries)
        connected = self.conn is not None and self.conn.is_open
        for q in self.queues:
            held = sum(ch.pending_deliveries for ch in q.channels)
            received = self.taken.get(q.name, 0) + held
            if ask_broker and connected and q.channel is not None:
                try:
                    self._ready[q.name] = (q.channel.queue_declare(q.name, passive=True).message_count, received)
                except AMQPError:
                    self._drop(q)
                    self._ready.pop(q.name, None)
            known = self._ready.get(q.name)
            ready = max(0, known[0] - (received - known[1])) if known else None
            out[q.name] = {"ready": ready, "unacked": in_batches.get(q.name, 0) + held, "held": held}
        return out

