"""Differential behaviour tests for queue arguments: x-message-ttl, per-message expiration, x-expires,
x-max-length / x-max-length-bytes with x-overflow, argument validation (406) and x-max-priority.

Every test takes ``broker_url`` and so runs against the embedded broker and against RabbitMQ 3.10 with the
same assertions. TTLs are kept at 100-500 ms; waits poll with a deadline.
"""

from __future__ import annotations

import time

import pika
import pika.exceptions
import pytest

from helpers import expect_close, pika_sync, queue_counts
from support import Collector, Env, bodies, drain, env, pump, settle  # noqa: F401
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------- message ttl


def test_message_ttl_expires_messages(env):
    q = env.queue(arguments={"x-message-ttl": 200})
    env.publish(q, bodies(2))
    assert queue_counts(env.url, q) == (2, 0)
    wait_until(lambda: queue_counts(env.url, q) == (0, 0), timeout=3, message="the messages to expire")
    ch = env.admin()
    assert ch.basic_get(q) == (None, None, None)


def test_message_ttl_expired_messages_not_delivered_to_late_consumer(env):
    q = env.queue(arguments={"x-message-ttl": 150})
    env.publish(q, [b"old"])
    time.sleep(0.3)
    env.publish(q, [b"new"])
    conn = env.pika()
    ch = conn.channel()
    got = Collector()
    ch.basic_consume(q, got, auto_ack=True)
    pump(conn, lambda: len(got) >= 1)
    settle(conn)
    assert got.bodies == [b"new"]


def test_message_ttl_get_returns_only_unexpired(env):
    q = env.queue(arguments={"x-message-ttl": 250})
    ch = env.admin()
    ch.basic_publish("", q, b"a")
    time.sleep(0.35)
    ch.basic_publish("", q, b"b")
    method, _p, body = ch.basic_get(q, auto_ack=True)
    assert (body, method.message_count) == (b"b", 0)


def test_message_ttl_zero_drops_unless_a_consumer_is_ready(env):
    q = env.queue(arguments={"x-message-ttl": 0})
    env.publish(q, [b"dropped"])
    assert wait_until(lambda: queue_counts(env.url, q) == (0, 0), timeout=2)
    conn = env.pika()
    ch = conn.channel()
    got = Collector()
    ch.basic_consume(q, got)
    env.publish(q, [b"delivered"])
    pump(conn, lambda: len(got) >= 1)
    assert got.bodies == [b"delivered"]


def test_requeued_message_past_its_ttl_is_not_delivered_again(env):
    q, conn, ch = env.queue_and_channel([b"x"], arguments={"x-message-ttl": 200})
    method, _p, body = ch.basic_get(q)
    assert body == b"x"
    time.sleep(0.35)  # expired while unacked: it is not expired while held
    assert queue_counts(env.url, q) == (0, 0)
    ch.basic_reject(method.delivery_tag, requeue=True)
    pika_sync(ch)
    wait_until(lambda: queue_counts(env.url, q) == (0, 0), timeout=3)
    assert ch.basic_get(q) == (None, None, None)


def test_per_message_expiration(env):
    q = env.queue()
    ch = env.admin()
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="150"))
    ch.basic_publish("", q, b"long", pika.BasicProperties(expiration="60000"))
    pika_sync(ch)
    assert queue_counts(env.url, q) == (2, 0)
    time.sleep(0.3)
    method, props, body = ch.basic_get(q, auto_ack=True)
    assert (body, props.expiration, method.message_count) == (b"long", "60000", 0)


def test_per_message_expiration_delivered_before_expiry_keeps_property(env):
    q = env.queue()
    ch = env.admin()
    ch.basic_publish("", q, b"soon", pika.BasicProperties(expiration="5000"))
    pika_sync(ch)
    _m, props, body = ch.basic_get(q, auto_ack=True)
    assert (body, props.expiration) == (b"soon", "5000")


def test_lower_of_queue_ttl_and_message_expiration_applies(env):
    q = env.queue(arguments={"x-message-ttl": 150})
    ch = env.admin()
    ch.basic_publish("", q, b"capped", pika.BasicProperties(expiration="60000"))
    pika_sync(ch)
    wait_until(lambda: queue_counts(env.url, q) == (0, 0), timeout=3)
    assert ch.basic_get(q) == (None, None, None)


def test_per_message_expiration_zero(env):
    q = env.queue()
    ch = env.admin()
    ch.basic_publish("", q, b"gone", pika.BasicProperties(expiration="0"))
    pika_sync(ch)
    wait_until(lambda: queue_counts(env.url, q) == (0, 0), timeout=2)
    assert ch.basic_get(q) == (None, None, None)


@pytest.mark.parametrize("expiration", ["abc", "-1", "1.5", ""])
def test_invalid_expiration_property_is_406(env, expiration):
    q, conn, ch = env.queue_and_channel()

    def go():
        ch.basic_publish("", q, b"x", pika.BasicProperties(expiration=expiration))
        pika_sync(ch)

    assert expect_close(go) == ("channel", 406)
    assert conn.is_open
    assert queue_counts(env.url, q) == (0, 0)


# ---------------------------------------------------------------------------------------- expires


class QueueWatch:
    """Tells whether a queue still exists WITHOUT touching it: a passive queue.declare counts as use and
    would restart an x-expires timer, a mandatory publish through the default exchange does not."""

    def __init__(self, env: Env):
        self.conn = env.pika()
        self.ch = self.conn.channel()
        self.ch.confirm_delivery()

    def exists(self, queue: str) -> bool:
        try:
            self.ch.basic_publish("", queue, b"probe", mandatory=True)
        except pika.exceptions.UnroutableError:
            return False
        except pika.exceptions.NackError:
            return False    # routed to the queue as it was going away (RabbitMQ 4.3 nacks that publish)
        return True

    def wait_gone(self, queue: str, timeout: float = 3.0, what: str = "the queue to be deleted by x-expires") -> None:
        wait_until(lambda: not self.exists(queue), timeout=timeout, interval=0.05, message=what)


def test_unused_queue_expires(env):
    watch = QueueWatch(env)
    q = env.queue(arguments={"x-expires": 200})
    assert watch.exists(q)
    watch.wait_gone(q)
    assert queue_counts(env.url, q) is None


def test_queue_with_messages_but_unused_still_expires(env):
    q = env.queue(arguments={"x-expires": 250})
    env.publish(q, bodies(3))
    QueueWatch(env).wait_gone(q)


def test_queue_with_a_consumer_does_not_expire(env):
    watch = QueueWatch(env)
    q, conn, ch = env.queue_and_channel(arguments={"x-expires": 200})
    got = Collector()
    tag = ch.basic_consume(q, got, auto_ack=True)
    settle(conn, 0.6)
    assert watch.exists(q)
    ch.basic_cancel(tag)
    watch.wait_gone(q, what="the queue to be deleted once its consumer was cancelled")


def test_queue_use_resets_expiry_timer(env):
    watch = QueueWatch(env)
    q = env.queue(arguments={"x-expires": 400})
    ch = env.admin()
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:  # a basic.get every 100 ms counts as use
        ch.basic_get(q, auto_ack=True)
        time.sleep(0.1)
    assert watch.exists(q)
    watch.wait_gone(q)


def test_redeclare_resets_expiry_timer(env):
    watch = QueueWatch(env)
    q = env.queue(arguments={"x-expires": 400})
    ch = env.admin()
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        ch.queue_declare(q, passive=True)
        time.sleep(0.1)
    assert watch.exists(q)
    watch.wait_gone(q)


# ------------------------------------------------------------------------------------- max length


def test_max_length_drop_head_drops_oldest(env):
    q = env.queue(arguments={"x-max-length": 2})
    env.publish(q, bodies(4))
    assert queue_counts(env.url, q) == (2, 0)
    assert drain(env.admin(), q) == [b"m3", b"m4"]


def test_max_length_explicit_drop_head(env):
    q = env.queue(arguments={"x-max-length": 3, "x-overflow": "drop-head"})
    env.publish(q, bodies(5))
    assert drain(env.admin(), q) == [b"m3", b"m4", b"m5"]


def test_max_length_counts_ready_messages_only(env):
    q, conn, ch = env.queue_and_channel([b"m1"], arguments={"x-max-length": 1})
    held, _p, _b = ch.basic_get(q)  # unacked messages do not count towards the limit
    env.publish(q, [b"m2", b"m3"])
    assert queue_counts(env.url, q) == (1, 0)
    ch.basic_reject(held.delivery_tag, requeue=True)
    pika_sync(ch)
    # the requeued m1 pushes the queue over its limit: the head (m1 itself) is dropped
    got = drain(ch, q)
    assert got == [b"m3"]


def test_max_length_zero_drop_head_keeps_nothing(env):
    q = env.queue(arguments={"x-max-length": 0})
    env.publish(q, bodies(3))
    assert queue_counts(env.url, q) == (0, 0)


def test_max_length_bytes_drop_head(env):
    q = env.queue(arguments={"x-max-length-bytes": 10})
    env.publish(q, [b"aaaa", b"bbbb", b"cccc", b"dddd"])
    assert drain(env.admin(), q) == [b"cccc", b"dddd"]


def test_max_length_bytes_counts_body_only(env):
    q = env.queue(arguments={"x-max-length-bytes": 8})
    ch = env.admin()
    big_headers = {"h": "x" * 500}
    for body in (b"aaaa", b"bbbb"):
        ch.basic_publish("", q, body, pika.BasicProperties(headers=big_headers))
    pika_sync(ch)
    assert drain(ch, q) == [b"aaaa", b"bbbb"]


def test_max_length_bytes_counts_only_what_is_still_ready_after_a_consumer_took_some(env):
    """Bytes delivered to a consumer no longer count toward x-max-length-bytes (the broker settles a
    queue's ready bytes once per dispatch, not per message)."""
    q = env.queue(arguments={"x-max-length-bytes": 10})
    env.publish(q, [b"aaaa", b"bbbb"])
    conn = env.pika()
    ch = conn.channel()
    got = Collector()
    tag = ch.basic_consume(q, got, auto_ack=True)
    pump(conn, lambda: len(got) >= 2)
    ch.basic_cancel(tag)
    env.publish(q, [b"cccc", b"dddd", b"eeee"])
    assert got.bodies == [b"aaaa", b"bbbb"]
    assert drain(env.admin(), q) == [b"dddd", b"eeee"]


def test_max_length_and_max_length_bytes_together(env):
    q = env.queue(arguments={"x-max-length": 3, "x-max-length-bytes": 6})
    env.publish(q, [b"aa", b"bb", b"cc", b"dddd"])
    # 3 by count allows bb,cc,dddd (8 bytes) but 6 bytes allows only cc,dddd
    assert drain(env.admin(), q) == [b"cc", b"dddd"]


def test_max_length_reject_publish_keeps_oldest(env):
    q = env.queue(arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    env.publish(q, bodies(4))
    assert drain(env.admin(), q) == [b"m1", b"m2"]


def test_max_length_bytes_reject_publish_nacks(env):
    q, conn, ch = env.queue_and_channel(arguments={"x-max-length-bytes": 10, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"aaaa")
    ch.basic_publish("", q, b"bbbb")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"cccc")
    ch.basic_publish("", q, b"dd")  # 10 bytes exactly: fits
    assert drain(ch, q) == [b"aaaa", b"bbbb", b"dd"]


def test_reject_publish_accepts_again_once_below_the_limit(env):
    q, conn, ch = env.queue_and_channel(arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"one")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"two")
    assert ch.basic_get(q, auto_ack=True)[2] == b"one"
    ch.basic_publish("", q, b"three")
    assert drain(ch, q) == [b"three"]


def test_reject_publish_with_consumer_ready_delivers(env):
    q, conn, ch = env.queue_and_channel(arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    got = Collector()
    ch.basic_consume(q, got, auto_ack=True)
    pub = env.pika().channel()
    pub.confirm_delivery()
    with pytest.raises(pika.exceptions.NackError):
        pub.basic_publish("", q, b"x")
    settle(conn)
    assert got.bodies == []


# ------------------------------------------------------------------------------ invalid arguments

INVALID_ARGUMENTS = [
    {"x-message-ttl": -1},
    {"x-message-ttl": "100"},
    {"x-expires": 0},
    {"x-expires": -5},
    {"x-expires": "1000"},
    {"x-max-length": "abc"},
    {"x-max-length": -1},
    {"x-max-length-bytes": -1},
    {"x-max-length-bytes": "10"},
    {"x-overflow": "nope"},
    {"x-overflow": 1},
    {"x-max-priority": -1},
    {"x-max-priority": "5"},
    {"x-dead-letter-exchange": 5},
    {"x-dead-letter-routing-key": "rk"},  # a routing key without a dead-letter exchange
    {"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": 7},
]


@pytest.mark.parametrize("arguments", INVALID_ARGUMENTS, ids=lambda a: ",".join(f"{k}={v!r}" for k, v in a.items()))
def test_invalid_queue_argument_is_406(env, arguments):
    name = env.track_queue(env.names("q"))
    conn = env.pika()
    ch = conn.channel()
    assert expect_close(lambda: ch.queue_declare(name, arguments=arguments)) == ("channel", 406)
    assert conn.is_open
    assert queue_counts(env.url, name) is None


VALID_ARGUMENTS = [
    {"x-message-ttl": 0},
    {"x-max-length": 0},
    {"x-max-length-bytes": 0},
    {"x-overflow": "reject-publish-dlx"},
    {"x-max-priority": 0},
    {"x-max-priority": 255},
    {"x-dead-letter-exchange": ""},
    {"x-dead-letter-exchange": "does-not-exist-yet", "x-dead-letter-routing-key": "rk"},
    {"x-custom-argument": "anything"},
]


@pytest.mark.parametrize("arguments", VALID_ARGUMENTS, ids=lambda a: ",".join(f"{k}={v!r}" for k, v in a.items()))
def test_valid_unusual_queue_arguments_are_accepted(env, arguments):
    name = env.queue(arguments=arguments)
    assert queue_counts(env.url, name) == (0, 0)


@pytest.mark.parametrize("arguments", [{"x-max-length": "abc"}, {"x-message-ttl": 1.5},
                                       {"x-max-length": 2.0}, {"x-max-priority": 1.0}],
                         ids=lambda a: ",".join(f"{k}={v!r}" for k, v in a.items()))
def test_invalid_argument_with_py_amqp(env, arguments):
    conn = env.amqp()
    ch = conn.channel()
    name = env.track_queue(env.names("q"))
    assert expect_close(lambda: ch.queue_declare(name, arguments=arguments), conn) == ("channel", 406)
    assert conn.connected


# ---------------------------------------------------------------------------------------- priority


def _get_all(ch, q) -> list[tuple]:
    """basic.get with auto-ack until get-empty: every (method, properties, body) in order."""
    got = []
    while (message := ch.basic_get(q, auto_ack=True))[0] is not None:
        got.append(message)
    return got


def _publish_priorities(ch, q, items):
    for body, priority in items:
        ch.basic_publish("", q, body, pika.BasicProperties(priority=priority))
    pika_sync(ch)


def test_priority_queue_delivers_higher_priority_first(env):
    q = env.queue(arguments={"x-max-priority": 10})
    ch = env.admin()
    _publish_priorities(ch, q, [(b"p1", 1), (b"p5", 5), (b"p3", 3), (b"p5b", 5), (b"p10", 10)])
    assert drain(ch, q) == [b"p10", b"p5", b"p5b", b"p3", b"p1"]


def test_priority_missing_counts_as_zero(env):
    q = env.queue(arguments={"x-max-priority": 5})
    ch = env.admin()
    _publish_priorities(ch, q, [(b"none1", None), (b"zero", 0), (b"one", 1), (b"none2", None)])
    assert drain(ch, q) == [b"one", b"none1", b"zero", b"none2"]


def test_priority_above_max_is_capped(env):
    q = env.queue(arguments={"x-max-priority": 3})
    ch = env.admin()
    _publish_priorities(ch, q, [(b"a3", 3), (b"b9", 9), (b"c2", 2), (b"d200", 200)])
    got = [(body, props.priority) for _m, props, body in _get_all(ch, q)]
    # 9 and 200 rank as 3, after the earlier 3; the property itself is delivered unchanged
    assert got == [(b"a3", 3), (b"b9", 9), (b"d200", 200), (b"c2", 2)]


def test_priority_ignored_without_max_priority(env):
    q = env.queue()
    ch = env.admin()
    _publish_priorities(ch, q, [(b"low", 1), (b"high", 9)])
    assert drain(ch, q) == [b"low", b"high"]


def test_priority_consumer_with_prefetch(env):
    q = env.queue(arguments={"x-max-priority": 10})
    ch = env.admin()
    _publish_priorities(ch, q, [(f"p{p}".encode(), p) for p in (2, 7, 1, 9, 4)])
    conn = env.pika()
    cch = conn.channel()
    cch.basic_qos(prefetch_count=1)
    got = Collector()
    cch.basic_consume(q, got)
    for n in range(1, 6):
        pump(conn, lambda: len(got) >= n)
        cch.basic_ack(got.tags[-1])
    assert got.bodies == [b"p9", b"p7", b"p4", b"p2", b"p1"]


def test_priority_requeued_message_keeps_its_rank(env):
    q = env.queue(arguments={"x-max-priority": 5})
    ch = env.admin()
    _publish_priorities(ch, q, [(b"hi", 5), (b"lo", 1)])
    conn = env.pika()
    c = conn.channel()
    method, _p, body = c.basic_get(q)
    assert body == b"hi"
    _publish_priorities(ch, q, [(b"mid", 3)])
    c.basic_reject(method.delivery_tag, requeue=True)
    pika_sync(c)
    got = [(b, m.redelivered) for m, _p, b in _get_all(c, q)]
    assert got == [(b"hi", True), (b"mid", False), (b"lo", False)]
