"""One AMQP channel: its consumers, unacked deliveries, publish assembly, confirms and transactions.

The connection routes each frame of channel N here; this object applies the method to the model (the
virtual host) and writes replies through the connection. Errors are raised as `AMQPError` and turned into
channel.close or connection.close by the connection.
"""

from __future__ import annotations

import base64
import logging
import os
import re
from operator import itemgetter

from pamqp import commands as C

from spark_amqp.codec import fields, frames, methods, properties, replies

from . import access, arguments
from .message import ACK, DISCARD, DOWN, DROP, REJECT, RETURN, Message
from .arguments import Crash

log = logging.getLogger("broker.channel")

# AMQP field-type tags as RabbitMQ names them in error texts.
_FIELD_TYPE_NAMES = {b"S": "longstr", b"s": "short", b"I": "signedint", b"l": "long", b"t": "bool",
                     b"F": "table", b"b": "byte", b"d": "double", b"f": "float", b"T": "timestamp",
                     b"V": "void", b"x": "binary", b"D": "decimal", b"u": "unsignedshort",
                     b"i": "unsignedint", b"B": "unsignedbyte"}

OPEN, CLOSING = "open", "closing"

INFINITY = float("inf")

# How a settlement reaches a quorum queue on 4.x (rabbit_fifo): by a return command (nack or reject with requeue,
# recover), or by a settle or discard one (ack, nack or reject without requeue). They differ for a consumer the
# queue timed out (see Channel.settle).
_RETURN_PATH = frozenset((RETURN, REJECT))

_LEADING_INTEGER = re.compile(r"[+-]?[0-9]+")


def _parse_expiration(text: str):
    """rabbit_basic:parse_expiration: (ttl ms, None), or (None, the reason RabbitMQ prints): string:to_integer
    reads a leading integer ("no_integer" without one, {leftover_string,"..."} with text after it), then
    rabbit_misc:check_expiry (negative, or more than ten years)."""
    match = _LEADING_INTEGER.match(text)
    if match is None:
        return None, "no_integer"
    rest = text[match.end():]
    if rest:
        return None, "{leftover_string," + arguments.erl_string(rest) + "}"
    n = int(match.group())
    if n < 0:
        return None, f"{{value_negative,{n}}}"
    if n > arguments.MAX_EXPIRY:
        return None, f"{{value_too_large,{n}}}"
    return n, None

# The message of an unacked delivery's entry (message, queue, consumer or None, deadline), for a C-level loop
# (map).
_MESSAGE = itemgetter(0)


def timed_out_error(channel: int, timeout: int) -> replies.AMQPError:
    """The channel.close of a consumer timeout (rabbit_channel: 406, naming no method). 4.x gives -1 for the
    timeout when a quorum queue's consumer cannot be cancelled instead (a client without
    consumer_cancel_notify, a basic.get, a consumer the client cancelled)."""
    return replies.AMQPError(
        replies.PRECONDITION_FAILED,
        f"delivery acknowledgement on channel {channel} timed out. Timeout value used: {timeout} ms. "
        "This timeout value can be configured, see consumers doc guide to learn more", hard=False)


class Consumer:
    __slots__ = ("tag", "tag_bytes", "queue", "channel", "no_ack", "exclusive", "prefetch", "unacked",
                 "arguments", "timeout", "timed_out", "stalled")

    def __init__(self, tag, queue, channel, no_ack, exclusive, prefetch, arguments):
        self.tag = tag
        self.tag_bytes = methods.shortstr(tag)
        self.queue = queue
        self.channel = channel
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch      # per-consumer limit (basic.qos global=false), 0 = none
        self.unacked = 0
        self.arguments = arguments
        self.timeout = None           # ms a delivery to it may stay unacked (None: never times out)
        # 4.x quorum queues: the delivery tags the queue took back at their timeout and the client has not
        # settled yet (the consumer gets nothing while there are any), and whether, all of them settled by
        # a return, it waits for its next settlement to be served again (rabbit_fifo's service queue).
        self.timed_out: set = set()
        self.stalled = False

    def can_take(self) -> bool:
        """Whether the queue may deliver to this consumer now: its channel is open, its connection takes
        more output, and the prefetch limits leave room (called per message by Queue.dispatch)."""
        ch = self.channel
        if ch.state is not OPEN or not ch.conn.writable():
            return False
        if self.no_ack:
            return True
        if self.prefetch and self.unacked >= self.prefetch:
            return False
        if ch.prefetch_global and len(ch.unacked) >= ch.prefetch_global:
            return False
        return True


class Channel:
    def __init__(self, conn, number: int):
        self.conn = conn
        self.number = number
        self.state = OPEN
        self.vhost = conn.vhost
        self.consumers: dict[str, Consumer] = {}
        # delivery tag -> (message, queue, consumer or None for basic.get, deadline: the clock's ms after which
        # it times out, or None)
        self.unacked: dict[int, tuple] = {}
        self.next_tag = 1
        self.settled_below = 1                # no tag below this is in `unacked` (see settle)
        self.prefetch_consumer = 0            # basic.qos global=false: applies to later consumers
        self.prefetch_global = 0              # basic.qos global=true: shared by the channel
        self.last_queue: str | None = None    # spec: an empty queue name means the last declared one
        # publish assembly: [exchange, routing_key, mandatory, header, body parts, remaining]
        self.pending = None
        # publisher confirms
        self.confirming = False
        self.publish_seq = 0
        self.confirm_runs: list[list] = []    # [[ack: bool, up_to_seq], ...] not yet sent
        # transactions: publishes and settlements wait here for tx.commit
        self.transactional = False
        self.tx_ops: list[tuple] = []
        # The consumer timeout. `due`: when the core's clock must next call `on_due` (INFINITY: never). 3.10:
        # the channel's tick, from its opening, with the timeout read then; 4.x: the earliest deadline of a
        # quorum queue delivery. `timed_out` (4.x): delivery tag -> (queue, consumer or None) of deliveries
        # a quorum queue took back at their deadline: settling one tells only the queue.
        core = conn.core
        self.timed_out: dict[int, tuple] = {}
        if core.behaviour.consumer_timeout_on_channel_tick:
            self.timeout = core.config.consumer_timeout
            self.due = core.now() + core.config.channel_tick_interval
            core.timed_channels.add(self)
        else:
            self.timeout = None
            self.due = INFINITY

    # --- delivery (called by queues) -----------------------------------------------------------

    def deliver(self, consumer: Consumer, queue, m: Message, now: float) -> None:
        tag = self.next_tag
        self.next_tag = tag + 1
        if not consumer.no_ack:
            timeout = consumer.timeout
            if timeout is None:
                self.unacked[tag] = (m, queue, consumer, None)
            else:
                deadline = now + timeout
                self.unacked[tag] = (m, queue, consumer, deadline)
                if deadline < self.due:
                    self._arm(now, deadline)
            consumer.unacked += 1
        if m.pid:
            self._journal_delivery(m, consumer.no_ack)
        self.conn.write_delivery(self.number, consumer.tag_bytes, tag, m)

    def _journal_delivery(self, m: Message, no_ack: bool) -> None:
        """A journaled message went out: auto-acked it is gone, else it comes back redelivered after a
        restart (store.py)."""
        store = self.conn.core.store
        if no_ack:
            store.removed((m,))
        else:
            store.delivered(m)

    # --- the consumer timeout ----------------------------------------------------------------------

    def _timeout_for(self, queue, consumer_arguments) -> int | None:
        """How long a delivery from `queue` may stay unacked, for a consumer with `consumer_arguments` (None:
        basic.get). 3.10: the channel's timeout, whatever the queue; 4.x: the queue's say (quorum queues
        only)."""
        if self.conn.core.behaviour.consumer_timeout_on_channel_tick:
            return self.timeout
        return queue.consumer_timeout(consumer_arguments)

    def _arm(self, now: float, deadline: float) -> None:
        """A delivery whose deadline comes before the channel's next check. 3.10: a stopped tick starts again
        (a channel that hibernated idle wakes and restarts its tick timer); 4.x: the check moves to it."""
        core = self.conn.core
        if core.behaviour.consumer_timeout_on_channel_tick:
            if self.due != INFINITY:
                return
            self.due = now + core.config.channel_tick_interval
        else:
            self.due = deadline
        core.timed_channels.add(self)

    def on_due(self, now: float) -> None:
        """The core's clock reached `due`: every tick (3.10) or expiry (4.x) due by `now`, in turn (each moves
        `due` past the one it ran, or closes the channel)."""
        on_tick = self.conn.core.behaviour.consumer_timeout_on_channel_tick
        while self.state is OPEN and self.due <= now:
            if on_tick:
                self._tick()
            else:
                self._expire(now)
        if self.state is not OPEN:
            self.conn.core.timed_channels.discard(self)

    def _tick(self) -> None:
        """3.10's channel tick (rabbit_channel:evaluate_consumer_timeout): the oldest unacked delivery older
        than the timeout at the tick closes the channel. A channel holding nothing stops ticking (RabbitMQ
        cancels the tick timer of a channel that hibernates with nothing unacked) until its next delivery."""
        core = self.conn.core
        tick = self.due
        if not self.unacked:
            self.due = INFINITY
            core.timed_channels.discard(self)
            return
        oldest = next(iter(self.unacked.values()))
        if oldest[3] is not None and oldest[3] < tick:
            consumer = oldest[2]
            log.warning("consumer '%s' on channel %s of AMQP connection %s has timed out waiting for delivery "
                        "acknowledgement; timeout used: %s ms", consumer.tag if consumer else "basic.get",
                        self.number, self.conn.peer, self.timeout)
            self.conn.channel_exception(self, timed_out_error(self.number, self.timeout))
            return
        self.due = tick + core.config.channel_tick_interval

    def _expire(self, now: float) -> None:
        """4.x (rabbit_fifo:apply({timeout, evaluate_consumer_timeout})): every quorum queue delivery past its
        deadline goes back to its queue, not as a failed delivery; each consumer that had one is sent
        basic.cancel (it stays on the channel, and gets nothing more until the client settles those
        delivery tags); the channel is closed instead (406, "-1 ms") when a basic.get timed out, or a
        consumer the client cancelled or a client without consumer_cancel_notify."""
        core = self.conn.core
        unacked = self.unacked
        expired = []
        for tag, e in [(tag, e) for tag, e in unacked.items() if e[3] is not None and e[3] <= now]:
            if e[1].deleted:         # a deleted queue times out nothing: its deliveries only wait for acks
                unacked[tag] = (e[0], e[1], e[2], None)
            else:
                del unacked[tag]
                expired.append((tag, e))
        self.due = min((e[3] for e in self.unacked.values() if e[3] is not None), default=INFINITY)
        if self.due == INFINITY:
            core.timed_channels.discard(self)
        groups: dict = {}       # (queue, consumer) -> (queue, consumer, tags, messages)
        for tag, (m, q, consumer, _deadline) in expired:
            group = groups.setdefault((id(q), id(consumer)), (q, consumer, [], []))
            group[2].append(tag)
            group[3].append(m)
        for q, consumer, tags, msgs in groups.values():
            for tag in tags:
                self.timed_out[tag] = (q, consumer)
            if consumer is not None:
                consumer.unacked -= len(tags)
                consumer.timed_out.update(tags)
            q.timed_out(consumer, msgs, now)
        close = False
        notify = self.conn.capabilities.get("consumer_cancel_notify")
        for q, consumer, tags, _msgs in groups.values():
            log.warning("consumer '%s' on channel %s of AMQP connection %s has timed out waiting for "
                        "acknowledgement of %d delivery(ies) from %s; timeout used: %s ms",
                        consumer.tag if consumer else "basic.get", self.number, self.conn.peer, len(tags),
                        arguments.rs(q.name, q.vhost.name), consumer.timeout if consumer else "-")
            if consumer is not None and notify and consumer.tag in self.consumers:
                self.reply(C.Basic.Cancel(consumer_tag=consumer.tag, nowait=True))
            else:
                close = True
        if close:
            self.conn.channel_exception(self, timed_out_error(self.number, -1))

    def _settle_timed_out(self, tags, outcome: str) -> None:
        """The client settled delivery tags a quorum queue took back at their timeout (4.x): the messages are
        not touched (they are back in the queue); the consumer is served again once it has settled all of
        them, by a return (nack or reject with requeue, recover) only at its next settlement."""
        entries = [(tag, self.timed_out.pop(tag)) for tag in tags]
        if self.transactional:
            self.tx_ops.append(("timed_out", entries, outcome))
            return
        self._apply_timed_out(entries, outcome)

    def _apply_timed_out(self, entries: list, outcome: str) -> None:
        for tag, (q, consumer) in entries:
            if consumer is not None and tag in consumer.timed_out:
                consumer.timed_out.discard(tag)
                if not consumer.timed_out:
                    q.untimeout(consumer, serve=outcome not in _RETURN_PATH)

    def cancel_by_broker(self, consumer: Consumer) -> None:
        """The queue went away: forget the consumer and tell the client if it understands
        basic.cancel from the server (capability consumer_cancel_notify)."""
        if self.consumers.pop(consumer.tag, None) is None:
            return
        if self.conn.capabilities.get("consumer_cancel_notify") and self.state is OPEN:
            # After whatever reply is being written now: RabbitMQ's queue.delete-ok precedes the
            # basic.cancel it causes (py-amqp relies on that order).
            self.conn.send_later(frames.method_frame(self.number,
                                                   C.Basic.Cancel(consumer_tag=consumer.tag, nowait=True)))

    # --- methods -------------------------------------------------------------------------------

    def handle(self, method) -> None:
        handler = getattr(self, "on_" + method.name.replace(".", "_").lower(), None)
        if handler is None:
            raise replies.connection_error(replies.COMMAND_INVALID,
                                           f"method {method.name} is not valid on a channel")
        handler(method)

    def reply(self, method) -> None:
        self.conn.send_method(self.number, method)

    def on_channel_open(self, m):
        raise replies.connection_error(replies.CHANNEL_ERROR, "second 'channel.open' seen")

    def on_channel_flow(self, m):
        # RabbitMQ 3.x no longer lets a client stop deliveries with flow(active=false): 540.
        if not m.active:
            raise replies.connection_error(replies.NOT_IMPLEMENTED, "active=false")
        self.reply(C.Channel.FlowOk(active=True))

    def on_channel_flowok(self, m):
        # The broker never sends channel.flow, so a flow-ok is unsolicited.
        raise replies.connection_error(replies.COMMAND_INVALID, "unexpected channel.flow-ok")

    # exchanges

    def on_exchange_declare(self, m):
        access.exchange_declare(self, m)
        self.vhost.declare_exchange(m.exchange, m.exchange_type, m.passive, m.durable, m.auto_delete,
                                    m.internal, m.arguments)
        if not m.nowait:
            self.reply(C.Exchange.DeclareOk())

    def on_exchange_delete(self, m):
        access.exchange_delete(self, m)
        self.vhost.delete_exchange(m.exchange, m.if_unused)
        if not m.nowait:
            self.reply(C.Exchange.DeleteOk())

    def on_exchange_bind(self, m):
        access.exchange_binding(self, m)
        self.vhost.bind_exchange(m.destination, m.source, m.routing_key, m.arguments)
        if not m.nowait:
            self.reply(C.Exchange.BindOk())

    def on_exchange_unbind(self, m):
        access.exchange_binding(self, m)
        self.vhost.unbind_exchange(m.destination, m.source, m.routing_key, m.arguments)
        if not m.nowait:
            self.reply(C.Exchange.UnbindOk())

    # queues

    def _queue_named(self, name: str):
        if not name:
            if self.last_queue is None:
                raise replies.channel_error(replies.NOT_FOUND, "no previously declared queue")
            name = self.last_queue
        return self.vhost.get_queue(name, self.conn)

    def on_queue_declare(self, m):
        server_name = access.queue_declare(self, m)
        q = self.vhost.declare_queue(m.queue, m.passive, m.durable, m.exclusive, m.auto_delete,
                                     m.arguments, self.conn, server_name=server_name)
        self.last_queue = q.name
        if not m.nowait:
            self.reply(methods.unchecked(C.Queue.DeclareOk, queue=q.name, message_count=q.message_count(),
                                      consumer_count=q.consumer_count()))

    def on_queue_bind(self, m):
        access.queue_binding(self, m)
        q = self._queue_named(m.queue)
        self.vhost.bind_queue(q, m.exchange, m.routing_key, m.arguments)
        if not m.nowait:
            self.reply(C.Queue.BindOk())

    def on_queue_unbind(self, m):
        access.queue_binding(self, m)
        # RabbitMQ: unbinding is idempotent (a missing queue, exchange or binding is fine) and does
        # not check exclusive ownership.
        q = self.vhost.queues.get(m.queue or self.last_queue or "")
        if q is not None:
            self.vhost.unbind_queue(q, m.exchange, m.routing_key, m.arguments)
        self.reply(C.Queue.UnbindOk())

    def on_queue_purge(self, m):
        access.queue_read(self, m)
        q = self._queue_named(m.queue)
        count = q.purge()
        if not m.nowait:
            self.reply(C.Queue.PurgeOk(message_count=count))

    def on_queue_delete(self, m):
        access.queue_configure(self, m)
        name = m.queue or self.last_queue or ""
        q = self.vhost.queues.get(name)
        if q is None:
            count = 0   # RabbitMQ: deleting a queue that does not exist succeeds with count 0
        else:
            self.vhost.check_exclusive(q, self.conn)
            count = self.vhost.delete_queue(q, m.if_unused, m.if_empty)
        if not m.nowait:
            self.reply(C.Queue.DeleteOk(message_count=count))

    # basic

    def on_basic_qos(self, m):
        if m.prefetch_size:
            raise replies.connection_error(replies.NOT_IMPLEMENTED,
                                           f"prefetch_size!=0 ({m.prefetch_size})")
        # RabbitMQ's per_consumer_qos: global=false limits each consumer created after it, global=true
        # limits the channel as a whole where the version still permits global QoS (versions.py); else
        # it is a per-consumer limit too.
        if m.global_ and self.conn.core.behaviour.global_qos:
            self.prefetch_global = m.prefetch_count
        else:
            self.prefetch_consumer = m.prefetch_count
        self.reply(C.Basic.QosOk())
        self._redispatch()

    def on_basic_consume(self, m):
        access.queue_read(self, m)
        q = self._queue_named(m.queue)
        tag = m.consumer_tag or "amq.ctag-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if tag in self.consumers:
            raise replies.connection_error(replies.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        q.check_consume(self, m)   # the queue type's rules: arguments, exclusive use, prefetch
        consumer = Consumer(tag, q, self, m.no_ack, m.exclusive, self.prefetch_consumer, m.arguments)
        if not m.no_ack:
            consumer.timeout = self._timeout_for(q, m.arguments or {})
        self.consumers[tag] = consumer
        q.last_used = self.conn.core.now()
        if not m.nowait:
            self.reply(C.Basic.ConsumeOk(consumer_tag=tag))
        q.add_consumer(consumer)

    def on_basic_cancel(self, m):
        consumer = self.consumers.pop(m.consumer_tag, None)
        if consumer is not None:
            consumer.queue.remove_consumer(consumer)
            consumer.queue.last_used = self.conn.core.now()
        if not m.nowait:
            self.reply(C.Basic.CancelOk(consumer_tag=m.consumer_tag))

    def on_basic_get(self, m):
        access.queue_read(self, m)
        q = self._queue_named(m.queue)
        core = self.conn.core
        now = core.now()
        q.last_used = now
        msg = q.take(now, m.no_ack)
        if msg is None:
            self.reply(C.Basic.GetEmpty())
            return
        tag = self.next_tag
        self.next_tag = tag + 1
        if not m.no_ack:
            timeout = self._timeout_for(q, None)
            deadline = None if timeout is None else now + timeout
            self.unacked[tag] = (msg, q, None, deadline)
            if deadline is not None and deadline < self.due:
                self._arm(now, deadline)
        if msg.pid:
            self._journal_delivery(msg, m.no_ack)
        self.reply(methods.unchecked(C.Basic.GetOk, delivery_tag=tag, redelivered=msg.redelivered,
                                  exchange=msg.exchange, routing_key=msg.routing_key,
                                  message_count=q.message_count()))
        self.conn.write_content(self.number, msg)

    def on_basic_ack(self, m):
        self.settle(m.delivery_tag, m.multiple, "ack")

    def on_basic_nack(self, m):
        self.settle(m.delivery_tag, m.multiple, RETURN if m.requeue else DROP)

    def on_basic_reject(self, m):
        self.settle(m.delivery_tag, False, REJECT if m.requeue else DISCARD)

    def on_basic_recover(self, m):
        if not m.requeue:
            raise replies.connection_error(replies.NOT_IMPLEMENTED, "requeue=false")
        self._check_recover()
        self.requeue_all(RETURN)
        self.reply(C.Basic.RecoverOk())

    def on_basic_recoverasync(self, m):
        if not m.requeue:
            raise replies.connection_error(replies.NOT_IMPLEMENTED, "requeue=false")
        self._check_recover()
        self.requeue_all(RETURN)

    def _check_recover(self):
        """RabbitMQ 3.10 crashes the channel (541) requeueing unacked stream deliveries; 4.x settles them,
        which gives their credit back and redelivers nothing."""
        if not self.conn.core.behaviour.stream_settle and any(e[1].is_stream for e in self.unacked.values()):
            raise Crash()

    def on_basic_publish(self, m):
        self.start_publish(m.exchange, m.routing_key, m.mandatory, m.immediate)

    # confirms and transactions

    def on_confirm_select(self, m):
        if self.transactional:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        "cannot switch from tx to confirm mode")
        self.confirming = True
        if not m.nowait:
            self.reply(C.Confirm.SelectOk())

    def on_tx_select(self, m):
        if self.confirming:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        "cannot switch from confirm to tx mode")
        self.transactional = True
        self.reply(C.Tx.SelectOk())

    def on_tx_commit(self, m):
        if not self.transactional:
            raise replies.channel_error(replies.PRECONDITION_FAILED, "channel is not transactional")
        ops, self.tx_ops = self.tx_ops, []
        for op in ops:
            if op[0] == "publish":
                self.route_message(*op[1:])
            elif op[0] == "timed_out":
                self._apply_timed_out(op[1], op[2])
            else:
                _op, entries, outcome = op
                self._apply_settle(list(map(itemgetter(1), entries)), outcome)
        self.reply(C.Tx.CommitOk())

    def on_tx_rollback(self, m):
        if not self.transactional:
            raise replies.channel_error(replies.PRECONDITION_FAILED, "channel is not transactional")
        ops, self.tx_ops = self.tx_ops, []
        restored = [entry for op in ops if op[0] == "settle" for entry in op[1]]
        self.timed_out.update(entry for op in ops if op[0] == "timed_out" for entry in op[1])
        if restored:  # settlements rolled back: those deliveries are unacked again, with their deadlines
            self.unacked = dict(sorted([*self.unacked.items(), *restored]))
            self.settled_below = min(self.settled_below, *(t for t, _entry in restored))
            deadlines = [entry[3] for _t, entry in restored if entry[3] is not None]
            if deadlines and min(deadlines) < self.due:
                self._arm(self.conn.core.now(), min(deadlines))
        self.reply(C.Tx.RollbackOk())

    # --- settlement ----------------------------------------------------------------------------

    def settle(self, tag: int, multiple: bool, outcome: str) -> None:
        """ack / nack / reject. Unknown tags are a 406 on the channel (spec 1.8.3.13)."""
        unacked = self.unacked
        if tag not in unacked and not (multiple and tag == 0):
            # rabbit_channel:collect_acks: with or without `multiple`, the tag itself must be
            # outstanding; multiple with tag 0 means "everything outstanding" (spec 1.8.3.13). A tag whose
            # delivery timed out (4.x) is still outstanding for the channel.
            if tag not in self.timed_out:
                raise replies.channel_error(replies.PRECONDITION_FAILED, f"unknown delivery tag {tag}")
            if not multiple:
                self._settle_timed_out((tag,), outcome)
                return
        if not multiple:
            tags = (tag,)
            below = tag + 1 if tag == self.settled_below else self.settled_below
        else:
            # Every outstanding tag up to `tag`: those from `settled_below` on that are still unacked. Not a
            # walk over the dict from its start: a dict keeps its deleted slots until it resizes, so a client
            # acking each delivery with multiple=true at prefetch 50,000 made every ack skip ~10,000s of
            # them again (15.5 us an ack against 0.35 this way, microbenchmark). Each tag is passed over at
            # most once, as `settled_below` moves past it.
            upto = self.next_tag - 1 if tag == 0 else tag
            tags = [t for t in range(self.settled_below, upto + 1) if t in unacked]
            below = upto + 1
            if self.timed_out:
                # Settled first: rabbit_fifo takes the consumer out of its timeout before it settles the rest.
                timed_out = [t for t in self.timed_out if t <= upto]
                if timed_out:
                    self._settle_timed_out(timed_out, outcome)
        if outcome != ACK and not self.conn.core.behaviour.stream_settle:
            for t in tags:
                if unacked[t][1].is_stream:
                    raise unacked[t][1].settle_refused()
        self.settled_below = below
        if self.transactional:
            # Spec 1.9: acks in a transaction take effect at commit; RabbitMQ keeps them unsettled but
            # counted, so the tags cannot be settled twice inside the transaction.
            entries = [(t, unacked.pop(t)) for t in tags]
            self.tx_ops.append(("settle", entries, outcome))
            return
        self._apply_settle([unacked.pop(tag)] if not multiple else list(map(unacked.pop, tags)), outcome)

    def _apply_settle(self, settled: list, outcome: str) -> None:
        """Settle deliveries taken out of `unacked`: `settled` holds their (message, queue, consumer or None,
        deadline) entries. Runs for every ack a consumer sends, one delivery or (basic.ack(multiple)) 100,000
        at once, so the loop over them does only what every outcome needs; requeue and drop group their
        messages after it. (Settling a 100,000-delivery ack took 308-324 ns a delivery when each turn also
        tested the outcome and `settle` gathered the tags in a Python loop, 121-123 since, microbenchmark;
        py-spy had put a sixth of the broker's samples there while the read benchmark's source drained it.)"""
        core = self.conn.core
        if outcome == ACK and core.store is not None:
            core.store.removed(list(map(_MESSAGE, settled)))
        touched = {}
        for _m, q, consumer, _deadline in settled:
            if consumer is not None:
                consumer.unacked -= 1
            touched[id(q)] = q
        if outcome != ACK or any(q.tracks_settlement for q in touched.values()):
            # Each queue settles its own deliveries (requeue, dead-letter, count); on acks only a queue that
            # tracks settlement (quorum queues: consumers, basic.get holds) hears of them.
            by_queue: dict = {}
            for m, q, consumer, _deadline in settled:
                by_queue.setdefault(id(q), (q, []))[1].append((m, consumer))
            now = core.now()
            for q, entries in by_queue.values():
                if outcome != ACK or q.tracks_settlement:
                    q.settled(entries, outcome, now)
        for q in touched.values():
            core.wants_dispatch(q)
        if self.prefetch_global:
            self._redispatch()

    def requeue_all(self, outcome: str) -> None:
        """Every unacked delivery back to its queue: `outcome` RETURN (basic.recover) or DOWN (the channel
        closed). basic.recover returns the tags of timed-out deliveries too (4.x), as one return command."""
        if outcome == RETURN and self.timed_out:
            self._settle_timed_out(list(self.timed_out), outcome)
        settled = list(self.unacked.values())
        self.unacked.clear()
        if settled:
            self._apply_settle(settled, outcome)

    def _redispatch(self) -> None:
        core = self.conn.core
        for c in self.consumers.values():
            core.wants_dispatch(c.queue)

    # --- publishing ----------------------------------------------------------------------------

    def start_publish(self, exchange: str, routing_key: str, mandatory: bool, immediate: bool) -> None:
        if immediate:
            # RabbitMQ removed support for the immediate flag (3.0): a connection error.
            raise replies.AMQPError(replies.NOT_IMPLEMENTED, "immediate=true", hard=True,
                                    class_id=60, method_id=40)
        self.pending = [exchange, routing_key, mandatory, None, [], 0]

    def on_header(self, payload: bytes) -> None:
        p = self.pending
        class_id, body_size = frames.decode_content_header(payload)
        if class_id != 60:
            raise replies.connection_error(
                replies.UNEXPECTED_FRAME, f"expected content header for class 60, got one for class {class_id}")
        limit = self.conn.core.config.max_message_size
        if body_size > limit:
            self.pending = None
            raise replies.AMQPError(
                replies.PRECONDITION_FAILED,
                f"message size {body_size} is larger than configured max size {limit}",
                hard=False, class_id=60, method_id=40)
        p[3] = payload
        p[5] = body_size
        if body_size == 0:
            self.pending = None
            self.publish(p[0], p[1], p[2], payload, b"")

    def on_body(self, payload: bytes) -> None:
        p = self.pending
        p[4].append(payload)
        p[5] -= len(payload)
        if p[5] <= 0:
            self.pending = None
            if p[5] < 0:
                raise replies.connection_error(replies.FRAME_ERROR,
                                               "content body larger than the size its header declared")
            parts = p[4]
            self.publish(p[0], p[1], p[2], p[3], parts[0] if len(parts) == 1 else b"".join(parts))

    def publish(self, exchange: str, routing_key: str, mandatory: bool, header: bytes, body: bytes):
        vhost = self.vhost
        access.publish_exchange(self, exchange)
        x = vhost.exchanges.get(exchange)
        if x is None:
            raise replies.AMQPError(replies.NOT_FOUND, f"no exchange '{exchange}' in vhost '{vhost.name}'",
                                    hard=False, class_id=60, method_id=40)
        if x.internal:
            raise replies.AMQPError(
                replies.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{exchange}' in vhost '{vhost.name}'",
                hard=False, class_id=60, method_id=40)
        access.publish_topic(self, x, routing_key)
        m = Message(exchange, routing_key, header, body)
        props = m.read_properties()
        cc = ()
        if props:
            self._apply_properties(m, props)
            if "headers_raw" in props:
                cc = self._sender_selected_keys(m, props["headers_raw"])
        self.conn.note_publish()
        if self.confirming:
            self.publish_seq += 1
        if self.transactional:
            self.tx_ops.append(("publish", x, m, mandatory, 0, cc))
            return
        self.route_message(x, m, mandatory, self.publish_seq, cc)

    def _sender_selected_keys(self, m: Message, headers_raw: bytes) -> list[str]:
        """RabbitMQ's sender-selected distribution: `CC` and `BCC` headers (arrays of strings) add
        routing keys; `BCC` is removed from the message before it is stored. Where the version sorts the
        headers table (4.x keeps headers in a table sorted by key, each key once: mc_amqpl's usort), the
        stored header has it sorted."""
        items = fields.table_items(headers_raw)
        if self.conn.core.behaviour.sorted_headers:
            raw = m.header[12:]
            sorted_raw = properties.with_sorted_headers(raw)
            if sorted_raw is not raw:
                m.header = m.header[:12] + sorted_raw
                items = fields.sorted_items(items)
        keys: list[str] = []
        has_bcc = False
        for key, value in items:
            if key not in ("CC", "BCC"):
                continue
            if value[:1] != b"A":
                kind = _FIELD_TYPE_NAMES.get(value[:1], "unknown")
                raise replies.AMQPError(
                    replies.PRECONDITION_FAILED,
                    f'invalid message: {{unacceptable_type_in_header,"{key}",{kind}}}',
                    hard=False, class_id=60, method_id=40)
            keys += [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
                     for v in fields.decode_value(value)]
            has_bcc = has_bcc or key == "BCC"
        if has_bcc:
            raw = properties.split(m.header[12:])
            raw["headers"] = fields.table_from_items([(k, v) for k, v in items if k != "BCC"])
            m.header = m.header[:12] + properties.join(raw)
        return keys

    def _apply_properties(self, m: Message, props: dict) -> None:
        if "priority" in props:
            m.priority = props["priority"]
        if "expiration" in props:
            text = props["expiration"]
            ttl, reason = _parse_expiration(text)
            if reason is not None:
                raise replies.AMQPError(replies.PRECONDITION_FAILED, f"invalid expiration '{text}': {reason}",
                                        hard=False, class_id=60, method_id=40)
            m.ttl = ttl
        if "user_id" in props and props["user_id"] != self.conn.user and not access.impersonator(self.conn):
            raise replies.AMQPError(
                replies.PRECONDITION_FAILED,
                f"user_id property set to '{props['user_id']}' but authenticated user was "
                f"'{self.conn.user}'", hard=False, class_id=60, method_id=40)

    def route_message(self, x, m: Message, mandatory: bool, seq: int, cc: list[str] = ()) -> None:
        vhost = self.vhost
        queues = vhost.route(x, m.routing_key, m)
        if cc:
            for key in cc:
                for q in vhost.route(x, key, m):
                    if q not in queues:
                        queues.append(q)
        ok = True
        if not queues:
            if mandatory:
                self.reply(methods.unchecked(C.Basic.Return, reply_code=replies.NO_ROUTE, reply_text="NO_ROUTE",
                                          exchange=m.exchange, routing_key=m.routing_key))
                self.conn.write_content(self.number, m)
        else:
            now = self.conn.core.now()
            accepted = [q for q in queues if not q.would_reject(m, self)]
            if len(accepted) != len(queues):
                ok = False
                for q in queues:
                    if q not in accepted and q.args.overflow == "reject-publish-dlx":
                        vhost.dead_letter(q, [m.copy()], "maxlen")
            last = len(accepted) - 1
            for i, q in enumerate(accepted):
                q.enqueue(m if i == last else m.copy(), now)
        if self.confirming and seq:
            self.confirm(seq, ok)

    def confirm(self, seq: int, ok: bool) -> None:
        """Record a confirm; the connection sends them coalesced (multiple=true) after each read.

        Runs of equal outcome collapse into one ack (or nack) with multiple=true for the run's last tag,
        which is what keeps a Python publisher's CPU per message low."""
        runs = self.confirm_runs
        self.conn.confirms_waiting += 1
        if not runs:
            self.conn.confirm_channels.add(self)
        if runs and runs[-1][0] == ok:
            runs[-1][1] = seq
        else:
            runs.append([ok, seq, seq])

    def flush_confirms(self) -> None:
        for run in self.confirm_runs:
            ok, upto, first = run[0], run[1], run[2]
            multiple = upto != first
            self.conn.write_raw(methods.encode_ack(self.number, upto, multiple) if ok
                                else methods.encode_nack(self.number, upto, multiple))
        self.confirm_runs = []

    # --- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Channel closed (either side) or connection gone: requeue unacked, drop consumers."""
        self.state = CLOSING
        self.conn.core.timed_channels.discard(self)
        self.timed_out.clear()
        for op in self.tx_ops:  # settlements of an uncommitted transaction never happened
            if op[0] == "settle":
                self.unacked.update(op[1])
        for consumer in list(self.consumers.values()):
            consumer.queue.remove_consumer(consumer)
        self.consumers.clear()
        self.requeue_all(DOWN)
        self.tx_ops = []
        self.pending = None
