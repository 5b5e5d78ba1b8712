"""Helpers for the client tests (module name distinct from tests/broker/helpers.py: rootdir-less imports).

- ``Proxy``: a TCP relay between the client and a real broker that can be *frozen* (stop relaying
  without closing: a network partition, so heartbeats go missing) or *killed* (reset both sockets).
- ``field_table(items)``: an AMQP field table with explicit type tags, so the tests can put every field
  type on the wire (pamqp picks tags from Python types and never emits some of them).
- ``raw_properties(...)``: content-header property bytes built by hand (flags word + values).
- ``wait_until``: poll with a deadline.
- ``Blocked``: run a blocking call in a thread and report what it raised and when.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any, Callable

import pytest

# ----------------------------------------------------------------------------------------- polling


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02,
               message: str = "condition not reached") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{message} within {timeout} s")
        time.sleep(interval)


class Blocked:
    """Runs ``fn`` in a daemon thread; ``.join(timeout)`` returns (exception or None, seconds taken)."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed: float | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()
        self._started.wait(5)

    def _run(self, fn):
        self._started.set()
        t0 = time.monotonic()
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        self.elapsed = time.monotonic() - t0

    def join(self, timeout: float) -> tuple[BaseException | None, float | None]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"the blocked call did not return within {timeout} s")
        return self.error, self.elapsed


def free_port() -> int:
    """A port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- proxy


class Proxy:
    """127.0.0.1:<port> -> upstream, relaying bytes both ways in two threads per connection."""

    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._frozen = threading.Event()
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url_for(self, broker_url: str) -> str:
        """The broker URL rewritten to go through this proxy."""
        head, _, rest = broker_url.rpartition("@")
        _, _, path = rest.partition("/")
        return f"{head}@127.0.0.1:{self.port}/{path}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self._frozen.is_set() and not self._stopped.is_set():
                    time.sleep(0.01)  # hold the bytes: neither side hears from the other
                if self._stopped.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def freeze(self) -> None:
        """Stop relaying (sockets stay open): what a network partition looks like to both peers."""
        self._frozen.set()

    def thaw(self) -> None:
        """Relay again, held bytes first."""
        self._frozen.clear()

    def kill(self) -> None:
        """Drop every relayed connection at once and stop accepting (the client sees FIN or RST)."""
        self._stopped.set()
        for s in self._sockets + [self._listener]:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump threads blocked in recv on it
            except OSError:
                pass
            s.close()

    close = kill

    @classmethod
    def to(cls, broker_url: str) -> "Proxy":
        host_port = broker_url.rpartition("@")[2].split("/")[0]
        host, port = host_port.rsplit(":", 1)
        return cls(host, int(port))


# ------------------------------------------------------------------------------- wire encodings


def _shortstr(text: str) -> bytes:
    raw = text.encode()
    return bytes([len(raw)]) + raw


def _longstr(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


def field_value(tag: str, value: Any) -> bytes:
    """One tagged field value, per RabbitMQ's errata table (the tags RabbitMQ and Qpid use)."""
    t = tag.encode()
    fixed = {"t": ">B", "b": ">b", "B": ">B", "s": ">h", "u": ">H", "I": ">i", "i": ">I", "l": ">q",
             "f": ">f", "d": ">d", "T": ">Q"}
    if tag in fixed:
        return t + struct.pack(fixed[tag], value)
    if tag == "D":
        scale, unscaled = value
        return t + struct.pack(">Bi", scale, unscaled)
    if tag == "S":
        return t + _longstr(value.encode() if isinstance(value, str) else value)
    if tag == "x":
        return t + _longstr(value)
    if tag == "F":
        return t + field_table(value)
    if tag == "A":
        inner = b"".join(field_value(it, iv) for it, iv in value)
        return t + _longstr(inner)
    if tag == "V":
        return t
    raise ValueError(tag)


def field_table(items: list[tuple[str, str, Any]]) -> bytes:
    return _longstr(b"".join(_shortstr(k) + field_value(tag, v) for k, tag, v in items))


# Basic.Properties in wire order with their flag bits (spec 1.8, class basic).
_PROPERTY_ORDER = [
    ("content_type", 15, "shortstr"), ("content_encoding", 14, "shortstr"), ("headers", 13, "table"),
    ("delivery_mode", 12, "octet"), ("priority", 11, "octet"), ("correlation_id", 10, "shortstr"),
    ("reply_to", 9, "shortstr"), ("expiration", 8, "shortstr"), ("message_id", 7, "shortstr"),
    ("timestamp", 6, "timestamp"), ("type", 5, "shortstr"), ("user_id", 4, "shortstr"),
    ("app_id", 3, "shortstr"),
]


def raw_properties(**props: Any) -> bytes:
    """Content-header property bytes; `headers` must already be an encoded field table."""
    flags, values = 0, []
    for name, bit, kind in _PROPERTY_ORDER:
        if name not in props:
            continue
        flags |= 1 << bit
        v = props.pop(name)
        if kind == "shortstr":
            values.append(_shortstr(v))
        elif kind == "octet":
            values.append(bytes([v]))
        elif kind == "timestamp":
            values.append(struct.pack(">Q", v))
        else:
            values.append(v)
    if props:
        raise ValueError(f"unknown properties {sorted(props)}")
    return struct.pack(">H", flags) + b"".join(values)
