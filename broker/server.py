"""The asyncio layer: sockets, the clock, and write back-pressure around the sans-I/O core.

After every read it runs the core's dispatch and writes each connection's pending output; a 50 ms
timer drives TTL expiry, x-expires and heartbeats. Everything AMQP lives in `connection.py` and below.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import termios

from . import limits
from .config import BrokerConfig
from .connection import Connection
from .core import BrokerCore

log = logging.getLogger("broker.server")

TICK_SECONDS = 0.05
_INT0 = b"\0\0\0\0"


class AMQPProtocol(asyncio.Protocol):
    def __init__(self, server: "Server"):
        self.server = server
        self.transport = None
        self.conn: Connection | None = None
        self.reading_paused = False

    def connection_made(self, transport):
        self.transport = transport
        self._fd = transport.get_extra_info("socket").fileno()
        transport.set_write_buffer_limits(high=limits.CONNECTION_OUTPUT_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.conn = Connection(self.server.core, peer=f"{peer[0]}:{peer[1]}" if peer else "")
        self.conn.io = self
        self.server.core.connection_made(self.conn)

    def data_received(self, data):
        conn = self.conn
        conn.receive_data(data)
        conn.end_of_read(self._more_to_read)
        self.server.after_input()

    def _more_to_read(self) -> bool:
        """Bytes already waiting in the socket (FIONREAD): the peer's next frames are on their way."""
        try:
            fionread = fcntl.ioctl(self._fd, termios.FIONREAD, _INT0)
        except OSError:
            return False
        return fionread != _INT0

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self.conn.connection_lost()
        self.server.after_input()

    def pause_writing(self):
        self.conn.set_paused_writing(True)

    def resume_writing(self):
        self.conn.set_paused_writing(False)
        self.server.after_input()

    def flush(self):
        conn = self.conn
        data = conn.data_to_send()
        transport = self.transport
        if transport.is_closing():
            return
        if data:
            transport.write(data)
        if conn.closed:
            transport.close()
            return
        paused = conn.reading_paused
        if paused != self.reading_paused:
            self.reading_paused = paused
            (transport.pause_reading if paused else transport.resume_reading)()


class Server:
    def __init__(self, config: BrokerConfig):
        self.config = config
        self.core = BrokerCore(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._more_scheduled = False
        self.port = config.port

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: AMQPProtocol(self), self.config.host,
                                                     self.config.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = self.loop.call_later(TICK_SECONDS, self._tick)
        log.info("AMQP 0-9-1 broker listening on %s:%s", self.config.host, self.port)

    def after_input(self) -> None:
        core = self.core
        core.run_dispatch()
        self._flush()
        if core.to_dispatch and not self._more_scheduled:
            self._more_scheduled = True
            self.loop.call_soon(self._dispatch_more)

    def _dispatch_more(self) -> None:
        self._more_scheduled = False
        self.after_input()

    def _flush(self) -> None:
        dirty = self.core.dirty
        while dirty:
            conn = dirty.pop()
            if conn.io is not None:
                conn.io.flush()

    def _tick(self) -> None:
        try:
            self.core.tick()
            self.after_input()
        except Exception:
            log.exception("broker timer failed")
        self._ticker = self.loop.call_later(TICK_SECONDS, self._tick)

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.core.connections):
            if conn.io is not None and conn.io.transport is not None:
                conn.io.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def serve_forever(self) -> None:
        await self.start()
        await self._server.serve_forever()
