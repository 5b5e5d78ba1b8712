"""Publishing with pipelined confirms, nacks and mandatory returns, against both brokers (`broker_url`).

This is what the sink does on every executor: confirm_select, publish rows with a bounded window of
unconfirmed messages, wait_for_confirms, and fail the task on a nack or a basic.return.
"""

from __future__ import annotations

import time

import pytest

from client_helpers import Blocked
from proxies import Proxy
from spark_amqp.client import (AMQPTimeoutError, ChannelClosedError, Connection, PublishNackedError,
                               UnroutableError)
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def test_ten_thousand_confirmed_with_a_window(channel, unique_name):
    q = channel.queue_declare(unique_name(), exclusive=True).name
    channel.confirm_select(window=500)
    most_in_flight = 0
    seqs = []
    for i in range(10_000):
        seqs.append(channel.publish("", q, b"message %05d" % i))
        most_in_flight = max(most_in_flight, channel.unconfirmed)
    assert seqs == list(range(1, 10_001))  # the broker's confirm numbering (delivery tags)
    assert most_in_flight <= 500
    assert channel.wait_for_confirms(timeout=30) == 10_000
    assert channel.unconfirmed == 0
    assert channel.queue_declare(q, passive=True).message_count == 10_000
    first = channel.basic_get(q, no_ack=True)
    assert first.body == b"message 00000"


def test_publish_many_keeps_order_window_and_properties(channel, unique_name):
    """publish_many writes messages in groups: the same messages, in order, within the window."""
    from spark_amqp.client import encode_properties

    q = channel.queue_declare(unique_name(), exclusive=True).name
    channel.confirm_select(window=100)
    bodies = [b"m%05d" % i for i in range(5_000)]
    props = [encode_properties({"message_id": str(i), "headers": {"n": i}}) for i in range(5_000)]
    assert channel.publish_many("", q, bodies[:10]) == 10              # no properties
    assert channel.unconfirmed <= 100
    assert channel.publish_many("", q, bodies[10:], props[10:]) == 4_990
    assert channel.unconfirmed <= 100
    assert channel.wait_for_confirms(timeout=30) == 5_000
    channel.basic_consume(q, no_ack=True)
    got = []
    while len(got) < 5_000:
        got += channel.get_deliveries(5_000, timeout=10)
    assert [d.body for d in got] == bodies
    assert got[0].properties_raw == b"\x00\x00"
    assert [d.properties_raw for d in got[10:]] == props[10:]


def test_publish_blocks_while_the_window_is_full(broker_url, unique_name):
    """Hold the broker's confirms back (a frozen relay): the publish past the window blocks, a publish
    with a timeout raises, wait_for_confirms times out naming what is outstanding; once the confirms
    flow again everything completes."""
    proxy = Proxy.to(broker_url)
    conn = Connection.open(proxy.url_for(broker_url))
    try:
        ch = conn.channel()
        q = ch.queue_declare(unique_name(), exclusive=True).name
        ch.confirm_select(window=2)
        proxy.freeze()
        ch.publish("", q, b"1")
        ch.publish("", q, b"2")
        with pytest.raises(AMQPTimeoutError, match="window 2"):
            ch.publish("", q, b"3", timeout=0.2)
        with pytest.raises(AMQPTimeoutError, match="2 of 2"):
            ch.wait_for_confirms(timeout=0.2)
        blocked = Blocked(lambda: ch.publish("", q, b"3"))
        time.sleep(0.5)
        assert blocked.elapsed is None  # still blocked
        proxy.thaw()
        error, elapsed = blocked.join(10)
        assert error is None and blocked.result == 3
        assert ch.wait_for_confirms(timeout=10) == 3
        assert ch.queue_declare(q, passive=True).message_count == 3
    finally:
        conn.close(timeout=2)
        proxy.kill()


def test_nacks_on_reject_publish_overflow(channel, unique_name):
    name = unique_name()
    channel.queue_declare(name, arguments={"x-max-length": 2, "x-overflow": "reject-publish",
                                           "x-expires": 60000})
    try:
        channel.confirm_select(window=100)
        for i in range(5):
            channel.publish("", name, b"%d" % i)
        with pytest.raises(PublishNackedError) as info:
            channel.wait_for_confirms(timeout=10)
        assert (info.value.nacked, info.value.published) == (3, 5)
        assert "nacked 3 of 5" in str(info.value)
        assert channel.queue_declare(name, passive=True).message_count == 2
        # the error was reported once; the channel goes on
        channel.queue_purge(name)
        channel.publish("", name, b"fits")
        assert channel.wait_for_confirms(timeout=10) == 1
    finally:
        channel.queue_delete(name)


def test_mandatory_return_names_exchange_and_routing_key(channel, unique_name):
    exchange = unique_name("direct")
    channel.exchange_declare(exchange, "direct", auto_delete=True)
    q = channel.queue_declare(unique_name(), exclusive=True).name
    channel.queue_bind(q, exchange, "bound")
    channel.confirm_select()
    channel.publish(exchange, "bound", b"routed", mandatory=True)
    channel.publish(exchange, "unbound.key", b"lost", mandatory=True)
    channel.publish(exchange, "unbound.key", b"dropped silently")  # not mandatory: no return
    with pytest.raises(UnroutableError) as info:
        channel.wait_for_confirms(timeout=10)
    err = info.value
    assert (err.reply_code, err.exchange, err.routing_key, err.count) == (312, exchange, "unbound.key", 1)
    assert "NO_ROUTE" in err.reply_text
    assert exchange in str(err) and "unbound.key" in str(err)
    assert channel.queue_declare(q, passive=True).message_count == 1
    channel.publish("", "no-such-queue-" + exchange, b"x", mandatory=True)  # default exchange too
    with pytest.raises(UnroutableError) as info:
        channel.wait_for_confirms(timeout=10)
    assert info.value.exchange == "" and info.value.routing_key.startswith("no-such-queue-")


def test_returns_without_confirm_mode(channel):
    channel.publish("", "no-such-queue-xyz-123", b"body", {"message_id": "m"}, mandatory=True)
    returned = wait_until(lambda: channel.take_returns())
    assert [(r.reply_code, r.routing_key, r.body, r.properties.message_id) for r in returned] == \
        [(312, "no-such-queue-xyz-123", b"body", "m")]


def test_publish_to_missing_exchange_closes_the_channel(connect, unique_name):
    conn = connect()
    ch = conn.channel()
    ch.confirm_select()
    ch.publish(unique_name("missing"), "k", b"x")
    with pytest.raises(ChannelClosedError) as info:
        ch.wait_for_confirms(timeout=10)
    assert info.value.reply_code == 404 and info.value.method == "Basic.Publish"
    assert conn.is_open
    with pytest.raises(ChannelClosedError):
        ch.publish("", "k", b"x")
