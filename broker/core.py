"""The broker's shared state: users, virtual hosts, live connections, and the work that runs after
each read or on the clock (dispatch to consumers, TTL expiry, x-expires, heartbeats, memory alarm).

Still sans-I/O: the server calls `run_dispatch()` and `tick()` and drains `dirty` connections.
"""

from __future__ import annotations

import time

from . import definitions
from .config import BrokerConfig
from .vhost import VirtualHost


class BrokerCore:
    """`clock` (monotonic seconds) times TTLs, expiry and heartbeats; `wall_clock` (epoch seconds) is only
    for what the broker writes into messages (`x-death` times). Both are injected so tests can drive them."""

    def __init__(self, config: BrokerConfig, clock=time.monotonic, wall_clock=time.time):
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.access = config.access                     # users, permissions (access.AccessControl)
        self.vhosts = {name: VirtualHost(self, name) for name in config.all_vhosts}
        self.definitions_skipped: list[str] = []        # what a definitions file held that we do not support
        self.connections: set = set()
        self.dirty: set = set()          # connections with output to write
        self.to_dispatch: dict = {}      # queues that may be able to deliver (insertion-ordered set)
        self.timed_queues: set = set()   # queues with x-expires or messages carrying a deadline
        self.queued_bytes = 0
        self.alarm = False
        self.store = None                # store.Store with data_dir: the durable-event hooks
        if config.loaded_definitions is not None:
            definitions.apply_topology(self, config.loaded_definitions)

    def now(self) -> float:
        """Milliseconds on the monotonic clock."""
        return self.clock() * 1000.0

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
        if q.args.expires is not None or q.has_ttl:
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
            if q.args.expires is not None:
                if not q.consumers and now - q.last_used >= q.args.expires:
                    q.vhost.delete_queue(q)
                    continue
            elif not q.has_ttl:
                self.timed_queues.discard(q)
        for conn in list(self.connections):
            conn.tick(now)
            if conn.closed:
                self.dirty.add(conn)

    # --- memory alarm --------------------------------------------------------------------------

    def account(self, delta: int) -> None:
        self.queued_bytes += delta
        limit = self.config.memory_high_watermark
        if limit is None:
            return
        if not self.alarm and self.queued_bytes > limit:
            self._set_alarm(True)
        elif self.alarm and self.queued_bytes <= limit:
            self._set_alarm(False)

    def _set_alarm(self, active: bool) -> None:
        self.alarm = active
        for conn in self.connections:
            conn.on_alarm(active)
            self.dirty.add(conn)  # the server re-reads `reading_paused` when it flushes
