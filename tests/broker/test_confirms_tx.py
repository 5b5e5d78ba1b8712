"""Differential behaviour tests for publisher confirms (confirm.select, basic.ack/nack from the broker) and
transactions (tx.select/commit/rollback).

Every test takes ``broker_url`` and so runs against the embedded broker and against RabbitMQ 3.10 with the
same assertions. Clients: pika (BlockingConnection) and py-amqp.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Callable

import amqp
import pika
import pika.exceptions
import pytest

from helpers import (amqp_connect, expect_close, pika_connect, pika_sync, queue_counts,
                     safe_close, wait_until)

pytestmark = pytest.mark.timeout(60)

QUIET = 0.3  # how long to watch for frames that must NOT arrive


# ------------------------------------------------------------------------------------------ support


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

    def publish(self, queue: str, bodies, exchange: str = "", **props: Any) -> None:
        ch = self.admin()
        for body in bodies:
            ch.basic_publish(exchange, queue, body, pika.BasicProperties(**props))
        pika_sync(ch)

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
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        try:
            conn.drain_events(timeout=0.05)
        except socket.timeout:
            pass


def asettle(conn: amqp.Connection, seconds: float = QUIET) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            conn.drain_events(timeout=0.05)
        except socket.timeout:
            pass


def bodies(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(1, n + 1)]




# --------------------------------------------------------------------------------------- confirms


class AmqpConfirms:
    """Records the publisher confirms a py-amqp channel receives: (kind, delivery_tag, multiple)."""

    def __init__(self, ch: amqp.Channel):
        self.events: list[tuple[str, int, bool]] = []
        ch.events["basic_ack"].add(lambda tag, multiple: self.events.append(("ack", tag, multiple)))
        ch.events["basic_nack"].add(lambda tag, multiple: self.events.append(("nack", tag, multiple)))

    def settled(self) -> dict[int, str]:
        """delivery tag -> "ack"/"nack", expanding multiple=true confirms."""
        out: dict[int, str] = {}
        for kind, tag, multiple in self.events:
            if multiple:
                for t in range(1, tag + 1):
                    out.setdefault(t, kind)
            else:
                out[tag] = kind
        return out


def test_confirms_ack_every_publish_in_order(env):
    q = env.queue()
    conn = env.amqp()
    ch = conn.channel()
    ch.confirm_select()
    confirms = AmqpConfirms(ch)
    n = 200
    for i in range(n):
        ch.basic_publish(amqp.Message(f"m{i}".encode()), exchange="", routing_key=q)
    apump(conn, lambda: len(confirms.settled()) >= n, what="publisher confirms")
    asettle(conn, 0.2)
    tags = [tag for _kind, tag, _multiple in confirms.events]
    assert tags == sorted(set(tags)), "confirm tags must be strictly increasing"
    assert confirms.settled() == {t: "ack" for t in range(1, n + 1)}
    assert max(tags) == n
    assert queue_counts(env.url, q) == (n, 0)


def test_confirms_with_pika_blocking_channel(env):
    q = env.queue()
    conn = env.pika()
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("", q, f"m{i}".encode())  # raises NackError / UnroutableError otherwise
    assert queue_counts(env.url, q) == (20, 0)


def test_confirm_tags_are_per_channel_and_unroutable_is_acked(env):
    q = env.queue()
    conn = env.amqp()
    ch1, ch2 = conn.channel(), conn.channel()
    ch1.confirm_select()
    ch2.confirm_select()
    ch2.confirm_select()  # selecting again is harmless
    c1, c2 = AmqpConfirms(ch1), AmqpConfirms(ch2)
    for i in range(3):
        ch1.basic_publish(amqp.Message(b"a"), exchange="", routing_key=q)
    ch2.basic_publish(amqp.Message(b"b"), exchange="amq.direct", routing_key=env.names("unbound"))
    ch2.basic_publish(amqp.Message(b"b"), exchange="", routing_key=q)
    apump(conn, lambda: len(c1.settled()) >= 3 and len(c2.settled()) >= 2)
    assert c1.settled() == {1: "ack", 2: "ack", 3: "ack"}
    assert c2.settled() == {1: "ack", 2: "ack"}
    assert queue_counts(env.url, q) == (4, 0)


def test_mandatory_unroutable_in_confirm_mode_returns_before_ack(env):
    conn = env.amqp()
    ch = conn.channel()
    ch.confirm_select()
    order = []
    ch.events["basic_return"].add(lambda exc, exchange, rk, msg: order.append(("return", exc.reply_code)))
    ch.events["basic_ack"].add(lambda tag, multiple: order.append(("ack", tag)))
    ch.basic_publish(amqp.Message(b"x"), exchange="amq.direct", routing_key=env.names("rk"), mandatory=True)
    apump(conn, lambda: len(order) >= 2)
    assert order == [("return", 312), ("ack", 1)]


def test_publish_to_reject_publish_queue_at_limit_is_nacked(env):
    q = env.queue(arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    conn = env.amqp()
    ch = conn.channel()
    ch.confirm_select()
    confirms = AmqpConfirms(ch)
    for i in range(4):
        ch.basic_publish(amqp.Message(f"m{i}".encode()), exchange="", routing_key=q)
    apump(conn, lambda: len(confirms.settled()) >= 4)
    assert confirms.settled() == {1: "ack", 2: "ack", 3: "nack", 4: "nack"}
    got = [ch.basic_get(q, no_ack=True) for _ in range(3)]
    assert [m.body for m in got[:2]] == [b"m0", b"m1"] and got[2] is None
    # room again: the next publish is acked
    ch.basic_publish(amqp.Message(b"m4"), exchange="", routing_key=q)
    apump(conn, lambda: len(confirms.settled()) >= 5)
    assert confirms.settled()[5] == "ack"


def test_reject_publish_nack_with_pika(env):
    q = env.queue(arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    conn = env.pika()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", q, b"first")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"second")
    assert ch.is_open
    assert queue_counts(env.url, q) == (1, 0)


def test_fanout_to_accepting_and_rejecting_queue_is_nacked(env):
    x = env.exchange("fanout")
    full = env.queue(arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    ok = env.queue()
    ch = env.admin()
    ch.queue_bind(full, x)
    ch.queue_bind(ok, x)
    conn = env.amqp()
    pub = conn.channel()
    pub.confirm_select()
    confirms = AmqpConfirms(pub)
    pub.basic_publish(amqp.Message(b"both"), exchange=x, routing_key="")
    apump(conn, lambda: confirms.settled())
    assert confirms.settled() == {1: "nack"}
    assert queue_counts(env.url, ok) == (1, 0)
    assert queue_counts(env.url, full) == (0, 0)


def test_publish_to_missing_exchange_in_confirm_mode_closes_channel(env):
    conn = env.pika()
    ch = conn.channel()
    ch.confirm_delivery()
    assert expect_close(lambda: ch.basic_publish(env.names("missing"), "rk", b"x")) == ("channel", 404)
    assert conn.is_open


def test_confirm_select_on_transactional_channel_is_406(env):
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    assert expect_close(ch.confirm_delivery) == ("channel", 406)
    assert conn.is_open


def test_tx_select_on_confirm_channel_is_406(env):
    conn = env.pika()
    ch = conn.channel()
    ch.confirm_delivery()
    assert expect_close(ch.tx_select) == ("channel", 406)
    assert conn.is_open


def test_tx_select_on_confirm_channel_py_amqp(env):
    conn = env.amqp()
    ch = conn.channel()
    ch.confirm_select()
    assert expect_close(ch.tx_select, conn) == ("channel", 406)
    assert conn.connected


# ------------------------------------------------------------------------------------ transactions


def test_tx_publishes_invisible_until_commit(env):
    q = env.queue()
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    for body in bodies(3):
        ch.basic_publish("", q, body)
    pika_sync(ch)
    assert queue_counts(env.url, q) == (0, 0)
    assert ch.basic_get(q) == (None, None, None)  # not even visible to the publishing channel
    ch.tx_commit()
    assert queue_counts(env.url, q) == (3, 0)
    assert [ch.basic_get(q, auto_ack=True)[2] for _ in range(3)] == bodies(3)
    ch.tx_commit()


def test_tx_rollback_drops_publishes_and_channel_stays_transactional(env):
    q = env.queue()
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    ch.basic_publish("", q, b"dropped")
    ch.tx_rollback()
    assert queue_counts(env.url, q) == (0, 0)
    ch.basic_publish("", q, b"kept")
    pika_sync(ch)
    assert queue_counts(env.url, q) == (0, 0)
    ch.tx_commit()
    assert queue_counts(env.url, q) == (1, 0)
    assert ch.basic_get(q, auto_ack=True)[2] == b"kept"


def test_tx_closing_channel_discards_uncommitted_publishes(env):
    q = env.queue()
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    ch.basic_publish("", q, b"never")
    pika_sync(ch)
    ch.close()
    assert queue_counts(env.url, q) == (0, 0)


def test_tx_acks_take_effect_on_commit(env):
    q = env.queue()
    env.publish(q, bodies(3))
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    tags = [ch.basic_get(q)[0].delivery_tag for _ in range(3)]
    ch.basic_ack(tags[0])
    ch.basic_ack(tags[2])
    pika_sync(ch)
    ch.tx_commit()
    ch.close()  # m2 was never acked: it comes back
    ch = conn.channel()
    method, _p, body = ch.basic_get(q, auto_ack=True)
    assert (body, method.redelivered, method.message_count) == (b"m2", True, 0)


def test_tx_rollback_discards_acks_messages_stay_unacked(env):
    q = env.queue()
    env.publish(q, bodies(2))
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    t1 = ch.basic_get(q)[0].delivery_tag
    t2 = ch.basic_get(q)[0].delivery_tag
    ch.basic_ack(t2, multiple=True)
    ch.tx_rollback()
    # not acked and not requeued: still held by this channel
    assert queue_counts(env.url, q) == (0, 0)
    assert ch.basic_get(q) == (None, None, None)
    ch.basic_ack(t1)  # after the rollback the tags are still valid
    ch.tx_commit()
    ch.close()
    ch = conn.channel()
    method, _p, body = ch.basic_get(q, auto_ack=True)
    assert (body, method.redelivered) == (b"m2", True)
    assert ch.basic_get(q) == (None, None, None)


def test_tx_ack_invisible_until_commit_seen_by_closing_connection(env):
    q = env.queue()
    env.publish(q, [b"one"])
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    tag = ch.basic_get(q)[0].delivery_tag
    ch.basic_ack(tag)
    pika_sync(ch)
    conn.close()  # the ack was never committed: the message is requeued
    assert wait_until(lambda: queue_counts(env.url, q) == (1, 0))


def test_tx_reject_requeue_applies_on_commit(env):
    q = env.queue()
    env.publish(q, [b"r"])
    conn = env.pika()
    ch = conn.channel()
    ch.tx_select()
    tag = ch.basic_get(q)[0].delivery_tag
    ch.basic_reject(tag, requeue=True)
    pika_sync(ch)
    assert queue_counts(env.url, q) == (0, 0)
    ch.tx_commit()
    assert queue_counts(env.url, q) == (1, 0)
    method, _p, body = ch.basic_get(q, auto_ack=True)
    assert (body, method.redelivered) == (b"r", True)


def test_tx_mandatory_return_happens_at_commit(env):
    conn = env.pika()
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(lambda c, method, props, body: returned.append((method.reply_code, body)))
    ch.tx_select()
    ch.basic_publish("amq.direct", env.names("rk"), b"lost", mandatory=True)
    pika_sync(ch)
    settle(conn)
    assert returned == []
    ch.tx_commit()
    pump(conn, lambda: returned, what="basic.return after commit")
    assert returned == [(312, b"lost")]


@pytest.mark.parametrize("method", ["commit", "rollback"])
def test_tx_commit_or_rollback_without_select_is_406(env, method):
    conn = env.pika()
    ch = conn.channel()
    assert expect_close(ch.tx_commit if method == "commit" else ch.tx_rollback) == ("channel", 406)
    assert conn.is_open


def test_tx_with_py_amqp(env):
    q = env.queue()
    conn = env.amqp()
    ch = conn.channel()
    ch.tx_select()
    ch.tx_select()  # again: harmless
    ch.basic_publish(amqp.Message(b"a"), exchange="", routing_key=q)
    ch.basic_publish(amqp.Message(b"b"), exchange="", routing_key=q)
    ch.tx_rollback()
    ch.basic_publish(amqp.Message(b"c"), exchange="", routing_key=q)
    assert queue_counts(env.url, q) == (0, 0)
    ch.tx_commit()
    assert queue_counts(env.url, q) == (1, 0)
    m = ch.basic_get(q)
    assert m.body == b"c"
    ch.basic_ack(m.delivery_tag)
    ch.tx_commit()
    ch.close()
    assert queue_counts(env.url, q) == (0, 0)


def test_tx_commit_without_select_py_amqp(env):
    conn = env.amqp()
    ch = conn.channel()
    assert expect_close(ch.tx_commit, conn) == ("channel", 406)
    assert conn.connected
