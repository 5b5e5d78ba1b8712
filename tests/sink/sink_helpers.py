"""Helpers for the sink tests: a pika admin connection to the broker under test, draining queues, and
cutting the sink's connections (with `brokers.cut_connections`: embedded broker through its core; RabbitMQ
through rabbitmqctl, one connection at a time, only ours). Polling is `waiting.wait_until`, the slow link
a `proxies.Proxy` with a rate."""

from __future__ import annotations

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


# ------------------------------------------------------------------------------ cutting connections


def cut_sink_connections(broker, marker: str, version: str = "3.10") -> int:
    """Close, from the side of `broker` (the embedded `Broker`, or None for RabbitMQ), every sink connection
    whose name contains `marker`; returns how many (the sink names its connections
    `spark-amqp sink <query or write id> ...`); `version` picks the RabbitMQ node."""
    return brokers.cut_connections(
        broker, reason="cut by the sink tests", columns=["client_properties"], version=version,
        rabbitmq=lambda row: marker in row["client_properties"],
        embedded=lambda conn: marker in str((conn.client_properties or {}).get("connection_name", "")))
