"""Quorum queues (`x-queue-type=quorum`) as RabbitMQ serves them to AMQP 0-9-1 clients: rabbit_fifo's rules
on one node, with 4.3's behaviour or 3.10's where the version setting says so (versions.Behaviour).

What a client sees, and so what this module keeps:

- Ready messages wait in a `returns` FIFO (messages given back by a consumer), served first, then in
  priority FIFOs: 4.x has 32 levels (a message without the priority property is level 4; higher first,
  FIFO within a level), 3.10 one. 3.10 puts messages returned by nack, reject or recover at the tail
  when no delivery limit is set.
- Every message counts how often it was taken back: 4.x's `acquired_count` (every return; x-acquired-count)
  and `delivery_count` (failed deliveries only: basic.reject, a consumer's channel gone; x-delivery-count);
  3.10's delivery count counts every return. A return past the delivery limit (4.x: 20 unless set, a
  negative limit none; 3.10: none unless set) dead-letters the message as `delivery_limit`.
- `x-max-length` / `x-max-length-bytes` count ready messages and those kept for at-least-once
  dead-lettering, never unacked ones: drop-head drops what would be delivered next (dead-lettered
  `maxlen`); reject-publish refuses (nacks) publishes once the queue is over the limit, until it is back
  at 80% of it. reject-publish-dlx is drop-head.
- Message TTL is checked at the heads only; an unacked message never expires. `x-expires` deletes an
  unused queue on the queue's own 5-second tick.
- Single active consumer (4.x: a waiting consumer of higher priority takes over once the active one has
  nothing unacked); consumer priorities; exclusive consume is not enforced; declare-ok's consumer count
  also counts cancelled consumers that still hold messages and unsettled basic.gets.
- Dead letters at most once (published as they go), or at least once (kept, counted against the limits,
  retried until every queue the dead-letter exchange routes them to took them).
- 4.x's consumer timeout: a delivery unacked past its consumer's timeout (x-consumer-timeout, else the lower
  of the queue's argument and policy, else the broker's consumer_timeout) comes back (x-acquired-count, not a
  failed delivery), and its consumer gets nothing more until the client has settled those delivery tags; a
  single active consumer left holding nothing makes way for the next one (the channel does the rest).

The effective value of each setting comes from `effective_config`, from the queue's arguments resolved with
its policy (policies.effective).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

from spark_amqp.codec import fields, properties, replies

from . import arguments, limits, policies
from .arguments import QUORUM, rs
from .message import ACK, DISCARD, DOWN, FAILED, RETURNED, TIMEOUT, Message

# rabbit_fifo (4.x): priorities 0..31, a message without a priority property is 4.
MAX_PRIORITY = 31
DEFAULT_PRIORITY = 4
# rabbit_fifo.hrl LOW_LIMIT: a reject-publish queue takes publishes again at 80% of its limits.
SOFT_LIMIT = 0.8

_PRIORITY_FLAG = properties.FLAG["priority"]


@dataclass(frozen=True)
class QuorumConfig:
    """A quorum queue's effective settings (rabbit_quorum_queue:gather_policy_config): what the queue acts
    on, after arguments (and, later, policies) are resolved."""
    max_length: int | None
    max_bytes: int | None
    reject_publish: bool              # overflow reject-publish (else drop-head)
    delivery_limit: int | None        # None: unlimited
    delivery_limit_set: bool          # a limit was given at all (3.10: decides where returns go)
    expires: int | None
    message_ttl: int | None
    dead_letter_exchange: str | None
    dead_letter_routing_key: str | None
    at_least_once: bool
    single_active: bool
    consumer_timeout: int | None = None   # 4.x: the lower of x-consumer-timeout and the policy's consumer-timeout


def effective_config(args: dict, behaviour) -> QuorumConfig:
    """The queue's settings from its effective arguments (its x-arguments resolved with its policy by
    policies.effective, as rabbit_quorum_queue:gather_policy_config resolves them)."""

    def lookup(key):
        return args.get("x-" + key)

    overflow = lookup("overflow")
    limit_value = lookup("delivery-limit")
    if arguments.is_int(limit_value):
        limit = None if limit_value < 0 and behaviour.quorum_negative_limit_unlimited else limit_value
    else:
        limit = behaviour.quorum_default_delivery_limit
    exchange = lookup("dead-letter-exchange")
    reject_publish = overflow == "reject-publish"
    return QuorumConfig(
        max_length=lookup("max-length"),
        max_bytes=lookup("max-length-bytes"),
        reject_publish=reject_publish,
        delivery_limit=limit,
        delivery_limit_set=limit_value is not None,
        expires=lookup("expires"),
        message_ttl=lookup("message-ttl"),
        dead_letter_exchange=exchange,
        dead_letter_routing_key=lookup("dead-letter-routing-key") if exchange is not None else None,
        # at-least-once needs reject-publish; otherwise RabbitMQ falls back to at-most-once
        at_least_once=(exchange is not None and reject_publish
                       and lookup("dead-letter-strategy") == "at-least-once"),
        single_active=args.get("x-single-active-consumer") is True,
        consumer_timeout=lookup("consumer-timeout") if arguments.is_int(lookup("consumer-timeout")) else None,
    )


class _Args:
    """What the rest of the broker reads of a queue's arguments (the core's timers, dead-lettering)."""

    def __init__(self, config: QuorumConfig):
        self.expires = config.expires
        self.dead_letter_exchange = config.dead_letter_exchange
        self.dead_letter_routing_key = config.dead_letter_routing_key
        self.overflow = "reject-publish" if config.reject_publish else "drop-head"
        self.max_length = config.max_length


class Shown:
    """A delivery as the client sees it when it differs from the stored message (redelivered, count
    headers): what the channel keeps for the delivery tag, pointing back at the message."""

    __slots__ = ("message", "exchange", "routing_key", "header", "body", "redelivered", "pid")

    def __init__(self, m: Message, header: bytes, redelivered: bool):
        self.message = m
        self.exchange = m.exchange
        self.routing_key = m.routing_key
        self.header = header
        self.body = m.body
        self.redelivered = redelivered
        self.pid = m.pid


def _stored(m):
    return m.message if isinstance(m, Shown) else m


def _with_counts(header: bytes, counts: list) -> bytes:
    """`header` with long (`l`) entries `counts` [(name, n)] in its headers table, replacing ones of the same
    name, the table sorted by key (as both versions deliver a quorum queue's counted messages)."""
    raw = properties.split(header[12:])
    items = fields.table_items(raw["headers"]) if "headers" in raw else []
    names = {name for name, _n in counts}
    items = fields.sorted_items([(k, v) for k, v in items if k not in names]
                                + [(k, fields.enc_long(n)) for k, n in counts])
    raw["headers"] = fields.table_from_items(items)
    return header[:12] + properties.join(raw)


class QuorumQueue:
    """A quorum queue: the queue interface the channel, the virtual host and the core use."""

    is_stream = False
    queue_type = QUORUM
    server_named = False
    tracks_settlement = True          # acks matter: cancelled consumers, basic.get holds, single active
    persists_all = True               # every message goes to the data_dir journal, whatever its delivery mode
    declare_is_use = False            # x-expires counts consumers and gets only (rabbit_fifo's last_active)
    exclusive_owner = None
    auto_delete = False
    has_ttl = False

    def __init__(self, vhost, name: str, durable: bool, exclusive_owner, auto_delete: bool,
                 arguments_: dict, now: float):
        for refused, prop in ((auto_delete, "auto-delete"), (exclusive_owner is not None, "exclusive-owner"),
                              (not durable, "non-durable")):
            if refused:    # rabbit_queue_type_util:check_auto_delete, check_exclusive, check_non_durable
                raise replies.channel_error(replies.PRECONDITION_FAILED,
                                            f"invalid property '{prop}' for {rs(name, vhost.name)}")
        self.vhost = vhost
        self.behaviour = behaviour = vhost.core.behaviour
        self.name = name
        self.durable = True
        self.arguments = dict(arguments_)
        self.config = effective_config(self.arguments, behaviour)
        self.args = _Args(self.config)
        self.returns: deque = deque()
        self.levels = [deque() for _ in range(MAX_PRIORITY + 1 if behaviour.quorum_priorities else 1)]
        self.ready = 0
        self.ready_bytes = 0              # sizes as the limits count them (see _size)
        self.consumers: list = []         # the consumers that may be delivered to (single active: one)
        self.waiting: list = []           # single active consumer: the others, in activation order
        self.cancelled: set = set()       # cancelled consumers still holding deliveries (counted)
        self.get_holds = 0                # unsettled basic.get deliveries (each counted as a consumer)
        self.exclusive_consumer = None
        self.quiescing = False            # the active consumer hands over once it holds nothing
        self.blocked = False              # reject-publish: publishes refused until the soft limit
        self.enqueuers = weakref.WeakSet()  # channels that published here (reject-publish)
        self.retained: list = []          # at-least-once dead letters: [message, reason, queues done]
        self.retained_bytes = 0
        self.next_retry = None
        self.deleted = False
        self.last_used = now
        self.created = now
        self._rr = 0
        self._attached = 0                # consumers attached so far
        self._order: dict = {}            # consumer -> attach number (single active: ties by attach order)
        self.has_ttl = False

    def apply_policy(self, definition: dict) -> None:
        """The effective policy definition changed (rabbit_quorum_queue:policy_changed): the new settings
        take effect at once; a lower limit drops (or blocks) as after any command."""
        effective = policies.effective(self.arguments, definition, QUORUM, self.behaviour)
        self.config = effective_config(effective, self.behaviour)
        self.args = _Args(self.config)
        self._evaluate_limits(newest_first=self.behaviour.quorum_drops_newest_first)
        self.vhost.core.register_timed_queue(self)
        self.vhost.core.wants_dispatch(self)

    # --- sizes and counts ------------------------------------------------------------------------

    def _size(self, m: Message) -> int:
        """What x-max-length-bytes counts of a message: 4.x its body and encoded properties, 3.10 its body."""
        if self.behaviour.quorum_bytes_with_properties:
            return len(m.header) - 12 + len(m.body)
        return len(m.body)

    def message_count(self) -> int:
        return self.ready

    def consumer_count(self) -> int:
        return len(self.consumers) + len(self.cancelled) + self.get_holds

    def _over_limit(self) -> bool:
        c = self.config
        return ((c.max_length is not None and self.ready + len(self.retained) > c.max_length)
                or (c.max_bytes is not None and self.ready_bytes + self.retained_bytes > c.max_bytes))

    def _below_soft_limit(self) -> bool:
        c = self.config
        return ((c.max_length is None or self.ready + len(self.retained) <= int(c.max_length * SOFT_LIMIT))
                and (c.max_bytes is None
                     or self.ready_bytes + self.retained_bytes <= int(c.max_bytes * SOFT_LIMIT)))

    # --- the ready messages ------------------------------------------------------------------------

    def _level(self, m: Message) -> deque:
        if len(self.levels) == 1:
            return self.levels[0]
        if properties.flags_of(m.header, 12) & _PRIORITY_FLAG:
            return self.levels[min(m.priority, MAX_PRIORITY)]
        return self.levels[DEFAULT_PRIORITY]

    def _push(self, target: deque, m: Message, front: bool = False) -> None:
        (target.appendleft if front else target.append)(m)
        self.ready += 1
        self.ready_bytes += self._size(m)
        self.vhost.core.account(len(m.body) + len(m.header))
        if m.expires_at is not None and not self.has_ttl:
            self.has_ttl = True
            self.vhost.core.register_timed_queue(self)

    def _heads(self):
        if self.returns:
            yield self.returns
        for level in reversed(self.levels):
            if level:
                yield level

    def _pop(self, head: deque) -> Message:
        m = head.popleft()
        self.ready -= 1
        self.ready_bytes -= self._size(m)
        self.vhost.core.account(-(len(m.body) + len(m.header)))
        return m

    def _next(self, now: float) -> Message | None:
        """The next message to deliver (returns first, then the highest priority), after dropping what
        expired at the heads."""
        self._expire_heads(now)
        for head in self._heads():
            return self._pop(head)
        return None

    def _expire_heads(self, now: float) -> None:
        """rabbit_fifo:expire_msgs: expired messages at the head of the returns and of each priority level."""
        if not self.has_ttl:
            return
        expired = []
        for head in (self.returns, *self.levels):
            while head and head[0].expires_at is not None and head[0].expires_at <= now:
                expired.append(self._pop(head))
        if expired:
            self._dead_letter(expired, "expired")

    # --- publish -------------------------------------------------------------------------------

    def would_reject(self, m: Message, channel=None) -> bool:
        """reject-publish: a channel's publish is refused (nacked) while the queue is blocked; a channel
        publishing here for the first time is refused if the queue is over its limit right now. Dead
        letters (no channel) are never refused."""
        if not self.config.reject_publish or channel is None:
            return False
        if channel not in self.enqueuers:
            self.enqueuers.add(channel)
            return self._over_limit()
        return self.blocked

    def enqueue(self, m: Message, now: float) -> None:
        b = self.behaviour
        m.redelivered = False
        # 4.x: a message that comes with failed deliveries (a dead letter) starts from that count
        m.acquired_count = m.delivery_count if b.quorum_acquired_count else 0
        if not b.quorum_acquired_count:
            m.delivery_count = 0
        ttl = self.config.message_ttl
        if m.ttl is not None:
            ttl = m.ttl if ttl is None else min(ttl, m.ttl)
        m.expires_at = None if ttl is None else now + ttl
        store = self.vhost.core.store
        if store is not None:
            store.enqueued(self, m)
        if ttl == 0:
            # rabbit_fifo: TTL 0 expires unless a consumer takes it in the same command
            consumer = self._ready_consumer()
            if consumer is None or self.ready:
                self._dead_letter([m], "expired")
            else:
                self._deliver(consumer, m, now)
            self._evaluate_limits()
            return
        self._push(self._level(m), m)
        if self.config.max_length is not None or self.config.max_bytes is not None:
            self.dispatch(now)        # a waiting consumer takes it before the limit is applied
            self._evaluate_limits()
        self.vhost.core.wants_dispatch(self)

    def _evaluate_limits(self, newest_first: bool = False) -> None:
        """rabbit_fifo:evaluate_limit, after every command: drop-head drops (dead-letters `maxlen`) what would
        be delivered next while over the limit; reject-publish blocks at the limit and unblocks at 80%."""
        c = self.config
        if c.max_length is None and c.max_bytes is None:
            self.blocked = False
            return
        if not c.reject_publish:
            dropped = []
            while self._over_limit() and self.ready:
                dropped.append(self._pop(next(self._heads())))
            if dropped:
                if newest_first:
                    dropped.reverse()
                self._dead_letter(dropped, "maxlen")
        elif self._over_limit():
            self.blocked = True
        elif self.blocked and self._below_soft_limit():
            self.blocked = False

    # --- consumers -----------------------------------------------------------------------------

    def check_consume(self, channel, m) -> None:
        """basic.consume: consumer arguments (x-priority must be an integer), then global QoS, which
        RabbitMQ refuses for quorum queues where the version still has it (540, the connection)."""
        arguments.check_consume(m.arguments or {}, QUORUM, self.name, self.vhost.name, self.behaviour)
        if channel.prefetch_global:
            raise replies.connection_error(
                replies.NOT_IMPLEMENTED, f"{rs(self.name, self.vhost.name)} does not support global qos")

    def consumer_timeout(self, consumer_arguments) -> int:
        """How long a delivery may stay unacked (rabbit_queue_type:consume / dequeue, 4.x): the consumer
        argument x-consumer-timeout, else the lower of the queue's argument and its policy's consumer-timeout,
        else the broker's consumer_timeout; read when the consumer starts (or the basic.get is made)."""
        value = (consumer_arguments or {}).get("x-consumer-timeout")
        if arguments.is_int(value):
            return value
        if self.config.consumer_timeout is not None:
            return self.config.consumer_timeout
        return self.vhost.core.config.consumer_timeout

    def timed_out(self, consumer, msgs: list, now: float) -> None:
        """Deliveries past their deadline (rabbit_fifo's evaluate_consumer_timeout, 4.x), of `consumer` (None:
        basic.get), taken out of the channel's unacked: back to the queue as returned, not failed. The
        consumer is in its timeout (consumer.timed_out, kept by the channel): served nothing until the client
        settles those tags. A single active consumer in its timeout holding nothing goes back to waiting and
        the next waiting one takes over."""
        if consumer is None:
            self.get_holds -= len(msgs)
        elif not consumer.unacked:
            self.cancelled.discard(consumer)
        if not self.deleted:
            self._returned([_stored(m) for m in msgs], TIMEOUT, now)
        if (consumer is not None and self.config.single_active and self.consumers
                and self.consumers[0] is consumer and not consumer.unacked):
            self.consumers.clear()
            self.quiescing = False
            self.waiting.append(consumer)
            self._sort_waiting()
            self._activate_next()
        self._evaluate_limits()
        self.vhost.core.wants_dispatch(self)

    def untimeout(self, consumer, serve: bool) -> None:
        """The client settled the last delivery tag `consumer` had timed out (4.x). By an ack or a discard it is
        served again; by a return (rabbit_fifo's return command does not put it back in the service queue)
        only after its next settlement. A waiting single active consumer may be activated again."""
        if consumer in self.waiting:
            self._activate_next()
        else:
            consumer.stalled = not serve
        self.vhost.core.wants_dispatch(self)

    @staticmethod
    def _servable(consumer) -> bool:
        """Not in its consumer timeout (4.x), nor waiting for a settlement after one."""
        return not consumer.timed_out and not consumer.stalled

    @staticmethod
    def _priority(consumer) -> int:
        p = (consumer.arguments or {}).get("x-priority", 0)
        return p if arguments.is_int(p) else 0

    def add_consumer(self, consumer) -> None:
        self.last_used = self.vhost.core.now()
        self._order[consumer] = self._attached
        self._attached += 1
        if not self.config.single_active:
            self.consumers.append(consumer)
        elif not self.consumers:
            self.consumers.append(consumer)
        else:
            self.waiting.append(consumer)
            self._sort_waiting()
            self._maybe_hand_over()
        self.vhost.core.wants_dispatch(self)

    def _sort_waiting(self) -> None:
        if self.behaviour.quorum_sac_priority:
            self.waiting.sort(key=lambda c: (-self._priority(c), self._order.get(c, 0)))

    def _maybe_hand_over(self) -> None:
        """4.x: a waiting consumer of higher priority than the active one takes over once the active one
        holds nothing (until then the active one gets no more: it is quiescing)."""
        ready = [c for c in self.waiting if not c.timed_out]
        if not (self.behaviour.quorum_sac_priority and self.consumers and ready):
            return
        active, best = self.consumers[0], ready[0]
        if self._priority(best) <= self._priority(active):
            return
        if active.unacked:
            self.quiescing = True
            return
        self.quiescing = False
        self.waiting.remove(best)
        self.consumers[0] = best
        self.waiting.append(active)
        self._sort_waiting()

    def _activate_next(self) -> None:
        """Single active consumer: with none active, the first waiting one not in its consumer timeout."""
        if self.config.single_active and not self.consumers:
            for i, c in enumerate(self.waiting):
                if not c.timed_out:
                    self.consumers.append(self.waiting.pop(i))
                    self.quiescing = False
                    break
        self.vhost.core.wants_dispatch(self)

    def remove_consumer(self, consumer) -> None:
        """basic.cancel, or the consumer's channel gone: a consumer still holding deliveries stays counted
        (as cancelled) until they are settled (a closing channel settles them right after)."""
        self.last_used = self.vhost.core.now()
        self._order.pop(consumer, None)
        if consumer in self.waiting:
            self.waiting.remove(consumer)
            return
        if consumer in self.consumers:
            self.consumers.remove(consumer)
            self.quiescing = False
            if consumer.unacked:
                self.cancelled.add(consumer)
        self._activate_next()

    def _ready_consumer(self):
        for c in self._by_priority():
            if c.can_take() and self._servable(c):
                return c
        return None

    def _by_priority(self) -> list:
        consumers = self.consumers
        if self.quiescing:
            return []
        if len(consumers) < 2:
            return consumers
        n = len(consumers)
        order = [consumers[(self._rr + k) % n] for k in range(n)]
        return sorted(order, key=lambda c: -self._priority(c))

    def dispatch(self, now: float) -> bool:
        """Deliver to consumers with credit: higher x-priority first, round-robin among equals."""
        sent = 0
        while self.ready and self.consumers and sent < limits.DISPATCH_BURST:
            progressed = False
            for c in self._by_priority():
                if not self.ready:
                    break
                if not (c.can_take() and self._servable(c)):
                    continue
                m = self._next(now)
                if m is None:
                    break
                self._rr = self.consumers.index(c) + 1
                self._deliver(c, m, now)
                sent += 1
                progressed = True
                break          # priorities first: start again from the highest
            if not progressed:
                break
        self._evaluate_limits()
        return bool(self.ready) and sent >= limits.DISPATCH_BURST

    def _deliver(self, consumer, m: Message, now: float) -> None:
        consumer.channel.deliver(consumer, self, self._shown(m, get=False), now)

    def _shown(self, m: Message, get: bool):
        """The delivery as the client sees it: 4.x sets redelivered after any return and adds
        x-acquired-count (and x-delivery-count once a delivery failed); 3.10 adds x-delivery-count once
        above zero, and to every basic.get."""
        b = self.behaviour
        if b.quorum_acquired_count:
            if not m.acquired_count:
                return m
            counts = [(properties.ACQUIRED_COUNT, m.acquired_count)]
            if m.delivery_count:
                counts.append((properties.DELIVERY_COUNT, m.delivery_count))
            return Shown(m, _with_counts(m.header, counts), True)
        if not m.delivery_count and not (get and b.quorum_get_always_counts):
            return m
        return Shown(m, _with_counts(m.header, [(properties.DELIVERY_COUNT, m.delivery_count)]), m.delivery_count > 0)

    # --- basic.get -------------------------------------------------------------------------------

    def take(self, now: float, no_ack: bool = True):
        """basic.get: 405 on a single-active-consumer queue; else the next message, as shown."""
        if self.config.single_active:
            raise replies.channel_error(
                replies.RESOURCE_LOCKED,
                f"cannot obtain access to locked {rs(self.name, self.vhost.name)}. basic.get operations are "
                f"not supported by {self.behaviour.quorum_sac_get_name} queues with single active consumer")
        self.last_used = now
        m = self._next(now)
        if m is None:
            return None
        if not no_ack:
            self.get_holds += 1
        shown = self._shown(m, get=True)
        self._evaluate_limits()
        return shown

    # --- settlement ------------------------------------------------------------------------------

    def settled(self, entries: list, outcome: str, now: float) -> None:
        """Deliveries of this queue settled (Channel._apply_settle): `entries` are (message as shown, consumer
        or None for a basic.get)."""
        b = self.behaviour
        for _m, consumer in entries:
            if consumer is None:
                self.get_holds -= 1
            else:
                consumer.stalled = False     # a settlement puts it back in rabbit_fifo's service queue
                if not consumer.unacked:
                    self.cancelled.discard(consumer)
        if outcome != ACK and not self.deleted:
            msgs = [_stored(m) for m, _c in entries]
            if outcome in RETURNED:
                self._returned(msgs, outcome, now)
            else:
                for m in msgs:
                    if b.quorum_acquired_count:
                        m.acquired_count += 1
                        if outcome == DISCARD:
                            m.delivery_count += 1
                self._dead_letter(msgs, "rejected")
        if self.quiescing and self.consumers and not self.consumers[0].unacked:
            self._maybe_hand_over()
        self._evaluate_limits()
        self.vhost.core.wants_dispatch(self)

    def _returned(self, msgs: list, outcome: str, now: float) -> None:
        """rabbit_fifo:return_one for each message, in order: counts up, then past the delivery limit
        dead-lettered as `delivery_limit`, else back: to the head (the returns FIFO), or to the tail on 3.10
        without a delivery limit (except a consumer gone, which goes to the head there too)."""
        b, c = self.behaviour, self.config
        to_tail = (b.quorum_requeue_to_tail_without_limit and not c.delivery_limit_set and outcome != DOWN)
        over = []
        for m in msgs:
            if b.quorum_acquired_count:
                m.acquired_count += 1
                if outcome in FAILED:
                    m.delivery_count += 1
            else:
                m.delivery_count += 1
            if c.delivery_limit is not None and m.delivery_count > c.delivery_limit:
                over.append(m)
                continue
            m.redelivered = True
            if self.vhost.core.store is not None:
                self.vhost.core.store.returned(m)
            self._push(self._level(m) if to_tail else self.returns, m)
        if over:
            self._dead_letter(over, "delivery_limit")

    # --- dead-lettering --------------------------------------------------------------------------

    def _dead_letter(self, msgs: list, reason: str) -> None:
        """At most once: published now (vhost.dead_letter). At least once: kept (counted against the
        limits) and published until every queue the dead-letter exchange routes each to took it."""
        if not self.config.at_least_once:
            self.vhost.dead_letter(self, msgs, reason)
            return
        for m in msgs:
            self.retained.append([m, reason, set()])
            self.retained_bytes += self._size(m)
        self._retry_dead_letters()

    def _retry_dead_letters(self) -> None:
        kept = []
        for entry in self.retained:
            if not self.vhost.dead_letter_at_least_once(self, entry):
                kept.append(entry)
            else:
                self.retained_bytes -= self._size(entry[0])
        self.retained = kept
        self.next_retry = (self.vhost.core.now() + limits.DEAD_LETTER_RETRY_INTERVAL * 1000) if kept else None
        if kept:
            self.vhost.core.register_timed_queue(self)

    # --- the clock -------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """The core's tick: expired heads, and the at-least-once retry."""
        self._expire_heads(now)
        if not self.ready:
            self.has_ttl = any(m.expires_at is not None for head in self._heads() for m in head)
        if self.next_retry is not None and now >= self.next_retry:
            self._retry_dead_letters()
        self._evaluate_limits()

    def timed(self) -> bool:
        """Whether the core's clock still has work here."""
        return self.has_ttl or self.config.expires is not None or self.next_retry is not None

    def idle_expired(self, now: float) -> bool:
        """x-expires: checked on the queue's own tick (every QUORUM_TICK seconds from its declaration, as
        Ra ticks rabbit_fifo), when no consumer (nor cancelled one, nor basic.get) holds it."""
        expires = self.config.expires
        if expires is None or self.consumers or self.waiting or self.cancelled or self.get_holds:
            return False
        tick = limits.QUORUM_TICK * 1000
        last_tick = self.created + int((now - self.created) // tick) * tick
        return last_tick > self.last_used + expires

    # --- purge, delete ---------------------------------------------------------------------------

    def check_delete(self, if_unused: bool, if_empty: bool) -> None:
        """queue.delete with if-unused or if-empty: RabbitMQ refuses both for quorum queues (540)."""
        for flag, name in ((if_unused, "if-unused"), (if_empty, "if-empty")):
            if flag:
                raise replies.connection_error(
                    replies.NOT_IMPLEMENTED,
                    f"cannot delete {rs(self.name, self.vhost.name)}. queue.delete operations with {name} flag "
                    "set are not supported by quorum queues")

    def purge(self) -> int:
        """queue.purge: the ready messages and those kept for at-least-once dead-lettering; unacked ones
        stay with their consumers."""
        msgs = [self._pop(head) for head in (self.returns, *self.levels) for _ in range(len(head))]
        dropped = [m for m, _reason, _done in self.retained]
        self.retained, self.retained_bytes, self.next_retry = [], 0, None
        if self.vhost.core.store is not None:
            self.vhost.core.store.removed(msgs + dropped)
        self._evaluate_limits()
        return len(msgs) + len(dropped)

    def drop_all(self) -> None:
        """The queue is deleted: its messages go (not dead-lettered)."""
        msgs = [self._pop(head) for head in (self.returns, *self.levels) for _ in range(len(head))]
        if self.vhost.core.store is not None:
            self.vhost.core.store.removed(msgs + [m for m, _r, _d in self.retained])
        self.retained = []

    def all_consumers(self) -> list:
        return [*self.consumers, *self.waiting]

    def restore(self, m: Message, now: float, delivered: bool, counts) -> None:
        """A message read back from the data_dir journal at start (store.py), in publish order, with the
        counts it had: one delivered and not acked comes back as from a consumer gone (counted, at the
        head); one taken back before goes to the head with its counts; the others are queued anew."""
        self.enqueue(m, now)
        if counts is None and not delivered:
            return
        level = self._level(m)
        level.remove(m)
        self.ready -= 1
        self.ready_bytes -= self._size(m)
        self.vhost.core.account(-(len(m.body) + len(m.header)))
        m.acquired_count, m.delivery_count = counts or (0, 0)
        if delivered:
            self._returned([m], DOWN, now)
        else:
            m.redelivered = True
            self._push(self.returns, m)
