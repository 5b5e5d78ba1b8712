"""`Connection`: a blocking AMQP 0-9-1 connection whose socket reads belong to a background thread.

Why a reader thread: the source's driver-side consumer is called by Spark only between micro-batches
(seconds to minutes apart), yet the broker expects heartbeats every `heartbeat / 2` seconds and closes the
connection after two missed intervals (spec 4.2.7). So one daemon thread per connection owns every socket
read: it parses frames (`events.EventParser`), answers heartbeats, replies to broker-initiated closes and
cancels, and feeds per-channel queues of deliveries and confirms. Callers' threads only write (under one
lock, a frame sequence at a time) and wait on conditions with timeouts. When the connection dies (broker
close, socket closed, missed heartbeats) every channel is failed at once, so every blocked call raises.

Handshake (spec 2.2.4): protocol header -> Start / StartOk (PLAIN, AMQPLAIN or EXTERNAL) -> Tune / TuneOk ->
Open / OpenOk, done synchronously on the caller's thread before the reader thread starts. An amqps:// URI
first does the TLS handshake (`tls.py`).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import sys
import threading
import time

from pamqp import commands

from .. import __version__
from ..codec import fields, frames, methods
from ..codec.replies import ACCESS_REFUSED, FRAME_ERROR, REPLY_SUCCESS
from .channel import Channel
from .errors import (AMQPError, AuthenticationError, ConnectError, ConnectionClosedError, ConnectionLostError,
                     ProtocolError)
from .events import Confirm, Delivery, EventParser, Returned
from .tls import TLSOptions, wrap as tls_wrap
from .uri import ConnectionParameters, parse_uri

log = logging.getLogger("spark_amqp.client")

DEFAULT_HEARTBEAT = 60       # seconds; RabbitMQ's server default
DEFAULT_CONNECT_TIMEOUT = 10.0
FRAME_MIN_SIZE = 4096        # spec 4.2.3: the smallest frame_max a peer may propose
RECV_SIZE = 256 * 1024
CLOSE_OK_WAIT = 1.0          # seconds the reader waits for the write lock to answer a broker's close

CLIENT_CAPABILITIES = {
    "publisher_confirms": True,
    "consumer_cancel_notify": True,      # the broker tells us when a queue we consume from is deleted
    "basic.nack": True,
    "connection.blocked": True,          # the broker tells us when it throttles publishers
    "authentication_failure_close": True,  # a bad password is a 403 close, not a bare socket close
}


AUTH_MECHANISMS = ("PLAIN", "AMQPLAIN", "EXTERNAL")


def _auth_response(mechanism: str, params: ConnectionParameters) -> str | bytes:
    """The SASL response of connection.start-ok (spec 1.4.2.2; RabbitMQ's AMQPLAIN and EXTERNAL)."""
    if mechanism == "PLAIN":
        return f"\0{params.username}\0{params.password}"
    if mechanism == "AMQPLAIN":   # a field table without its length prefix (pamqp sends the text as UTF-8)
        table = fields.table_from_items([("LOGIN", fields.enc_longstr(params.username)),
                                         ("PASSWORD", fields.enc_longstr(params.password))])[4:]
        try:
            return table.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("AMQPLAIN cannot carry this user name or password (a length above 127 bytes); "
                             "use PLAIN") from None
    return ""                      # EXTERNAL: the identity is the client certificate


class Connection:
    """A live AMQP connection. Open with `Connection.open(uri)`; use as a context manager to close."""

    def __init__(self, sock: socket.socket, params: ConnectionParameters, *, rpc_timeout: float):
        self._sock = sock
        self.uri = params.redacted          # never the password
        self.vhost = params.vhost
        self.rpc_timeout = rpc_timeout
        self.heartbeat = 0
        self.frame_max = FRAME_MIN_SIZE
        self.channel_max = 0
        self.server_properties: dict = {}
        self.blocked: str | None = None     # connection.blocked reason while the broker throttles us
        self._parser = EventParser(frame_max=0)
        self._wlock = threading.Lock()
        self._lock = threading.Lock()       # channel table
        self._channels: dict[int, Channel] = {}
        self._error: ConnectionClosedError | None = None
        self._closed = threading.Event()      # the reader thread has exited
        self._terminated = threading.Event()  # _error is set
        self._reader: threading.Thread | None = None
        self._last_send = self._last_recv = time.monotonic()
        self._poll = select.poll()
        # reading_paused: the reader thread takes nothing from the socket while this is clear, for at most
        # _pause_most seconds per pause (_pauses counts them, so that one pause is waited out once).
        self._reading = threading.Event()
        self._reading.set()
        self._pause_most = 0.0
        self._pauses = 0
        self._auth_mechanism = "PLAIN"

    # ----------------------------------------------------------------------------------------- open

    @classmethod
    def open(cls, uri: str, *, heartbeat: int | None = None, connect_timeout: float | None = None,
             frame_max: int | None = None, channel_max: int | None = None,
             client_properties: dict | None = None, rpc_timeout: float = 30.0,
             tls: TLSOptions | None = None, auth_mechanism: str = "PLAIN") -> "Connection":
        """Connect (TLS for amqps://), authenticate, tune and open the URI's vhost.

        Keyword arguments left at None take the URI's query parameters (``heartbeat``,
        ``connection_timeout`` in ms, ``frame_max``, ``channel_max``), else the defaults: heartbeat 60 s
        (0 disables heartbeats), connect timeout 10 s, frame_max and channel_max as the broker proposes.
        `tls`: CA, client certificate and checks for amqps:// (default: verify against the system's CAs).
        `auth_mechanism`: PLAIN (default), AMQPLAIN, or EXTERNAL (the broker takes the user from the
        client certificate).
        """
        params = parse_uri(uri)
        if tls is not None and not params.tls:
            raise ValueError(f"TLS options were given for {params.redacted}: use an amqps:// URI for TLS")
        auth_mechanism = auth_mechanism.upper()
        if auth_mechanism not in AUTH_MECHANISMS:
            raise ValueError(f"unknown authentication mechanism {auth_mechanism!r}; "
                             f"expected one of {', '.join(AUTH_MECHANISMS)}")
        heartbeat = _first(heartbeat, params.heartbeat, DEFAULT_HEARTBEAT)
        connect_timeout = _first(connect_timeout, params.connect_timeout, DEFAULT_CONNECT_TIMEOUT)
        frame_max = _first(frame_max, params.frame_max, 0)
        channel_max = _first(channel_max, params.channel_max, 0)
        if frame_max and frame_max < FRAME_MIN_SIZE:
            raise ValueError(f"frame_max must be at least {FRAME_MIN_SIZE} (spec 4.2.3), not {frame_max}")
        deadline = time.monotonic() + connect_timeout
        try:
            sock = socket.create_connection((params.host, params.port), timeout=connect_timeout)
        except OSError as exc:
            raise ConnectError(f"cannot connect to {params.host}:{params.port} ({params.redacted}): "
                               f"{exc.strerror or exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if params.tls:
            try:
                sock = tls_wrap(sock, tls or TLSOptions(), params.host, params.redacted,
                                deadline - time.monotonic())
            except BaseException:
                _close_quietly(sock)
                raise
        conn = cls(sock, params, rpc_timeout=rpc_timeout)
        conn._auth_mechanism = auth_mechanism
        try:
            conn._handshake(params, heartbeat, frame_max, channel_max, client_properties, deadline)
        except OSError as exc:  # a send failed or timed out mid-handshake
            _close_quietly(sock)
            raise ConnectError(f"connection to {conn.uri} failed during the handshake: {exc}") from None
        except BaseException:
            _close_quietly(sock)
            raise
        sock.settimeout(None)
        conn._poll.register(sock, select.POLLIN)
        conn._reader = threading.Thread(target=conn._run, name=f"amqp-reader {conn.uri}", daemon=True)
        conn._reader.start()
        log.info("connected to %s (heartbeat %s s, frame_max %s)", conn.uri, conn.heartbeat, conn.frame_max)
        return conn

    def _handshake(self, params, heartbeat, frame_max, channel_max, client_properties, deadline):
        events: list = []
        phase = "connection.start"

        def expect(*types):
            while True:
                while events:
                    ev = events.pop(0)
                    if ev == EventParser.HEARTBEAT:
                        continue
                    _, method = ev
                    if isinstance(method, commands.Connection.Close):
                        self._handshake_closed(method, phase)
                    if isinstance(method, types):
                        return method
                    raise ConnectError(f"unexpected {method.name} from {self.uri} during {phase}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectError(f"{self.uri} did not complete {phase} in time (connect timeout)")
                self._sock.settimeout(remaining)
                try:
                    data = self._sock.recv(RECV_SIZE)
                except socket.timeout:
                    raise ConnectError(f"{self.uri} did not complete {phase} in time (connect timeout)") \
                        from None
                except ssl.SSLError as exc:
                    if "CERTIFICATE_REQUIRED" in str(exc).upper():
                        raise ConnectError(f"TLS: {self.uri} requires a client certificate; set tls.certFile "
                                           "and tls.keyFile") from None
                    raise ConnectError(f"TLS connection to {self.uri} failed during {phase}: {exc}") from None
                except OSError as exc:
                    raise ConnectError(f"connection to {self.uri} failed during {phase}: {exc}") from None
                if not data and phase == "connection.start" and isinstance(self._sock, ssl.SSLSocket):
                    # TLS 1.3 lets the client finish its handshake before the server has judged its
                    # certificate; a refusal then shows as the connection closing before AMQP starts.
                    raise ConnectError(f"{self.uri} closed the TLS connection before AMQP started: it "
                                       "probably requires a client certificate (set tls.certFile and "
                                       "tls.keyFile) or refused the one given")
                if not data:
                    if phase == "authentication":
                        # Brokers without authentication_failure_close just drop the socket (spec 2.2.4:
                        # "the server closes the connection" on failed authentication).
                        raise AuthenticationError(ACCESS_REFUSED, "the broker closed the connection after "
                                                  "connection.start-ok: access refused (bad user name or "
                                                  "password?)")
                    raise ConnectError(f"{self.uri} closed the connection during {phase}")
                if data.startswith(b"AMQP"):
                    raise ConnectError(f"{self.uri} does not speak AMQP 0-9-1: it answered with protocol "
                                       f"header {data[:8]!r}")
                try:
                    events.extend(self._parser.feed(data))
                except ProtocolError as exc:
                    raise ConnectError(f"{self.uri} sent a malformed frame during {phase}: {exc}") from None

        self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
        self._sock.sendall(frames.PROTOCOL_HEADER)
        start = expect(commands.Connection.Start)
        self.server_properties = start.server_properties or {}
        mechanisms = _text(start.mechanisms).split()
        mechanism = self._auth_mechanism
        if mechanism not in mechanisms:
            hint = (" (EXTERNAL needs the broker's certificate authentication, e.g. RabbitMQ's "
                    "rabbitmq_auth_mechanism_ssl plugin)" if mechanism == "EXTERNAL" else "")
            raise ConnectError(f"{self.uri} does not offer {mechanism} authentication (offers "
                               f"{' '.join(mechanisms)}){hint}")
        properties = {
            "product": "spark-amqp", "version": __version__,
            "platform": f"Python {sys.version.split()[0]}",
            "information": "AMQP 0-9-1 client of the spark-amqp connector",
        }
        properties.update(client_properties or {})
        properties["capabilities"] = {**CLIENT_CAPABILITIES, **(properties.get("capabilities") or {})}
        phase = "authentication"
        start_ok = methods.unchecked(commands.Connection.StartOk, client_properties=properties,
                                     mechanism=mechanism, locale="en_US",
                                     response=_auth_response(mechanism, params))
        self._sock.sendall(frames.method_frame(0, start_ok))
        del start_ok
        tune = expect(commands.Connection.Tune, commands.Connection.Secure)
        if isinstance(tune, commands.Connection.Secure):
            raise ConnectError(f"{self.uri} asked for a SASL challenge, which {mechanism} does not use")
        phase = "connection.tune"
        self.channel_max = _negotiate(channel_max, tune.channel_max) or 65535
        self.frame_max = _negotiate(frame_max, tune.frame_max) or 131072
        # heartbeat=0 from the caller disables heartbeats; otherwise the smaller non-zero value wins.
        self.heartbeat = 0 if heartbeat == 0 else _negotiate(heartbeat, tune.heartbeat)
        self._sock.sendall(frames.method_frame(0, commands.Connection.TuneOk(
            channel_max=self.channel_max, frame_max=self.frame_max, heartbeat=self.heartbeat)))
        self._parser.frame_max = self.frame_max
        phase = "connection.open"
        self._sock.sendall(frames.method_frame(0, methods.unchecked(commands.Connection.Open,
                                                               virtual_host=params.vhost)))
        expect(commands.Connection.OpenOk)
        self._last_send = self._last_recv = time.monotonic()

    def _handshake_closed(self, close, phase):
        try:
            self._sock.sendall(frames.method_frame(0, commands.Connection.CloseOk()))
        except OSError:
            pass
        cls = AuthenticationError if close.reply_code == ACCESS_REFUSED and phase == "authentication" \
            else ConnectionClosedError
        raise cls(close.reply_code, close.reply_text, close.class_id, close.method_id)

    # ------------------------------------------------------------------------------------ public API

    @property
    def is_open(self) -> bool:
        return self._error is None

    @property
    def error(self) -> ConnectionClosedError | None:
        """Why the connection is closed (None while it is open)."""
        return self._error

    @contextlib.contextmanager
    def reading_paused(self, most: float = 0.5):
        """Within this block the reader thread takes no more bytes from the socket (after the chunk it is
        on), for at most `most` seconds (a quarter of the heartbeat interval, if that is less), then reads on.

        For a caller about to run pure Python work on what it has already received: the reader thread
        parsing the next deliveries holds the GIL half the time and doubles that work's wall time. What the
        broker sends meanwhile waits in the socket (TCP flow control); nothing is lost. Nothing inside the
        block may wait for the broker (an RPC would wait out the pause). Used by the streaming source's
        driver while it builds a batch's partitions (docs/performance.md)."""
        if self.heartbeat:
            most = min(most, self.heartbeat / 4)
        self._pause_most = most
        self._pauses += 1
        self._reading.clear()
        try:
            yield
        finally:
            self._reading.set()

    def channel(self) -> Channel:
        """Open a new channel (the lowest free channel number)."""
        self._check()
        with self._lock:
            number = next((n for n in range(1, self.channel_max + 1) if n not in self._channels), None)
            if number is None:
                raise AMQPError(f"all {self.channel_max} channels of {self.uri} are in use (channel_max)")
            ch = Channel(self, number)
            self._channels[number] = ch
        try:
            ch._open()
        except BaseException:
            with self._lock:
                if self._channels.get(number) is ch and not ch.is_open:
                    del self._channels[number]
            raise
        return ch

    def close(self, timeout: float = 5.0) -> None:
        """Close cleanly (connection.close 200 / close-ok); idempotent; never raises for a dead peer."""
        if self._error is None:
            close = frames.method_frame(0, commands.Connection.Close(
                reply_code=REPLY_SUCCESS, reply_text="Normal shutdown", class_id=0, method_id=0))
            # close-ok, or the broker's own connection.close crossing ours: either ends it.
            if self._send_within(close, timeout) and not self._terminated.wait(timeout):
                log.warning("%s did not answer connection.close within %s s", self.uri, timeout)
            self._terminate(ConnectionClosedError(REPLY_SUCCESS, "connection closed by the client"))
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._error is None else f"closed: {self._error}"
        return f"<Connection {self.uri} {state}>"

    # --------------------------------------------------------------------------------- writing side

    def _check(self) -> None:
        if self._error is not None:
            raise self._error.fresh()

    def _send(self, data: bytes) -> None:
        """Write whole frames under the write lock (frames of one content must not interleave, 4.2.6)."""
        if self._error is not None:
            raise self._error.fresh()
        try:
            with self._wlock:
                self._sock.sendall(data)
                self._last_send = time.monotonic()
        except OSError as exc:
            # The reader usually knows better why (a connection.close just before the reset): let it finish.
            if threading.current_thread() is not self._reader:
                self._closed.wait(1.0)
            self._terminate(ConnectionLostError(f"socket error while sending: {exc}"))
            raise self._error.fresh() from None

    def _send_within(self, data: bytes, timeout: float) -> bool:
        """For close() and the close-ok to a broker's close: a blocked broker (connection.blocked) or a slow
        link stops taking our bytes, so a plain sendall, or the lock held by a publisher stuck in one,
        could wait forever. Bounded here."""
        if not self._wlock.acquire(timeout=timeout):
            return False
        try:
            self._sock.settimeout(timeout)
            try:
                self._sock.sendall(data)
            finally:
                self._sock.settimeout(None)
            self._last_send = time.monotonic()
            return True
        except OSError:
            return False
        finally:
            self._wlock.release()

    def _send_heartbeat(self) -> None:
        """From the reader thread: skip when a writer holds the lock (its bytes are traffic enough)."""
        if not self._wlock.acquire(blocking=False):
            return
        try:
            if isinstance(self._sock, ssl.SSLSocket):
                # No MSG_DONTWAIT on a TLS socket (a record must be written whole): send only when the
                # socket can take it now, which an 8-byte frame's record then does without blocking.
                writable = select.poll()
                writable.register(self._sock, select.POLLOUT)
                if writable.poll(0):
                    self._sock.sendall(frames.HEARTBEAT_FRAME)
                    self._last_send = time.monotonic()
                return
            sent = self._sock.send(frames.HEARTBEAT_FRAME, socket.MSG_DONTWAIT)
            if 0 < sent < len(frames.HEARTBEAT_FRAME):
                self._sock.sendall(frames.HEARTBEAT_FRAME[sent:])  # never leave half a frame
            self._last_send = time.monotonic()
        except BlockingIOError:
            pass  # the send buffer is full: the broker has plenty of our bytes still to read
        finally:
            self._wlock.release()

    # --------------------------------------------------------------------------------- reading side

    def _run(self) -> None:
        waited_out = 0          # the last pause this thread waited for
        try:
            while self._error is None:
                ready = self._poll.poll(self._tick() * 1000)
                if not self._reading.is_set() and waited_out != self._pauses:
                    waited_out = self._pauses     # checked after the poll, which may have begun before the pause
                    self._reading.wait(self._pause_most)
                if ready:
                    data = self._recv()
                    if data is not None:
                        self._last_recv = time.monotonic()
                        self._dispatch(self._parser.feed(data))
                if self.heartbeat:
                    self._heartbeat_check()
        except ConnectionClosedError as exc:
            self._terminate(exc)
        except ProtocolError as exc:
            log.error("protocol error from %s: %s", self.uri, exc)
            self._abort(FRAME_ERROR, str(exc))
        except OSError as exc:
            self._terminate(ConnectionLostError(f"socket error: {exc}"))
        except BaseException as exc:  # a bug here must not leave callers blocked forever
            log.exception("the reader thread of %s failed", self.uri)
            self._terminate(ConnectionLostError(f"the client's reader thread failed: {exc!r}"))
        finally:
            self._closed.set()
            _close_quietly(self._sock)

    def _recv(self) -> bytes | None:
        """What the socket has (None: nothing yet). With TLS, also what OpenSSL has already decrypted and
        buffered, which poll() cannot see; a readable socket may hold only part of a TLS record."""
        try:
            data = self._sock.recv(RECV_SIZE)
        except ssl.SSLWantReadError:
            return None
        if not data:
            raise ConnectionLostError("the broker closed the TCP connection")
        pending = getattr(self._sock, "pending", None)
        if pending is not None:
            parts = [data]
            while pending():
                parts.append(self._sock.recv(max(pending(), RECV_SIZE)))
            data = b"".join(parts) if len(parts) > 1 else data
        return data

    def _tick(self) -> float:
        if not self.heartbeat:
            return 1.0
        return min(max(self.heartbeat / 4, 0.05), 1.0)

    def _heartbeat_check(self) -> None:
        now = time.monotonic()
        silent = now - self._last_recv
        # Spec 4.2.7: a peer that receives no octets for two heartbeat intervals closes the connection
        # without the close handshake.
        if silent > 2 * self.heartbeat:
            raise ConnectionLostError(f"missed heartbeats: nothing received from the broker for "
                                      f"{silent:.1f} s (heartbeat {self.heartbeat} s)")
        if now - self._last_send >= self.heartbeat / 2:
            self._send_heartbeat()

    def _dispatch(self, events: list) -> None:
        channels = self._channels
        touched = set()
        for ev in events:
            kind = type(ev)
            if kind is Delivery or kind is Confirm or kind is Returned:
                ch = channels.get(ev.channel)
                if ch is None:
                    continue  # late frames for a channel we closed
                if kind is Delivery:
                    ch._on_delivery(ev)
                elif kind is Confirm:
                    ch._on_confirm(ev)
                else:
                    ch._on_return(ev)
                touched.add(ch)
            elif ev == EventParser.HEARTBEAT:
                continue
            else:
                number, method = ev
                if number == 0:
                    self._on_connection_method(method)
                else:
                    ch = channels.get(number)
                    if ch is not None:
                        ch._on_method(method)
        for ch in touched:
            ch._wake()

    def _on_connection_method(self, method) -> None:
        if isinstance(method, commands.Connection.Close):
            log.warning("%s closed the connection: %s %s", self.uri, method.reply_code, method.reply_text)
            # Bounded: a publisher may hold the write lock in a sendall that a slow link or a broker no
            # longer reading keeps blocked; waiting for it would keep every caller from hearing the close.
            # Without our close-ok the broker drops the socket at its own closing timeout.
            self._send_within(frames.method_frame(0, commands.Connection.CloseOk()), CLOSE_OK_WAIT)
            raise ConnectionClosedError(method.reply_code, method.reply_text, method.class_id,
                                        method.method_id)
        if isinstance(method, commands.Connection.CloseOk):
            raise ConnectionClosedError(REPLY_SUCCESS, "connection closed by the client")
        if isinstance(method, commands.Connection.Blocked):
            self.blocked = method.reason or "blocked"
            log.warning("%s blocked publishing: %s", self.uri, self.blocked)
        elif isinstance(method, commands.Connection.Unblocked):
            self.blocked = None
            log.info("%s unblocked publishing", self.uri)
        else:
            log.debug("ignoring %s on channel 0", method.name)

    # ------------------------------------------------------------------------------- channel table

    def _release(self, number: int) -> None:
        """Called by the reader thread once a channel is closed on both sides (its number is free again)."""
        with self._lock:
            self._channels.pop(number, None)
        self._parser.forget_channel(number)

    # ------------------------------------------------------------------------------------- teardown

    def _abort(self, reply_code: int, text: str) -> None:
        """We found the broker at fault: say why (best effort) and drop the connection."""
        try:
            self._send(frames.method_frame(0, commands.Connection.Close(
                reply_code=reply_code, reply_text=text[:255], class_id=0, method_id=0)))
        except AMQPError:
            pass
        self._terminate(ConnectionClosedError(reply_code, f"closed by the client: {text}"))

    def _terminate(self, error: ConnectionClosedError) -> None:
        """Record why the connection ended (first reason wins), fail every channel, wake everyone."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            channels = list(self._channels.values())
        self._terminated.set()
        if error.reply_code != REPLY_SUCCESS:
            log.warning("connection %s ended: %s", self.uri, error)
        for ch in channels:
            ch._fail(error)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's poll and any blocked sendall
        except OSError:
            pass


def _first(*values):
    return next(v for v in values if v is not None)


def _negotiate(ours: int, theirs: int) -> int:
    """Tune values: 0 means "no limit", else the smaller proposal wins (spec 1.4.2.5/1.4.2.6)."""
    if not ours or not theirs:
        return ours or theirs
    return min(ours, theirs)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
