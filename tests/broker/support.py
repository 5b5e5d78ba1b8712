"""Support shared by the differential behaviour tests of the basic class, confirms / tx, queue arguments and
dead-lettering (test_basic.py, test_confirms_tx.py, test_queue_arguments.py, test_dead_letter.py).

- ``Env`` and the ``env`` fixture (import it into the test module: ``from support import env``): the
  connections and declared entities of one test, closed / deleted at teardown.
- ``pump`` / ``settle`` (pika) and ``apump`` / ``asettle`` (py-amqp): process client I/O until a condition
  holds, or for a while to observe that nothing more arrives (``QUIET`` seconds by default).
- ``Collector``: a pika ``on_message_callback`` that records the deliveries.
- ``amqp_nack``, ``bodies``, ``drain``: small helpers.
- ``raw_frame``, ``raw_method``, ``read_raw_frame``: hand-built frames over a ``helpers.raw_handshake``
  connection, for tests that must see the bytes the broker sends.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any, Callable

import amqp
import amqp.spec
import pika
import pytest

from helpers import amqp_connect, drain_get, pika_connect, pika_sync, safe_close

QUIET = 0.3  # how long to watch for deliveries (or frames) that must NOT arrive


# ---------------------------------------------------------------------------------------- Env


class Env:
    """Connections and declared entities of one test; everything is closed / deleted at teardown."""

    def __init__(self, url: str, names: Callable[[str], str]):
        self.url = url
        self.names = names
        self._conns: list[Any] = []
        self._queues: list[str] = []
        self._exchanges: list[str] = []
        self._admin: Any = None

    def pika(self, **kw: Any) -> pika.BlockingConnection:
        conn = pika_connect(self.url, **kw)
        self._conns.append(conn)
        return conn

    def amqp(self, **kw: Any) -> amqp.Connection:
        conn = amqp_connect(self.url, **kw)
        self._conns.append(conn)
        return conn

    def admin(self):
        """A pika channel for declarations (reopened if a test got it closed)."""
        if self._admin is None or not self._admin.is_open:
            if not self._conns or not isinstance(self._conns[0], pika.BlockingConnection) \
                    or not self._conns[0].is_open:
                self._conns.insert(0, pika_connect(self.url))
            self._admin = self._conns[0].channel()
        return self._admin

    def queue(self, arguments: dict | None = None, name: str | None = None, **kw: Any) -> str:
        name = name or self.names("q")
        self._queues.append(name)
        self.admin().queue_declare(name, arguments=arguments, **kw)
        return name

    def exchange(self, exchange_type: str = "direct", **kw: Any) -> str:
        name = self.names("x")
        self._exchanges.append(name)
        self.admin().exchange_declare(name, exchange_type=exchange_type, **kw)
        return name

    def track_queue(self, name: str) -> str:
        self._queues.append(name)
        return name

    def track_exchange(self, name: str) -> str:
        self._exchanges.append(name)
        return name

    def publish(self, queue: str, bodies, exchange: str = "", **props: Any) -> None:
        ch = self.admin()
        for body in bodies:
            ch.basic_publish(exchange, queue, body, pika.BasicProperties(**props))
        pika_sync(ch)

    def queue_and_channel(self, messages=(), arguments: dict | None = None, client: str = "pika"):
        """A new queue holding ``messages`` (published with ``publish``) and a channel on a new connection
        of ``client`` ("pika" or "amqp" for py-amqp): (queue, connection, channel)."""
        q = self.queue(arguments)
        if messages:
            self.publish(q, messages)
        conn = self.pika() if client == "pika" else self.amqp()
        return q, conn, conn.channel()

    def close(self) -> None:
        for conn in self._conns:
            safe_close(conn)
        if not (self._queues or self._exchanges):
            return
        try:
            conn = pika_connect(self.url)
        except Exception:
            return
        try:
            for kind, names in (("queue", self._queues), ("exchange", self._exchanges)):
                for name in names:
                    try:
                        ch = conn.channel()
                        if kind == "queue":
                            ch.queue_delete(name)
                        else:
                            ch.exchange_delete(name)
                        ch.close()
                    except Exception:
                        if not conn.is_open:
                            conn = pika_connect(self.url)
        finally:
            safe_close(conn)


@pytest.fixture
def env(broker_url, unique_name):
    e = Env(broker_url, unique_name)
    yield e
    e.close()


# ------------------------------------------------------------------------------------ client I/O


def pump(conn: pika.BlockingConnection, until: Callable[[], Any], timeout: float = 5.0,
         what: str = "deliveries") -> None:
    """Process pika I/O until ``until()`` is true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        conn.process_data_events(time_limit=0.02)


def settle(conn: pika.BlockingConnection, seconds: float = QUIET) -> None:
    """Process pika I/O for a while (to observe that nothing more arrives)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        conn.process_data_events(time_limit=0.02)


def apump(conn: amqp.Connection, until: Callable[[], Any], timeout: float = 5.0,
          what: str = "deliveries") -> None:
    """``pump`` for py-amqp."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        try:
            conn.drain_events(timeout=0.05)
        except socket.timeout:
            pass


def asettle(conn: amqp.Connection, seconds: float = QUIET) -> None:
    """``settle`` for py-amqp."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            conn.drain_events(timeout=0.05)
        except socket.timeout:
            pass


class Collector:
    """A pika on_message_callback that records (consumer_tag, delivery_tag, redelivered, body, props)."""

    def __init__(self):
        self.items: list[tuple[str, int, bool, bytes, Any]] = []

    def __call__(self, ch, method, props, body):
        self.items.append((method.consumer_tag, method.delivery_tag, method.redelivered, body, props))

    def __len__(self):
        return len(self.items)

    @property
    def bodies(self) -> list[bytes]:
        return [i[3] for i in self.items]

    @property
    def tags(self) -> list[int]:
        return [i[1] for i in self.items]

    @property
    def redelivered(self) -> list[bool]:
        return [i[2] for i in self.items]


# --------------------------------------------------------------------------------- small helpers


def amqp_nack(ch: amqp.Channel, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
    """py-amqp has no basic_nack helper; send the method itself."""
    ch.send_method(amqp.spec.Basic.Nack, "Lbb", (delivery_tag, multiple, requeue))


def bodies(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(1, n + 1)]


def drain(ch, queue: str, limit: int = 1000) -> list[bytes]:
    """basic.get with auto-ack until get-empty; the bodies in order."""
    return drain_get(ch, queue, limit)


# ------------------------------------------------------------------------------------ raw frames


def raw_frame(ftype: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + b"\xce"


def raw_method(class_id: int, method_id: int, args: bytes = b"") -> bytes:
    """A method frame payload: class id, method id, then the encoded arguments."""
    return struct.pack(">HH", class_id, method_id) + args


def read_raw_frame(rc, timeout: float = 5.0) -> tuple[int, int, bytes]:
    """The next non-heartbeat frame of a ``helpers.RawConnection``, undecoded: (type, channel, payload)."""
    deadline = time.monotonic() + timeout
    while True:
        if len(rc.buf) >= 7:
            ftype, channel, size = struct.unpack(">BHI", rc.buf[:7])
            if len(rc.buf) >= size + 8:
                payload, end = rc.buf[7:7 + size], rc.buf[7 + size]
                rc.buf = rc.buf[size + 8:]
                assert end == 0xCE
                if ftype == 8:  # heartbeat
                    continue
                return ftype, channel, payload
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail("no frame from the broker in time")
        rc.sock.settimeout(remaining)
        try:
            chunk = rc.sock.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            pytest.fail(f"broker closed the socket; buffered {rc.buf!r}")
        rc.buf += chunk
