"""Channels: lifecycle, flow, and which errors close the channel vs the connection (with which reply code).

Differential: every test runs against the embedded broker and RabbitMQ 3.10 (``broker_url``) with the same
assertions; the expected codes and levels were observed on RabbitMQ 3.10.8.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import amqp
import pika
import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import header as pheader

from helpers import (amqp_connect, amqp_sync, close_outcome, pika_connect, pika_sync,
                     raw_handshake, safe_close)
from waiting import wait_until

# ---------------------------------------------------------------------------------------- lifecycle


def test_open_and_close_channels_pika(broker_url):
    conn = pika_connect(broker_url)
    try:
        chans = [conn.channel() for _ in range(10)]
        assert len({c.channel_number for c in chans}) == 10
        assert all(c.is_open for c in chans)
        for c in chans[::2]:
            c.close()
        assert all(c.is_closed for c in chans[::2])
        assert all(c.is_open for c in chans[1::2])
        # the survivors still work
        for c in chans[1::2]:
            assert c.queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")
    finally:
        conn.close()


def test_open_and_close_channels_py_amqp(broker_url):
    conn = amqp_connect(broker_url)
    try:
        chans = [conn.channel() for _ in range(5)]
        for c in chans:
            assert c.is_open
        chans[0].close()
        assert not chans[0].is_open
        assert chans[1].queue_declare("", exclusive=True)[0].startswith("amq.gen-")
    finally:
        conn.close()


def test_reopen_closed_channel_number(broker_url):
    conn = pika_connect(broker_url)
    try:
        for _ in range(3):
            ch = conn.channel(channel_number=7)
            assert ch.channel_number == 7 and ch.is_open
            ch.queue_declare("", exclusive=True)
            ch.close()
    finally:
        conn.close()


def test_reopen_channel_number_after_channel_error(broker_url, unique_name):
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel(channel_number=5)
        assert close_outcome(lambda: ch.queue_declare(unique_name("missing"), passive=True)) == ("channel", 404)
        assert ch.is_closed and conn.is_open
        ch = conn.channel(channel_number=5)
        assert ch.queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")
    finally:
        conn.close()


def test_channel_error_leaves_other_channels_working(broker_url, unique_name):
    conn = pika_connect(broker_url)
    try:
        good = conn.channel()
        bad = conn.channel()
        q = good.queue_declare(unique_name("q"), exclusive=True).method.queue
        assert close_outcome(lambda: bad.exchange_declare(unique_name("missing"), passive=True)) == ("channel", 404)
        good.basic_publish("", q, b"ok")
        wait_until(lambda: good.queue_declare(q, passive=True).method.message_count == 1)
        assert good.basic_get(q, auto_ack=True)[2] == b"ok"
    finally:
        conn.close()


def test_closing_channel_cancels_its_consumers(broker_url, unique_name):
    conn = pika_connect(broker_url)
    try:
        owner = conn.channel()
        q = owner.queue_declare(unique_name("q"), exclusive=True).method.queue
        ch = conn.channel()
        ch.basic_consume(q, lambda *a: None)
        ch.basic_consume(q, lambda *a: None)
        assert owner.queue_declare(q, passive=True).method.consumer_count == 2
        ch.close()
        wait_until(lambda: owner.queue_declare(q, passive=True).method.consumer_count == 0)
    finally:
        conn.close()


def test_closing_channel_requeues_unacked(broker_url, unique_name):
    conn = pika_connect(broker_url)
    try:
        owner = conn.channel()
        q = owner.queue_declare(unique_name("q"), exclusive=True).method.queue
        for i in range(3):
            owner.basic_publish("", q, b"m%d" % i)
        ch = conn.channel()
        got = []
        for _ in range(3):
            m = None
            deadline = time.monotonic() + 5
            while m is None and time.monotonic() < deadline:
                m, _p, body = ch.basic_get(q, auto_ack=False)
            got.append(body)
        assert got == [b"m0", b"m1", b"m2"]
        assert owner.queue_declare(q, passive=True).method.message_count == 0
        ch.close()
        wait_until(lambda: owner.queue_declare(q, passive=True).method.message_count == 3)
        m, _p, body = owner.basic_get(q, auto_ack=True)
        assert body == b"m0" and m.redelivered is True
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------- flow


def test_flow_active_true_is_acknowledged(broker_url):
    conn = amqp_connect(broker_url)
    try:
        ch = conn.channel()
        assert ch.flow(True) is True
        assert ch.is_open
        assert ch.queue_declare("", exclusive=True)[0].startswith("amq.gen-")
    finally:
        safe_close(conn)


def test_flow_active_false_is_540_connection_error(broker_url):
    """RabbitMQ 3.10 does not implement client-requested flow stop: 540 NOT_IMPLEMENTED, connection."""
    conn = amqp_connect(broker_url)
    try:
        ch = conn.channel()
        assert close_outcome(lambda: ch.flow(False), conn) == ("connection", 540)
        assert not conn.connected
    finally:
        safe_close(conn)


def test_flow_raw_ok_carries_active_flag(broker_url):
    rc, _tune = raw_handshake(broker_url)
    try:
        rc.send(1, C.Channel.Open())
        assert isinstance(rc.read_method()[1], C.Channel.OpenOk)
        rc.send(1, C.Channel.Flow(active=True))
        ch, frame = rc.read_method()
        assert ch == 1 and isinstance(frame, C.Channel.FlowOk) and frame.active is True
        rc.send(1, C.Channel.Flow(active=False))
        ch, frame = rc.read_method()
        assert ch == 0 and isinstance(frame, C.Connection.Close)
        assert (frame.reply_code, frame.class_id, frame.method_id) == (540, 20, 20)
    finally:
        rc.close()


# ------------------------------------------------------------------------------- error level / code


@dataclass
class Ctx:
    """What an error scenario needs: the client's connection and channel, names, and a helper connection."""
    url: str
    conn: Any
    ch: Any
    make_name: Callable[[str], str]
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    _helper: Any = None

    def name(self, prefix: str = "x") -> str:
        return self.make_name(prefix)

    def helper_channel(self):
        """A pika channel on a separate connection (for setup that must survive the error)."""
        if self._helper is None:
            self._helper = pika_connect(self.url)
        return self._helper.channel()

    def queue(self, **kw) -> str:
        """A queue that exists for the test (declared on the helper connection, deleted afterwards)."""
        ch = self.helper_channel()
        q = ch.queue_declare(self.name("q"), **kw).method.queue
        self.cleanup.append(lambda: self.helper_channel().queue_delete(q))
        return q

    def exchange(self, type_: str = "direct", **kw) -> str:
        ch = self.helper_channel()
        x = self.name("x")
        ch.exchange_declare(x, type_, **kw)
        self.cleanup.append(lambda: self.helper_channel().exchange_delete(x))
        return x

    def close(self):
        for fn in self.cleanup:
            try:
                fn()
            except Exception:
                pass
        safe_close(self.conn)
        if self._helper is not None:
            safe_close(self._helper)


def _pika_publish(ctx, exchange, key, **kw):
    ctx.ch.basic_publish(exchange, key, b"body", **kw)
    pika_sync(ctx.ch)


def _exclusive_elsewhere(ctx) -> str:
    """An exclusive queue owned by the helper connection (not by the client under test)."""
    ch = ctx.helper_channel()
    q = ch.queue_declare(ctx.name("excl"), exclusive=True).method.queue
    return q


PIKA_ERRORS: dict[str, tuple[Callable[[Ctx], Any], tuple[str, int]]] = {
    # 404 NOT_FOUND (channel)
    "passive-missing-queue": (lambda c: c.ch.queue_declare(c.name(), passive=True), ("channel", 404)),
    "passive-missing-exchange": (lambda c: c.ch.exchange_declare(c.name(), passive=True), ("channel", 404)),
    "publish-missing-exchange": (lambda c: _pika_publish(c, c.name(), "k"), ("channel", 404)),
    "consume-missing-queue": (lambda c: c.ch.basic_consume(c.name(), lambda *a: None), ("channel", 404)),
    "get-missing-queue": (lambda c: c.ch.basic_get(c.name()), ("channel", 404)),
    "purge-missing-queue": (lambda c: c.ch.queue_purge(c.name()), ("channel", 404)),
    "bind-missing-exchange": (lambda c: c.ch.queue_bind(c.queue(), c.name()), ("channel", 404)),
    "bind-missing-queue": (lambda c: c.ch.queue_bind(c.name(), "amq.direct", "k"), ("channel", 404)),
    "e2e-bind-missing-source": (lambda c: c.ch.exchange_bind("amq.fanout", c.name()), ("channel", 404)),
    "e2e-bind-missing-destination": (lambda c: c.ch.exchange_bind(c.name(), "amq.fanout"), ("channel", 404)),
    # 405 RESOURCE_LOCKED (channel)
    "exclusive-queue-other-connection-declare":
        (lambda c: c.ch.queue_declare(_exclusive_elsewhere(c)), ("channel", 405)),
    "exclusive-queue-other-connection-passive":
        (lambda c: c.ch.queue_declare(_exclusive_elsewhere(c), passive=True), ("channel", 405)),
    "exclusive-queue-other-connection-consume":
        (lambda c: c.ch.basic_consume(_exclusive_elsewhere(c), lambda *a: None), ("channel", 405)),
    "exclusive-queue-other-connection-get": (lambda c: c.ch.basic_get(_exclusive_elsewhere(c)), ("channel", 405)),
    "exclusive-queue-other-connection-purge": (lambda c: c.ch.queue_purge(_exclusive_elsewhere(c)), ("channel", 405)),
    "exclusive-queue-other-connection-delete": (lambda c: c.ch.queue_delete(_exclusive_elsewhere(c)), ("channel", 405)),
    "exclusive-queue-other-connection-bind":
        (lambda c: c.ch.queue_bind(_exclusive_elsewhere(c), "amq.direct", "k"), ("channel", 405)),
    "redeclare-shared-queue-as-exclusive": (lambda c: c.ch.queue_declare(c.queue(), exclusive=True), ("channel", 405)),
    # 406 PRECONDITION_FAILED (channel)
    "queue-equivalence-durable": (lambda c: c.ch.queue_declare(c.queue(), durable=True), ("channel", 406)),
    "queue-equivalence-auto-delete": (lambda c: c.ch.queue_declare(c.queue(), auto_delete=True), ("channel", 406)),
    "exchange-equivalence-type": (lambda c: c.ch.exchange_declare(c.exchange("direct"), "fanout"), ("channel", 406)),
    "ack-unknown-delivery-tag": (lambda c: (c.ch.basic_ack(5), pika_sync(c.ch)), ("channel", 406)),
    "nack-unknown-delivery-tag": (lambda c: (c.ch.basic_nack(5), pika_sync(c.ch)), ("channel", 406)),
    "reject-unknown-delivery-tag": (lambda c: (c.ch.basic_reject(5), pika_sync(c.ch)), ("channel", 406)),
    "tx-commit-without-select": (lambda c: c.ch.tx_commit(), ("channel", 406)),
    "tx-rollback-without-select": (lambda c: c.ch.tx_rollback(), ("channel", 406)),
    "confirm-then-tx": (lambda c: (c.ch.confirm_delivery(), c.ch.tx_select()), ("channel", 406)),
    "tx-then-confirm": (lambda c: (c.ch.tx_select(), c.ch.confirm_delivery()), ("channel", 406)),
    "exchange-delete-if-unused": (lambda c: (c.helper_channel().queue_bind(c.queue(), x := c.exchange(), "k"),
                                             c.ch.exchange_delete(x, if_unused=True)), ("channel", 406)),
    # 403 ACCESS_REFUSED (channel)
    "declare-amq-exchange": (lambda c: c.ch.exchange_declare("amq.x-" + c.name(), "direct"), ("channel", 403)),
    "declare-amq-queue": (lambda c: c.ch.queue_declare("amq.q-" + c.name()), ("channel", 403)),
    "delete-amq-direct": (lambda c: c.ch.exchange_delete("amq.direct"), ("channel", 403)),
    "delete-default-exchange": (lambda c: c.ch.exchange_delete(""), ("channel", 403)),
    "bind-to-default-exchange": (lambda c: c.ch.queue_bind(c.queue(), "", "k"), ("channel", 403)),
    "unbind-from-default-exchange": (lambda c: c.ch.queue_unbind(c.queue(), "", "k"), ("channel", 403)),
    "publish-to-internal-exchange":
        (lambda c: _pika_publish(c, c.exchange("fanout", internal=True), ""), ("channel", 403)),
    # connection-level errors
    "unknown-exchange-type": (lambda c: c.ch.exchange_declare(c.name(), "no-such-type"), ("connection", 503)),
    "qos-prefetch-size": (lambda c: c.ch.basic_qos(prefetch_size=10), ("connection", 540)),
    "recover-requeue-false": (lambda c: c.ch.basic_recover(requeue=False), ("connection", 540)),
}


# What 4.x answers differently: an unknown exchange type closes the channel (406), not the connection (503).
ERRORS_43 = {"unknown-exchange-type": ("channel", 406)}


@pytest.mark.parametrize("scenario", list(PIKA_ERRORS))
def test_error_level_and_code_pika(broker_url, unique_name, scenario, rabbitmq_version):
    fn, expected = PIKA_ERRORS[scenario]
    if rabbitmq_version == "4.3":
        expected = ERRORS_43.get(scenario, expected)
    conn = pika_connect(broker_url)
    ctx = Ctx(broker_url, conn, conn.channel(), unique_name)
    try:
        outcome = close_outcome(lambda: fn(ctx))
        assert outcome == expected
        if expected[0] == "channel":
            assert ctx.ch.is_closed
            assert conn.is_open
            # the connection still works
            assert conn.channel().queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")
        else:
            assert conn.is_closed
    finally:
        ctx.close()


def _amqp_publish(ctx, exchange, key, **kw):
    ctx.ch.basic_publish(amqp.Message(b"body"), exchange, key, **kw)
    amqp_sync(ctx.ch)


PY_AMQP_ERRORS: dict[str, tuple[Callable[[Ctx], Any], tuple[str, int]]] = {
    "passive-missing-queue": (lambda c: c.ch.queue_declare(c.name(), passive=True), ("channel", 404)),
    "passive-missing-exchange":
        (lambda c: c.ch.exchange_declare(c.name(), "direct", passive=True), ("channel", 404)),
    "publish-missing-exchange": (lambda c: _amqp_publish(c, c.name(), "k"), ("channel", 404)),
    "exclusive-queue-other-connection":
        (lambda c: c.ch.queue_declare(_exclusive_elsewhere(c), auto_delete=False), ("channel", 405)),
    "queue-equivalence-durable":
        (lambda c: c.ch.queue_declare(c.queue(), durable=True, auto_delete=False), ("channel", 406)),
    "ack-unknown-delivery-tag": (lambda c: (c.ch.basic_ack(99), amqp_sync(c.ch)), ("channel", 406)),
    "declare-amq-exchange":
        (lambda c: c.ch.exchange_declare("amq.x-" + c.name(), "direct", auto_delete=False), ("channel", 403)),
    "unknown-exchange-type": (lambda c: c.ch.exchange_declare(c.name(), "no-such-type"), ("connection", 503)),
    "publish-immediate": (lambda c: _amqp_publish(c, "", c.queue(), immediate=True), ("connection", 540)),
    "flow-false": (lambda c: c.ch.flow(False), ("connection", 540)),
    "recover-requeue-false":
        (lambda c: (c.ch.basic_recover(requeue=False), amqp_sync(c.ch)), ("connection", 540)),
    "qos-prefetch-size": (lambda c: c.ch.basic_qos(10, 0, False), ("connection", 540)),
}


@pytest.mark.parametrize("scenario", list(PY_AMQP_ERRORS))
def test_error_level_and_code_py_amqp(broker_url, unique_name, scenario, rabbitmq_version):
    fn, expected = PY_AMQP_ERRORS[scenario]
    if rabbitmq_version == "4.3":
        expected = ERRORS_43.get(scenario, expected)
    conn = amqp_connect(broker_url)
    ctx = Ctx(broker_url, conn, conn.channel(), unique_name)
    try:
        outcome = close_outcome(lambda: fn(ctx), conn)
        assert outcome == expected
        if expected[0] == "channel":
            assert conn.connected
            assert conn.channel().queue_declare("", exclusive=True)[0].startswith("amq.gen-")
        else:
            assert not conn.connected
    finally:
        ctx.close()


# ------------------------------------------------------------ protocol errors a raw client provokes


def _open(rc, n=1):
    rc.send(n, C.Channel.Open())
    ch, frame = rc.read_method()
    assert (ch, type(frame)) == (n, C.Channel.OpenOk)


def _expect_connection_close(rc, code, class_method=None):
    got = rc.read_method()
    assert got is not None, "socket closed without connection.close"
    ch, frame = got
    assert ch == 0 and isinstance(frame, C.Connection.Close), (ch, frame)
    assert frame.reply_code == code, frame.reply_text
    if class_method is not None:
        assert (frame.class_id, frame.method_id) == class_method
    rc.send(0, C.Connection.CloseOk())
    rc.wait_closed()


def _publish_frames(rc, n, body_size, bodies=()):
    rc.send(n, C.Basic.Publish(exchange="", routing_key="nowhere"))
    rc.send(n, pheader.ContentHeader(0, body_size, C.Basic.Properties()))
    for b in bodies:
        rc.send(n, pbody.ContentBody(b))


RAW_CONNECTION_ERRORS = {
    # 504 CHANNEL_ERROR
    "second-channel-open": (lambda rc: (_open(rc), rc.send(1, C.Channel.Open())), 504, (20, 10)),
    "method-on-unopened-channel":
        (lambda rc: rc.send(3, C.Queue.Declare(queue="x", passive=True)), 504, (50, 10)),
    "method-on-closed-channel": (lambda rc: (
        _open(rc), rc.send(1, C.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0)),
        rc.read_method(), rc.send(1, C.Basic.Qos(prefetch_count=1))), 504, (60, 10)),
    "channel-open-on-channel-zero": (lambda rc: rc.send(0, C.Channel.Open()), 504, (20, 10)),
    "queue-declare-on-channel-zero":
        (lambda rc: rc.send(0, C.Queue.Declare(queue="x", passive=True)), 504, (50, 10)),
    # 503 COMMAND_INVALID
    "unsolicited-flow-ok": (lambda rc: (_open(rc), rc.send(1, C.Channel.FlowOk(active=True))), 503, (20, 21)),
    "unsolicited-channel-close-ok": (lambda rc: (_open(rc), rc.send(1, C.Channel.CloseOk())), 503, (20, 41)),
    "connection-method-on-channel-1":
        (lambda rc: (_open(rc), rc.send(1, C.Connection.Open(virtual_host="/"))), 503, (10, 40)),
    "unknown-exchange-type": (lambda rc: (_open(rc), rc.send(1, C.Exchange.Declare(
        exchange="zz-unknown-type", exchange_type="no-such-type"))), 503, (40, 10)),
    # 505 UNEXPECTED_FRAME
    "header-without-publish": (lambda rc: (_open(rc), rc.send(1, pheader.ContentHeader(
        0, 0, C.Basic.Properties()))), 505, None),
    "body-without-publish": (lambda rc: (_open(rc), rc.send(1, pbody.ContentBody(b"x"))), 505, None),
    "method-instead-of-header": (lambda rc: (_open(rc), rc.send(1, C.Basic.Publish(
        exchange="", routing_key="x")), rc.send(1, C.Basic.Qos())), 505, (60, 40)),
    "method-instead-of-body": (lambda rc: (_open(rc), rc.send(1, C.Basic.Publish(exchange="", routing_key="x")),
                                           rc.send(1, pheader.ContentHeader(0, 5, C.Basic.Properties())),
                                           rc.send(1, C.Basic.Qos())), 505, (60, 40)),
    "heartbeat-on-channel-1":
        (lambda rc: (_open(rc), rc.send_bytes(b"\x08\x00\x01\x00\x00\x00\x00\xce")), 505, None),
    # 540 NOT_IMPLEMENTED
    "publish-immediate": (lambda rc: (_open(rc), rc.send(1, C.Basic.Publish(
        exchange="", routing_key="x", immediate=True)), rc.send(1, pheader.ContentHeader(
            0, 0, C.Basic.Properties()))), 540, (60, 40)),
    "recover-async": (lambda rc: (_open(rc), rc.send(1, C.Basic.RecoverAsync(requeue=False))), 540, (60, 100)),
    "flow-false": (lambda rc: (_open(rc), rc.send(1, C.Channel.Flow(active=False))), 540, (20, 20)),
    # 501 FRAME_ERROR
    "bad-frame-end": (lambda rc: (_open(rc), rc.send_bytes(b"\x08\x00\x00\x00\x00\x00\x00\xcf")), 501, None),
    "unknown-frame-type": (lambda rc: (_open(rc), rc.send_bytes(b"\x05\x00\x00\x00\x00\x00\x00\xce")), 501, None),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # pamqp warns on basic.recover-async
@pytest.mark.parametrize("scenario", list(RAW_CONNECTION_ERRORS))
def test_protocol_error_closes_connection(broker_url, scenario, rabbitmq_version):
    provoke, code, class_method = RAW_CONNECTION_ERRORS[scenario]
    rc, _tune = raw_handshake(broker_url)
    try:
        provoke(rc)
        if rabbitmq_version == "4.3" and scenario in ERRORS_43:
            channel, frame = rc.read_method()
            assert (channel, type(frame), frame.reply_code) == (1, C.Channel.Close, ERRORS_43[scenario][1])
            assert (frame.class_id, frame.method_id) == class_method
            return
        _expect_connection_close(rc, code, class_method)
    finally:
        rc.close()


@contextlib.contextmanager
def _raw_channel(broker_url, n=1):
    """A raw connection with channel ``n`` open; closed on exit."""
    rc, _tune = raw_handshake(broker_url)
    try:
        _open(rc, n)
        yield rc
    finally:
        rc.close()


def _declare_missing_queue(rc):
    """A passive queue.declare of a queue that does not exist on channel 1; the broker's answer."""
    rc.send(1, C.Queue.Declare(queue="zz-missing-queue-raw", passive=True))
    return rc.read_method()


def test_channel_error_reports_class_and_method(broker_url):
    with _raw_channel(broker_url) as rc:
        ch, frame = _declare_missing_queue(rc)
        assert ch == 1 and isinstance(frame, C.Channel.Close)
        assert (frame.reply_code, frame.class_id, frame.method_id) == (404, 50, 10)
        assert frame.reply_text.startswith("NOT_FOUND")


def test_methods_after_server_channel_close_are_discarded(broker_url):
    """After the server's channel.close, the client's methods on that channel are ignored until close-ok."""
    with _raw_channel(broker_url) as rc:
        ch, frame = _declare_missing_queue(rc)
        assert (ch, type(frame), frame.reply_code) == (1, C.Channel.Close, 404)
        rc.send(1, C.Basic.Qos(prefetch_count=1))
        rc.send(1, C.Queue.Declare(queue="", exclusive=True))
        rc.send(1, C.Channel.CloseOk())
        rc.send(1, C.Channel.Open())
        ch, frame = rc.read_method()
        assert (ch, type(frame)) == (1, C.Channel.OpenOk)


def test_simultaneous_channel_close_gets_close_ok(broker_url):
    """Server sent channel.close; the client answers with its own channel.close: the server replies close-ok."""
    with _raw_channel(broker_url) as rc:
        ch, frame = _declare_missing_queue(rc)
        assert (ch, type(frame)) == (1, C.Channel.Close)
        rc.send(1, C.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0))
        ch, frame = rc.read_method()
        assert (ch, type(frame)) == (1, C.Channel.CloseOk)


def test_client_channel_close_gets_close_ok(broker_url):
    with _raw_channel(broker_url, 9) as rc:
        rc.send(9, C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
        ch, frame = rc.read_method()
        assert (ch, type(frame)) == (9, C.Channel.CloseOk)
        _open(rc, 9)   # the number is free again


def test_exclusive_consumer_conflict_is_403(broker_url, unique_name):
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        q = ch.queue_declare(unique_name("q"), exclusive=True).method.queue
        ch.basic_consume(q, lambda *a: None, exclusive=True)
        ch2 = conn.channel()
        assert close_outcome(lambda: ch2.basic_consume(q, lambda *a: None)) == ("channel", 403)
        assert ch.queue_declare(q, passive=True).method.consumer_count == 1
    finally:
        conn.close()
