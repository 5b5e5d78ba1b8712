"""The asyncio layer: sockets, the clock, and write back-pressure around the sans-I/O core.

After every read it runs the core's dispatch and writes each connection's pending output; a 50 ms
timer drives TTL expiry, x-expires and heartbeats. Everything AMQP lives in `connection.py` and below.

TLS is this layer's business only: with `tls_port` set, a second listener wraps its sockets with an
`ssl.SSLContext` (asyncio's SSL transport) and hands the decrypted bytes to the same `AMQPProtocol`; the
sans-I/O core never knows whether a connection is encrypted.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import ssl
import termios

from . import limits
from .config import BrokerConfig
from .connection import SHUTDOWN_TEXT, Connection
from .core import BrokerCore
from .store import Store

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
        # Over TLS this runs once the TLS handshake has succeeded: a client that fails it never reaches
        # the core (no Connection, no max_connections slot).
        self.transport = transport
        self._fd = transport.get_extra_info("socket").fileno()
        ssl_object = transport.get_extra_info("ssl_object")
        self._tls = ssl_object is not None
        transport.set_write_buffer_limits(high=limits.CONNECTION_OUTPUT_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        # getpeercert() is a dict only for a certificate that was verified (the context has tls_ca);
        # None (no certificate) or {} (not verified) otherwise. Its subject is what SASL EXTERNAL uses.
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        subject = cert.get("subject") if cert else None
        self.conn = Connection(self.server.core, peer=f"{peer[0]}:{peer[1]}" if peer else "",
                               peer_cert_subject=subject)
        self.conn.io = self
        self.server.core.connection_made(self.conn)

    def data_received(self, data):
        conn = self.conn
        conn.receive_data(data)
        conn.end_of_read(self._more_to_read)
        self.server.after_input()

    def _more_to_read(self) -> bool:
        """Bytes already waiting in the socket (FIONREAD): the peer's next frames are on their way.

        Over TLS the answer is always False, so publisher confirms go out at the end of every read. The
        socket holds ciphertext, and waiting ciphertext does not promise another `data_received`: it may
        be a TLS record carrying no application data (an alert, a TLS 1.3 KeyUpdate or other
        post-handshake message) and it says nothing of the partial record asyncio's SSL layer already took
        off the socket. A True answer defers confirms until the next read, which a publisher waiting for
        its confirms may never send (there is no timer flush); False only gives up coalescing (more,
        smaller basic.ack frames), never correctness."""
        if self._tls:
            return False
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
        self.store = None
        if config.data_dir:   # read, repair and compact the journal; restore what it holds
            self.store = self.core.store = Store.open(config.data_dir)
            self.store.restore(self.core)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tls_server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._more_scheduled = False
        self.port = config.port
        self.tls_port = config.tls_port
        # Built here, not at start, so a bad certificate or key is reported before anything listens.
        self.ssl_context = tls_context(config) if config.tls_port is not None else None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: AMQPProtocol(self), self.config.host,
                                                     self.config.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.ssl_context is not None:
            try:
                self._tls_server = await self.loop.create_server(
                    lambda: AMQPProtocol(self), self.config.host, self.config.tls_port,
                    reuse_address=True, ssl=self.ssl_context,
                    ssl_handshake_timeout=limits.TLS_HANDSHAKE_TIMEOUT)
            except BaseException:
                self._server.close()
                raise
            self.tls_port = self._tls_server.sockets[0].getsockname()[1]
        self._ticker = self.loop.call_later(TICK_SECONDS, self._tick)
        log.info("AMQP 0-9-1 broker listening on %s:%s", self.config.host, self.port)
        if self._tls_server is not None:
            log.info("AMQP 0-9-1 broker listening for TLS (amqps) on %s:%s%s", self.config.host,
                     self.tls_port, " (client certificates required)" if self.config.tls_verify_peer else "")

    def _servers(self) -> list:
        return [s for s in (self._server, self._tls_server) if s is not None]

    def after_input(self) -> None:
        core = self.core
        core.run_dispatch()
        if self.store is not None:
            self.store.commit()   # before any output: confirms leave only once their messages are on disk
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
        servers = self._servers()
        for server in servers:
            server.close()
            # Python 3.13+: also drops sockets still in their TLS handshake (not yet in core.connections),
            # which wait_closed() would otherwise wait for up to TLS_HANDSHAKE_TIMEOUT on 3.12+.
            abort_clients = getattr(server, "abort_clients", None)
            if abort_clients is not None:
                abort_clients()
        for conn in list(self.core.connections):
            if conn.io is not None and conn.io.transport is not None:
                conn.io.transport.abort()
        for server in servers:
            await server.wait_closed()
        if self.store is not None:
            self.store.close()

    async def shutdown(self, grace: float = limits.SHUTDOWN_GRACE) -> None:
        """Stop listening, send connection.close 320 CONNECTION_FORCED (RabbitMQ's "broker forced
        connection closure with reason 'shutdown'") to every connection, give the clients up to `grace`
        seconds to answer close-ok and go, then drop whatever is left (`stop`)."""
        for server in self._servers():
            server.close()
        count = self.core.shutdown(SHUTDOWN_TEXT)
        if count:
            log.info("shutting down: closing %d connection(s) with 320 CONNECTION_FORCED", count)
        self.after_input()
        deadline = self.loop.time() + grace
        while self.core.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.stop()

    async def serve_forever(self) -> None:
        await self.start()
        await asyncio.gather(*(server.serve_forever() for server in self._servers()))


def tls_context(config: BrokerConfig) -> ssl.SSLContext:
    """The TLS listener's server context: TLS 1.2 or later, the configured certificate chain and key, and,
    with `tls_ca`, client certificates verified against it (required when `tls_verify_peer`, else
    verified only when presented). Errors are ValueErrors naming the config key and the file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    cert, key = config.tls_cert, config.tls_key
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=cert)   # parses the certificates only: tells a bad cert file apart
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"tls_cert: no PEM certificate could be read from {cert!r} ({_reason(exc)})") from None

    def no_password():
        raise ValueError(f"tls_key: {key!r} is encrypted (password-protected); give an unencrypted key")

    try:
        ctx.load_cert_chain(certfile=cert, keyfile=key, password=no_password)
    except ssl.SSLError as exc:
        raise ValueError(f"tls_key: cannot use {key!r} as the private key of the certificate in {cert!r} "
                         f"({_reason(exc)})") from None
    except OSError as exc:
        raise ValueError(f"tls_cert/tls_key: cannot load {cert!r} / {key!r} ({_reason(exc)})") from None
    if config.tls_ca is not None:
        try:
            ctx.load_verify_locations(cafile=config.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"tls_ca: no PEM CA certificate could be read from {config.tls_ca!r} "
                             f"({_reason(exc)})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if config.tls_verify_peer else ssl.CERT_OPTIONAL
    return ctx


def _reason(exc: OSError) -> str:
    """OpenSSL's reason (e.g. KEY_VALUES_MISMATCH) or the OS error; never any file contents."""
    return getattr(exc, "reason", None) or exc.strerror or type(exc).__name__
