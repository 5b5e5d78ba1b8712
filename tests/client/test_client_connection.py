"""Connection lifecycle over real TCP, against the embedded broker and RabbitMQ (`broker_url`).

Covers: open/close, authentication and vhost errors with the broker's reply codes, unreachable hosts,
heartbeats kept alive by the reader thread while the caller sleeps, and every kind of connection loss
(broker stopped, socket reset, network partition = missed heartbeats) making blocked calls raise promptly.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest

from brokers import cut_connections, free_port
from client_helpers import Blocked
from proxies import Proxy
from spark_amqp.client import (AuthenticationError, ChannelClosedError, ConnectError, Connection,
                               ConnectionClosedError, ConnectionLostError)
from spark_amqp_broker import Broker
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)

SECRET = "Wr0ng-PASSWORD-must-not-leak"


def with_password(url: str, password: str) -> str:
    head, _, rest = url.partition("@")
    scheme_user = head.rpartition(":")[0]
    return f"{scheme_user}:{password}@{rest}"


def exception_texts(exc: BaseException) -> str:
    """Everything a user or a log could print about an exception, along its whole chain."""
    parts = []
    while exc is not None:
        parts += [str(exc), repr(exc), repr(exc.args)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def test_open_and_close(broker_url, broker_kind, unique_name):
    conn = Connection.open(broker_url)
    assert conn.is_open
    caps = conn.server_properties["capabilities"]
    for cap in ("publisher_confirms", "basic.nack", "consumer_cancel_notify", "connection.blocked",
                "authentication_failure_close"):
        assert caps.get(cap) is True, cap
    assert conn.heartbeat == 60 and conn.frame_max == 131072 and conn.channel_max == 2047
    ch = conn.channel()
    assert ch.is_open and ch.number == 1
    assert conn.channel().number == 2
    ch.close()
    assert not ch.is_open
    ch = conn.channel()
    assert ch.number == 1  # a closed channel's number is free again
    conn.close()
    assert not conn.is_open and not ch.is_open
    assert conn.error.reply_code == 200
    with pytest.raises(ConnectionClosedError) as info:
        ch.queue_declare(unique_name(), exclusive=True)
    assert info.value.reply_code == 200
    with pytest.raises(ConnectionClosedError):
        conn.channel()
    conn.close()  # idempotent


def test_context_manager_closes(broker_url, unique_name):
    with Connection.open(broker_url) as conn:
        with conn.channel() as ch:
            ch.queue_declare(unique_name(), exclusive=True)
        with pytest.raises(ChannelClosedError) as info:
            ch.queue_declare(unique_name(), exclusive=True)
        assert info.value.reply_code == 200
    assert not conn.is_open


def test_uri_query_parameters_are_negotiated(broker_url):
    with Connection.open(broker_url + "?heartbeat=7&frame_max=8192&channel_max=5") as conn:
        assert (conn.heartbeat, conn.frame_max, conn.channel_max) == (7, 8192, 5)
    # explicit keyword arguments win over the URI
    with Connection.open(broker_url + "?heartbeat=7", heartbeat=9) as conn:
        assert conn.heartbeat == 9


def test_bad_password_is_403_without_the_password(broker_url, caplog):
    caplog.set_level(logging.DEBUG)
    started = time.monotonic()
    with pytest.raises(AuthenticationError) as info:
        Connection.open(with_password(broker_url, SECRET))
    assert time.monotonic() - started < 5
    assert info.value.reply_code == 403
    assert "ACCESS_REFUSED" in info.value.reply_text
    assert isinstance(info.value, ConnectionClosedError)
    assert SECRET not in exception_texts(info.value)
    assert SECRET not in caplog.text


def test_unknown_vhost_is_530(broker_url):
    url = broker_url.rsplit("/", 1)[0] + "/no-such-vhost"
    with pytest.raises(ConnectionClosedError) as info:
        Connection.open(url)
    assert type(info.value) is ConnectionClosedError
    assert info.value.reply_code == 530
    assert "NOT_ALLOWED" in info.value.reply_text and "no-such-vhost" in info.value.reply_text


def test_unreachable_port_fails_fast():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConnectError) as info:
        Connection.open(f"amqp://guest:{SECRET}@127.0.0.1:{port}/%2F")
    assert time.monotonic() - started < 2
    assert str(port) in str(info.value) and SECRET not in exception_texts(info.value)


def test_silent_server_hits_connect_timeout():
    """A TCP peer that accepts but never answers the protocol header: bounded by connect_timeout."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ConnectError, match="connection.start"):
            Connection.open(f"amqp://guest:guest@127.0.0.1:{port}/%2F?connection_timeout=500")
        assert 0.4 < time.monotonic() - started < 2


def test_percent_encoded_credentials_reach_the_broker():
    user, password = "us@er:1", "p@ss/w:rd%?#"
    with Broker(port=0, users={user: password}) as broker:
        url = f"amqp://us%40er%3A1:p%40ss%2Fw%3Ard%25%3F%23@127.0.0.1:{broker.port}/%2F"
        with Connection.open(url) as conn:
            assert conn.channel().queue_declare("", exclusive=True).name.startswith("amq.gen-")
            assert "p@ss" not in repr(conn) and "***" in repr(conn)


def test_heartbeats_answered_while_the_caller_sleeps(connect, unique_name):
    conn = connect(heartbeat=1)
    assert conn.heartbeat == 1
    ch = conn.channel()
    q = ch.queue_declare(unique_name(), exclusive=True).name
    # > two heartbeat intervals without a single call from this thread. A client that stays silent is
    # dropped by RabbitMQ 3.10 after 3.0 s (TCP reset) and by the embedded broker after 2.0 s (FIN):
    # see the control test below; 3.5 s is past both.
    time.sleep(3.5)
    assert conn.is_open
    assert ch.queue_declare(q, passive=True).message_count == 0


def test_silent_client_is_dropped(connect, unique_name):
    """Control for the test above: with our heartbeats switched off, the broker does drop us, and the
    blocked caller learns it. (Without this, the test above could pass against a broker that never
    checks heartbeats.)"""
    conn = connect(heartbeat=1)
    conn._send_heartbeat = lambda: None
    ch = conn.channel()
    ch.basic_consume(ch.queue_declare(unique_name(), exclusive=True).name)
    error, elapsed = Blocked(lambda: ch.get_deliveries(10, timeout=15)).join(15)
    assert isinstance(error, ConnectionClosedError), error
    assert elapsed < 8


def test_broker_stopped_wakes_a_blocked_consumer(unique_name):
    broker = Broker(port=0).start()
    try:
        conn = Connection.open(broker.url)
        ch = conn.channel()
        ch.basic_consume(ch.queue_declare(unique_name(), exclusive=True).name)
        blocked = Blocked(lambda: ch.get_deliveries(10, timeout=30))
        time.sleep(0.2)
        broker.stop()
        error, elapsed = blocked.join(10)
        assert isinstance(error, ConnectionClosedError), error
        assert elapsed < 3
        assert not conn.is_open
        with pytest.raises(ConnectionClosedError):
            ch.basic_ack(1)
        conn.close()  # closing a dead connection does not raise
    finally:
        broker.stop()


def through_proxy(broker_url: str, **kw):
    proxy = Proxy.to(broker_url)
    return proxy, Connection.open(proxy.url_for(broker_url), **kw)


def test_socket_reset_wakes_blocked_calls(broker_url, unique_name):
    proxy, conn = through_proxy(broker_url)
    try:
        consumer = conn.channel()
        consumer.basic_consume(consumer.queue_declare(unique_name(), exclusive=True).name)
        get = Blocked(lambda: consumer.get_deliveries(10, timeout=30))
        time.sleep(0.2)
        proxy.kill()
        error, elapsed = get.join(10)
        assert isinstance(error, ConnectionLostError), error
        assert error.reply_code is None and elapsed < 2
    finally:
        proxy.kill()
        conn.close(timeout=1)


def close_from_the_broker(request, broker_kind: str, name: str) -> None:
    """connection.close 320 CONNECTION_FORCED from the broker to the connection named `name`: the embedded
    broker's `force_close`, or `rabbitmqctl close_connection` on RabbitMQ."""
    if broker_kind == "embedded":
        broker = request.getfixturevalue("amqp_broker")
        closed = broker.call(lambda core: [c.force_close("closed by the client tests") for c in list(core.connections)
                                           if (c.client_properties or {}).get("connection_name") == name],
                             broker.core)
        assert len(closed) == 1
    else:
        assert cut_connections(None, embedded=None, rabbitmq=lambda row: name in row["client_properties"],
                               columns=["client_properties"], reason="closed by the client tests") == 1


def test_a_broker_close_wakes_a_publisher_stuck_in_a_slow_send(request, broker_url, broker_kind, unique_name):
    """The broker closes the connection while a publisher is blocked in a send that a slow link holds up:
    the publisher hears the broker's 320 at once, not when its send ends (the reader answers close-ok only
    if it can take the write lock within a second)."""
    name = unique_name("slow-link")
    proxy = Proxy.to(broker_url, rate=20_000)
    conn = Connection.open(proxy.url_for(broker_url), client_properties={"connection_name": name})
    try:
        ch = conn.channel()
        q = ch.queue_declare(unique_name(), exclusive=True).name
        chunk = [b"x" * 100_000] * 10

        def publish_until_it_fails():
            while True:
                ch.publish_many("", q, chunk)

        publishing = Blocked(publish_until_it_fails)
        time.sleep(1.0)   # the socket buffers fill: the publisher now waits in sendall
        assert publishing.elapsed is None, publishing.error
        close_from_the_broker(request, broker_kind, name)
        closed_at = time.monotonic()
        error, _ = publishing.join(15)
        assert isinstance(error, ConnectionClosedError) and error.reply_code == 320, error
        assert "closed by the client tests" in str(error)
        assert time.monotonic() - closed_at < 4
    finally:
        proxy.kill()
        conn.close(timeout=1)


def test_missed_heartbeats_wake_blocked_calls(broker_url, unique_name):
    """A network partition: no RST, no FIN, just silence. Spec 4.2.7: after two heartbeat intervals
    without traffic the connection is dead; every blocked call (a consumer waiting, a publisher waiting
    for window space, an RPC waiting for its reply) must raise."""
    proxy, conn = through_proxy(broker_url, heartbeat=1)
    try:
        consumer = conn.channel()
        q = consumer.queue_declare(unique_name(), exclusive=True).name
        consumer.basic_consume(q)
        publisher = conn.channel()
        publisher.confirm_select(window=1)
        rpc_channel = conn.channel()
        proxy.freeze()
        publisher.publish("", q, b"one")  # fills the window: its confirm cannot come back
        calls = [Blocked(lambda: consumer.get_deliveries(10, timeout=30)),
                 Blocked(lambda: publisher.publish("", q, b"two")),
                 Blocked(lambda: rpc_channel.queue_declare(q, passive=True))]
        for call in calls:
            error, elapsed = call.join(10)
            assert isinstance(error, ConnectionLostError), error
            assert "missed heartbeats" in str(error)
            assert 1.5 < elapsed < 4
    finally:
        proxy.kill()
        conn.close(timeout=1)


def test_connection_blocked_and_unblocked_are_tracked():
    """Embedded broker only (RabbitMQ's memory alarm cannot be raised on the shared server): crossing
    the memory high-watermark sends connection.blocked to publishers that announced the capability,
    and connection.unblocked once back below."""
    with Broker(port=0, memory_high_watermark=4096) as broker:
        with Connection.open(broker.url) as publisher, Connection.open(broker.url) as admin:
            assert publisher.blocked is None
            ch = publisher.channel()
            q = ch.queue_declare("big").name
            for _ in range(10):
                ch.publish("", q, b"x" * 1000)
            wait_until(lambda: publisher.blocked is not None, message="connection.blocked")
            assert "memory" in publisher.blocked
            admin_ch = admin.channel()
            purged = [admin_ch.queue_purge(q)]
            assert purged[0] >= 5  # what crossed the watermark (the broker may hold the rest unread)

            def drained():  # held-back messages arrive once the alarm clears; purge until all are gone
                purged.append(admin_ch.queue_purge(q))
                return sum(purged) == 10 and publisher.blocked is None

            wait_until(drained, message="connection.unblocked and every message published while blocked")
            # Blocked again: a blocked connection's socket is not read (RabbitMQ's rule, which the
            # embedded broker follows), so close() cannot get its close-ok; it must still return in time.
            for _ in range(10):
                ch.publish("", q, b"x" * 1000)
            wait_until(lambda: publisher.blocked is not None, message="a second connection.blocked")
            started = time.monotonic()
            publisher.close(timeout=0.5)
            assert time.monotonic() - started < 2 and not publisher.is_open


def test_connection_that_never_published_is_not_blocked():
    with Broker(port=0, memory_high_watermark=4096) as broker:
        with Connection.open(broker.url) as publisher, Connection.open(broker.url) as consumer:
            ch = publisher.channel()
            q = ch.queue_declare("big").name
            for _ in range(10):
                ch.publish("", q, b"x" * 1000)
            wait_until(lambda: publisher.blocked is not None, message="connection.blocked")
            consumer.channel().queue_declare(q, passive=True)  # a round trip after the alarm
            blocked = consumer.blocked
            purger = consumer.channel()
            purged = []

            def drained():  # unblock, so that the publisher closes promptly
                purged.append(purger.queue_purge(q))
                return sum(purged) == 10 and publisher.blocked is None

            wait_until(drained, message="connection.unblocked")
            assert blocked is None


def _queue_of(conn, unique_name, count: int) -> str:
    """A queue holding `count` messages, published and confirmed on a channel of its own."""
    publisher = conn.channel()
    publisher.confirm_select()
    q = publisher.queue_declare(unique_name(), exclusive=True).name
    for i in range(count):
        publisher.publish("", q, b"m%d" % i)
    publisher.wait_for_confirms(timeout=5)
    return q


def test_reading_paused_leaves_deliveries_in_the_socket_until_the_block_ends(connect, unique_name):
    """While the block runs, what the broker sends stays in the socket; at its end it is all read."""
    conn = connect()
    q = _queue_of(conn, unique_name, 200)
    ch = conn.channel()
    with conn.reading_paused(most=5):
        ch.basic_consume(q, nowait=True)    # no consume-ok to wait for: the reader is paused
        time.sleep(0.5)                     # the broker has sent them all by now (control: below)
        assert ch.pending_deliveries == 0
    wait_until(lambda: ch.pending_deliveries == 200, timeout=5)
    deliveries = ch.get_deliveries(200)
    assert [d.body for d in deliveries] == [b"m%d" % i for i in range(200)]


@pytest.mark.parametrize("heartbeat, most, bound", [(0, 0.3, 0.3), (1, 10, 0.25)],
                         ids=["its own bound", "a quarter of the heartbeat"])
def test_a_pause_ends_by_itself_at_its_bound(connect, unique_name, heartbeat, most, bound):
    """A block that outlasts the pause's bound finds the reader reading again: a pause never starves the
    heartbeats or the broker for long."""
    conn = connect(heartbeat=heartbeat)
    q = _queue_of(conn, unique_name, 50)
    ch = conn.channel()
    with conn.reading_paused(most=most):
        t0 = time.monotonic()
        ch.basic_consume(q, nowait=True)
        wait_until(lambda: ch.pending_deliveries == 50, timeout=5)
        elapsed = time.monotonic() - t0
    assert bound - 0.05 <= elapsed < bound + 1.0, elapsed
