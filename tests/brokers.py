"""Broker helpers shared by the test suites (``from brokers import ...``): a port nothing listens on, the
reference RabbitMQ through ``rabbitmqctl``, and cutting a broker's connections from the broker's side.

Cutting on RabbitMQ closes the chosen connections one at a time (``rabbitmqctl close_connection``: the
client gets 320 CONNECTION_FORCED with the given reason), never ``close_all_connections``: the server is
shared. On the embedded broker the chosen connections' transports are aborted on the broker's thread (a
dropped TCP connection, as a network cut).
"""

from __future__ import annotations

import socket
import subprocess
from typing import Any, Callable, Sequence

RABBITMQCTL_TIMEOUT = 30


def free_port() -> int:
    """A loopback port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- RabbitMQ


def rabbitmqctl(*args: str) -> str:
    """``rabbitmqctl -q <args>``'s output; RuntimeError (with its stderr) when it fails."""
    out = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True,
                         timeout=RABBITMQCTL_TIMEOUT)
    if out.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def rabbitmq_list(what: str, *columns: str) -> list[dict[str, str]]:
    """``rabbitmqctl list_<what> <columns>`` as one dict a row (column name -> text); the last column
    keeps any tabs of its own (``client_properties`` does)."""
    rows = []
    for line in rabbitmqctl(f"list_{what}", *columns, "--no-table-headers").splitlines():
        parts = line.split("\t", len(columns) - 1)
        if len(parts) == len(columns):
            rows.append(dict(zip(columns, parts)))
    return rows


# ------------------------------------------------------------------------------ cutting connections


def cut_connections(broker: Any, *, embedded: Callable[[Any], bool],
                    rabbitmq: Callable[[dict[str, str]], bool], columns: Sequence[str],
                    reason: str) -> int:
    """Close, from the broker's side, the connections a test picks; returns how many were closed.

    ``broker`` is the embedded ``Broker``, or None for RabbitMQ. On the embedded broker ``embedded(conn)``
    picks among the core's connections (read on the broker's thread); on RabbitMQ ``rabbitmq(row)`` picks
    among the rows of ``rabbitmq_list("connections", "pid", *columns)``, and ``reason`` is the close text.
    """
    if broker is None:
        pids = [row["pid"] for row in rabbitmq_list("connections", "pid", *columns) if rabbitmq(row)]
        for pid in pids:
            rabbitmqctl("close_connection", pid, reason)
        return len(pids)

    def abort(core) -> int:
        victims = [c for c in list(core.connections)
                   if c.io is not None and c.io.transport is not None and embedded(c)]
        for c in victims:
            c.io.transport.abort()
        return len(victims)

    return broker.call(abort, broker.core)
