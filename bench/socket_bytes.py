"""Bytes each process received over TCP from one server port, read from the kernel (`ss -tinp`).

Why the kernel: the question "does message data flow through the Spark driver?" must be answered from
outside the connector, by counting what the driver's processes really received. `ss -i` reports each TCP
socket's `bytes_received` (tcp_info) and `-p` its owning process, sampled every `interval`. A socket's
count is kept at the highest value seen, and `ss -E` reports each socket once more as the kernel destroys
it, with its final count: so a connection that closes between two samples loses nothing. A socket that
opens and closes between two samples is still counted, at its close, but no sample saw its process: its
bytes are `unattributed` (pid 0). A fast task's short connection does that; the driver's connection lives
for the whole query and is always seen.

Used by bench/stream_read_throughput.py and tests/source/test_stream_mode.py. Linux only; needs `ss`
(iproute2) and the right to see the sockets of the processes (same user, or root).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import defaultdict

import psutil

_PROCESS = re.compile(r'users:\(\("[^"]*",pid=(\d+),fd=\d+\)')
_RECEIVED = re.compile(r"bytes_received:(\d+)")


def sample(port: int) -> dict[tuple[str, int], int]:
    """{(local address, pid): bytes received} for every established TCP socket whose peer port is `port`."""
    out = subprocess.run(["ss", "-tinpH", "state", "established", f"( dport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    found: dict[tuple[str, int], int] = {}
    local = pid = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):            # a socket line: Recv-Q Send-Q Local Peer users:...
            fields = line.split()
            local = fields[2] if len(fields) > 3 else None
            m = _PROCESS.search(line)
            pid = int(m.group(1)) if m else None
        else:                                           # its tcp_info line
            m = _RECEIVED.search(line)
            if m and local and pid is not None:
                found[(local, pid)] = int(m.group(1))
    return found


def cmdline(pid: int) -> str:
    """The process's command line, or "" once it is gone."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def received_now(port: int, marker: str) -> int:
    """Bytes received so far, on their open sockets to `port`, by the processes whose command line contains
    `marker` (one sample: take two to see what came in between)."""
    return sum(n for (_local, pid), n in sample(port).items() if marker in cmdline(pid))


class Sampler:
    """Calls `take()` every `interval` seconds in a thread, from `with` to its end (and once more then)."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def take(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.take()


class ReceivedBytes(Sampler):
    """`sample(port)` every `interval` seconds, plus every socket's final count at its close (`ss -E`):
    each socket's highest count, each process's command line."""

    #: How long `ss -E` is given to subscribe to the kernel's socket events before the measured work starts,
    #: and to print the last ones after it ends.
    EVENTS_SETTLE = 0.3

    def __init__(self, port: int, interval: float = 0.05):
        super().__init__(interval)
        self.port = port
        self.sockets: dict[tuple[str, int], int] = {}
        self.cmdlines: dict[int, str] = {}     # read when first seen: a process may be gone by the end
        self._lock = threading.Lock()
        self._events: subprocess.Popen | None = None
        self.sees_closes = False       # whether `ss -E` runs (see __enter__)
        self._events_thread = threading.Thread(target=self._read_events, daemon=True)

    def __enter__(self):
        self._events = subprocess.Popen(["stdbuf", "-oL", "ss", "-tinHE", f"( dport = :{self.port} )"],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._events_thread.start()
        time.sleep(self.EVENTS_SETTLE)
        # Listening to the kernel's socket-destroy events needs CAP_NET_ADMIN: without it `ss -E` exits at
        # once, and only the samples count.
        self.sees_closes = self._events.poll() is None
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        time.sleep(self.EVENTS_SETTLE)
        self._events.terminate()
        self._events.wait()
        self._events_thread.join()

    def take(self) -> None:
        for key, n in sample(self.port).items():
            self._count(key, n)
            pid = key[1]
            if pid not in self.cmdlines:
                self.cmdlines[pid] = cmdline(pid)

    def _count(self, key: tuple[str, int], n: int) -> None:
        with self._lock:
            if n > self.sockets.get(key, -1):
                self.sockets[key] = n

    def _read_events(self) -> None:
        """Reads `ss -E`'s destroyed sockets (a socket line, then its tcp_info line) until it is stopped; a
        socket's final count goes to the process a sample saw holding its local address, else to pid 0."""
        local = None
        for line in self._events.stdout:
            if not line.startswith((" ", "\t")):
                fields = line.split()
                local = fields[3] if len(fields) > 4 else None     # UNCONN Recv-Q Send-Q Local Peer
                continue
            m = _RECEIVED.search(line)
            if m and local:
                with self._lock:
                    pids = [pid for (address, pid) in self.sockets if address == local]
                self._count((local, pids[-1] if pids else 0), int(m.group(1)))

    @property
    def unattributed(self) -> int:
        """Bytes received by sockets that opened and closed between two samples: their process is unknown."""
        return self.by_pid().get(0, 0)

    def received_by(self, marker: str) -> tuple[int, int]:
        """(bytes received by the processes whose command line contains `marker`, by all the others, the
        unattributed sockets included)."""
        mine = others = 0
        for pid, n in self.by_pid().items():
            if marker in self.cmdlines.get(pid, ""):
                mine += n
            else:
                others += n
        return mine, others

    def by_pid(self) -> dict[int, int]:
        """Bytes received per process, summed over its sockets."""
        total: dict[int, int] = defaultdict(int)
        with self._lock:
            for (_, pid), n in self.sockets.items():
                total[pid] += n
        return dict(total)
