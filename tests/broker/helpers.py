"""Small helpers shared by the broker behaviour tests (differential: embedded broker vs RabbitMQ).

Stable interface (other test files import these; do not rename):

- ``parse_url(url) -> UrlParts``: host, port, user, password, vhost of an ``amqp://`` URL.
- ``pika_connect(url, **params)``: a ``pika.BlockingConnection``; keyword arguments override
  ``pika.URLParameters`` attributes (``heartbeat``, ``frame_max``, ``channel_max``, ``credentials``,
  ``virtual_host``, ``client_properties`` ...).
- ``amqp_connect(url, **kw)``: a connected py-amqp ``amqp.Connection`` (kw are passed to it: ``userid``,
  ``password``, ``virtual_host``, ``login_method``, ``heartbeat``, ``frame_max``, ``channel_max`` ...).
- ``close_outcome(fn, conn=None) -> (level, reply_code) | None``: runs ``fn()``; when the broker closes
  the channel or the connection, returns ``("channel", code)`` or ``("connection", code)``; returns None
  when ``fn`` returned normally. Works with pika and py-amqp (for py-amqp pass ``conn`` so the level can
  be told apart: py-amqp's exception class follows the reply code, not the level).
- ``expect_close(fn, conn=None) -> (level, reply_code)``: like ``close_outcome`` but fails when nothing
  was closed.
- ``refusal(fn) -> (level, reply_code, reply_text)``: runs ``fn()`` (pika); the broker must close the
  channel or the connection.
- ``queue_counts(url, queue) -> (message_count, consumer_count) | None``: passive declare on a fresh
  connection (None when the queue does not exist, i.e. 404).
- ``exchange_exists(url, exchange) -> bool``: passive exchange declare on a fresh connection.
- ``pika_sync(ch)``: a cheap round trip on a pika channel so asynchronous errors (publish, ack) surface.
- ``amqp_sync(ch)``: the same for a py-amqp channel.
- ``raw_socket(url, timeout=5.0)``: a plain TCP socket to the broker.
- ``recv_until_closed(sock, timeout=5.0) -> bytes``: read until the peer closes (or fail on timeout).
- ``raw_handshake(url, ..., capabilities=None)``: drive a connection over a raw socket up to connection.open-ok
  with pamqp and return a ``RawConnection`` (socket + frame reader: ``read_frame``, or ``poll_frame`` giving
  ``TIMED_OUT`` rather than failing) for protocol-level tests.

Polling with a deadline is ``waiting.wait_until`` (tests/waiting.py, shared by every suite).
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

import amqp
import amqp.exceptions
import pika
import pika.exceptions
import pytest

# --------------------------------------------------------------------------------------------- URLs


@dataclass(frozen=True)
class UrlParts:
    host: str
    port: int
    user: str
    password: str
    vhost: str


def parse_url(url: str) -> UrlParts:
    u = urllib.parse.urlparse(url)
    vhost = urllib.parse.unquote(u.path[1:]) if u.path and u.path != "/" else "/"
    return UrlParts(
        host=u.hostname or "127.0.0.1",
        port=u.port or 5672,
        user=urllib.parse.unquote(u.username or "guest"),
        password=urllib.parse.unquote(u.password or "guest"),
        vhost=vhost,
    )


# ------------------------------------------------------------------------------------------ clients


def pika_params(url: str, **params: Any) -> pika.URLParameters:
    p = pika.URLParameters(url)
    p.connection_attempts = 1
    p.socket_timeout = 5
    p.blocked_connection_timeout = None
    p.stack_timeout = 10
    for key, value in params.items():
        setattr(p, key, value)
    return p


def pika_connect(url: str, **params: Any) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika_params(url, **params))


def amqp_connect(url: str, **kw: Any) -> amqp.Connection:
    u = parse_url(url)
    args: dict[str, Any] = dict(
        host=f"{u.host}:{u.port}", userid=u.user, password=u.password, virtual_host=u.vhost,
        connect_timeout=5, read_timeout=10, write_timeout=10,
    )
    args.update(kw)
    conn = amqp.Connection(**args)
    conn.connect()
    return conn


def safe_close(conn: Any) -> None:
    """Close a pika or py-amqp connection, ignoring errors (it may already be closed by the broker)."""
    try:
        if isinstance(conn, pika.BlockingConnection):
            if conn.is_open:
                conn.close()
        else:
            if conn.connected:
                conn.close()
            else:
                conn.collect()
    except Exception:
        pass


# ---------------------------------------------------------------------------------- error outcomes

Outcome = tuple[str, int]


def close_outcome(fn: Callable[[], Any], conn: Any = None) -> Outcome | None:
    """Run fn; return ("channel"|"connection", reply_code) if the broker closed something, else None."""
    try:
        fn()
    except pika.exceptions.ChannelClosedByBroker as e:
        return ("channel", e.reply_code)
    except pika.exceptions.ConnectionClosedByBroker as e:
        return ("connection", e.reply_code)
    except amqp.exceptions.AMQPError as e:
        code = e.reply_code
        if conn is not None:
            level = "channel" if conn.connected else "connection"
        else:
            level = "connection" if isinstance(e, amqp.exceptions.ConnectionError) else "channel"
        return (level, code)
    return None


def expect_close(fn: Callable[[], Any], conn: Any = None) -> Outcome:
    outcome = close_outcome(fn, conn)
    assert outcome is not None, "expected the broker to close the channel or the connection"
    return outcome


def refusal(fn: Callable[[], Any]) -> tuple[str, int, str]:
    """Run fn; the broker must close the channel or the connection: (level, reply code, reply text)."""
    try:
        fn()
    except pika.exceptions.ChannelClosedByBroker as e:
        return ("channel", e.reply_code, e.reply_text)
    except pika.exceptions.ConnectionClosedByBroker as e:
        return ("connection", e.reply_code, e.reply_text)
    raise AssertionError("expected the broker to close the channel or the connection")


def pika_sync(ch: Any) -> None:
    """A round trip on a pika BlockingChannel (so asynchronous channel errors surface)."""
    ch.basic_qos(prefetch_count=0)


def amqp_sync(ch: Any) -> None:
    """A round trip on a py-amqp channel."""
    ch.basic_qos(prefetch_size=0, prefetch_count=0, a_global=False)


# ------------------------------------------------------------------------------------ broker state


def queue_counts(url: str, queue: str) -> tuple[int, int] | None:
    """(message_count, consumer_count) of a queue via passive declare on a fresh connection; None if 404."""
    conn = pika_connect(url)
    try:
        ch = conn.channel()
        try:
            ok = ch.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code == 404:
                return None
            raise
        return ok.method.message_count, ok.method.consumer_count
    finally:
        safe_close(conn)


def queue_exists(url: str, queue: str) -> bool:
    return queue_counts(url, queue) is not None


def exchange_exists(url: str, exchange: str) -> bool:
    conn = pika_connect(url)
    try:
        ch = conn.channel()
        try:
            ch.exchange_declare(exchange, passive=True)
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code == 404:
                return False
            raise
        return True
    finally:
        safe_close(conn)


def drain_get(ch: Any, queue: str, limit: int = 10_000) -> list[bytes]:
    """basic.get with auto-ack until get-empty (pika channel); returns the bodies in order."""
    bodies = []
    for _ in range(limit):
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        bodies.append(body)
    return bodies


# ------------------------------------------------------------------------------------ raw sockets

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


def raw_socket(url: str, timeout: float = 5.0) -> socket.socket:
    u = parse_url(url)
    s = socket.create_connection((u.host, u.port), timeout=timeout)
    s.settimeout(timeout)
    return s


def recv_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Read until EOF (or connection reset); fail the test if the peer keeps the socket open."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"peer did not close the socket within {timeout}s (got {data!r})")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return data
        if not chunk:
            return data
        data += chunk


TIMED_OUT = "timed out"    # RawConnection.poll_frame: no whole frame in time


class RawConnection:
    """A raw AMQP connection driven frame by frame with pamqp (for protocol-level tests)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.closed = False

    def send(self, channel: int, frame: Any) -> None:
        from pamqp import frame as pframe
        self.sock.sendall(pframe.marshal(frame, channel))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self, timeout: float = 5.0) -> tuple[int, Any] | None:
        """Next (channel, frame); None on EOF. Fails the test on timeout."""
        got = self.poll_frame(timeout)
        if got is TIMED_OUT:
            pytest.fail(f"no frame within {timeout}s")
        return got

    def poll_frame(self, timeout: float) -> tuple[int, Any] | None | str:
        """Next (channel, frame); None on EOF; TIMED_OUT when no whole frame arrived within `timeout`."""
        from pamqp import exceptions as pexc
        from pamqp import frame as pframe
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            if self.buf:
                try:
                    consumed, channel, frame = pframe.unmarshal(self.buf)
                except pexc.UnmarshalingException:
                    consumed = 0
                if consumed:
                    self.buf = self.buf[consumed:]
                    return channel, frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TIMED_OUT
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self.buf += chunk

    def read_method(self, timeout: float = 5.0, skip_heartbeats: bool = True) -> tuple[int, Any] | None:
        from pamqp import heartbeat
        while True:
            got = self.read_frame(timeout)
            if got is None:
                return None
            if skip_heartbeats and isinstance(got[1], heartbeat.Heartbeat):
                continue
            return got

    def wait_closed(self, timeout: float = 5.0) -> list[Any]:
        """Read frames until EOF; returns the frames seen. Fails if the socket stays open."""
        frames = []
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"socket still open after {timeout}s; frames seen: {frames!r}")
            got = self.read_frame(remaining)
            if got is None:
                return frames
            frames.append(got[1])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def raw_handshake(url: str, heartbeat: int = 0, frame_max: int = 131072, channel_max: int = 2047,
                  open_vhost: bool = True, timeout: float = 5.0,
                  capabilities: dict | None = None) -> tuple[RawConnection, Any]:
    """Protocol header, start-ok (PLAIN), tune-ok with the given values, open (unless open_vhost=False).

    Returns (raw connection, the server's connection.tune frame). Tune-ok values are sent as given
    (the server's own proposal is not applied), so a caller can ask for heartbeat=1 and stay silent.
    `capabilities`: the client capabilities announced in start-ok (none by default).
    """
    from pamqp import commands

    u = parse_url(url)
    sock = raw_socket(url, timeout)
    rc = RawConnection(sock)
    rc.send_bytes(PROTOCOL_HEADER)
    ch, start = rc.read_method(timeout)
    assert isinstance(start, commands.Connection.Start), start
    rc.send(0, commands.Connection.StartOk(
        client_properties={"product": "raw-test", **({"capabilities": capabilities} if capabilities else {})},
        mechanism="PLAIN",
        response=f"\0{u.user}\0{u.password}", locale="en_US"))
    ch, tune = rc.read_method(timeout)
    assert isinstance(tune, commands.Connection.Tune), tune
    rc.send(0, commands.Connection.TuneOk(channel_max=channel_max, frame_max=frame_max,
                                          heartbeat=heartbeat))
    if open_vhost:
        rc.send(0, commands.Connection.Open(virtual_host=u.vhost))
        ch, ok = rc.read_method(timeout)
        assert isinstance(ok, commands.Connection.OpenOk), ok
    return rc, tune
