"""The broker's shared state: users, virtual hosts, live connections, and the work that runs after
each read or on the clock (dispatch to consumers, TTL expiry, x-expires, consumer timeouts, heartbeats, memory
alarm).

Still sans-I/O: the server calls `run_dispatch()` and `tick()` and drains `dirty` connections.
"""

from __future__ import annotations

import logging
import time

from . import definitions, limits, policies
from .config import BrokerConfig
from .vhost import VirtualHost

log = logging.getLogger("broker.core")


class BrokerCore:
    """`clock` (monotonic seconds) times TTLs, expiry and heartbeats; `wall_clock` (epoch seconds) is only
    for what the broker writes into messages (`x-death` times). Both are injected so tests can drive them."""

    def __init__(self, config: BrokerConfig, clock=time.monotonic, wall_clock=time.time):
        self.config = config
        # What differs between RabbitMQ versions (versions.Behaviour): the code reads its fields, never a
        # version string.
        self.behaviour = config.behaviour
        self.clock = clock
        self.wall_clock = wall_clock
        self.access = config.access                     # users, permissions (access.AccessControl)
        self.vhosts = {name: VirtualHost(self, name) for name in config.all_vhosts}
        for name, qtype in config.vhost_default_queue_types.items():
            if self.behaviour.vhost_default_queue_type:
                self.vhosts[name].default_queue_type = qtype
            elif qtype != "classic":
                log.warning("vhost '%s': default_queue_type '%s' ignored: RabbitMQ %s has no default queue type",
                            name, qtype, self.behaviour.version)
        self.policies = policies.Policies(self.behaviour)   # policies and operator policies of every vhost
        for policy in config.policy_list:
            if policy.vhost in self.vhosts:
                self.policies.set(policy)
            else:
                log.warning("%s '%s' not loaded: vhost '%s' is not configured", policy.kind.replace("_", " "),
                            policy.name, policy.vhost)
        self.definitions_skipped: list[str] = []        # what a definitions file held that we do not support
        self.connections: set = set()
        self.dirty: set = set()          # connections with output to write
        self.to_dispatch: dict = {}      # queues that may be able to deliver (insertion-ordered set)
        self.timed_queues: set = set()   # queues with x-expires or messages carrying a deadline
        self.timed_channels: set = set() # channels whose consumer timeout is due at `channel.due`
        self.queued_bytes = 0            # bytes of message data held in queues: the memory alarm's measure
        self.alarm = False
        self._next_memory_check = self.now() + limits.MEMORY_CHECK_INTERVAL * 1000
        self.store = None                # store.Store with data_dir: the durable-event hooks
        if config.loaded_definitions is not None:
            definitions.apply_topology(self, config.loaded_definitions)

    def now(self) -> float:
        """Milliseconds on the monotonic clock."""
        return self.clock() * 1000.0

    # --- policies ------------------------------------------------------------------------------

    def set_policy(self, policy, journal: bool = True) -> None:
        """Add or replace a (validated) policy or operator policy; the vhost's queues and exchanges take
        their new effective settings at once, as RabbitMQ's do."""
        vhost = self.vhosts.get(policy.vhost)
        if vhost is None:
            raise ValueError(f"no such vhost '{policy.vhost}' (vhosts: {sorted(self.vhosts)})")
        self.policies.set(policy)
        if journal and self.store is not None:
            self.store.policy_set(policy)
        vhost.refresh_policies()

    def clear_policy(self, kind: str, vhost_name: str, name: str) -> bool:
        """Remove a policy (kind policies.POLICY or OPERATOR_POLICY); False when there was none."""
        removed = self.policies.clear(kind, vhost_name, name)
        if removed is None:
            return False
        if self.store is not None:
            self.store.policy_cleared(kind, vhost_name, name)
        self.vhosts[vhost_name].refresh_policies()
        return True

    # --- connections ---------------------------------------------------------------------------

    def connection_made(self, conn) -> None:
        self.connections.add(conn)

    def connection_closed(self, conn) -> None:
        self.connections.discard(conn)
        self.dirty.discard(conn)

    def shutdown(self, text: str) -> int:
        """The broker is going away: queue connection.close 320 CONNECTION_FORCED with `text` on every
        open connection (the I/O layer flushes them). Returns how many connections there were."""
        conns = list(self.connections)
        for conn in conns:
            conn.force_close(text)
        return len(conns)

    def open_connections(self) -> int:
        return sum(1 for c in self.connections if c.vhost is not None and not c.closed)

    # --- work after each read ----------------------------------------------------------------

    def wants_dispatch(self, queue) -> None:
        self.to_dispatch[queue] = None

    def run_dispatch(self) -> bool:
        """Deliver what can be delivered; True if some queue could deliver more right away."""
        if not self.to_dispatch:
            return False
        now = self.now()
        pending, self.to_dispatch = self.to_dispatch, {}
        more = False
        for q in pending:
            if not q.deleted and q.dispatch(now):
                self.to_dispatch[q] = None
                more = True
        return more

    def register_timed_queue(self, q) -> None:
        if q.timed():
            self.timed_queues.add(q)

    def unregister_timed_queue(self, q) -> None:
        self.timed_queues.discard(q)

    def tick(self) -> None:
        now = self.now()
        for q in list(self.timed_queues):
            if q.deleted:
                self.timed_queues.discard(q)
                continue
            q.expire(now)
            if q.idle_expired(now):      # x-expires
                q.vhost.delete_queue(q)
            elif not q.timed():
                self.timed_queues.discard(q)
        if self.timed_channels:
            for ch in list(self.timed_channels):
                if ch.due <= now:
                    ch.on_due(now)
        for conn in list(self.connections):
            conn.tick(now)
            if conn.closed:
                self.dirty.add(conn)
        if now >= self._next_memory_check:
            self._next_memory_check = now + limits.MEMORY_CHECK_INTERVAL * 1000
            self.check_memory()

    # --- memory alarm --------------------------------------------------------------------------

    def account(self, delta: int) -> None:
        """Only counts: the alarm is decided by `check_memory` on the clock. Deciding it here, per message,
        made a publisher whose consumers keep up toggle connection.blocked/unblocked hundreds of times a
        second around the watermark."""
        self.queued_bytes += delta

    def check_memory(self) -> None:
        """Set or clear the memory alarm (run every MEMORY_CHECK_INTERVAL, as RabbitMQ's vm_memory_monitor
        polls): on when more than `memory_limit` bytes of message data are queued, off at or below it."""
        limit = self.config.memory_limit
        active = limit is not None and self.queued_bytes > limit
        if active != self.alarm:
            self._set_alarm(active)

    def _set_alarm(self, active: bool) -> None:
        limit = self.config.memory_limit
        if active:
            log.warning("memory resource limit alarm set: %d bytes of messages queued, above the "
                        "memory_high_watermark of %s bytes; publishers will be blocked",
                        self.queued_bytes, limit)
        else:
            log.warning("memory resource limit alarm cleared: %d bytes of messages queued (limit %s)",
                        self.queued_bytes, limit)
        self.alarm = active
        for conn in self.connections:
            conn.on_alarm(active)
            self.dirty.add(conn)  # the server re-reads `reading_paused` when it flushes
