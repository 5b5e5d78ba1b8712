"""Queues: declare (server-named, passive, durable, exclusive, auto-delete, equivalence), bind/unbind, purge,
delete (if-unused, if-empty) and the counts the broker reports.

Differential: every test runs against the embedded broker and RabbitMQ 3.10 (``broker_url``) with the same
assertions (RabbitMQ 3.10.8's observed behaviour is the expected one).
"""

from __future__ import annotations

import time

import amqp
import pika
import pika.exceptions
import pytest

from helpers import (amqp_connect, close_outcome, drain_get, pika_connect, queue_counts, queue_exists,
                     safe_close)
from waiting import wait_until


@pytest.fixture
def conn(broker_url):
    c = pika_connect(broker_url)
    yield c
    safe_close(c)


@pytest.fixture
def ch(conn):
    c = conn.channel()
    c.confirm_delivery()
    return c


@pytest.fixture
def declared(ch, unique_name):
    """Factory: declare a named queue and delete it at teardown (on a fresh connection, in case ch died)."""
    names = []

    def make(prefix="q", **kw):
        name = unique_name(prefix)
        ch.queue_declare(name, **kw)
        names.append(name)
        return name

    yield make
    if names:
        url = _url_of(ch.connection)
        c = pika_connect(url)
        try:
            for n in names:
                try:
                    c.channel().queue_delete(n)
                except Exception:
                    pass
        finally:
            safe_close(c)


def _url_of(conn) -> str:
    p = conn._impl.params
    vh = "%2F" if p.virtual_host == "/" else p.virtual_host
    return f"amqp://{p.credentials.username}:{p.credentials.password}@{p.host}:{p.port}/{vh}"


def _get(ch, q, auto_ack=True, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(q, auto_ack=auto_ack)
        if method is not None:
            return method, props, body
        if time.monotonic() > deadline:
            pytest.fail(f"no message in {q} within {timeout}s")
        time.sleep(0.01)


# ----------------------------------------------------------------------------------- server-named


def test_server_named_queue(ch):
    ok1 = ch.queue_declare("", exclusive=True).method
    ok2 = ch.queue_declare("", exclusive=True).method
    assert ok1.queue.startswith("amq.gen-") and len(ok1.queue) > len("amq.gen-")
    assert ok1.queue != ok2.queue
    assert (ok1.message_count, ok1.consumer_count) == (0, 0)
    ch.basic_publish("", ok1.queue, b"x")
    assert _get(ch, ok1.queue)[2] == b"x"


def test_server_named_queue_py_amqp(broker_url):
    conn = amqp_connect(broker_url)
    try:
        ch = conn.channel()
        name, messages, consumers = ch.queue_declare("", exclusive=True)
        assert name.startswith("amq.gen-")
        assert (messages, consumers) == (0, 0)
    finally:
        conn.close()


def test_declaring_amq_gen_name_is_403(conn):
    ch = conn.channel()
    assert close_outcome(lambda: ch.queue_declare("amq.gen-chosen-by-client")) == ("channel", 403)


def test_last_declared_queue_used_for_empty_name(broker_url, unique_name):
    """queue.bind / basic.get / queue.purge with queue="" use the channel's last declared queue."""
    conn = amqp_connect(broker_url)
    try:
        ch = conn.channel()
        x = unique_name("x")
        ch.exchange_declare(x, "direct", auto_delete=True)
        name, _, _ = ch.queue_declare("", exclusive=True)
        ch.queue_bind("", x, "k")
        ch.basic_publish(amqp.Message(b"via-empty-name"), x, "k")
        wait_until(lambda: ch.queue_declare(name, passive=True)[1] == 1)
        msg = ch.basic_get("", no_ack=True)
        assert msg is not None and msg.body == b"via-empty-name"
    finally:
        safe_close(conn)


def test_empty_name_without_declared_queue_is_404(conn):
    ch = conn.channel()
    assert close_outcome(lambda: ch.basic_get("")) == ("channel", 404)
    ch = conn.channel()
    assert close_outcome(lambda: ch.queue_declare("", passive=True)) == ("channel", 404)


# ------------------------------------------------------------------------------------------ passive


def test_passive_missing_is_404(conn, unique_name):
    ch = conn.channel()
    assert close_outcome(lambda: ch.queue_declare(unique_name("missing"), passive=True)) == ("channel", 404)
    assert conn.is_open


def test_passive_existing_returns_counts_and_ignores_properties(ch, declared):
    q = declared(durable=True)
    for i in range(3):
        ch.basic_publish("", q, b"%d" % i)
    ok = ch.queue_declare(q, passive=True, durable=False, auto_delete=True).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (q, 3, 0)


# ----------------------------------------------------------------------------------------- counts


def test_declare_ok_counts_ready_messages_and_consumers(conn, ch, declared):
    q = declared()
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i)
    getter = conn.channel()
    _get(getter, q, auto_ack=False)
    _get(getter, q, auto_ack=False)                      # two unacked
    ok = ch.queue_declare(q).method                      # active re-declare reports counts too
    assert (ok.message_count, ok.consumer_count) == (3, 0)

    q2 = declared()
    c1, c2 = conn.channel(), conn.channel()
    t1 = c1.basic_consume(q2, lambda *a: None)
    c2.basic_consume(q2, lambda *a: None)
    assert ch.queue_declare(q2, passive=True).method.consumer_count == 2
    c1.basic_cancel(t1)
    assert ch.queue_declare(q2, passive=True).method.consumer_count == 1
    getter.close()
    wait_until(lambda: ch.queue_declare(q, passive=True).method.message_count == 5)


# ---------------------------------------------------------------------------------------- durable


def test_durable_queue_declare_and_delete(ch, declared, broker_url):
    q = declared(durable=True)
    ch.queue_declare(q, durable=True)                 # equivalent
    ch.basic_publish("", q, b"p", pika.BasicProperties(delivery_mode=2))
    assert queue_counts(broker_url, q) == (1, 0)
    assert ch.queue_delete(q).method.message_count == 1
    assert not queue_exists(broker_url, q)


# -------------------------------------------------------------------------------------- exclusive


def test_exclusive_queue_locked_for_other_connections(broker_url, ch, unique_name):
    q = ch.queue_declare(unique_name("excl"), exclusive=True).method.queue
    other = pika_connect(broker_url)
    try:
        for fn in (lambda c: c.queue_declare(q, passive=True),
                   lambda c: c.queue_declare(q, exclusive=True),
                   lambda c: c.queue_declare(q),
                   lambda c: c.basic_consume(q, lambda *a: None),
                   lambda c: c.basic_get(q),
                   lambda c: c.queue_purge(q),
                   lambda c: c.queue_delete(q),
                   lambda c: c.queue_bind(q, "amq.direct", "k")):
            oc = other.channel()
            assert close_outcome(lambda: fn(oc)) == ("channel", 405)
        # publishing to it from another connection is allowed
        oc = other.channel()
        oc.confirm_delivery()
        oc.basic_publish("", q, b"from-other", mandatory=True)
        # and unbinding is not checked
        oc.queue_unbind(q, "amq.direct", "k")
    finally:
        safe_close(other)
    assert _get(ch, q)[2] == b"from-other"


def test_exclusive_queue_shared_by_owner_channels(conn, ch, unique_name):
    q = ch.queue_declare(unique_name("excl"), exclusive=True).method.queue
    other_ch = conn.channel()
    assert other_ch.queue_declare(q, exclusive=True).method.queue == q
    assert other_ch.queue_declare(q, passive=True).method.queue == q
    other_ch.basic_publish("", q, b"x")
    ch.close()                                      # closing the declaring channel keeps the queue
    assert _get(other_ch, q)[2] == b"x"


def test_exclusive_queue_redeclared_non_exclusive_by_owner_is_405(conn, ch, unique_name):
    q = ch.queue_declare(unique_name("excl"), exclusive=True).method.queue
    c2 = conn.channel()
    assert close_outcome(lambda: c2.queue_declare(q)) == ("channel", 405)


def test_exclusive_queue_deleted_when_owner_closes(broker_url, unique_name):
    owner = pika_connect(broker_url)
    och = owner.channel()
    q = och.queue_declare(unique_name("excl"), exclusive=True).method.queue
    och.basic_publish("", q, b"lost with its owner")
    owner.close()
    wait_until(lambda: not queue_exists(broker_url, q), message="the exclusive queue to go with its connection")
    # the name is free again
    c = pika_connect(broker_url)
    try:
        cc = c.channel()
        assert cc.queue_declare(q, exclusive=True).method.message_count == 0
    finally:
        safe_close(c)


def test_exclusive_queue_deleted_when_owner_connection_dies(broker_url, unique_name):
    owner = amqp_connect(broker_url)
    och = owner.channel()
    q = unique_name("excl")
    och.queue_declare(q, exclusive=True, auto_delete=False)
    owner.sock.close()                               # no connection.close: the socket just goes away
    try:
        wait_until(lambda: not queue_exists(broker_url, q), message="the exclusive queue to go with its socket")
    finally:
        safe_close(owner)


def test_exclusive_queue_deleted_when_owner_closes_py_amqp(broker_url, unique_name):
    owner = amqp_connect(broker_url)
    q = unique_name("excl")
    owner.channel().queue_declare(q, exclusive=True, auto_delete=False)
    owner.close()
    wait_until(lambda: not queue_exists(broker_url, q))


# ------------------------------------------------------------------------------------ auto-delete


def test_auto_delete_queue_deleted_when_last_consumer_cancels(conn, ch, declared, broker_url):
    q = declared(auto_delete=True)
    c1, c2 = conn.channel(), conn.channel()
    t1 = c1.basic_consume(q, lambda *a: None)
    t2 = c2.basic_consume(q, lambda *a: None)
    c1.basic_cancel(t1)
    assert queue_counts(broker_url, q) == (0, 1)          # one consumer left: still there
    c2.basic_cancel(t2)
    wait_until(lambda: not queue_exists(broker_url, q), message="the auto-delete queue to go with its last consumer")


def test_auto_delete_queue_without_consumers_survives(conn, ch, declared, broker_url):
    q = declared(auto_delete=True)
    ch.basic_publish("", q, b"a")
    assert _get(ch, q)[2] == b"a"                          # basic.get is not a consumer
    conn.process_data_events(time_limit=0.2)
    assert queue_counts(broker_url, q) == (0, 0)


def test_auto_delete_queue_survives_declaring_connection_without_consumers(broker_url, unique_name):
    c = pika_connect(broker_url)
    q = unique_name("ad")
    c.channel().queue_declare(q, auto_delete=True)
    c.close()
    try:
        time.sleep(0.2)
        assert queue_exists(broker_url, q)
    finally:
        c = pika_connect(broker_url)
        c.channel().queue_delete(q)
        safe_close(c)


def test_auto_delete_queue_deleted_when_consumer_channel_closes(conn, ch, declared, broker_url):
    q = declared(auto_delete=True)
    cc = conn.channel()
    cc.basic_consume(q, lambda *a: None)
    cc.close()
    wait_until(lambda: not queue_exists(broker_url, q))


def test_auto_delete_queue_deleted_when_consumer_connection_closes(broker_url, unique_name):
    setup = pika_connect(broker_url)
    q = unique_name("ad")
    setup.channel().queue_declare(q, auto_delete=True)
    consumer = amqp_connect(broker_url)
    try:
        consumer.channel().basic_consume(q, callback=lambda m: None)
        assert queue_counts(broker_url, q) == (0, 1)
        consumer.close()
        wait_until(lambda: not queue_exists(broker_url, q))
    finally:
        safe_close(consumer)
        try:
            setup.channel().queue_delete(q)
        finally:
            safe_close(setup)


# ------------------------------------------------------------------------------------ equivalence

EQUIVALENCE = {
    "durable-added": ({}, dict(durable=True), 406),
    "durable-removed": (dict(durable=True), {}, 406),
    "auto-delete-added": ({}, dict(auto_delete=True), 406),
    "auto-delete-removed": (dict(auto_delete=True), {}, 406),
    "exclusive-added": ({}, dict(exclusive=True), 405),
    "ttl-added": ({}, dict(arguments={"x-message-ttl": 1000}), 406),
    "ttl-removed": (dict(arguments={"x-message-ttl": 1000}), {}, 406),
    "ttl-changed": (dict(arguments={"x-message-ttl": 1000}), dict(arguments={"x-message-ttl": 2000}), 406),
    "max-length-added": ({}, dict(arguments={"x-max-length": 10}), 406),
    "expires-added": ({}, dict(arguments={"x-expires": 100000}), 406),
    "dlx-added": ({}, dict(arguments={"x-dead-letter-exchange": "somewhere"}), 406),
    "max-priority-added": ({}, dict(arguments={"x-max-priority": 5}), 406),
}


@pytest.mark.parametrize("case", list(EQUIVALENCE))
def test_redeclare_not_equivalent(conn, ch, declared, case):
    first, second, code = EQUIVALENCE[case]
    q = declared(**first)
    c2 = conn.channel()
    assert close_outcome(lambda: c2.queue_declare(q, **second)) == ("channel", code)
    assert conn.is_open
    ch.queue_declare(q, **first)          # the original declaration still stands


@pytest.mark.parametrize("args", [
    {"x-message-ttl": 1000},
    {"x-unknown-argument": 1},
], ids=["same-ttl", "unknown-argument"])
def test_redeclare_equivalent_ok(ch, declared, args):
    q = declared(arguments=dict(args))
    ok = ch.queue_declare(q, arguments=dict(args)).method
    assert ok.queue == q


def test_unknown_arguments_are_not_compared(ch, declared):
    q = declared(arguments={"x-foo": 1})
    ch.queue_declare(q, arguments={"x-foo": 2})
    ch.queue_declare(q)
    assert ch.is_open


# ---------------------------------------------------------------------------------- bind / unbind


def test_bind_and_unbind(ch, declared, unique_name):
    x = unique_name("x")
    ch.exchange_declare(x, "direct", auto_delete=True)
    q = declared()
    ch.queue_bind(q, x, "k1")
    ch.queue_bind(q, x, "k1")                    # idempotent
    ch.queue_bind(q, x, "k2")
    ch.basic_publish(x, "k1", b"1")
    ch.basic_publish(x, "k2", b"2")
    ch.queue_unbind(q, x, "k1")
    ch.basic_publish(x, "k1", b"1-after")
    ch.basic_publish(x, "k2", b"2-after")
    assert drain_get(ch, q) == [b"1", b"2", b"2-after"]


def test_unbind_missing_things_is_ok(ch, declared, unique_name):
    q = declared()
    ch.queue_unbind(q, "amq.direct", unique_name("never-bound"))     # missing binding
    ch.queue_unbind(unique_name("no-queue"), "amq.direct", "k")    # missing queue
    ch.queue_unbind(q, unique_name("no-exchange"), "k")             # missing exchange
    assert ch.is_open


def test_bind_missing_is_404(conn, declared, unique_name):
    q = declared()
    c = conn.channel()
    assert close_outcome(lambda: c.queue_bind(q, unique_name("no-exchange"), "k")) == ("channel", 404)
    c = conn.channel()
    assert close_outcome(lambda: c.queue_bind(unique_name("no-queue"), "amq.direct", "k")) == ("channel", 404)


def test_delete_queue_removes_its_bindings(ch, unique_name):
    x = unique_name("x")
    ch.exchange_declare(x, "direct", auto_delete=False)
    q = unique_name("q")
    try:
        ch.queue_declare(q)
        ch.queue_bind(q, x, "k")
        ch.queue_delete(q)
        ch.queue_declare(q)
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish(x, "k", b"nobody", mandatory=True)
        assert ch.queue_declare(q, passive=True).method.message_count == 0
    finally:
        ch.queue_delete(q)
        ch.exchange_delete(x)


# ------------------------------------------------------------------------------------------ purge


def test_purge_returns_count_and_keeps_unacked(conn, ch, declared):
    q = declared()
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i)
    getter = conn.channel()
    _get(getter, q, auto_ack=False)                       # one unacked
    assert ch.queue_purge(q).method.message_count == 4
    assert ch.queue_declare(q, passive=True).method.message_count == 0
    assert ch.queue_purge(q).method.message_count == 0
    getter.close()                                         # the unacked one comes back
    wait_until(lambda: ch.queue_declare(q, passive=True).method.message_count == 1)
    method, _props, body = _get(ch, q)
    assert body == b"0" and method.redelivered


def test_purge_missing_is_404(conn, unique_name):
    ch = conn.channel()
    assert close_outcome(lambda: ch.queue_purge(unique_name("missing"))) == ("channel", 404)


def test_purge_py_amqp(broker_url, unique_name):
    conn = amqp_connect(broker_url, confirm_publish=True)
    try:
        ch = conn.channel()
        q = unique_name("q")
        ch.queue_declare(q, exclusive=True, auto_delete=False)
        for _ in range(3):
            ch.basic_publish(amqp.Message(b"m"), "", q)
        assert ch.queue_purge(q) == 3
    finally:
        safe_close(conn)


# ----------------------------------------------------------------------------------------- delete


def test_delete_returns_ready_message_count(conn, ch, unique_name, broker_url):
    q = unique_name("q")
    ch.queue_declare(q)
    for i in range(4):
        ch.basic_publish("", q, b"%d" % i)
    getter = conn.channel()
    _get(getter, q, auto_ack=False)                        # unacked is not counted
    assert ch.queue_delete(q).method.message_count == 3
    assert not queue_exists(broker_url, q)


def test_delete_missing_queue_is_ok(ch, unique_name):
    assert ch.queue_delete(unique_name("missing")).method.message_count == 0
    assert ch.is_open


def test_delete_if_unused(conn, ch, declared, broker_url):
    q = declared()
    cc = conn.channel()
    tag = cc.basic_consume(q, lambda *a: None)
    bad = conn.channel()
    assert close_outcome(lambda: bad.queue_delete(q, if_unused=True)) == ("channel", 406)
    assert queue_counts(broker_url, q) == (0, 1)
    cc.basic_cancel(tag)
    ch.queue_delete(q, if_unused=True)
    assert not queue_exists(broker_url, q)


def test_delete_if_empty(conn, ch, declared, broker_url):
    q = declared()
    ch.basic_publish("", q, b"x")
    bad = conn.channel()
    assert close_outcome(lambda: bad.queue_delete(q, if_empty=True)) == ("channel", 406)
    assert queue_counts(broker_url, q) == (1, 0)
    # only ready messages count: with the message unacked the queue is "empty"
    getter = conn.channel()
    _get(getter, q, auto_ack=False)
    assert ch.queue_delete(q, if_empty=True).method.message_count == 0
    assert not queue_exists(broker_url, q)


def test_delete_cancels_consumers(conn, ch, declared, broker_url):
    q = declared()
    cc = conn.channel()
    cancelled = []
    cc.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = cc.basic_consume(q, lambda *a: None)
    ch.queue_delete(q)

    def seen():
        conn.process_data_events(time_limit=0.05)
        return cancelled
    wait_until(seen, message="basic.cancel after the queue was deleted")
    assert cancelled == [tag]
    assert not queue_exists(broker_url, q)


def test_delete_py_amqp(broker_url, unique_name):
    conn = amqp_connect(broker_url, confirm_publish=True)
    try:
        ch = conn.channel()
        q = unique_name("q")
        ch.queue_declare(q, auto_delete=False)
        ch.basic_publish(amqp.Message(b"m"), "", q)
        assert ch.queue_delete(q) == 1
        assert not queue_exists(broker_url, q)
    finally:
        safe_close(conn)
