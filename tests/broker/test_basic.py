"""Differential behaviour tests for the basic class: qos, consume, cancel, publish/return, get, ack/nack/reject,
recover, and message properties passing through unchanged.

Every test takes ``broker_url`` and so runs against the embedded broker and against RabbitMQ 3.10 with the
same assertions. Clients: pika (BlockingConnection) and py-amqp.
"""

from __future__ import annotations

import datetime
import decimal
import struct

import amqp
import pika
import pika.exceptions
import pytest

from helpers import amqp_sync, expect_close, pika_sync, queue_counts, raw_handshake
from support import (Collector, Env, amqp_nack, apump, asettle, bodies, env, pump, raw_frame,  # noqa: F401
                     raw_method, read_raw_frame, settle)
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)


# -------------------------------------------------------------------------------------------- qos


def test_qos_prefetch_count_limits_unacked_deliveries(env):
    q, conn, ch = env.queue_and_channel(bodies(5))
    ch.basic_qos(prefetch_count=2)
    got = Collector()
    ch.basic_consume(q, got)
    pump(conn, lambda: len(got) >= 2)
    settle(conn)
    assert got.bodies == [b"m1", b"m2"]
    ch.basic_ack(got.tags[0])
    pump(conn, lambda: len(got) >= 3)
    settle(conn)
    assert got.bodies == [b"m1", b"m2", b"m3"]
    ch.basic_ack(got.tags[2], multiple=True)  # acks m2 and m3: two more may flow
    pump(conn, lambda: len(got) >= 5)
    settle(conn)
    assert got.bodies == bodies(5)
    ch.basic_ack(0, multiple=True)
    pika_sync(ch)
    assert queue_counts(env.url, q) == (0, 1)


@pytest.mark.parametrize("prefetch,through", [(2, 3), (40, 71)], ids=["few", "many"])
def test_ack_multiple_frees_the_prefetch_of_each_consumer_it_settles(env, prefetch, through):
    """Two consumers on one channel, each with its own prefetch (qos before both consumes): one
    basic.ack(multiple) through the `through`-th delivery, which settles an odd number, so more of one
    consumer's deliveries than of the other's, lets exactly that many more flow to each."""
    q, conn, ch = env.queue_and_channel(bodies(4 * prefetch))
    ch.basic_qos(prefetch_count=prefetch)
    got = Collector()
    ch.basic_consume(q, got, consumer_tag="c1")
    ch.basic_consume(q, got, consumer_tag="c2")
    pump(conn, lambda: len(got) >= 2 * prefetch)
    settle(conn)
    first = got.items[:]
    assert sorted(i[0] for i in first) == ["c1"] * prefetch + ["c2"] * prefetch
    last_tag = sorted(i[1] for i in first)[through - 1]
    settled = [i[0] for i in first if i[1] <= last_tag]
    assert settled.count("c1") != settled.count("c2")
    ch.basic_ack(last_tag, multiple=True)
    pump(conn, lambda: len(got) >= 2 * prefetch + through)
    settle(conn)
    per_consumer = {tag: sum(1 for i in got.items if i[0] == tag) for tag in ("c1", "c2")}
    assert len(got) == 2 * prefetch + through
    assert per_consumer == {tag: prefetch + settled.count(tag) for tag in ("c1", "c2")}
    ch.basic_ack(0, multiple=True)
    pika_sync(ch)


def test_full_consumers_are_passed_over_while_the_others_are_refilled(env):
    """The source's pattern: four channels consuming one queue, each with its own prefetch; the acks of two
    of them let the queue refill exactly those two, alternately, while the other two stay full, and after
    their acks the queue goes on to them."""
    prefetch = 5
    q, conn, _ch = env.queue_and_channel(bodies(8 * prefetch))
    got = Collector()
    channels = []
    for i in range(4):
        ch = conn.channel()
        ch.basic_qos(prefetch_count=prefetch)
        ch.basic_consume(q, got, consumer_tag=f"c{i}")
        channels.append(ch)
    pump(conn, lambda: len(got) >= 4 * prefetch)
    settle(conn)

    def per_consumer():
        return [sum(1 for item in got.items if item[0] == f"c{i}") for i in range(4)]

    assert per_consumer() == [prefetch] * 4
    for ch in channels[:2]:
        ch.basic_ack(0, multiple=True)
    pump(conn, lambda: len(got) >= 6 * prefetch)
    settle(conn)
    assert per_consumer() == [2 * prefetch, 2 * prefetch, prefetch, prefetch]
    refilled = [item[0] for item in got.items[4 * prefetch:]]
    assert sorted(refilled) == ["c0"] * prefetch + ["c1"] * prefetch
    for ch in channels[2:]:
        ch.basic_ack(0, multiple=True)
    pump(conn, lambda: len(got) >= 8 * prefetch)
    settle(conn)
    assert per_consumer() == [2 * prefetch] * 4
    assert queue_counts(env.url, q)[0] == 0


def test_qos_prefetch_with_py_amqp(env):
    q, conn, ch = env.queue_and_channel(bodies(4), client="amqp")
    ch.basic_qos(0, 1, False)
    got = []
    ch.basic_consume(q, callback=got.append)
    apump(conn, lambda: len(got) >= 1)
    asettle(conn)
    assert [m.body for m in got] == [b"m1"]
    ch.basic_ack(got[0].delivery_tag)
    apump(conn, lambda: len(got) >= 2)
    asettle(conn)
    assert [m.body for m in got] == [b"m1", b"m2"]


def _consuming_two_queues(env, prefetch=None, global_prefetch=None):
    """Queues holding a1..a4 and b1..b4, one consumer on each, both on one pika channel with the given
    channel-wide (global) and per-consumer prefetch counts: (connection, channel, collector of both)."""
    q1, q2 = env.queue(), env.queue()
    env.publish(q1, bodies(4, "a"))
    env.publish(q2, bodies(4, "b"))
    conn = env.pika()
    ch = conn.channel()
    if global_prefetch is not None:
        ch.basic_qos(prefetch_count=global_prefetch, global_qos=True)
    if prefetch is not None:
        ch.basic_qos(prefetch_count=prefetch, global_qos=False)
    got = Collector()
    ch.basic_consume(q1, got)
    ch.basic_consume(q2, got)
    return conn, ch, got


def test_qos_per_consumer_limit_applies_to_each_consumer(env):
    conn, ch, got = _consuming_two_queues(env, prefetch=2)
    pump(conn, lambda: len(got) >= 4)
    settle(conn)
    assert sorted(got.bodies) == [b"a1", b"a2", b"b1", b"b2"]


def test_qos_global_limit_is_shared_by_the_channel(env, rabbitmq_version):
    """3.10 limits the channel as a whole; 4.x denies global QoS and limits each consumer instead (three
    messages in each queue: two consumers take six)."""
    conn, ch, got = _consuming_two_queues(env, global_prefetch=3)
    limit = 3 if rabbitmq_version == "3.10" else 6
    pump(conn, lambda: len(got) >= limit)
    settle(conn)
    assert len(got) == limit
    if rabbitmq_version == "3.10":
        ch.basic_ack(got.tags[0])
        pump(conn, lambda: len(got) >= 4)
        settle(conn)
        assert len(got) == 4
    total = 7 if rabbitmq_version == "3.10" else 8
    ch.basic_ack(0, multiple=True)
    pump(conn, lambda: len(got) >= total)
    settle(conn)
    assert len(got) == total


def test_qos_global_and_per_consumer_limits_combine(env):
    conn, ch, got = _consuming_two_queues(env, prefetch=1, global_prefetch=3)
    pump(conn, lambda: len(got) >= 2)
    settle(conn)
    # each consumer is held to 1 although the channel would allow 3
    assert sorted(got.bodies) == [b"a1", b"b1"]


def test_qos_change_applies_only_to_consumers_created_afterwards(env):
    q1, q2 = env.queue(), env.queue()
    env.publish(q1, bodies(5, "a"))
    env.publish(q2, bodies(5, "b"))
    conn = env.pika()
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1)
    first = Collector()
    ch.basic_consume(q1, first)
    pump(conn, lambda: len(first) >= 1)
    ch.basic_qos(prefetch_count=3)
    second = Collector()
    ch.basic_consume(q2, second)
    pump(conn, lambda: len(second) >= 3)
    settle(conn)
    assert first.bodies == [b"a1"]
    assert second.bodies == [b"b1", b"b2", b"b3"]


def test_qos_does_not_limit_no_ack_consumers(env):
    q, conn, ch = env.queue_and_channel(bodies(5))
    ch.basic_qos(prefetch_count=1)
    got = Collector()
    ch.basic_consume(q, got, auto_ack=True)
    pump(conn, lambda: len(got) >= 5)
    assert got.bodies == bodies(5)


def test_qos_does_not_limit_basic_get(env):
    q, conn, ch = env.queue_and_channel(bodies(3))
    ch.basic_qos(prefetch_count=1)
    got = [ch.basic_get(q)[2] for _ in range(3)]
    assert got == bodies(3)


def test_qos_prefetch_size_is_not_implemented(env):
    conn = env.pika()
    ch = conn.channel()
    assert expect_close(lambda: ch.basic_qos(prefetch_size=1000, prefetch_count=10)) == ("connection", 540)


# ---------------------------------------------------------------------------------------- consume


def test_exclusive_consumer_refuses_a_second_consumer(env):
    q = env.queue()
    conn = env.pika()
    ch1 = conn.channel()
    ch1.basic_consume(q, Collector(), exclusive=True)
    ch2 = conn.channel()
    assert expect_close(lambda: ch2.basic_consume(q, Collector())) == ("channel", 403)
    assert conn.is_open and ch1.is_open
    env.publish(q, [b"x"])
    assert queue_counts(env.url, q)[1] == 1


def test_exclusive_consume_refused_when_queue_already_has_consumers(env):
    q = env.queue()
    other = env.pika()
    other.channel().basic_consume(q, Collector())
    conn = env.amqp()
    ch = conn.channel()
    assert expect_close(lambda: ch.basic_consume(q, exclusive=True, callback=lambda m: None), conn) \
        == ("channel", 403)
    assert conn.connected


def test_server_generated_consumer_tags(env):
    q, conn, ch = env.queue_and_channel([b"hello"], client="amqp")
    got = []
    tag1 = ch.basic_consume(q, consumer_tag="", callback=got.append, no_ack=True)
    tag2 = ch.basic_consume(q, consumer_tag="", callback=got.append, no_ack=True)
    assert tag1.startswith("amq.ctag-") and tag2.startswith("amq.ctag-")
    assert tag1 != tag2
    apump(conn, lambda: got)
    assert got[0].delivery_info["consumer_tag"] == tag1
    assert queue_counts(env.url, q) == (0, 2)


def test_duplicate_consumer_tag_on_a_channel_closes_the_connection(env):
    q, conn, ch = env.queue_and_channel(client="amqp")
    assert ch.basic_consume(q, consumer_tag="dup", callback=lambda m: None) == "dup"
    assert expect_close(lambda: ch.basic_consume(q, consumer_tag="dup", callback=lambda m: None), conn) \
        == ("connection", 530)


def test_same_consumer_tag_on_two_channels_is_allowed(env):
    q = env.queue()
    conn = env.pika()
    conn.channel().basic_consume(q, Collector(), consumer_tag="same")
    conn.channel().basic_consume(q, Collector(), consumer_tag="same")
    assert queue_counts(env.url, q) == (0, 2)


def test_consume_from_missing_queue_is_404(env):
    conn = env.pika()
    ch = conn.channel()
    assert expect_close(lambda: ch.basic_consume(env.names("missing"), Collector())) == ("channel", 404)
    assert conn.is_open


def test_no_ack_consumer_removes_messages_on_delivery(env):
    q, conn, ch = env.queue_and_channel(bodies(3))
    got = Collector()
    ch.basic_consume(q, got, auto_ack=True)
    pump(conn, lambda: len(got) >= 3)
    assert got.bodies == bodies(3)
    assert got.redelivered == [False] * 3
    ch.close()  # nothing is requeued: nothing was outstanding
    assert queue_counts(env.url, q) == (0, 0)


def test_cancel_stops_deliveries_and_unacked_stay_ackable(env):
    q, conn, ch = env.queue_and_channel()
    got = Collector()
    tag = ch.basic_consume(q, got)
    env.publish(q, [b"one"])
    pump(conn, lambda: len(got) >= 1)
    ch.basic_cancel(tag)
    assert queue_counts(env.url, q) == (0, 0)
    env.publish(q, [b"two"])
    settle(conn)
    assert got.bodies == [b"one"]
    ch.basic_ack(got.tags[0])
    pika_sync(ch)
    assert ch.is_open
    assert queue_counts(env.url, q) == (1, 0)
    ch.close()
    assert queue_counts(env.url, q) == (1, 0)  # "one" was acked, not requeued


def test_cancel_with_py_amqp_and_unknown_tag(env):
    q, conn, ch = env.queue_and_channel(client="amqp")
    tag = ch.basic_consume(q, callback=lambda m: None)
    assert queue_counts(env.url, q) == (0, 1)
    ch.basic_cancel(tag)
    assert queue_counts(env.url, q) == (0, 0)
    ch.basic_cancel("no-such-consumer")  # RabbitMQ answers cancel-ok
    amqp_sync(ch)
    assert conn.connected and ch.is_open


def test_queue_deletion_cancels_consumers_pika(env):
    q, conn, ch = env.queue_and_channel()
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ch.basic_consume(q, Collector())
    env.admin().queue_delete(q)
    pump(conn, lambda: cancelled, what="basic.cancel from the broker")
    assert cancelled == [tag]
    assert ch.is_open
    pika_sync(ch)


def test_queue_deletion_cancels_consumers_py_amqp(env):
    q, conn, ch = env.queue_and_channel(client="amqp")
    cancelled = []
    tag = ch.basic_consume(q, callback=lambda m: None, on_cancel=cancelled.append)
    env.admin().queue_delete(q)
    apump(conn, lambda: cancelled, what="basic.cancel from the broker")
    assert cancelled == [tag]
    amqp_sync(ch)
    assert ch.is_open


def test_unacked_messages_requeued_when_consumer_channel_closes(env):
    q, conn, ch = env.queue_and_channel(bodies(3))
    got = Collector()
    ch.basic_consume(q, got)
    pump(conn, lambda: len(got) >= 3)
    ch.basic_ack(got.tags[1])
    ch.close()
    ch2 = conn.channel()
    again = [ch2.basic_get(q, auto_ack=True) for _ in range(3)]
    assert [(m.redelivered, b) for m, _p, b in again[:2]] == [(True, b"m1"), (True, b"m3")]
    assert again[2] == (None, None, None)


# ---------------------------------------------------------------------------------------- publish


def test_mandatory_unroutable_is_returned_with_312(env):
    x = env.exchange("direct")
    conn = env.pika()
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(lambda c, method, props, body: returned.append((method, props, body)))
    ch.basic_publish(x, "nowhere", b"lost", pika.BasicProperties(message_id="m-1", headers={"h": 1}),
                     mandatory=True)
    ch.basic_publish("", env.names("no-such-queue"), b"lost2", mandatory=True)
    pump(conn, lambda: len(returned) >= 2, what="basic.return")
    (m1, p1, b1), (m2, _p2, b2) = returned
    assert (m1.reply_code, m1.reply_text, m1.exchange, m1.routing_key, b1) == \
        (312, "NO_ROUTE", x, "nowhere", b"lost")
    assert (p1.message_id, p1.headers) == ("m-1", {"h": 1})
    assert (m2.reply_code, m2.reply_text, m2.exchange, b2) == (312, "NO_ROUTE", "", b"lost2")
    assert ch.is_open


def test_mandatory_routable_is_not_returned(env):
    q, conn, ch = env.queue_and_channel()
    returned = []
    ch.add_on_return_callback(lambda *a: returned.append(a))
    ch.basic_publish("", q, b"ok", mandatory=True)
    ch.basic_publish("", env.names("nobody"), b"dropped", mandatory=False)
    pika_sync(ch)
    settle(conn)
    assert returned == []
    assert queue_counts(env.url, q) == (1, 0)


def test_mandatory_return_py_amqp(env):
    conn = env.amqp()
    ch = conn.channel()
    returned = []
    ch.events["basic_return"].add(
        lambda exc, exchange, routing_key, msg: returned.append((exc.reply_code, exchange, routing_key, msg.body)))
    ch.basic_publish(amqp.Message(b"body"), exchange="amq.direct", routing_key=env.names("rk"), mandatory=True)
    apump(conn, lambda: returned, what="basic.return")
    code, exchange, _rk, body = returned[0]
    assert (code, exchange, body) == (312, "amq.direct", b"body")


def test_mandatory_unroutable_with_confirms_is_returned_then_acked(env):
    conn = env.pika()
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError) as info:
        ch.basic_publish("amq.direct", env.names("rk"), b"x", mandatory=True)
    assert [m.method.reply_code for m in info.value.messages] == [312]
    assert ch.is_open


def test_immediate_flag_closes_the_connection_540(env):
    q, conn, ch = env.queue_and_channel(client="amqp")

    def go():
        ch.basic_publish(amqp.Message(b"now"), exchange="", routing_key=q, immediate=True)
        amqp_sync(ch)

    assert expect_close(go, conn) == ("connection", 540)
    assert queue_counts(env.url, q) == (0, 0)


def test_publish_to_missing_exchange_closes_the_channel_404(env):
    conn = env.pika()
    ch = conn.channel()

    def go():
        ch.basic_publish(env.names("no-such-exchange"), "rk", b"x")
        pika_sync(ch)

    assert expect_close(go) == ("channel", 404)
    assert conn.is_open
    conn.channel().basic_qos(prefetch_count=1)


def test_publish_with_foreign_user_id_is_406(env):
    q, conn, ch = env.queue_and_channel()

    def go():
        ch.basic_publish("", q, b"x", pika.BasicProperties(user_id="not-guest"))
        pika_sync(ch)

    assert expect_close(go) == ("channel", 406)
    assert queue_counts(env.url, q) == (0, 0)


def test_cc_and_bcc_headers_route_and_bcc_is_stripped(env):
    x = env.exchange("direct")
    qa, qb, qc = env.queue(), env.queue(), env.queue()
    ch = env.admin()
    for q, key in ((qa, "a"), (qb, "b"), (qc, "c")):
        ch.queue_bind(q, x, key)
    ch.basic_publish(x, "a", b"multi", pika.BasicProperties(headers={"CC": ["b"], "BCC": ["c"], "k": "v"}))
    pika_sync(ch)
    got = {}
    for q in (qa, qb, qc):
        method, props, body = wait_until(lambda: (r := ch.basic_get(q, auto_ack=True))[0] and r,
                                         message=f"message in {q}")
        got[q] = (method.routing_key, body, props.headers)
    assert got[qa] == ("a", b"multi", {"CC": ["b"], "k": "v"})
    assert got[qb] == got[qa]
    assert got[qc] == got[qa]


@pytest.mark.parametrize("header", ["CC", "BCC"])
def test_cc_or_bcc_header_that_is_not_an_array_is_406(env, header):
    q, conn, ch = env.queue_and_channel()

    def go():
        ch.basic_publish("", q, b"x", pika.BasicProperties(headers={header: "b"}))
        pika_sync(ch)

    assert expect_close(go) == ("channel", 406)
    assert conn.is_open
    assert queue_counts(env.url, q) == (0, 0)


# ------------------------------------------------------------------------------------ round robin


def test_round_robin_between_two_consumers(env):
    q, conn, ch = env.queue_and_channel()
    got = Collector()
    t1 = ch.basic_consume(q, got, auto_ack=True, consumer_tag="c1")
    t2 = ch.basic_consume(q, got, auto_ack=True, consumer_tag="c2")
    pub = env.pika().channel()
    for body in bodies(6):
        pub.basic_publish("", q, body)
    pump(conn, lambda: len(got) >= 6)
    assert got.bodies == bodies(6)
    tags = [i[0] for i in got.items]
    assert tags.count(t1) == 3 and tags.count(t2) == 3
    assert all(tags[i] != tags[i + 1] for i in range(5)), tags


def test_round_robin_across_channels_with_prefetch_1(env):
    q = env.queue()
    env.publish(q, bodies(6))
    conn = env.pika()
    chans = [conn.channel(), conn.channel()]
    got = [Collector(), Collector()]
    for ch, coll in zip(chans, got):
        ch.basic_qos(prefetch_count=1)
        ch.basic_consume(q, coll)
    pump(conn, lambda: len(got[0]) + len(got[1]) >= 2)
    settle(conn)
    assert (len(got[0]), len(got[1])) == (1, 1)
    # each consumer acks its one message and gets exactly one more, until the queue is drained
    while len(got[0]) + len(got[1]) < 6:
        target = len(got[0]) + len(got[1]) + 2
        for ch in chans:
            ch.basic_ack(0, multiple=True)
        pump(conn, lambda: len(got[0]) + len(got[1]) >= target)
    settle(conn)
    assert (len(got[0]), len(got[1])) == (3, 3)
    assert sorted(got[0].bodies + got[1].bodies) == sorted(bodies(6))


# -------------------------------------------------------------------------------------------- get


def test_get_empty_and_message_count(env):
    q, conn, ch = env.queue_and_channel()
    assert ch.basic_get(q) == (None, None, None)
    env.publish(q, bodies(3))
    seen = []
    for _ in range(3):
        method, _props, body = ch.basic_get(q, auto_ack=True)
        seen.append((method.message_count, method.redelivered, method.exchange, method.routing_key, body))
    assert seen == [(2, False, "", q, b"m1"), (1, False, "", q, b"m2"), (0, False, "", q, b"m3")]
    assert ch.basic_get(q) == (None, None, None)


def test_get_with_py_amqp(env):
    q, conn, ch = env.queue_and_channel(client="amqp")
    assert ch.basic_get(q) is None
    env.publish(q, bodies(2))
    m = ch.basic_get(q)
    assert (m.body, m.delivery_info["message_count"], m.delivery_info["redelivered"]) == (b"m1", 1, False)
    ch.basic_ack(m.delivery_tag)
    m = ch.basic_get(q, no_ack=True)
    assert (m.body, m.delivery_info["message_count"]) == (b"m2", 0)
    assert ch.basic_get(q) is None


def test_get_without_ack_holds_the_message_until_channel_close(env):
    q, conn, ch = env.queue_and_channel([b"held"])
    method, _p, body = ch.basic_get(q)
    assert (body, method.redelivered, method.delivery_tag) == (b"held", False, 1)
    assert queue_counts(env.url, q) == (0, 0)
    assert ch.basic_get(q) == (None, None, None)
    ch.close()
    ch2 = conn.channel()
    method, _p, body = ch2.basic_get(q, auto_ack=True)
    assert (body, method.redelivered) == (b"held", True)


def test_get_from_missing_queue_is_404(env):
    conn = env.pika()
    ch = conn.channel()
    assert expect_close(lambda: ch.basic_get(env.names("missing"))) == ("channel", 404)


# ------------------------------------------------------------------------------ ack / nack / reject


def _get_n(ch, q, n):
    out = []
    for _ in range(n):
        method, _p, body = ch.basic_get(q)
        assert method is not None
        out.append((method.delivery_tag, body))
    return out


def test_ack_multiple(env):
    q, conn, ch = env.queue_and_channel(bodies(5))
    got = _get_n(ch, q, 5)
    assert [t for t, _ in got] == [1, 2, 3, 4, 5]
    ch.basic_ack(3, multiple=True)
    pika_sync(ch)
    ch.close()
    ch = conn.channel()
    rest = [(m.redelivered, b) for m, _p, b in (ch.basic_get(q, auto_ack=True) for _ in range(2))]
    assert rest == [(True, b"m4"), (True, b"m5")]
    assert ch.basic_get(q) == (None, None, None)


@pytest.mark.parametrize("single", [0, 1, 4])
def test_ack_multiple_after_a_single_ack(env, single):
    """A single ack of the lowest, a middle or a later outstanding delivery, then a multiple ack through the
    fourth: the five fetched are settled but the fifth (unless acked singly), which comes back redelivered."""
    q, conn, ch = env.queue_and_channel(bodies(6))
    got = _get_n(ch, q, 5)
    ch.basic_ack(got[single][0])
    ch.basic_ack(got[3][0], multiple=True)
    pika_sync(ch)
    ch.close()
    ch = conn.channel()
    expected = ([] if single == 4 else [(True, b"m5")]) + [(False, b"m6")]
    rest = [(m.redelivered, b) for m, _p, b in (ch.basic_get(q, auto_ack=True) for _ in expected)]
    assert rest == expected
    assert ch.basic_get(q) == (None, None, None)


def test_ack_zero_multiple_acks_everything_outstanding(env):
    q, conn, ch = env.queue_and_channel(bodies(4))
    _get_n(ch, q, 4)
    ch.basic_ack(0, multiple=True)
    pika_sync(ch)
    ch.close()
    assert queue_counts(env.url, q) == (0, 0)


def test_nack_multiple_requeue_keeps_original_order(env):
    q, conn, ch = env.queue_and_channel(bodies(4))
    got = _get_n(ch, q, 3)
    ch.basic_nack(got[-1][0], multiple=True, requeue=True)
    again = [(m.redelivered, b) for m, _p, b in (ch.basic_get(q, auto_ack=True) for _ in range(4))]
    assert again == [(True, b"m1"), (True, b"m2"), (True, b"m3"), (False, b"m4")]


def test_requeued_messages_return_to_their_original_position(env):
    q, conn, ch = env.queue_and_channel(bodies(5))
    (t1, _), (_t2, _), (t3, _) = _get_n(ch, q, 3)
    ch.basic_reject(t3, requeue=True)
    ch.basic_reject(t1, requeue=True)
    again = [(m.redelivered, b) for m, _p, b in (ch.basic_get(q, auto_ack=True) for _ in range(4))]
    assert again == [(True, b"m1"), (True, b"m3"), (False, b"m4"), (False, b"m5")]
    assert ch.basic_get(q) == (None, None, None)  # m2 is still unacked


def test_reject_requeue_to_consumer_sets_redelivered(env):
    q, conn, ch = env.queue_and_channel([b"only"])
    got = Collector()
    ch.basic_consume(q, got)
    pump(conn, lambda: len(got) >= 1)
    ch.basic_reject(got.tags[0], requeue=True)
    pump(conn, lambda: len(got) >= 2)
    assert got.bodies == [b"only", b"only"]
    assert got.redelivered == [False, True]
    assert got.tags[1] > got.tags[0]


@pytest.mark.parametrize("how", ["nack", "nack-multiple", "reject"])
def test_nack_or_reject_without_requeue_discards(env, how):
    q, conn, ch = env.queue_and_channel(bodies(2))
    got = _get_n(ch, q, 2)
    if how == "nack":
        ch.basic_nack(got[0][0], requeue=False)
        ch.basic_nack(got[1][0], requeue=False)
    elif how == "nack-multiple":
        ch.basic_nack(got[1][0], multiple=True, requeue=False)
    else:
        ch.basic_reject(got[0][0], requeue=False)
        ch.basic_reject(got[1][0], requeue=False)
    pika_sync(ch)
    ch.close()
    assert queue_counts(env.url, q) == (0, 0)


def test_nack_and_reject_with_py_amqp(env):
    q, conn, ch = env.queue_and_channel(bodies(3), client="amqp")
    msgs = [ch.basic_get(q) for _ in range(3)]
    amqp_nack(ch, msgs[1].delivery_tag, multiple=True, requeue=True)  # m1, m2 back
    ch.basic_reject(msgs[2].delivery_tag, requeue=False)              # m3 dropped
    amqp_sync(ch)
    again = [ch.basic_get(q, no_ack=True) for _ in range(3)]
    assert [(m.body, m.delivery_info["redelivered"]) for m in again[:2]] == [(b"m1", True), (b"m2", True)]
    assert again[2] is None


@pytest.mark.parametrize("method", ["ack", "ack-multiple", "nack", "reject"])
def test_unknown_delivery_tag_is_406(env, method):
    q, conn, ch = env.queue_and_channel([b"x"])
    ch.basic_get(q)  # tag 1 outstanding

    def go():
        if method == "ack":
            ch.basic_ack(7)
        elif method == "ack-multiple":
            ch.basic_ack(7, multiple=True)
        elif method == "nack":
            ch.basic_nack(7)
        else:
            ch.basic_reject(7)
        pika_sync(ch)

    assert expect_close(go) == ("channel", 406)
    assert conn.is_open
    # the channel's unacked message went back to the queue
    assert wait_until(lambda: queue_counts(env.url, q) == (1, 0))


def test_unknown_delivery_tag_py_amqp(env):
    conn = env.amqp()
    ch = conn.channel()

    def go():
        ch.basic_ack(1)
        amqp_sync(ch)

    assert expect_close(go, conn) == ("channel", 406)
    assert conn.connected


def test_double_ack_is_406(env):
    q, conn, ch = env.queue_and_channel([b"x"])
    method, _p, _b = ch.basic_get(q)
    ch.basic_ack(method.delivery_tag)
    pika_sync(ch)

    def go():
        ch.basic_ack(method.delivery_tag)
        pika_sync(ch)

    assert expect_close(go) == ("channel", 406)
    assert queue_counts(env.url, q) == (0, 0)


def test_ack_of_a_no_ack_delivery_is_406(env):
    q, conn, ch = env.queue_and_channel([b"x"])
    method, _p, _b = ch.basic_get(q, auto_ack=True)

    def go():
        ch.basic_ack(method.delivery_tag)
        pika_sync(ch)

    assert expect_close(go) == ("channel", 406)


def test_delivery_tags_are_per_channel(env):
    q = env.queue()
    env.publish(q, bodies(2))
    conn = env.pika()
    ch1, ch2 = conn.channel(), conn.channel()
    m1, _p, _b = ch1.basic_get(q)
    m2, _p, _b = ch2.basic_get(q)
    assert (m1.delivery_tag, m2.delivery_tag) == (1, 1)
    ch2.basic_ack(1)
    pika_sync(ch2)

    def go():
        ch2.basic_ack(1)  # ch1's tag 1 is not ch2's to ack
        pika_sync(ch2)

    assert expect_close(go) == ("channel", 406)
    assert ch1.is_open
    ch1.basic_ack(1)
    pika_sync(ch1)
    assert queue_counts(env.url, q) == (0, 0)


# ---------------------------------------------------------------------------------------- recover


def test_recover_requeue_redelivers_unacked_to_consumer(env):
    q, conn, ch = env.queue_and_channel(bodies(3))
    got = Collector()
    ch.basic_consume(q, got)
    pump(conn, lambda: len(got) >= 3)
    ch.basic_ack(got.tags[0])
    ch.basic_recover(requeue=True)
    pump(conn, lambda: len(got) >= 5)
    settle(conn)
    assert got.bodies == [b"m1", b"m2", b"m3", b"m2", b"m3"]
    assert got.redelivered == [False, False, False, True, True]
    ch.basic_ack(0, multiple=True)
    pika_sync(ch)
    ch.close()
    assert queue_counts(env.url, q) == (0, 0)


def test_recover_requeue_py_amqp_after_get(env):
    q, conn, ch = env.queue_and_channel(bodies(2), client="amqp")
    assert [ch.basic_get(q).body for _ in range(2)] == bodies(2)
    ch.basic_recover(requeue=True)
    again = [ch.basic_get(q, no_ack=True) for _ in range(2)]
    assert [(m.body, m.delivery_info["redelivered"]) for m in again] == [(b"m1", True), (b"m2", True)]


def test_recover_without_requeue_is_not_implemented(env):
    conn = env.pika()
    ch = conn.channel()
    assert expect_close(lambda: ch.basic_recover(requeue=False)) == ("connection", 540)


# ------------------------------------------------------------------------------------- properties

HEADERS = {
    "str": "héllo wörld",
    "empty": "",
    "int": 42,
    "neg": -7,
    "big": 2 ** 40,
    "true": True,
    "false": False,
    "none": None,
    "bytes": b"\x00\x01\xfe\xff",
    "decimal": decimal.Decimal("12.34"),
    "datetime": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
    "nested": {"a": 1, "b": {"c": "d", "e": [1, 2]}},
    "list": [1, "two", True, None, [4, "five"], {"k": "v"}, b"\x07"],
}
# pika cannot encode floats, py-amqp encodes bytes as 'S' (decoded back to str): each client gets its own mix
AMQP_HEADERS = {k: v for k, v in HEADERS.items() if k not in ("bytes", "list")}
AMQP_HEADERS.update({"float": 3.25, "list": [1, "two", 3.5, True, None, [4, "five"], {"k": "v"}]})

PROPS = dict(
    content_type="application/json",
    content_encoding="gzip",
    headers=HEADERS,
    delivery_mode=2,
    priority=7,
    correlation_id="corr-1",
    reply_to="reply.queue",
    expiration="600000",
    message_id="msg-1",
    timestamp=1_700_000_000,
    type="event.type",
    user_id="guest",
    app_id="the-app",
    cluster_id="cluster-9",
)

PROP_NAMES = list(PROPS)


def _pika_props(props) -> dict:
    return {name: getattr(props, name) for name in PROP_NAMES}


def test_all_properties_and_header_types_round_trip_pika(env):
    q, conn, ch = env.queue_and_channel()
    body = bytes(range(256)) * 3
    ch.basic_publish("", q, body, pika.BasicProperties(**PROPS))
    ch.basic_publish("", q, body, pika.BasicProperties(**PROPS))
    ch.basic_publish("", q, b"", pika.BasicProperties())  # no properties at all, empty body
    pika_sync(ch)
    _m, props_get, body_get = ch.basic_get(q, auto_ack=True)
    got = Collector()
    ch.basic_consume(q, got, auto_ack=True)
    pump(conn, lambda: len(got) >= 2)
    assert body_get == body and got.bodies[0] == body
    assert _pika_props(props_get) == PROPS
    assert _pika_props(got.items[0][4]) == PROPS
    assert got.bodies[1] == b""
    assert _pika_props(got.items[1][4]) == dict.fromkeys(PROP_NAMES)


def test_all_properties_round_trip_py_amqp(env):
    q, conn, ch = env.queue_and_channel(client="amqp")
    props = dict(PROPS)
    props["application_headers"] = props.pop("headers")
    props["application_headers"] = dict(AMQP_HEADERS)
    msg = amqp.Message(b"\x00payload\xff", **props)
    ch.basic_publish(msg, exchange="", routing_key=q)
    got = ch.basic_get(q, no_ack=True)
    assert got.body == b"\x00payload\xff"
    received = dict(got.properties)
    expected = dict(props)
    expected["application_headers"] = dict(props["application_headers"])
    hdr = received.get("application_headers", {})
    if isinstance(hdr.get("datetime"), datetime.datetime) and hdr["datetime"].tzinfo is None:
        expected["application_headers"]["datetime"] = AMQP_HEADERS["datetime"].replace(tzinfo=None)
    assert received == expected


# ------------------------------------------------------------------- raw content header pass-through


def _lstr(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def _sstr(b: bytes) -> bytes:
    return bytes([len(b)]) + b


def _field(name: bytes, tag: bytes, payload: bytes) -> bytes:
    return _sstr(name) + tag + payload


def _raw_header_table() -> bytes:
    inner = _field(b"k", b"S", _lstr(b"v")) + _field(b"n", b"b", struct.pack(">b", -1))
    array = b"I" + struct.pack(">i", 1) + b"S" + _lstr(b"x") + b"t\x00" + b"V" + b"F" + _lstr(inner)
    return b"".join([
        _field(b"bool", b"t", b"\x01"),
        _field(b"i8", b"b", struct.pack(">b", -5)),
        _field(b"u8", b"B", struct.pack(">B", 250)),
        _field(b"i16", b"s", struct.pack(">h", -300)),
        _field(b"u16", b"u", struct.pack(">H", 60000)),
        _field(b"i32", b"I", struct.pack(">i", -70000)),
        _field(b"u32", b"i", struct.pack(">I", 4_000_000_000)),
        _field(b"i64", b"l", struct.pack(">q", -(2 ** 40))),
        _field(b"f32", b"f", struct.pack(">f", 1.5)),
        _field(b"f64", b"d", struct.pack(">d", 2.25)),
        _field(b"dec", b"D", struct.pack(">Bi", 2, 12345)),
        _field(b"str", b"S", _lstr("héllo".encode())),
        _field(b"bin", b"x", _lstr(b"\x00\xff\x01")),
        _field(b"ts", b"T", struct.pack(">Q", 1_700_000_000)),
        _field(b"void", b"V", b""),
        _field(b"arr", b"A", _lstr(array)),
        _field(b"tbl", b"F", _lstr(inner)),
    ])


def _raw_content_header(body_size: int) -> bytes:
    """A content header payload with every basic property set, encoded by hand."""
    props = b"".join([
        _sstr(b"text/plain"), _sstr(b"utf-8"), _lstr(_raw_header_table()), b"\x02", b"\x05",
        _sstr(b"corr"), _sstr(b"reply"), _sstr(b"600000"), _sstr(b"mid"), struct.pack(">Q", 1_600_000_000),
        _sstr(b"type"), _sstr(b"guest"), _sstr(b"app"), _sstr(b"cluster"),
    ])
    return struct.pack(">HHQH", 60, 0, body_size, 0xFFFC) + props


def _sorted_table_header(header: bytes) -> bytes:
    """`header` (the content header above) with its headers table sorted by key, as 4.x delivers it."""
    from spark_amqp.codec import fields, properties

    raw = properties.split(header[12:])
    items = fields.table_items(raw["headers"])
    raw["headers"] = fields.table_from_items(sorted(items, key=lambda kv: kv[0].encode()))
    return header[:12] + properties.join(raw)


def test_content_header_bytes_pass_through_unchanged(env, rabbitmq_version):
    """Byte for byte on 3.10; 4.x sorts the headers table by key and leaves every other byte as sent."""
    q = env.queue()
    rc, _tune = raw_handshake(env.url)
    try:
        rc.send_bytes(raw_frame(1, 1, raw_method(20, 10, _sstr(b""))))  # channel.open
        ftype, _c, payload = read_raw_frame(rc)
        assert (ftype, payload[:4]) == (1, raw_method(20, 11))
        body = b"raw body \x00\xff"
        header = _raw_content_header(len(body))
        publish = raw_method(60, 40, struct.pack(">H", 0) + _sstr(b"") + _sstr(q.encode()) + b"\x00")
        rc.send_bytes(raw_frame(1, 1, publish) + raw_frame(2, 1, header) + raw_frame(3, 1, body))
        # basic.consume no-ack, tag "t"
        consume = raw_method(60, 20, struct.pack(">H", 0) + _sstr(q.encode()) + _sstr(b"t") + b"\x02"
                          + _lstr(b""))
        rc.send_bytes(raw_frame(1, 1, consume))
        frames = []
        while len(frames) < 4:
            frames.append(read_raw_frame(rc))
        (t0, _, consume_ok), (t1, _, deliver), (t2, _, got_header), (t3, _, got_body) = frames
        assert (t0, consume_ok[:4]) == (1, raw_method(60, 21))
        assert (t1, deliver[:4]) == (1, raw_method(60, 60))
        assert (t2, t3) == (2, 3)
        assert got_header == (header if rabbitmq_version == "3.10" else _sorted_table_header(header))
        assert got_body == body
    finally:
        rc.close()


def test_properties_decoded_identically_by_both_brokers(request, rabbitmq_url, unique_name):
    """The same message through RabbitMQ and through the embedded broker decodes to the same properties."""
    embedded_url = request.getfixturevalue("amqp_broker").url
    results = []
    for url in (rabbitmq_url, embedded_url):
        e = Env(url, unique_name)
        try:
            q = e.queue()
            ch = e.admin()
            ch.basic_publish("", q, b"same", pika.BasicProperties(**PROPS))
            pika_sync(ch)
            method, props, body = ch.basic_get(q, auto_ack=True)
            results.append((method.redelivered, method.exchange, method.message_count, body,
                            _pika_props(props)))
        finally:
            e.close()
    assert results[0] == results[1]
