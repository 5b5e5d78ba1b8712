"""RabbitMQ's consumer timeout, differential: the four brokers of tests/broker/conftest.py (the embedded broker as
3.10, RabbitMQ 3.10, the embedded broker as 4.3, RabbitMQ 4.3), and, for what only 4.3 does, the two 4.3 ones.

What the versions do (measured on RabbitMQ 3.10.8 and 4.3.6 with pika and raw frames):

- 3.10: at each channel tick (`channel_tick_interval`), a channel whose oldest unacked delivery (any queue
  type, basic.get's too) is older than the `consumer_timeout` it read when it opened is closed: 406
  "delivery acknowledgement on channel N timed out. Timeout value used: T ms. ...", naming no method; its
  deliveries go back as for any closed channel. x-consumer-timeout (queue or consumer argument) is ignored.
- 4.3: classic queues and streams never time out. A quorum queue delivery times out at its own deadline; the
  timeout is the consumer argument x-consumer-timeout, else the lower of the queue argument and the policy's
  consumer-timeout, else `consumer_timeout` (read at basic.consume or basic.get). The expired deliveries go
  back to the queue (x-acquired-count, redelivered, not a failed delivery), the others stay with the
  consumer; the consumer is sent basic.cancel and stays on the channel, counted, served nothing until the
  client settles the timed-out tags (which touches no message); the channel is closed instead (406,
  "Timeout value used: -1 ms") for a basic.get, a consumer the client cancelled, or a client without the
  consumer_cancel_notify capability.

The global setting is changed at run time on the reference nodes (`rabbitmqctl eval 'application:set_env(...)'`)
and on the embedded brokers (their configuration), only while a test opens the channel (3.10) or starts the
consumer (4.3) that must time out: both read it then. RabbitMQ 3.10 is the session's second 3.10 node
(`rabbitmq_tls`, on its plain listener): on 3.10 the timeout reaches every channel opened meanwhile, whatever
its queue, and a test on another worker opening one on the shared node would keep it. On the shared 4.3 node
it reaches only the quorum queue consumers started meanwhile; the tests against both nodes run on the Spark
tests' worker, so that no Spark query starts one then. 3.10's `channel_tick_interval` is 1 s during each test that needs it (re-read at every tick; it
only makes the node's channels tick more often). Everything is restored in teardown.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pika
import pytest
from pamqp import body as pamqp_body
from pamqp import commands as C
from pamqp import header as pamqp_header
from pamqp import heartbeat as pamqp_heartbeat

from brokers import rabbitmqctl, require_rabbitmq
from helpers import TIMED_OUT, queue_counts, raw_handshake
from targets import TARGETS, Target, targets_fixture
from spark_amqp_broker import Broker
from spark_amqp_broker.__main__ import build_config, parse_args
from spark_amqp_broker.config import BrokerConfig
from support import Env, env, pump, settle  # noqa: F401  (the env fixture)

pytestmark = pytest.mark.timeout(120)

TIMEOUT_MS = 2000
TICK_MS = 1000
DEFAULT_TIMEOUT_MS = 1_800_000
DEFAULT_TICK_MS = 60_000
QQ = {"x-queue-type": "quorum"}
# This module's embedded brokers (tests/broker/conftest.py): their channels tick every TICK_MS, as the
# reference 3.10 node's do during these tests.
EMBEDDED_CONFIG = {"channel_tick_interval": TICK_MS}


def timed_out_text(channel: int, timeout: int) -> str:
    return (f"PRECONDITION_FAILED - delivery acknowledgement on channel {channel} timed out. Timeout value used: "
            f"{timeout} ms. This timeout value can be configured, see consumers doc guide to learn more")


# ------------------------------------------------------------------------------------------ brokers

REFERENCE_310 = Target("rabbitmq", "3.10")
# On the Spark tests' worker (tests/conftest.py): the session's second 3.10 node is one per machine, and
# while the shared 4.3 node's consumer_timeout is short no Spark query may start a quorum queue consumer.
broker_target = targets_fixture(TARGETS, marks={t: pytest.mark.xdist_group("spark") for t in TARGETS
                                                 if t.kind == "rabbitmq"})


@pytest.fixture
def broker_url(request, broker_target, broker_url) -> str:
    """tests/broker/conftest.py's broker, but RabbitMQ 3.10 is the session's second 3.10 node."""
    if broker_target == REFERENCE_310:
        return request.getfixturevalue("rabbitmq_tls").tcp_url
    return broker_url


class Settings:
    """The global consumer_timeout of the broker under test, set for a moment (`window`)."""

    def __init__(self, target, broker: Broker | None, node=None):
        self.target, self.broker, self.node = target, broker, node
        self.restoring: threading.Thread | None = None

    def _set(self, key: str, value: int) -> None:
        command = ("eval", f"application:set_env(rabbit, {key}, {value}).")
        if self.broker is not None:
            self.broker.call(setattr, self.broker.config, key, value)
        elif self.node is not None:
            self.node.ctl(*command)
        else:
            rabbitmqctl(*command, version=self.target.version)

    @contextlib.contextmanager
    def window(self, timeout: int = TIMEOUT_MS):
        """consumer_timeout = `timeout` inside: open the channel (3.10) or start the consumer or basic.get (4.3)
        that must time out here. The default comes back in the background (rabbitmqctl takes a second, which
        the test must not spend waiting: it times what follows), and for sure by the test's teardown."""
        self.join()
        self._set("consumer_timeout", timeout)
        try:
            yield
        finally:
            self.restoring = threading.Thread(target=self._set, args=("consumer_timeout", DEFAULT_TIMEOUT_MS))
            self.restoring.start()

    def join(self) -> None:
        if self.restoring is not None:
            self.restoring.join()
            self.restoring = None

    def fast_ticks(self) -> None:
        if self.broker is None and self.target.version == "3.10":
            self._set("channel_tick_interval", TICK_MS)

    def restore(self) -> None:
        self.join()
        if self.broker is None and self.target.version == "3.10":
            self._set("channel_tick_interval", DEFAULT_TICK_MS)


@pytest.fixture
def global_consumer_timeout(request, broker_target, broker_url):
    """Settings of the broker under test (for RabbitMQ 3.10, the session's second node: `broker_url`)."""
    broker = node = None
    if broker_target.kind == "embedded":
        broker = request.getfixturevalue("embedded_310" if broker_target.version == "3.10" else "embedded_43")
    elif broker_target == REFERENCE_310:
        node = request.getfixturevalue("rabbitmq_tls")
    s = Settings(broker_target, broker, node)
    s.fast_ticks()
    try:
        yield s
    finally:
        s.restore()


@pytest.fixture(params=["embedded", "rabbitmq"], ids=lambda kind: f"{kind}-4.3")
def env43(request, unique_name):
    """An Env on one of the two 4.3 brokers, for what only 4.3 does (3.10 closes the channel at the timeout,
    which the four-broker tests show)."""
    if request.param == "rabbitmq":
        url = require_rabbitmq("4.3")
    else:
        url = request.getfixturevalue("embedded_43").url
    e = Env(url, unique_name)
    yield e
    e.close()


# ------------------------------------------------------------------------------------------ helpers


class Watched:
    """A pika channel whose deliveries, broker-sent basic.cancel and channel.close are recorded with the time
    they arrived (time.monotonic())."""

    def __init__(self, conn: pika.BlockingConnection):
        self.conn = conn
        self.ch = conn.channel()
        self.deliveries: list[tuple] = []    # (time, method, properties, body)
        self.cancels: list[tuple] = []       # (time, consumer tag)
        self.closed: tuple | None = None     # (time, reply code, reply text)
        self.ch._impl.add_on_close_callback(self._on_close)
        self.ch.add_on_cancel_callback(lambda frame: self.cancels.append((time.monotonic(),
                                                                          frame.method.consumer_tag)))

    def _on_close(self, _channel, reason) -> None:
        self.closed = (time.monotonic(), getattr(reason, "reply_code", None), getattr(reason, "reply_text", None))

    def on_message(self, _ch, method, props, body) -> None:
        self.deliveries.append((time.monotonic(), method, props, body))

    def consume(self, queue: str, prefetch: int = 10, **arguments) -> str:
        self.ch.basic_qos(prefetch_count=prefetch)
        return self.ch.basic_consume(queue, self.on_message, arguments=arguments or None)

    def wait(self, until, timeout: float, what: str) -> None:
        pump(self.conn, until, timeout, what)

    def bodies(self) -> list[bytes]:
        return [d[3] for d in self.deliveries]


class Raw:
    """A client over raw frames (helpers.raw_handshake), announcing consumer_cancel_notify or not: what a client
    sees, frame by frame, with none of a client library's handling of a cancelled consumer (pika drops the
    deliveries 4.3 sends a consumer after its basic.cancel). `events`: (time, channel, method, properties,
    body) in arrival order, a delivery's content joined to its method."""

    def __init__(self, url: str, cancel_notify: bool = True):
        self.conn, _tune = raw_handshake(url, capabilities={"consumer_cancel_notify": cancel_notify,
                                                            "basic.nack": True})
        self.events: list[tuple] = []
        self._content = None      # [time, channel, method, properties, body parts, bytes left]

    def close(self) -> None:
        self.conn.close()

    def send(self, channel: int, method) -> None:
        self.conn.send(channel, method)

    def call(self, channel: int, method, reply: type):
        """Send and wait for the reply (of class `reply`) on that channel."""
        seen = len(self.events)
        self.send(channel, method)
        self.wait(lambda: any(e[1] == channel and isinstance(e[2], reply) for e in self.events[seen:]), 5,
                  reply.__name__)
        return next(e[2] for e in self.events[seen:] if e[1] == channel and isinstance(e[2], reply))

    def open(self, channel: int, prefetch: int = 10) -> None:
        self.call(channel, C.Channel.Open(), C.Channel.OpenOk)
        self.call(channel, C.Basic.Qos(prefetch_count=prefetch), C.Basic.QosOk)

    def sync(self, channel: int) -> None:
        """A round trip, after which what the broker made of the frames sent before it is known."""
        self.call(channel, C.Basic.Qos(prefetch_count=10), C.Basic.QosOk)

    def poll(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (frame := self._read(end - time.monotonic())) is not None:
            self._take(*frame)

    def wait(self, until, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}; frames seen: {self.events!r}")
            self.poll(0.02)

    def _read(self, timeout: float):
        """The next frame that is not a heartbeat, or None when none came within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.conn.poll_frame(deadline - time.monotonic())
            if got is TIMED_OUT:
                return None
            if got is None:
                pytest.fail(f"the broker closed the socket; frames seen: {self.events!r}")
            if not isinstance(got[1], pamqp_heartbeat.Heartbeat):
                return got

    def _take(self, channel: int, frame) -> None:
        now = time.monotonic()
        if isinstance(frame, pamqp_header.ContentHeader):
            self._content[3] = frame.properties
            self._content[5] = frame.body_size
        elif isinstance(frame, pamqp_body.ContentBody):
            self._content[4].append(frame.value)
            self._content[5] -= len(frame.value)
        elif isinstance(frame, (C.Basic.Deliver, C.Basic.GetOk)):
            self._content = [now, channel, frame, None, [], None]
            return
        else:
            self.events.append((now, channel, frame, None, None))
            return
        if self._content[5] == 0:
            t, ch, method, props, parts, _left = self._content
            self.events.append((t, ch, method, props, b"".join(parts)))
            self._content = None

    def deliveries(self) -> list[tuple]:
        """(time, delivery tag, redelivered, body, headers) of every basic.deliver."""
        return [(t, m.delivery_tag, m.redelivered, body, props.headers) for t, _c, m, props, body in self.events
                if isinstance(m, C.Basic.Deliver)]

    def cancels(self) -> list[tuple]:
        return [(t, m.consumer_tag) for t, _c, m, _p, _b in self.events if isinstance(m, C.Basic.Cancel)]

    def closed(self) -> tuple | None:
        """(time, reply code, reply text, class id, method id) of a channel.close from the broker."""
        for t, _c, m, _p, _b in self.events:
            if isinstance(m, C.Channel.Close):
                return t, m.reply_code, m.reply_text, m.class_id, m.method_id
        return None


def declare(env: Env, qtype: str, **arguments) -> str:
    name = env.track_queue(env.names(f"ct-{qtype}"))
    env.admin().queue_declare(name, durable=True, arguments={"x-queue-type": qtype, **arguments})
    return name


def publish(env: Env, queue: str, bodies) -> None:
    """Published with confirms (one channel per Env): in the queue when this returns."""
    ch = getattr(env, "confirming", None)
    if ch is None or not ch.is_open:
        ch = env.confirming = env.pika().channel()
        ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", queue, body)


def wait_counts(env: Env, queue: str, counts: tuple, timeout: float = 3.0) -> tuple:
    """The queue's (messages, consumers) once they are `counts` (a closed channel's deliveries go back a moment
    after its close-ok on RabbitMQ), or as they are after `timeout`."""
    deadline = time.monotonic() + timeout
    while (got := queue_counts(env.url, queue)) != counts and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def get_all(env: Env, queue: str) -> list[tuple]:
    """(body, redelivered, headers) of every ready message, taken with basic.get and auto-ack."""
    ch = env.pika().channel()
    out = []
    while (got := ch.basic_get(queue, auto_ack=True))[0] is not None:
        method, props, body = got
        out.append((body, method.redelivered, props.headers))
    ch.close()
    return out


def within(start: float, at: float, low_ms: int, high_ms: int) -> bool:
    """Whether `at` is low_ms to high_ms after `start`, as a client can tell: the times are when the client
    read the frames, late by what its process and the machine were busy with."""
    return low_ms / 1000 - 0.5 <= at - start <= high_ms / 1000 + 1.0


# ------------------------------------------------------------------------------- the four brokers


@pytest.mark.parametrize("qtype", ["classic", "quorum", "stream"])
def test_a_consumer_holding_deliveries_past_the_timeout(env, global_consumer_timeout, rabbitmq_version, qtype):
    """3.10: the channel is closed at the first tick past the timeout, whatever the queue type, and the
    deliveries go back; 4.3: a quorum queue takes them back and cancels the consumer, on a channel that
    stays open; classic queues and streams never time out."""
    q = declare(env, qtype)
    publish(env, q, [b"m1", b"m2"])
    with global_consumer_timeout.window():
        w = Watched(env.pika())
        w.consume(q, **({"x-stream-offset": "first"} if qtype == "stream" else {}))
    w.wait(lambda: len(w.deliveries) == 2, 5, "the two deliveries")
    first = w.deliveries[0][0]
    if rabbitmq_version == "3.10":
        w.wait(lambda: w.closed, (TIMEOUT_MS + TICK_MS) / 1000 + 2, "the channel's close")
        assert w.closed[1:] == (406, timed_out_text(w.ch.channel_number, TIMEOUT_MS))
        assert within(first, w.closed[0], TIMEOUT_MS, TIMEOUT_MS + TICK_MS), w.closed[0] - first
        if qtype != "stream":
            assert wait_counts(env, q, (2, 0)) == (2, 0)
            counts = {"x-delivery-count": 1} if qtype == "quorum" else None
            assert get_all(env, q) == [(b"m1", True, counts), (b"m2", True, counts)]
    elif qtype != "quorum":
        settle(w.conn, (TIMEOUT_MS + TICK_MS) / 1000 + 1)
        assert (w.closed, w.cancels) == (None, [])
        w.ch.basic_ack(0, multiple=True)
        if qtype == "classic":
            assert queue_counts(env.url, q) == (0, 1)
    else:
        w.wait(lambda: w.cancels, TIMEOUT_MS / 1000 + 2, "basic.cancel")
        settle(w.conn, 0.3)
        assert w.closed is None and w.ch.is_open
        assert [tag for _t, tag in w.cancels] == [w.deliveries[0][1].consumer_tag]
        assert within(first, w.cancels[0][0], TIMEOUT_MS, TIMEOUT_MS)
        assert queue_counts(env.url, q) == (2, 1)          # back, ready; the consumer still counted
        assert get_all(env, q) == [(b"m1", True, {"x-acquired-count": 1}), (b"m2", True, {"x-acquired-count": 1})]


@pytest.mark.parametrize("qtype", ["classic", "quorum"])
def test_basic_get_past_the_timeout(env, global_consumer_timeout, rabbitmq_version, qtype):
    """An unacked basic.get times out too, except on a 4.3 classic queue; on a 4.3 quorum queue the channel is
    closed (there is no consumer to cancel), the timeout it names being -1."""
    q = declare(env, qtype)
    publish(env, q, [b"m1", b"m2"])
    with global_consumer_timeout.window():
        w = Watched(env.pika())
        method, _props, body = w.ch.basic_get(q)
        got = time.monotonic()
    assert (body, method.delivery_tag) == (b"m1", 1)
    if rabbitmq_version == "4.3" and qtype == "classic":
        settle(w.conn, TIMEOUT_MS / 1000 + 1.5)
        assert w.closed is None
        w.ch.basic_ack(1)
        assert queue_counts(env.url, q) == (1, 0)
        return
    w.wait(lambda: w.closed, (TIMEOUT_MS + TICK_MS) / 1000 + 2, "the channel's close")
    assert wait_counts(env, q, (2, 0)) == (2, 0)
    if rabbitmq_version == "3.10":
        assert w.closed[1:] == (406, timed_out_text(1, TIMEOUT_MS))
        assert within(got, w.closed[0], TIMEOUT_MS, TIMEOUT_MS + TICK_MS)
        counts = {"x-delivery-count": 1} if qtype == "quorum" else None
        first = [(b"m1", True, counts)]
    else:
        assert w.closed[1:] == (406, timed_out_text(1, -1))
        assert within(got, w.closed[0], TIMEOUT_MS, TIMEOUT_MS)
        first = [(b"m1", True, {"x-acquired-count": 1})]
    second = [(b"m2", False, {"x-delivery-count": 0} if rabbitmq_version == "3.10" and qtype == "quorum" else None)]
    assert get_all(env, q) == first + second


def test_the_close_names_no_method_and_a_client_without_cancel_notify_gets_it_too(env, global_consumer_timeout,
                                                                                   rabbitmq_version):
    """As the client reads it: channel.close 406 naming class and method 0. A 4.3 quorum queue closes the channel
    of a client that did not announce consumer_cancel_notify, with -1 for the timeout."""
    q = declare(env, "quorum")
    publish(env, q, [b"m1"])
    raw = Raw(env.url, cancel_notify=False)
    try:
        with global_consumer_timeout.window():
            raw.open(1)
            raw.call(1, C.Basic.Consume(queue=q, consumer_tag="c1"), C.Basic.ConsumeOk)
        raw.wait(lambda: raw.deliveries(), 5, "the delivery")
        raw.wait(lambda: raw.closed(), (TIMEOUT_MS + TICK_MS) / 1000 + 2, "the channel's close")
        timeout = TIMEOUT_MS if rabbitmq_version == "3.10" else -1
        assert raw.closed()[1:] == (406, timed_out_text(1, timeout), 0, 0)
        raw.send(1, C.Channel.CloseOk())
        raw.poll(0.1)
    finally:
        raw.close()
    assert wait_counts(env, q, (1, 0)) == (1, 0)
    counts = {"x-delivery-count": 1} if rabbitmq_version == "3.10" else {"x-acquired-count": 1}
    assert get_all(env, q) == [(b"m1", True, counts)]


def test_x_consumer_timeout_arguments(env, global_consumer_timeout, rabbitmq_version):
    """4.3: the queue argument times out a quorum queue's consumer without any global setting, and the consumer
    argument overrides a short global one; 3.10 ignores both (only its channel's timeout counts)."""
    by_queue = declare(env, "quorum", **{"x-consumer-timeout": TIMEOUT_MS})
    by_global = declare(env, "quorum")
    publish(env, by_queue, [b"q1"])
    publish(env, by_global, [b"g1"])
    a = Watched(env.pika())
    a.consume(by_queue)
    with global_consumer_timeout.window():
        b = Watched(env.pika())
        b.consume(by_global, **{"x-consumer-timeout": 600_000})
    a.wait(lambda: a.deliveries, 5, "a delivery")
    b.wait(lambda: b.deliveries, 5, "a delivery")
    settle(a.conn, (TIMEOUT_MS + TICK_MS) / 1000 + 1)
    settle(b.conn, 0.1)
    if rabbitmq_version == "3.10":
        assert (a.closed, a.cancels) == (None, [])
        assert b.closed[1:] == (406, timed_out_text(b.ch.channel_number, TIMEOUT_MS))
    else:
        assert (len(a.cancels), a.closed) == (1, None)
        assert (b.closed, b.cancels) == (None, [])


def test_a_classic_queue_refuses_x_consumer_timeout_on_43(env, rabbitmq_version):
    """4.3 refuses the argument on a classic queue, as a consumer or a queue argument; 3.10 ignores it."""
    q = declare(env, "classic")
    ch = env.pika().channel()
    text = f"PRECONDITION_FAILED - invalid arg 'x-consumer-timeout' for queue '{q}' in vhost '/' of queue type " \
           "rabbit_classic_queue"
    if rabbitmq_version == "3.10":
        ch.basic_consume(q, lambda *a: None, arguments={"x-consumer-timeout": 1000})
        ch.queue_declare(env.track_queue(env.names("ct-arg")), arguments={"x-consumer-timeout": 1000})
        return
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.basic_consume(q, lambda *a: None, arguments={"x-consumer-timeout": 1000})
    assert (refused.value.reply_code, refused.value.reply_text) == (406, text)
    ch = env.pika().channel()
    other = env.track_queue(env.names("ct-arg"))
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.queue_declare(other, arguments={"x-consumer-timeout": 1000})
    assert (refused.value.reply_code, refused.value.reply_text) == (406, text.replace(q, other))


def test_consumer_timeout_policy(env, request, broker_target, rabbitmq_version):
    """4.3: the lower of the policy's consumer-timeout and the queue argument; 3.10 has no such policy key."""
    from test_policies import Policies

    broker = None
    if broker_target.kind == "embedded":
        broker = request.getfixturevalue("embedded_310" if rabbitmq_version == "3.10" else "embedded_43")
    policies = Policies(broker_target, broker)
    try:
        q = env.track_queue(env.names("ct-policy"))
        refused = policies.set("ct", f"^{q}$", {"consumer-timeout": TIMEOUT_MS}, apply_to="queues")
        if rabbitmq_version == "3.10":
            assert refused == f'[{{<<"consumer-timeout">>,{TIMEOUT_MS}}}] are not recognised policy settings'
            return
        assert refused is None
        env.admin().queue_declare(q, durable=True, arguments={**QQ, "x-consumer-timeout": 600_000})
        publish(env, q, [b"m1"])
        w = Watched(env.pika())
        w.consume(q)
        w.wait(lambda: w.deliveries, 5, "a delivery")
        w.wait(lambda: w.cancels, TIMEOUT_MS / 1000 + 2, "basic.cancel")
        assert within(w.deliveries[0][0], w.cancels[0][0], TIMEOUT_MS, TIMEOUT_MS)
    finally:
        policies.close()


# ------------------------------------------------------------------------------- what only 4.3 does


@pytest.fixture
def raw43(env43):
    """A raw client (announcing consumer_cancel_notify) on the 4.3 broker of env43."""
    raw = Raw(env43.url)
    yield raw
    raw.close()


def _consumer(env: Env, raw: Raw, **queue_arguments) -> str:
    """A quorum queue timing out after TIMEOUT_MS and consumer c1 of it on the raw client's channel 1."""
    q = declare(env, "quorum", **{"x-consumer-timeout": TIMEOUT_MS, **queue_arguments})
    raw.open(1)
    raw.call(1, C.Basic.Consume(queue=q, consumer_tag="c1"), C.Basic.ConsumeOk)
    return q


def _two_deliveries(env: Env, raw: Raw, **queue_arguments) -> str:
    """c1 holding m1 and, 1.2 s later, m2; returns once m1 timed out (basic.cancel)."""
    q = _consumer(env, raw, **queue_arguments)
    publish(env, q, [b"m1"])
    raw.wait(lambda: len(raw.deliveries()) == 1, 5, "m1")
    raw.poll(1.2)
    publish(env, q, [b"m2"])
    raw.wait(lambda: len(raw.deliveries()) == 2, 5, "m2")
    raw.wait(lambda: raw.cancels(), TIMEOUT_MS / 1000 + 1, "basic.cancel")
    assert within(raw.deliveries()[0][0], raw.cancels()[0][0], TIMEOUT_MS, TIMEOUT_MS)
    return q


def _again(raw: Raw, seen: int = 2) -> list[tuple]:
    """(tag, redelivered, body, headers) of the deliveries after the first `seen`."""
    return [d[1:] for d in raw.deliveries()[seen:]]


def test_only_expired_deliveries_go_back_and_the_consumer_waits_for_their_tags(env43, raw43):
    """m1 expired, m2 not yet: m1 is back in the queue, m2 stays with the consumer and can be acked. The consumer
    gets nothing (not even a new message) until the client settles m1's tag, which is no error and leaves the
    message where it is; then m1 and the new message are delivered to it again, and later timeouts cancel it
    again."""
    env, raw = env43, raw43
    q = _two_deliveries(env, raw)
    assert raw.cancels()[0][1] == "c1" and raw.closed() is None
    assert queue_counts(env.url, q) == (1, 1)
    raw.send(1, C.Basic.Ack(delivery_tag=2))               # m2, still held: settled as usual
    publish(env, q, [b"m3"])
    raw.sync(1)
    raw.poll(0.3)
    assert len(raw.deliveries()) == 2 and queue_counts(env.url, q) == (2, 1)
    raw.send(1, C.Basic.Ack(delivery_tag=1))               # m1's tag, timed out: no error
    raw.wait(lambda: len(raw.deliveries()) == 4, 3, "m1 and m3 again")
    assert _again(raw) == [(3, True, b"m1", {"x-acquired-count": 1}), (4, False, b"m3", None)]
    raw.wait(lambda: len(raw.cancels()) == 2, TIMEOUT_MS / 1000 + 1, "the second basic.cancel")
    assert raw.closed() is None and queue_counts(env.url, q) == (2, 1)


@pytest.mark.parametrize("how", ["ack", "ack-multiple", "nack-requeue", "reject-discard", "recover"])
def test_settling_a_timed_out_tag(env43, raw43, how):
    """m1's timed-out tag settled while m2 is still held. An ack, or a nack / reject without requeue (which
    dead-letters nothing: the message is back in the queue), serves the consumer again at once; a requeue
    (rabbit_fifo's return) only at its next settlement; basic.recover also returns m2, which is that."""
    env, raw = env43, raw43
    dlx_queue, extra = None, {}
    if how == "reject-discard":
        dlx = env.exchange("fanout")
        dlx_queue = env.queue()
        env.admin().queue_bind(dlx_queue, dlx)
        extra = {"x-dead-letter-exchange": dlx}
    _two_deliveries(env, raw, **extra)
    raw.send(1, {"ack": C.Basic.Ack(delivery_tag=1), "ack-multiple": C.Basic.Ack(delivery_tag=2, multiple=True),
                 "nack-requeue": C.Basic.Nack(delivery_tag=1, requeue=True),
                 "reject-discard": C.Basic.Reject(delivery_tag=1, requeue=False),
                 "recover": C.Basic.Recover(requeue=True)}[how])
    raw.sync(1)
    raw.poll(0.3)
    if how == "nack-requeue":
        assert _again(raw) == []
        raw.send(1, C.Basic.Ack(delivery_tag=2))           # its next settlement
        raw.wait(lambda: len(raw.deliveries()) == 3, 3, "m1 again")
    expected = [(3, True, b"m1", {"x-acquired-count": 1})]
    if how == "recover":
        expected.append((4, True, b"m2", {"x-acquired-count": 1}))
    assert _again(raw) == expected
    if dlx_queue is not None:
        assert queue_counts(env.url, dlx_queue) == (0, 0)
    assert raw.closed() is None


def test_recover_with_only_timed_out_tags_serves_nothing(env43, raw43):
    """basic.recover when the consumer holds nothing but m1's timed-out tag: it is out of its timeout but waits
    for a settlement that cannot come; the message stays in the queue."""
    env, raw = env43, raw43
    q = _consumer(env, raw)
    publish(env, q, [b"m1"])
    raw.wait(lambda: raw.cancels(), TIMEOUT_MS / 1000 + 3, "basic.cancel")
    raw.call(1, C.Basic.Recover(requeue=True), C.Basic.RecoverOk)
    raw.poll(0.5)
    assert len(raw.deliveries()) == 1 and queue_counts(env.url, q) == (1, 1)


def test_a_consumer_cancelled_by_the_client_closes_the_channel_when_its_delivery_times_out(env43, raw43):
    """The consumer is gone from the channel, so the timeout of a delivery it still held closes the channel
    (406, -1 ms) instead of cancelling anything; meanwhile the queue counts it as a consumer."""
    env, raw = env43, raw43
    q = _consumer(env, raw)
    publish(env, q, [b"m1"])
    raw.wait(lambda: raw.deliveries(), 5, "m1")
    raw.call(1, C.Basic.Cancel(consumer_tag="c1"), C.Basic.CancelOk)
    assert queue_counts(env.url, q) == (0, 1)
    raw.wait(lambda: raw.closed(), TIMEOUT_MS / 1000 + 2, "the channel's close")
    assert raw.closed()[1:] == (406, timed_out_text(1, -1), 0, 0) and raw.cancels() == []
    raw.send(1, C.Channel.CloseOk())
    assert wait_counts(env, q, (1, 0)) == (1, 0)


def test_client_cancel_of_a_timed_out_consumer(env43, raw43):
    """After the broker's basic.cancel the client may still cancel the consumer (cancel-ok); holding nothing, it
    is no longer counted, and acking the timed-out tag afterwards is no error."""
    env, raw = env43, raw43
    q = _consumer(env, raw)
    publish(env, q, [b"m1"])
    raw.wait(lambda: raw.cancels(), TIMEOUT_MS / 1000 + 3, "basic.cancel")
    assert queue_counts(env.url, q) == (1, 1)
    raw.call(1, C.Basic.Cancel(consumer_tag="c1"), C.Basic.CancelOk)
    assert queue_counts(env.url, q) == (1, 0)
    raw.send(1, C.Basic.Ack(delivery_tag=1))
    raw.sync(1)
    assert raw.closed() is None and queue_counts(env.url, q) == (1, 0)


def test_a_single_active_consumer_in_its_timeout_makes_way(env43, raw43):
    """The active consumer's delivery times out: it goes back to waiting (not counted), the next consumer takes
    over and gets the message; the first, once it settled its tag, takes over at the second one's timeout."""
    env, raw = env43, raw43
    q = declare(env, "quorum", **{"x-consumer-timeout": TIMEOUT_MS, "x-single-active-consumer": True})
    for channel, tag in ((1, "c1"), (2, "c2")):
        raw.open(channel)
        raw.call(channel, C.Basic.Consume(queue=q, consumer_tag=tag), C.Basic.ConsumeOk)
    publish(env, q, [b"m1"])
    raw.wait(lambda: len(raw.deliveries()) == 2, TIMEOUT_MS / 1000 + 3, "m1 on c1, then on c2")
    on = [(e[1], e[2].consumer_tag, e[2].redelivered, e[4], e[3].headers) for e in raw.events
          if isinstance(e[2], C.Basic.Deliver)]
    assert on == [(1, "c1", False, b"m1", None), (2, "c2", True, b"m1", {"x-acquired-count": 1})]
    assert raw.cancels()[0][1] == "c1" and queue_counts(env.url, q) == (0, 1)
    raw.send(1, C.Basic.Ack(delivery_tag=1))
    raw.wait(lambda: len(raw.deliveries()) == 3, TIMEOUT_MS / 1000 + 3, "m1 back on c1")
    assert [c[1] for c in raw.cancels()] == ["c1", "c2"]
    last = [e for e in raw.events if isinstance(e[2], C.Basic.Deliver)][-1]
    assert (last[1], last[2].consumer_tag, last[3].headers) == (1, "c1", {"x-acquired-count": 2})


# ------------------------------------------------------------------------ the clock, without a socket


def _driven(version: str, **config):
    """A sans-I/O broker (test_sans_io.Driver: a fake clock, no socket) as `version`, and a connected client with
    a queue "q" holding m1, consumed on channel 1 by c1 (prefetch 10)."""
    from test_sans_io import Driver

    driver = Driver(BrokerConfig(rabbitmq_version=version, channel_tick_interval=TICK_MS, **config))
    c = driver.connect()
    c.handshake(heartbeat=0)
    c.open_channel(1)
    return driver, c


def _consume(c, queue: str, **arguments) -> list:
    c.rpc(1, C.Basic.Qos(prefetch_count=10), expect=C.Basic.QosOk)
    return c.send(c.method(1, C.Basic.Consume(queue=queue, consumer_tag="c1", arguments=arguments or None)))


def test_310_ticks_from_the_channel_open_stop_while_it_holds_nothing_and_restart_at_a_delivery():
    """The model of RabbitMQ 3.10's tick timer: armed when the channel opens, re-armed at each tick, cancelled
    when the channel hibernates holding nothing (here: at a tick finding nothing unacked) and armed again when a
    delivery wakes it. The check at a tick is strict: a delivery exactly `timeout` old at a tick is not yet late."""
    driver, c = _driven("3.10", consumer_timeout=5000)
    ch = c.conn.channels[1]
    assert ch in driver.core.timed_channels and ch.due == driver.clock.now * 1000 + TICK_MS
    driver.tick(1.0)                                       # the first tick: nothing unacked, the timer stops
    assert ch not in driver.core.timed_channels
    driver.tick(1.5)
    c.declare(1, "q")
    c.send(c.publish_bytes(1, "q", b"m1")[0])
    assert [f.name for f in _consume(c, "q")] == ["Basic.ConsumeOk", "Basic.Deliver", "header", "body"]
    delivered = driver.clock.now
    assert ch.due == delivered * 1000 + TICK_MS             # the delivery restarts the tick
    driver.tick(5.99)                                      # ticks at +1 .. +5: +5 is not past the deadline
    assert c.frames() == []
    driver.tick(0.01)                                      # the tick at +6
    [close] = c.frames()
    assert (close.method.name, close.method.reply_code, close.method.class_id, close.method.method_id) == (
        "Channel.Close", 406, 0, 0)
    assert close.method.reply_text == timed_out_text(1, 5000)
    assert ch not in driver.core.timed_channels


def test_43_times_out_a_quorum_delivery_at_its_deadline_and_never_a_classic_one():
    driver, c = _driven("4.3", consumer_timeout=5000)
    c.declare(1, "classic")
    c.declare(1, "qq", durable=True, arguments=QQ)
    for q in ("classic", "qq"):
        c.send(c.publish_bytes(1, q, b"m1")[0])
    _consume(c, "classic")
    assert not driver.core.timed_channels                  # nothing to time out, nothing to look at
    c.send(c.method(1, C.Basic.Consume(queue="qq", consumer_tag="c2")))
    ch = c.conn.channels[1]
    assert ch in driver.core.timed_channels and ch.due == driver.clock.now * 1000 + 5000
    c.frames()
    driver.tick(4.999)
    assert c.frames() == []
    driver.tick(0.001)
    assert [(f.name, f.method.consumer_tag) for f in c.frames()] == [("Basic.Cancel", "c2")]
    assert ch not in driver.core.timed_channels
    driver.tick(3600)
    assert c.frames() == []


# ------------------------------------------------------------------------------------- configuration


def test_the_settings_and_their_defaults():
    config = BrokerConfig()
    assert (config.consumer_timeout, config.channel_tick_interval) == (DEFAULT_TIMEOUT_MS, DEFAULT_TICK_MS)
    config = build_config(parse_args(["--consumer-timeout", "5000", "--channel-tick-interval", "1000"]))
    assert (config.consumer_timeout, config.channel_tick_interval) == (5000, 1000)
    for key, value in (("consumer_timeout", -1), ("consumer_timeout", "5s"), ("consumer_timeout", True),
                       ("channel_tick_interval", 0)):
        with pytest.raises(ValueError, match=key):
            BrokerConfig(**{key: value})


def test_the_settings_from_toml(tmp_path):
    path = tmp_path / "broker.toml"
    path.write_text("[broker]\nconsumer_timeout = 900000\nchannel_tick_interval = 5000\n")
    config = BrokerConfig.from_toml(str(path))
    assert (config.consumer_timeout, config.channel_tick_interval) == (900_000, 5000)
