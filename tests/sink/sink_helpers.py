"""Helpers for the sink tests: a pika admin connection to the broker under test, draining queues, and
cutting the sink's connections (embedded broker: through its core; RabbitMQ: rabbitmqctl, one connection at
a time, only ours, never close_all_connections on the shared server)."""

from __future__ import annotations

import subprocess
import time

import pika


class Admin:
    """Declares what a test needs (and deletes it afterwards), counts and drains queues."""

    def __init__(self, url: str):
        self.url = url
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.ch = self.conn.channel()
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def queue(self, name: str, arguments: dict | None = None) -> str:
        args = {"x-expires": 300_000}
        args.update(arguments or {})
        self.ch.queue_declare(name, arguments=args)
        self.queues.append(name)
        return name

    def exchange(self, name: str, kind: str = "direct") -> str:
        self.ch.exchange_declare(name, kind, auto_delete=False)
        self.exchanges.append(name)
        return name

    def depth(self, queue: str) -> int:
        return self.ch.queue_declare(queue, passive=True).method.message_count

    def drain(self, queue: str, timeout: float = 10.0, idle: float = 0.3) -> list[tuple]:
        """Every message in the queue as (method, properties, body), consumed with acks; stops once the
        queue reports empty and nothing arrived for `idle` seconds, or after `timeout`."""
        out = []
        deadline = time.monotonic() + timeout
        self.ch.basic_qos(prefetch_count=1000)
        for method, props, body in self.ch.consume(queue, auto_ack=True, inactivity_timeout=idle):
            if method is None:
                if self.depth(queue) == 0 or time.monotonic() > deadline:
                    break
                continue
            out.append((method, props, body))
            if time.monotonic() > deadline:
                break
        self.ch.cancel()
        return out

    def close(self) -> None:
        try:
            for q in self.queues:
                self.ch.queue_delete(q)
            for e in self.exchanges:
                self.ch.exchange_delete(e)
        finally:
            try:
                self.conn.close()
            except Exception:
                pass


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------ cutting connections


def sink_connections_rabbitmq(marker: str) -> list[str]:
    """Pids (in the form close_connection takes) of RabbitMQ connections whose client properties contain
    `marker` (the sink names its connections `spark-amqp sink <query or write id> ...`)."""
    out = subprocess.run(["rabbitmqctl", "list_connections", "pid", "client_properties", "-q",
                          "--no-table-headers"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.split("\t", 1)[0] for line in out.splitlines() if marker in line]


def cut_connections(broker_kind: str, amqp_broker_or_none, marker: str) -> int:
    """Close, from the broker's side, every sink connection whose name contains `marker`; returns how many."""
    if broker_kind == "rabbitmq":
        pids = sink_connections_rabbitmq(marker)
        for pid in pids:
            subprocess.run(["rabbitmqctl", "close_connection", pid, "cut by the sink tests", "-q"],
                           capture_output=True, text=True, timeout=30, check=True)
        return len(pids)
    broker = amqp_broker_or_none

    def abort_ours():
        n = 0
        for conn in list(broker.core.connections):
            name = str((conn.client_properties or {}).get("connection_name", ""))
            if marker in name and conn.io is not None and conn.io.transport is not None:
                conn.io.transport.abort()   # a dropped TCP connection, as a network cut
                n += 1
        return n

    return broker.call(abort_ours)


# ------------------------------------------------------------------------------------ a slow link


class SlowLink:
    """A TCP relay 127.0.0.1:<port> -> the broker that passes the publisher's bytes at `rate` bytes/s per
    connection (so a write lasts long enough to be cut in its middle) and can cut every connection at once
    (`cut()`: both sockets reset, as when the network or the broker goes away). Broker-independent: the
    same cut for the embedded broker and RabbitMQ, and nothing else on the shared RabbitMQ is touched."""

    def __init__(self, broker_url: str, rate: int):
        import socket
        import threading

        host_port = broker_url.rpartition("@")[2].split("/")[0]
        host, port = host_port.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.rate = rate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._sockets: list = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def url_for(self, broker_url: str) -> str:
        head, _, rest = broker_url.rpartition("@")
        return f"{head}@127.0.0.1:{self.port}/{rest.partition('/')[2]}"

    def _accept(self) -> None:
        import socket
        import threading

        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, self.rate), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _pump(self, src, dst, rate) -> None:
        try:
            while not self._cut.is_set():
                data = src.recv(4096 if rate else 65536)
                if not data or self._cut.is_set():
                    break
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        try:
            dst.shutdown(2)   # the other side closed (or the broker dropped us): pass it on
        except OSError:
            pass

    def cut(self) -> None:
        import socket
        import struct

        self._cut.set()
        for s in self._sockets + [self._listener]:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
