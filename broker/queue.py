"""Queues: where messages wait, the arguments that bound them, and round-robin delivery to consumers.

RabbitMQ's classic queue is the model: FIFO (or one FIFO per priority with `x-max-priority`), messages
requeued by a nack/reject/recover/channel close go back to their original place at the head with
`redelivered` set, `x-max-length`/`x-max-length-bytes` count ready messages only, TTL'd messages are
dropped when they reach the head, and every removal for a reason (rejected, expired, maxlen) is
dead-lettered when the queue has `x-dead-letter-exchange`.
"""

from __future__ import annotations

from collections import deque

from spark_amqp.codec import replies

from . import arguments as arguments_module
from . import limits, policies
from .message import FAILED, RETURNED, Message

class QueueArguments:
    """The values of a classic queue's `x-*` arguments, already checked by `arguments.check_declare`
    (406 with RabbitMQ's text on a bad value)."""

    def __init__(self, arguments: dict, queue_name: str):
        a = self.raw = dict(arguments or {})
        self.message_ttl = a.get("x-message-ttl")
        self.expires = a.get("x-expires")
        self.max_length = a.get("x-max-length")
        self.max_length_bytes = a.get("x-max-length-bytes")
        self.max_priority = a.get("x-max-priority")
        self.overflow = a.get("x-overflow") or "drop-head"
        self.dead_letter_exchange = a.get("x-dead-letter-exchange")
        self.dead_letter_routing_key = a.get("x-dead-letter-routing-key")


class FifoStore:
    """Ready messages of a queue without priorities, oldest first."""

    def __init__(self):
        self.items: deque[Message] = deque()

    def __len__(self):
        return len(self.items)

    def append(self, m: Message):
        self.items.append(m)

    def peek(self) -> Message | None:
        return self.items[0] if self.items else None

    def popleft(self) -> Message:
        return self.items.popleft()

    def requeue(self, msgs: list[Message]):
        _merge_at_head(self.items, msgs)

    def clear(self) -> list[Message]:
        out = list(self.items)
        self.items.clear()
        return out

    def heads(self):
        if self.items:
            yield self.items


class PriorityStore:
    """One FIFO per priority 0..max; the highest non-empty one is served first (RabbitMQ's rule)."""

    def __init__(self, max_priority: int):
        self.levels = [deque() for _ in range(max_priority + 1)]
        self.count = 0

    def __len__(self):
        return self.count

    def append(self, m: Message):
        self.levels[m.priority].append(m)
        self.count += 1

    def _top(self):
        for level in reversed(self.levels):
            if level:
                return level
        return None

    def peek(self):
        top = self._top()
        return top[0] if top else None

    def popleft(self):
        top = self._top()
        self.count -= 1
        return top.popleft()

    def requeue(self, msgs):
        by_level: dict[int, list] = {}
        for m in msgs:
            by_level.setdefault(m.priority, []).append(m)
        for p, group in by_level.items():
            _merge_at_head(self.levels[p], group)
        self.count += len(msgs)

    def clear(self):
        out = [m for level in reversed(self.levels) for m in level]
        for level in self.levels:
            level.clear()
        self.count = 0
        return out

    def heads(self):
        for level in reversed(self.levels):
            if level:
                yield level


def _merge_at_head(items: deque, msgs: list[Message]) -> None:
    """Put requeued messages back where they were: merged by arrival sequence into the head."""
    msgs = sorted(msgs, key=lambda m: m.seq)
    last = msgs[-1].seq
    earlier = []
    while items and items[0].seq < last:
        earlier.append(items.popleft())
    if earlier:
        merged = sorted(earlier + msgs, key=lambda m: m.seq)
    else:
        merged = msgs
    items.extendleft(reversed(merged))


class Queue:
    is_stream = False
    tracks_settlement = False   # told of acks too (Channel._apply_settle); a classic queue is not
    persists_all = False        # with a data_dir, only persistent messages (delivery mode 2) are journaled
    declare_is_use = True       # a (passive) redeclare restarts the x-expires timer
    queue_type = arguments_module.CLASSIC
    server_named = True     # a declare with an empty name gets an amq.gen-... name

    def __init__(self, vhost, name: str, durable: bool, exclusive_owner, auto_delete: bool,
                 arguments: dict, now: float):
        self.vhost = vhost
        self.name = name
        self.durable = durable
        self.exclusive_owner = exclusive_owner   # the owning Connection, or None
        self.auto_delete = auto_delete
        if "x-queue-master-locator" in arguments:
            # rabbit_classic_queue:declare: 4.x denies the deprecated feature; 3.10 crashes on a locator
            # that is not a string.
            if not vhost.core.behaviour.master_locator_allowed:
                raise arguments_module.deprecated_feature_denied("queue_master_locator")
            if not isinstance(arguments["x-queue-master-locator"], str):
                raise arguments_module.Crash()
        self.args = QueueArguments(arguments, name)     # what the queue acts on (arguments and policy)
        self.arguments = self.args.raw                  # the arguments as declared
        self.store = PriorityStore(self.args.max_priority) if self.args.max_priority else FifoStore()
        self.consumers: list = []
        self._rr = 0
        self.ready_bytes = 0
        self.next_seq = 0
        self.ever_consumed = False
        self.deleted = False
        self.last_used = now
        self.has_ttl = False       # some stored message carries an expiry deadline
        self.exclusive_consumer = None

    def apply_policy(self, definition: dict) -> None:
        """The effective policy definition (policies.py) changed: act on the settings resolved against the
        arguments (rabbit_amqqueue_process:process_args_policy). A lower length limit drops (dead-letters
        `maxlen`) from the head at once under drop-head; a message TTL applies to messages enqueued from now
        on (measured on both reference nodes)."""
        effective = policies.effective(self.arguments, definition, self.queue_type, self.vhost.core.behaviour)
        self.args = QueueArguments(effective, self.name)
        if self.args.overflow == "drop-head" and (self.args.max_length is not None
                                                 or self.args.max_length_bytes is not None):
            self._enforce_length()
        self.vhost.core.register_timed_queue(self)

    # --- enqueue -------------------------------------------------------------------------------

    def would_reject(self, m: Message, channel=None) -> bool:
        """x-overflow reject-publish: a publish that would exceed a limit is refused (and nacked)."""
        a = self.args
        if a.overflow == "drop-head":
            return False
        if a.max_length is not None and len(self.store) >= a.max_length:
            return True
        if a.max_length_bytes is not None and self.ready_bytes + len(m.body) > a.max_length_bytes:
            return True
        return False

    def timed(self) -> bool:
        """Whether the core's clock has work here: x-expires, or messages with a deadline."""
        return self.args.expires is not None or self.has_ttl

    def idle_expired(self, now: float) -> bool:
        """x-expires: no consumer and unused (no consume, get or redeclare) for that long."""
        expires = self.args.expires
        return expires is not None and not self.consumers and now - self.last_used >= expires

    def consumer_count(self) -> int:
        return len(self.consumers)

    def all_consumers(self) -> list:
        return self.consumers

    def consumer_timeout(self, consumer_arguments) -> None:
        """4.x never times out a classic queue's deliveries (3.10's channel does, whatever the queue)."""
        return None

    def check_consume(self, channel, m) -> None:
        """basic.consume: the consumer arguments (rabbit_amqqueue:check_consume_arguments), then exclusive
        use: an exclusive consumer, or an exclusive consume while others consume, is refused (403)."""
        arguments_module.check_consume(m.arguments or {}, self.queue_type, self.name, self.vhost.name,
                                       self.vhost.core.behaviour)
        if self.exclusive_consumer is not None or (m.exclusive and self.consumers):
            raise replies.channel_error(
                replies.ACCESS_REFUSED, f"queue '{self.name}' in vhost '{self.vhost.name}' in exclusive use")

    def check_delete(self, if_unused: bool, if_empty: bool) -> None:
        where = arguments_module.rs(self.name, self.vhost.name)
        if if_unused and self.consumers:
            raise replies.channel_error(replies.PRECONDITION_FAILED, f"{where} in use")
        if if_empty and self.message_count():
            raise replies.channel_error(replies.PRECONDITION_FAILED, f"{where} not empty")

    def drop_all(self) -> None:
        """The queue is deleted: its messages go (not dead-lettered)."""
        self.purge()

    def restore(self, m: Message, now: float, delivered: bool, counts) -> None:
        """A message read back from the data_dir journal at start (store.py), in publish order; one that was
        delivered and not acked comes back redelivered."""
        self.enqueue(m, now)

    def enqueue(self, m: Message, now: float) -> None:
        a = self.args
        m.seq = self.next_seq
        self.next_seq += 1
        if m.delivery_count:
            m.redelivered = True    # 4.x: a message that comes with failed deliveries counts as delivered
        if a.max_priority:
            m.priority = min(m.priority, a.max_priority)
        ttl = a.message_ttl
        if m.ttl is not None:
            ttl = m.ttl if ttl is None else min(ttl, m.ttl)
        if ttl == 0:
            # RabbitMQ: a message with TTL 0 goes to a consumer that can take it now, or expires.
            consumer = self._ready_consumer()
            if consumer is None:
                self.vhost.dead_letter(self, [m], "expired")
            else:
                consumer.channel.deliver(consumer, self, m, now)
            return
        if ttl is not None:
            m.expires_at = now + ttl
            if not self.has_ttl:
                self.has_ttl = True
                self.vhost.core.register_timed_queue(self)
        if self.durable and self.vhost.core.store is not None:
            self.vhost.core.store.enqueued(self, m)
        self.store.append(m)
        self.ready_bytes += len(m.body)
        self.vhost.core.account(len(m.body) + len(m.header))
        if a.max_length is not None or a.max_length_bytes is not None:
            self._enforce_length()
        self.vhost.core.wants_dispatch(self)

    def _enforce_length(self):
        a = self.args
        dropped = []
        while len(self.store) and (
                (a.max_length is not None and len(self.store) > a.max_length)
                or (a.max_length_bytes is not None and self.ready_bytes > a.max_length_bytes)):
            dropped.append(self._pop())
        if dropped:
            self.vhost.dead_letter(self, dropped, "maxlen")

    def _pop(self) -> Message:
        m = self.store.popleft()
        self.ready_bytes -= len(m.body)
        self.vhost.core.account(-(len(m.body) + len(m.header)))
        return m

    def settled(self, entries: list, outcome: str, now: float) -> None:
        """Deliveries settled other than by an ack: `entries` are (message, consumer or None), `outcome`
        one of message.py's. Returned ones go back to the head, the others are dead-lettered as rejected.
        Where the version counts failed deliveries (4.x) the count goes with a dead letter."""
        msgs = [m for m, _consumer in entries]
        if outcome in FAILED and self.vhost.core.behaviour.delivery_count_annotation:
            for m in msgs:
                m.delivery_count += 1
        if outcome in RETURNED:
            self.requeue(msgs, now)
        elif not self.deleted:
            self.vhost.dead_letter(self, msgs, "rejected")

    def requeue(self, msgs: list[Message], now: float) -> None:
        """Back to the head in original order, redelivered; what expired meanwhile is dropped and
        the length limits are applied again (both as RabbitMQ does on requeue)."""
        if self.deleted or not msgs:
            return
        expired = [m for m in msgs if m.expires_at is not None and m.expires_at <= now]
        if expired:
            msgs = [m for m in msgs if not (m.expires_at is not None and m.expires_at <= now)]
            self.vhost.dead_letter(self, expired, "expired")
        if not msgs:
            return
        for m in msgs:
            m.redelivered = True
            self.ready_bytes += len(m.body)
            self.vhost.core.account(len(m.body) + len(m.header))
        self.store.requeue(msgs)
        if self.args.max_length is not None or self.args.max_length_bytes is not None:
            self._enforce_length()
        self.vhost.core.wants_dispatch(self)

    # --- dequeue -------------------------------------------------------------------------------

    def take(self, now: float, no_ack: bool = True) -> Message | None:
        """The next live message, dropping (and dead-lettering) expired ones at the head (dispatch, and
        basic.get whatever its no-ack)."""
        store = self.store
        expired = None
        while len(store):
            m = store.peek()
            if m.expires_at is not None and m.expires_at <= now:
                (expired := expired or []).append(self._pop())
                continue
            m = self._pop()
            break
        else:
            m = None
        if expired:
            self.vhost.dead_letter(self, expired, "expired")
        return m

    def expire(self, now: float) -> None:
        """Drop expired messages at the head(s) (RabbitMQ expires only what reaches the head)."""
        if not self.has_ttl:
            return
        expired = []
        for head in self.store.heads():
            while head and head[0].expires_at is not None and head[0].expires_at <= now:
                m = head.popleft()
                if isinstance(self.store, PriorityStore):
                    self.store.count -= 1
                self.ready_bytes -= len(m.body)
                self.vhost.core.account(-(len(m.body) + len(m.header)))
                expired.append(m)
        if not len(self.store):
            self.has_ttl = False
        if expired:
            self.vhost.dead_letter(self, expired, "expired")

    def purge(self) -> int:
        msgs = self.store.clear()
        if self.vhost.core.store is not None:
            self.vhost.core.store.removed(msgs)
        self.ready_bytes = 0
        self.vhost.core.account(-sum(len(m.body) + len(m.header) for m in msgs))
        return len(msgs)

    def message_count(self) -> int:
        return len(self.store)

    # --- consumers -----------------------------------------------------------------------------

    def add_consumer(self, consumer) -> None:
        self.consumers.append(consumer)
        self.ever_consumed = True
        if consumer.exclusive:
            self.exclusive_consumer = consumer
        self.vhost.core.wants_dispatch(self)

    def remove_consumer(self, consumer) -> None:
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        if self.exclusive_consumer is consumer:
            self.exclusive_consumer = None
        if self.auto_delete and self.ever_consumed and not self.consumers and not self.deleted:
            self.vhost.delete_queue(self)

    def _ready_consumer(self):
        n = len(self.consumers)
        for _ in range(n):
            c = self.consumers[self._rr % n]
            self._rr += 1
            if c.can_take():
                return c
        return None

    def dispatch(self, now: float) -> bool:
        """Deliver to consumers with credit, round-robin. Returns True if more could go right away."""
        if type(self.store) is not FifoStore:
            return self._dispatch(now, self.take, self.store.__len__)
        # The common case inlined (the broker's per-message path): a live head is popped from the deque
        # here, and the queue's byte counts are settled once per call instead of once per message.
        items = self.store.items
        popleft = items.popleft
        take = self.take
        freed = [0, 0]      # [body bytes, body + header bytes] popped here

        def take_fifo(now: float) -> Message | None:
            m = items[0]
            if m.expires_at is not None and m.expires_at <= now:
                return take(now)        # drops (dead-letters) what expired at the head, then takes
            popleft()
            size = len(m.body)
            freed[0] += size
            freed[1] += size + len(m.header)
            return m

        try:
            return self._dispatch(now, take_fifo, items.__len__)
        finally:
            if freed[1]:            # bodies and headers: non-zero whenever anything was popped
                self.ready_bytes -= freed[0]
                self.vhost.core.account(-freed[1])

    def _dispatch(self, now: float, take, ready) -> bool:
        """dispatch's loop: `take(now)` gives the next live message of a non-empty store (or None), and
        `ready()` how many the store holds.

        Round-robin in rounds of the consumers' positions from `_rr`, each round visiting every position
        once, and `_rr` left where a loop visiting every position in turn leaves it (after the last
        delivery, or whole rounds on). A consumer that cannot take drops out of the rounds for the rest of
        the call: nothing inside a call gives one room again (acks and socket drains come between calls),
        and the source's four channels on one queue keep two of them full while the other two are
        refilled, which cost the broker a refused `can_take` per delivery (a tenth of its time)."""
        consumers = self.consumers
        sent = 0
        while ready() and consumers:
            n = len(consumers)
            start = self._rr
            order = [(k, consumers[(start + k) % n]) for k in range(n)]
            while True:
                progressed = False
                refused = None
                for k, c in order:
                    if not c.can_take():
                        refused = refused or set()
                        refused.add(k)
                        continue
                    m = take(now)
                    if m is None:
                        self._rr = start + k + 1
                        return False
                    c.channel.deliver(c, self, m, now)
                    progressed = True
                    sent += 1
                    if len(consumers) != n:
                        break
                    if not ready():
                        self._rr = start + k + 1
                        return False
                else:
                    start += n
                    self._rr = start
                    if not progressed:
                        return False
                    if sent >= limits.DISPATCH_BURST:
                        return bool(ready())
                    if refused:
                        order = [item for item in order if item[0] not in refused]
                    continue
                self._rr = start + k + 1      # the consumers changed: new rounds from the next position
                break
            if sent >= limits.DISPATCH_BURST:
                return bool(ready())
        return False
