"""Differential behaviour tests for publisher confirms (confirm.select, basic.ack/nack from the broker) and
transactions (tx.select/commit/rollback).

Every test takes ``broker_url`` and so runs against the embedded broker and against RabbitMQ 3.10 with the
same assertions. Clients: pika (BlockingConnection) and py-amqp.
"""

from __future__ import annotations

import amqp
import pika
import pika.exceptions
import pytest

from helpers import expect_close, pika_sync, queue_counts
from support import apump, asettle, bodies, env, pump, settle  # noqa: F401
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)


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
    q, conn, ch = env.queue_and_channel(client="amqp")
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
    q, conn, ch = env.queue_and_channel()
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
    q, conn, ch = env.queue_and_channel(arguments={"x-max-length": 2, "x-overflow": "reject-publish"},
                                        client="amqp")
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
    q, conn, ch = env.queue_and_channel(arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
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


@pytest.mark.parametrize("first, then", [("tx_select", "confirm_delivery"), ("confirm_delivery", "tx_select")],
                         ids=["confirm-select-on-transactional-channel", "tx-select-on-confirm-channel"])
def test_confirm_and_tx_on_one_channel_is_406(env, first, then):
    conn = env.pika()
    ch = conn.channel()
    getattr(ch, first)()
    assert expect_close(getattr(ch, then)) == ("channel", 406)
    assert conn.is_open


def test_tx_select_on_confirm_channel_py_amqp(env):
    conn = env.amqp()
    ch = conn.channel()
    ch.confirm_select()
    assert expect_close(ch.tx_select, conn) == ("channel", 406)
    assert conn.connected


# ------------------------------------------------------------------------------------ transactions


def test_tx_publishes_invisible_until_commit(env):
    q, conn, ch = env.queue_and_channel()
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
    q, conn, ch = env.queue_and_channel()
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
    q, conn, ch = env.queue_and_channel()
    ch.tx_select()
    ch.basic_publish("", q, b"never")
    pika_sync(ch)
    ch.close()
    assert queue_counts(env.url, q) == (0, 0)


def test_tx_acks_take_effect_on_commit(env):
    q, conn, ch = env.queue_and_channel(bodies(3))
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
    q, conn, ch = env.queue_and_channel(bodies(2))
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


def test_tx_rollback_of_a_multiple_ack_leaves_its_tags_to_the_next_multiple_ack(env):
    """The rolled-back deliveries are outstanding again, below later tags: a multiple ack through a later
    tag settles them too (the broker tracks the lowest tag that may be outstanding; a rollback lowers it)."""
    q, conn, ch = env.queue_and_channel(bodies(4))
    ch.tx_select()
    tags = [ch.basic_get(q)[0].delivery_tag for _ in range(3)]
    ch.basic_ack(tags[1], multiple=True)
    ch.tx_rollback()
    ch.basic_ack(tags[2], multiple=True)
    ch.tx_commit()
    ch.close()
    ch = conn.channel()
    method, _p, body = ch.basic_get(q, auto_ack=True)
    assert (body, method.redelivered) == (b"m4", False)
    assert ch.basic_get(q) == (None, None, None)


def test_tx_ack_invisible_until_commit_seen_by_closing_connection(env):
    q, conn, ch = env.queue_and_channel([b"one"])
    ch.tx_select()
    tag = ch.basic_get(q)[0].delivery_tag
    ch.basic_ack(tag)
    pika_sync(ch)
    conn.close()  # the ack was never committed: the message is requeued
    assert wait_until(lambda: queue_counts(env.url, q) == (1, 0))


def test_tx_reject_requeue_applies_on_commit(env):
    q, conn, ch = env.queue_and_channel([b"r"])
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
    q, conn, ch = env.queue_and_channel(client="amqp")
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
