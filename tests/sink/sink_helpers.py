"""Helpers for the sink tests: a pika admin connection to the broker under test, draining queues, and
cutting the sink's connections (with `brokers.cut_connections`: embedded broker through its core; RabbitMQ
through rabbitmqctl, one connection at a time, only ours). Polling is `waiting.wait_until`, the slow link
a `proxies.Proxy` with a rate."""

from __future__ import annotations

import subprocess
import time

import pika

import brokers


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

    def read_stream(self, stream: str, expected: int, timeout: float = 20.0, idle: float = 0.5) -> list[tuple]:
        """Every message of a stream from its first offset as (method, properties, body): reads until
        `expected` arrived and then nothing more for `idle` seconds (so a copy too many shows), or `timeout`."""
        out = []
        deadline = time.monotonic() + timeout
        self.ch.basic_qos(prefetch_count=1000)
        for method, props, body in self.ch.consume(stream, arguments={"x-stream-offset": "first"},
                                                   inactivity_timeout=idle):
            if method is None:
                if len(out) >= expected or time.monotonic() > deadline:
                    break
                continue
            out.append((method, props, body))
            self.ch.basic_ack(method.delivery_tag)
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


# ------------------------------------------------------------------------------------ super streams


class SuperStreams:
    """Super streams on the broker under test, deleted afterwards. On RabbitMQ 4.3 made by its CLI
    (`rabbitmq-streams add_super_stream`); on the embedded broker (no such command) by declaring what that
    command declares: a durable direct exchange NAME with `x-super-stream: true`, a durable stream per
    partition, and bindings with the partition's key and `x-stream-partition-order`."""

    def __init__(self, admin: Admin, on_rabbitmq: bool):
        self.admin = admin
        self.on_rabbitmq = on_rabbitmq       # the RabbitMQ 4.3 node (3.10 has no super streams), else embedded
        self.made: list[str] = []

    def create(self, name: str, partitions: int = 3, binding_keys: list[str] | None = None) -> list[str]:
        """The super stream's partition streams, in partition order."""
        keys = binding_keys or [str(i) for i in range(partitions)]
        self.made.append(name)
        if self.on_rabbitmq:
            given = ["--binding-keys", ",".join(binding_keys)] if binding_keys else ["--partitions", str(partitions)]
            _streams_cli("add_super_stream", name, *given)
        else:
            self.admin.ch.exchange_declare(name, "direct", durable=True, arguments={"x-super-stream": True})
            for order, key in enumerate(keys):
                self.add_partition(name, key, order)
        return [f"{name}-{key}" for key in keys]

    def add_partition(self, name: str, key: str, order: int) -> str:
        """Declare stream NAME-key and bind it as the super stream's partition `order`."""
        stream = f"{name}-{key}"
        self.admin.ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
        self.admin.ch.queue_bind(stream, name, key, arguments={"x-stream-partition-order": order})
        return stream

    def close(self) -> None:
        for name in self.made:
            if self.on_rabbitmq:
                _streams_cli("delete_super_stream", name)


def _streams_cli(*args: str) -> str:
    """`rabbitmq-streams <args>` on the RabbitMQ 4.3 node (its ctl.sh runs the tool named first)."""
    out = subprocess.run([brokers.RABBITMQ4_CTL, "rabbitmq-streams", *args], capture_output=True, text=True,
                         timeout=brokers.RABBITMQCTL_TIMEOUT)
    if out.returncode != 0:
        raise RuntimeError(f"rabbitmq-streams {' '.join(args)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


# ------------------------------------------------------------------------------ cutting connections


def cut_sink_connections(broker, marker: str, version: str = "3.10") -> int:
    """Close, from the side of `broker` (the embedded `Broker`, or None for RabbitMQ), every sink connection
    whose name contains `marker`; returns how many (the sink names its connections
    `spark-amqp sink <query or write id> ...`); `version` picks the RabbitMQ node."""
    return brokers.cut_connections(
        broker, reason="cut by the sink tests", columns=["client_properties"], version=version,
        rabbitmq=lambda row: marker in row["client_properties"],
        embedded=lambda conn: marker in str((conn.client_properties or {}).get("connection_name", "")))
