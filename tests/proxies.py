"""A TCP relay between a client under test and a broker, for every test suite (``from proxies import Proxy``).

``Proxy.to(broker_url)`` listens on 127.0.0.1 (loopback only) and relays each accepted connection to the
broker, two threads per connection. What a test can do to the link:

- ``freeze()`` / ``thaw()``: stop relaying without closing anything (what a network partition looks like to
  both peers: heartbeats and confirms go missing), then relay again, held bytes first;
- ``rate=`` (bytes/s, client to broker, per connection): a slow link, so a write lasts long enough to be
  cut in its middle;
- ``kill()`` (alias ``cut()``, ``close()``): reset every relayed connection at once (SO_LINGER 0) and stop
  accepting; the client sees its connection drop, as when the network or the broker goes away.

Every loop is bounded: the threads poll with short timeouts and stop on ``kill()``, and a relay that was
never killed stops on its own after ``lifetime`` seconds. Use it as a context manager, or kill it in a
``finally``.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
import urllib.parse

LOOPBACK = "127.0.0.1"
POLL = 0.05          # seconds a relay thread waits before looking at its flags again
CHUNK = 65536
SLOW_CHUNK = 4096    # read size on a rate-limited direction, so the pace is smooth


class Proxy:
    """127.0.0.1:<port> -> upstream, with freeze / thaw, an optional rate limit, and kill."""

    def __init__(self, upstream_host: str, upstream_port: int, rate: int | None = None,
                 lifetime: float = 600.0):
        self.upstream = (upstream_host, upstream_port)
        self.rate = rate
        self.connections = 0                       # how many client connections were accepted so far
        self._deadline = time.monotonic() + lifetime
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        self._flowing = threading.Event()          # cleared while frozen
        self._flowing.set()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    @classmethod
    def to(cls, broker_url: str, **kw) -> "Proxy":
        """A relay to the broker of an ``amqp://`` URL (keyword arguments as for the constructor)."""
        u = urllib.parse.urlsplit(broker_url)
        return cls(u.hostname or LOOPBACK, u.port or 5672, **kw)

    def url_for(self, broker_url: str) -> str:
        """The broker URL rewritten to go through this relay (credentials, vhost and query kept)."""
        head, _, rest = broker_url.rpartition("@")
        _, _, path = rest.partition("/")
        return f"{head}@{LOOPBACK}:{self.port}/{path}"

    # --------------------------------------------------------------------------------- controls

    def freeze(self) -> None:
        """Stop relaying (sockets stay open): what a network partition looks like to both peers."""
        self._flowing.clear()

    def thaw(self) -> None:
        """Proxy again, held bytes first."""
        self._flowing.set()

    def kill(self) -> None:
        """Drop every relayed connection at once and stop accepting (the client sees FIN or RST)."""
        self._stopped.set()
        self._flowing.set()
        with self._lock:
            sockets, self._sockets = self._sockets + [self._listener], []
            threads = list(self._threads)
        for s in sockets:
            _reset(s)
        for t in threads:
            if t is not threading.current_thread():
                t.join(2)

    cut = kill
    close = kill

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    # ---------------------------------------------------------------------------------- threads

    def _running(self) -> bool:
        return not self._stopped.is_set() and time.monotonic() < self._deadline

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"proxy-{self.port}")
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept(self) -> None:
        while self._running():
            if not _readable(self._listener):
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                break
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._stopped.is_set():
                    _reset(client)
                    _reset(upstream)
                    break
                self._sockets += [client, upstream]
                self.connections += 1
            ends = [2]   # directions still relaying; the last one to finish closes both sockets
            self._spawn(self._pump, client, upstream, self.rate, ends)
            self._spawn(self._pump, upstream, client, None, ends)
        if not self._stopped.is_set():   # lifetime over: nothing is relayed any more
            self.kill()

    def _pump(self, src: socket.socket, dst: socket.socket, rate: int | None, ends: list[int]) -> None:
        try:
            while self._running():
                if not _readable(src):
                    continue
                data = src.recv(SLOW_CHUNK if rate else CHUNK)
                if not data:
                    break
                while not self._flowing.wait(POLL):   # frozen: hold the bytes, neither side hears
                    if not self._running():
                        return
                if not self._running():
                    return
                dst.sendall(data)
                if rate:
                    self._stopped.wait(len(data) / rate)
        except (OSError, ValueError):      # reset, or a socket kill() closed under us
            pass
        finally:
            if not self._stopped.is_set():
                try:
                    dst.shutdown(socket.SHUT_WR)   # this side closed (or failed): pass the FIN on
                except OSError:
                    pass
            with self._lock:
                ends[0] -= 1
                last = ends[0] == 0
                if last:
                    self._sockets = [s for s in self._sockets if s is not src and s is not dst]
            if last:
                src.close()
                dst.close()


def _readable(sock: socket.socket) -> bool:
    """Wait at most POLL seconds for `sock` to be readable (or closed: then recv/accept tells)."""
    try:
        ready, _, _ = select.select([sock], [], [], POLL)
    except (OSError, ValueError):   # closed by kill(): let the caller's recv / accept fail
        return True
    return bool(ready)


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0 (an RST), after a shutdown that wakes whoever waits on the socket."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
