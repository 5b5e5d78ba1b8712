"""A virtual host: the AMQ model's exchanges, queues and bindings, and routing between them.

Every model effect of a protocol method lands here (declare, bind, delete, route, dead-letter), as
methods that raise `AMQPError` with RabbitMQ's reply code and text when the method is refused.
Nothing here knows about frames or sockets.
"""

from __future__ import annotations

import base64
import os

from spark_amqp.codec import fields, properties, replies

from .exchange import EXCHANGE_TYPES, DirectExchange, Exchange, LocalRandomExchange, _freeze
from .message import Message
from . import arguments
from .queue import Queue
from .quorum import QuorumQueue
from .stream import StreamQueue

# The queue types a declare can ask for (x-queue-type), each a class with the same interface.
QUEUE_TYPES = {arguments.CLASSIC: Queue, arguments.QUORUM: QuorumQueue, arguments.STREAM: StreamQueue}

# RabbitMQ pre-declares these in every virtual host (spec 3.1.3.1 requires amq.direct, amq.fanout,
# amq.topic, amq.headers/amq.match; RabbitMQ adds amq.rabbitmq.trace, which we do not).
PREDECLARED = (("amq.direct", "direct"), ("amq.fanout", "fanout"), ("amq.topic", "topic"),
               ("amq.headers", "headers"), ("amq.match", "headers"))


def _rs_queue(name, vhost):
    return f"queue '{name}' in vhost '{vhost}'"


def _rs_exchange(name, vhost):
    return f"exchange '{name}' in vhost '{vhost}'"


class VirtualHost:
    def __init__(self, core, name: str):
        self.core = core
        self.name = name
        self.default_exchange = DirectExchange("", durable=True)
        self.exchanges: dict[str, Exchange] = {"": self.default_exchange}
        for xname, xtype in PREDECLARED:
            self.exchanges[xname] = EXCHANGE_TYPES[xtype](xname, durable=True)
            self.exchanges[xname].configure(core.behaviour)
        self.queues: dict[str, Queue] = {}
        # The vhost's default queue type (4.x's vhost metadata default_queue_type), None: classic.
        self.default_queue_type: str | None = None

    # --- exchanges -----------------------------------------------------------------------------

    def get_exchange(self, name: str) -> Exchange:
        x = self.exchanges.get(name)
        if x is None:
            raise replies.channel_error(replies.NOT_FOUND, f"no {_rs_exchange(name, self.name)}")
        return x

    def declare_exchange(self, name, type_, passive, durable, auto_delete, internal, arguments):
        if name == "":
            raise replies.channel_error(replies.ACCESS_REFUSED,
                                        "operation not permitted on the default exchange")
        if passive:
            return self.get_exchange(name)
        if name.startswith("amq.") and name not in self.exchanges:
            # Redeclaring a pre-declared amq.* exchange equivalently is allowed; creating one is not.
            raise replies.channel_error(
                replies.ACCESS_REFUSED,
                f"exchange name '{name}' contains reserved prefix 'amq.*'")     # rabbit_channel:check_name
        cls = EXCHANGE_TYPES.get(type_)
        if cls is LocalRandomExchange and not self.core.behaviour.local_random_exchange:
            cls = None
        if cls is None:
            # rabbit_exchange:check_type: 3.10 closes the connection (503), 4.x the channel (406).
            if self.core.behaviour.unknown_exchange_type_closes_connection:
                raise replies.connection_error(replies.COMMAND_INVALID, f"unknown exchange type '{type_}'")
            raise replies.channel_error(replies.PRECONDITION_FAILED, f"unknown exchange type '{type_}'")
        existing = self.exchanges.get(name)
        if existing is not None:
            for field, have, want in (("type", existing.type_name, type_),
                                      ("durable", existing.durable, durable),
                                      ("auto_delete", existing.auto_delete, auto_delete),
                                      ("internal", existing.internal, internal)):
                if have != want:
                    raise replies.channel_error(
                        replies.PRECONDITION_FAILED,
                        f"inequivalent arg '{field}' for {_rs_exchange(name, self.name)}: "
                        f"received '{_fmt(want)}' but current is '{_fmt(have)}'")
            for key in ("alternate-exchange",):
                if _freeze(existing.arguments.get(key)) != _freeze((arguments or {}).get(key)):
                    raise replies.channel_error(
                        replies.PRECONDITION_FAILED,
                        f"inequivalent arg '{key}' for {_rs_exchange(name, self.name)}")
            return existing
        x = cls(name, durable=durable, auto_delete=auto_delete, internal=internal, arguments=arguments)
        x.configure(self.core.behaviour)
        self.exchanges[name] = x
        if self.core.policies.any_in(self.name):
            x.policy_alternate_exchange = self.core.policies.exchange_definition(self.name, name).get(
                "alternate-exchange")
        if self.core.store is not None:
            self.core.store.exchange_declared(self.name, x)
        return x

    def delete_exchange(self, name: str, if_unused: bool) -> None:
        if name == "" or name.startswith("amq."):
            raise replies.channel_error(
                replies.ACCESS_REFUSED,
                "operation not permitted on the default exchange" if name == "" else
                f"deletion of system {_rs_exchange(name, self.name)} not allowed")   # check_exchange_deletion
        x = self.exchanges.get(name)
        if x is None:
            return  # RabbitMQ: deleting an exchange that does not exist succeeds
        if if_unused and x.bindings:
            raise replies.channel_error(replies.PRECONDITION_FAILED,
                                        f"{_rs_exchange(name, self.name)} in use")
        self._remove_exchange(x)

    def _remove_exchange(self, x: Exchange) -> None:
        self.exchanges.pop(x.name, None)
        if self.core.store is not None:
            self.core.store.exchange_deleted(self.name, x.name)
        x.bindings.clear()
        for other in list(self.exchanges.values()):
            if any(k[0] is x for k in other.bindings):
                other.unbind_destination(x)
                self._maybe_auto_delete(other)

    def _maybe_auto_delete(self, x: Exchange) -> None:
        if x.auto_delete and not x.bindings and x.name in self.exchanges:
            self._remove_exchange(x)

    def bind_exchange(self, destination, source, routing_key, arguments):
        src, dst = self._binding_ends(source, destination)
        src.bind(dst, routing_key, arguments or {})
        if self.core.store is not None:
            self.core.store.bound(self.name, src, dst, routing_key, arguments, True)

    def unbind_exchange(self, destination, source, routing_key, arguments):
        if source == "" or destination == "":
            raise replies.channel_error(replies.ACCESS_REFUSED,
                                        "operation not permitted on the default exchange")
        src, dst = self.exchanges.get(source), self.exchanges.get(destination)
        if src is None or dst is None:
            return  # RabbitMQ: unbinding what does not exist succeeds
        if self.core.store is not None:
            self.core.store.bound(self.name, src, dst, routing_key, arguments, False)
        if src.unbind(dst, routing_key, arguments or {}):
            self._maybe_auto_delete(src)

    def _binding_ends(self, source, destination):
        if source == "" or destination == "":
            raise replies.channel_error(replies.ACCESS_REFUSED,
                                        "operation not permitted on the default exchange")
        return self.get_exchange(source), self.get_exchange(destination)

    # --- queues --------------------------------------------------------------------------------

    def get_queue(self, name: str, conn=None) -> Queue:
        q = self.queues.get(name)
        if q is None:
            raise replies.channel_error(replies.NOT_FOUND, f"no {_rs_queue(name, self.name)}")
        if conn is not None:
            self.check_exclusive(q, conn)
        return q

    def check_exclusive(self, q: Queue, conn) -> None:
        if q.exclusive_owner is not None and q.exclusive_owner is not conn:
            raise replies.channel_error(
                replies.RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked {_rs_queue(q.name, self.name)}. It could be "
                "originally declared on another connection or the exclusive property value does not "
                "match that of the original declaration.")

    def declare_queue(self, name, passive, durable, exclusive, auto_delete, table, conn,
                      server_name=None) -> Queue:
        """queue.declare, in rabbit_channel's order: the queue type a nameless declare may have, the name,
        then for an existing queue the equivalence checks, for a new one its arguments
        (arguments.check_declare) and its type's own checks."""
        now = self.core.now()
        if passive:
            q = self.get_queue(name, conn)
            if q.declare_is_use:
                q.last_used = now
            return q
        behaviour = self.core.behaviour
        args = self._with_default_type(table, durable, exclusive, auto_delete)
        if not name:
            qtype = arguments.queue_type(args, behaviour, self.default_queue_type)
            if qtype in QUEUE_TYPES and not QUEUE_TYPES[qtype].server_named:
                raise replies.channel_error(
                    replies.PRECONDITION_FAILED,
                    f"Cannot declare a server-named queue for type {arguments.TYPE_MODULES[qtype]}")
            name = server_name or "amq.gen-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        elif name.startswith("amq."):
            raise replies.channel_error(
                replies.ACCESS_REFUSED,
                f"queue name '{name}' contains reserved prefix 'amq.*'")
        owner = conn if exclusive else None
        durable = durable and not exclusive     # rabbit_channel: an exclusive queue is never durable
        q = self.queues.get(name)
        if q is not None:
            # rabbit_amqqueue:check_exclusive_access(strict): owned by another connection, or the
            # exclusive flag differs from the original declaration -> 405.
            if q.exclusive_owner is not owner:
                raise replies.channel_error(
                    replies.RESOURCE_LOCKED,
                    f"cannot obtain exclusive access to locked {_rs_queue(name, self.name)}. It could "
                    "be originally declared on another connection or the exclusive property value "
                    "does not match that of the original declaration.")
            for field, have, want in (("durable", q.durable, durable),
                                      ("auto_delete", q.auto_delete, auto_delete)):
                if have != want:
                    raise replies.channel_error(
                        replies.PRECONDITION_FAILED,
                        f"inequivalent arg '{field}' for {_rs_queue(name, self.name)}: "
                        f"received '{_fmt(want)}' but current is '{_fmt(have)}'")
            arguments.assert_equivalent(q.arguments, args, q.queue_type, name, self.name, behaviour)
            if q.declare_is_use:
                q.last_used = now
            return q
        arguments.check_dead_letter_exchange(args, name, self.name)
        qtype = arguments.check_declare(args, name, self.name, behaviour, self.default_queue_type)
        q = QUEUE_TYPES[qtype](self, name, durable, owner, auto_delete, args, now)
        self.queues[name] = q
        q.policy_definition = {}
        if self.core.policies.any_in(self.name):
            self._apply_policy(q)
        self.default_exchange.bind(q, name, {})
        if owner is not None:
            owner.exclusive_queues.add(q)
        elif self.core.store is not None:
            self.core.store.queue_declared(self.name, q)
        self.core.register_timed_queue(q)
        return q

    def _with_default_type(self, table, durable, exclusive, auto_delete) -> dict:
        """The declare's arguments as RabbitMQ 4.x works with them (rabbit_amqqueue:augment_declare_args):
        without x-queue-type, the vhost's default type is added when that type allows the declare's
        properties (quorum and stream: durable, not exclusive, not auto-delete), else classic."""
        dqt = self.default_queue_type
        if dqt is None or "x-queue-type" in (table or {}):
            return arguments.with_queue_type(table, self.core.behaviour)
        compatible = dqt == arguments.CLASSIC or (durable and not exclusive and not auto_delete)
        return {**(table or {}), "x-queue-type": dqt if compatible else arguments.CLASSIC}

    def _apply_policy(self, q) -> None:
        definition = self.core.policies.queue_definition(self.name, q.name, q.queue_type)
        if definition != q.policy_definition:
            q.policy_definition = definition
            q.apply_policy(definition)

    def refresh_policies(self) -> None:
        """The vhost's policies changed: every queue and exchange takes its (new) effective policy."""
        for q in list(self.queues.values()):
            if not q.deleted:
                self._apply_policy(q)
        for x in self.exchanges.values():
            if x.name and not x.name.startswith("amq."):
                x.policy_alternate_exchange = self.core.policies.exchange_definition(self.name, x.name).get(
                    "alternate-exchange")

    def delete_queue(self, q: Queue, if_unused: bool = False, if_empty: bool = False) -> int:
        """queue.delete: the queue type checks if-unused / if-empty; delete-ok counts the ready messages
        (0 for a stream, as RabbitMQ's); consumers get basic.cancel."""
        q.check_delete(if_unused, if_empty)
        count = 0 if q.is_stream else q.message_count()
        if q.deleted:
            return count
        q.deleted = True
        self.queues.pop(q.name, None)
        if self.core.store is not None:
            self.core.store.queue_deleted(self.name, q.name)
        for x in list(self.exchanges.values()):
            if any(k[0] is q for k in x.bindings):
                x.unbind_destination(q)
                if x is not self.default_exchange:
                    self._maybe_auto_delete(x)
        q.drop_all()
        for consumer in list(q.all_consumers()):
            consumer.channel.cancel_by_broker(consumer)
        q.consumers.clear()
        if q.exclusive_owner is not None:
            q.exclusive_owner.exclusive_queues.discard(q)
        self.core.unregister_timed_queue(q)
        return count

    def bind_queue(self, q: Queue, exchange: str, routing_key: str, arguments) -> None:
        if exchange == "":
            raise replies.channel_error(replies.ACCESS_REFUSED,
                                        "operation not permitted on the default exchange")
        x = self.get_exchange(exchange)
        x.bind(q, routing_key, arguments or {})
        if self.core.store is not None:
            self.core.store.bound(self.name, x, q, routing_key, arguments, True)

    def unbind_queue(self, q: Queue, exchange: str, routing_key: str, arguments) -> None:
        if exchange == "":
            raise replies.channel_error(replies.ACCESS_REFUSED,
                                        "operation not permitted on the default exchange")
        x = self.exchanges.get(exchange)
        if x is not None and self.core.store is not None:
            self.core.store.bound(self.name, x, q, routing_key, arguments, False)
        if x is not None and x.unbind(q, routing_key, arguments or {}):
            self._maybe_auto_delete(x)

    # --- routing -------------------------------------------------------------------------------

    def route(self, x: Exchange, routing_key: str, message: Message) -> list[Queue]:
        """Queues the message goes to from exchange x: through exchange-to-exchange bindings and
        alternate exchanges (used when an exchange itself selects nothing), each queue once."""
        if x is self.default_exchange:
            q = self.queues.get(routing_key)
            return [q] if q is not None else []
        queues: list[Queue] = []
        visited = set()
        pending = [x]
        while pending:
            ex = pending.pop()
            if id(ex) in visited:
                continue
            visited.add(id(ex))
            dests = ex.route(routing_key, message)
            if not dests:
                ae = ex.alternate_exchange
                if ae and ae in self.exchanges:
                    pending.append(self.exchanges[ae])
                continue
            for d in dests:
                if not isinstance(d, Exchange):
                    if d not in queues:
                        queues.append(d)
                else:
                    pending.append(d)
        return queues

    # --- dead-lettering ------------------------------------------------------------------------

    def dead_letter(self, q: Queue, msgs: list[Message], reason: str) -> None:
        """Republish msgs removed from q for `reason` (rejected | expired | maxlen) to q's DLX.

        RabbitMQ's rules (dead-letter docs, rabbit_dead_letter): routing key is x-dead-letter-routing-key
        or the original one; an `x-death` entry per (queue, reason) counts repeats; x-first-death-*
        are set once; a per-message `expiration` is removed and kept as `original-expiration`; a
        message is dropped where it would cycle back to a queue without any rejection in the cycle.
        No DLX, or a DLX that does not exist: the message is dropped.
        """
        if self.core.store is not None:
            self.core.store.removed(msgs)   # gone from q for good, whether or not they are republished
        dlx = self.exchanges.get(q.args.dead_letter_exchange) if q.args.dead_letter_exchange is not None else None
        if dlx is None:
            return
        now = self.core.now()
        for m in msgs:
            dm, targets = self._dead_letter_targets(q, dlx, m, reason)
            for t in targets:
                if t.would_reject(dm):
                    continue
                t.enqueue(dm.copy() if len(targets) > 1 else dm, now)

    def _dead_letter_targets(self, q, dlx: Exchange, m: Message, reason: str):
        """The dead letter of `m` (its x-death recorded) and the queues the dead-letter exchange routes it to,
        leaving out a queue it would cycle back to without a rejection in the cycle, and streams where the
        version drops dead letters to them (RabbitMQ 3.10 dead-letters with stateless queue states, which
        its streams drop: rabbit_stream_queue:deliver/2, "TODO what do we do with stateless?")."""
        behaviour = self.core.behaviour
        header, deaths = _with_x_death(m, q.name, reason, int(self.core.wall_clock()), behaviour.last_death_headers)
        rk = q.args.dead_letter_routing_key
        keys = [rk] if rk is not None else [m.routing_key, *_cc_keys(header)]
        dm = Message(dlx.name, keys[0], header, m.body)
        dm.priority = m.priority
        if behaviour.delivery_count_annotation:
            dm.delivery_count = m.delivery_count
        targets = []
        for key in keys:
            targets += [t for t in self.route(dlx, key, dm) if t not in targets]
        if reason != "rejected" and not any(r == "rejected" for _, r in deaths):
            targets = [t for t in targets if not any(qn == t.name for qn, _ in deaths)]
        if not behaviour.stream_dead_letters:
            targets = [t for t in targets if not t.is_stream]
        return dm, targets

    def dead_letter_at_least_once(self, q, entry: list) -> bool:
        """One at-least-once dead letter of quorum queue q (entry: [message, reason, names of the queues
        that took it]): published to the queues the dead-letter exchange routes it to that have not taken
        it yet. True once it routed somewhere and every queue took it (RabbitMQ's dead-letter worker
        settles it when every target confirmed); else it stays with q for a retry."""
        m, reason, done = entry
        dlx = self.exchanges.get(q.args.dead_letter_exchange)
        if dlx is None:
            return False
        dm, targets = self._dead_letter_targets(q, dlx, m, reason)
        if not targets:
            return False
        now = self.core.now()
        for t in targets:
            if t.name in done:
                continue
            if t.would_reject(dm, q):
                continue
            t.enqueue(dm.copy(), now)
            done.add(t.name)
        if all(t.name in done for t in targets):
            if self.core.store is not None:
                self.core.store.removed([m])
            return True
        return False


def _with_x_death(m: Message, queue_name: str, reason: str, wall: int, last_death: bool):
    """The message's content header with x-death updated (see dead_letter), and its prior deaths.
    `last_death`: x-last-death-exchange/-queue/-reason name this death too (4.x)."""
    prefix, raw = m.header[:12], properties.split(m.header[12:])
    items = fields.table_items(raw["headers"]) if "headers" in raw else []
    entries = []
    others = []
    for key, value in items:
        if key == "x-death":
            try:
                entries = list(fields.decode_value(value))
            except Exception:
                entries = []
        else:
            others.append((key, value))
    prior = [(_s(e.get("queue")), _s(e.get("reason"))) for e in entries if isinstance(e, dict)]
    new_entry = None
    rest = []
    for e in entries:
        if isinstance(e, dict) and _s(e.get("queue")) == queue_name and _s(e.get("reason")) == reason \
                and new_entry is None:
            new_entry = dict(e)
            new_entry["count"] = int(e.get("count", 0)) + 1
        else:
            rest.append(e)
    if new_entry is None:
        new_entry = {"count": 1, "reason": reason, "queue": queue_name, "time": wall,
                     "exchange": m.exchange, "routing-keys": [m.routing_key, *_cc_keys(m.header)]}
        if "expiration" in raw:
            new_entry["original-expiration"] = properties.decode_shortstr(raw["expiration"])
    entry_fields = []
    for k in sorted(new_entry):
        v = new_entry[k]
        if k == "time":
            entry_fields.append((k, fields.enc_timestamp(v)))
        elif k == "count":
            entry_fields.append((k, fields.enc_long(int(v))))
        else:
            entry_fields.append((k, fields.encode_value(v)))
    death_values = [fields.enc_table(entry_fields)]
    for e in rest:
        death_values.append(fields.encode_value(e) if not isinstance(e, dict) else fields.enc_table(
            [(k, fields.enc_timestamp(v) if k == "time" else
              fields.enc_long(int(v)) if k == "count" else fields.encode_value(v))
             for k, v in e.items()]))
    present = {k for k, _ in others}
    firsts = []
    for key, value in (("x-first-death-exchange", m.exchange), ("x-first-death-queue", queue_name),
                       ("x-first-death-reason", reason)):
        if key not in present:
            firsts.append((key, fields.enc_longstr(value)))
    if last_death:
        lasts = (("x-last-death-exchange", m.exchange), ("x-last-death-queue", queue_name),
                 ("x-last-death-reason", reason))
        others = [(k, v) for k, v in others if k not in dict(lasts)]
        firsts += [(key, fields.enc_longstr(value)) for key, value in lasts]
    new_items = [("x-death", fields.enc_array(death_values))] + firsts + others
    raw["headers"] = fields.table_from_items(new_items)
    raw.pop("expiration", None)
    return prefix + properties.join(raw), prior


def _cc_keys(header: bytes) -> list[str]:
    """The `CC` routing keys a message carries (BCC was stripped when it was published)."""
    if not properties.flags_of(header, 12) & properties.FLAG["headers"]:
        return []
    raw = properties.split(header[12:])
    for key, value in fields.table_items(raw["headers"]):
        if key == "CC" and value[:1] == b"A":
            return [_s(v) for v in fields.decode_value(value)]
    return []


def _s(v):
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v


def _fmt(v):
    return str(v).lower() if isinstance(v, bool) else str(v)


