"""Differential tests of stream queues (`x-queue-type=stream`) as RabbitMQ 3.10 serves them to AMQP 0-9-1
clients: declare rules, consumer offsets, the `x-stream-offset` header, prefetch as credit, what streams
refuse, several consumers, and retention by whole segments.

Every test takes ``broker_url`` and runs against the embedded broker and RabbitMQ with the same assertions.
Streams are deleted at teardown. RabbitMQ writes a chunk per batch its stream writer takes, so tests that
depend on chunk boundaries publish one message per confirm round trip; it applies retention asynchronously
after a segment rolls and reports message_count with up to 5 s delay: those are awaited with wait_until.
Segment sizes stay well above osiris' header sizes: RabbitMQ 3.10's stream writer loops on segments
smaller than a chunk header, and deleting a stream while retention evaluations are queued crashes osiris'
retention process (often enough, the whole node).
"""

from __future__ import annotations

import datetime
import time

import pika
import pytest
from spark_amqp_broker.stream import with_offset_header

from spark_amqp.codec import fields, frames, properties

from helpers import refusal, safe_close
from support import Env
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)

STREAM = {"x-queue-type": "stream"}


class Streams(Env):
    """support.Env (connections and queues of one test, closed and deleted at teardown) for streams, with a
    publisher that waits for each confirm."""

    def connect(self):
        return self.pika()

    def admin(self):
        if self._admin is None or not self._admin.is_open:
            self._admin = self.pika().channel()
            self._admin.confirm_delivery()
        return self._admin

    def declare(self, arguments=None, **kw):
        return self.queue(arguments={**STREAM, **(arguments or {})}, durable=True, **kw)

    def publish(self, stream, bodies, **props):
        """One message per confirm round trip: each is its own chunk on both brokers."""
        ch = self.admin()
        for body in bodies:
            ch.basic_publish("", stream, body, pika.BasicProperties(**props) if props else None)

    def consume(self, stream, offset=None, prefetch=100, ch=None):
        """A consumer from `offset` on a new connection (or on channel ch): (channel, deliveries), where
        deliveries fills with (x-stream-offset, body, method, properties)."""
        if ch is None:
            ch = self.connect().channel()
            ch.basic_qos(prefetch_count=prefetch)
        got = []
        args = {} if offset is None else {"x-stream-offset": offset}
        ch.basic_consume(stream, lambda _c, m, p, b: got.append((p.headers["x-stream-offset"], b, m, p)),
                         arguments=args)
        return ch, got

    def read(self, stream, offset=None, expect=None, quiet=0.4):
        """Offsets and bodies a new consumer from `offset` gets: `expect` many, then nothing more for
        `quiet` seconds."""
        ch, got = self.consume(stream, offset)
        deadline = time.monotonic() + 5.0
        while expect and len(got) < expect and time.monotonic() < deadline:
            ch.connection.process_data_events(0.05)
        ch.connection.process_data_events(quiet)
        out = [(o, b) for o, b, _m, _p in got]
        safe_close(ch.connection)
        return out


@pytest.fixture
def streams(broker_url, unique_name):
    s = Streams(broker_url, unique_name)
    yield s
    s.close()


def pump(ch, until, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out waiting for deliveries"
        ch.connection.process_data_events(0.05)


def fresh_channel(streams):
    return streams.connect().channel()


def message_count(streams, name):
    ch = fresh_channel(streams)
    count = ch.queue_declare(name, passive=True).method.message_count
    safe_close(ch.connection)
    return count


def rs(name):
    return f"queue '{name}' in vhost '/'"


# -------------------------------------------------------------------------------------------- declare


@pytest.mark.parametrize("kw, prop", [({"durable": False}, "non-durable"),
                                      ({"exclusive": True}, "exclusive-owner"),
                                      ({"auto_delete": True}, "auto-delete"),
                                      ({"durable": False, "exclusive": True}, "exclusive-owner")])
def test_declare_refuses_non_durable_exclusive_auto_delete(streams, kw, prop):
    name = streams.names("s")
    ch = fresh_channel(streams)
    kw = {"durable": True, **kw}
    assert refusal(lambda: ch.queue_declare(name, arguments=STREAM, **kw)) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid property '{prop}' for {rs(name)}")


def test_declare_refuses_server_named(streams):
    ch = fresh_channel(streams)
    assert refusal(lambda: ch.queue_declare("", durable=True, arguments=STREAM)) == (
        "channel", 406, "PRECONDITION_FAILED - Cannot declare a server-named queue for type rabbit_stream_queue")


@pytest.mark.parametrize("key, value, reason", [
    ("x-message-ttl", 1000, None),
    ("x-max-length", 10, None),
    ("x-overflow", "drop-head", None),
    ("x-dead-letter-exchange", "dlx", None),
    ("x-max-priority", 5, None),
    ("x-single-active-consumer", True, None),
    ("x-max-age", "1X", "invalid_max_age"),
    ("x-max-age", "0D", "invalid_max_age"),
    ("x-max-age", "10", "invalid_max_age"),
    ("x-max-age", 5, "{unacceptable_type,signedint}"),
    ("x-max-length-bytes", -1, "{value_negative,-1}"),
    ("x-max-length-bytes", "a", '"expected integer, got longstr"'),
    ("x-stream-max-segment-size-bytes", -5, "{value_negative,-5}"),
    ("x-initial-cluster-size", 0, "{value_zero,0}"),
    ("x-queue-leader-locator", "bad", "invalid_queue_locator_arg"),
])
def test_declare_refuses_arguments(streams, key, value, reason):
    name = streams.names("s")
    ch = fresh_channel(streams)
    text = (f"PRECONDITION_FAILED - invalid arg '{key}' for {rs(name)}: {reason}" if reason else
            f"PRECONDITION_FAILED - invalid arg '{key}' for {rs(name)} of queue type rabbit_stream_queue")
    assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={**STREAM, key: value})) == (
        "channel", 406, text)


def test_declare_refuses_segment_size_over_limit_and_crashes_on_age_without_digits(streams, rabbitmq_version):
    """x-max-age without digits crashes 3.10's channel (541); 4.x calls it invalid."""
    name = streams.names("s")
    ch = fresh_channel(streams)
    args = {**STREAM, "x-stream-max-segment-size-bytes": 3_000_000_001}
    assert refusal(lambda: ch.queue_declare(name, durable=True, arguments=args)) == (
        "channel", 406, "PRECONDITION_FAILED - Exceeded max value for x-stream-max-segment-size-bytes")
    ch = fresh_channel(streams)
    args = {**STREAM, "x-max-age": "h"}
    assert refusal(lambda: ch.queue_declare(name, durable=True, arguments=args)) == (
        ("connection", 541, "INTERNAL_ERROR") if rabbitmq_version == "3.10" else
        ("channel", 406, f"PRECONDITION_FAILED - invalid arg 'x-max-age' for {rs(name)}: invalid_max_age"))


def test_declare_accepts_stream_arguments_and_ignores_unknown_ones(streams):
    name = streams.declare({"x-max-age": "7D", "x-max-length-bytes": 10_000_000,
                            "x-stream-max-segment-size-bytes": 1_000_000, "x-initial-cluster-size": 1,
                            "x-queue-leader-locator": "client-local", "x-unknown": 1})
    ok = fresh_channel(streams).queue_declare(name, passive=True).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (name, 0, 0)


def test_redeclare_must_be_equivalent(streams, rabbitmq_version):
    """4.x keeps x-max-age in milliseconds: "60m" is "1h", and the texts print milliseconds."""
    name = streams.declare({"x-max-age": "1h"})
    ms = rabbitmq_version == "4.3"
    if ms:
        fresh_channel(streams).queue_declare(name, durable=True, arguments={**STREAM, "x-max-age": "60m"})
    same = fresh_channel(streams).queue_declare(name, durable=True, arguments={**STREAM, "x-max-age": "1h"})
    assert same.method.queue == name
    cases = [
        ({"durable": True, "arguments": {**STREAM, "x-max-age": "2h"}},
         f"inequivalent arg 'x-max-age' for {rs(name)}: received '{'7200000' if ms else '2h'}' but current "
         f"is '{'3600000' if ms else '1h'}'"),
        ({"durable": True, "arguments": {**STREAM}},
         f"inequivalent arg 'x-max-age' for {rs(name)}: received none but current is the value "
         f"'{'3600000' if ms else '1h'}' of type 'longstr'"),
        ({"durable": True, "arguments": {**STREAM, "x-max-age": "1h", "x-max-length-bytes": 100}},
         f"inequivalent arg 'x-max-length-bytes' for {rs(name)}: received the value '100' of type "
         "'signedint' but current is none"),
        ({"durable": True, "arguments": {"x-queue-type": "classic"}},
         f"inequivalent arg 'x-queue-type' for {rs(name)}: received 'classic' but current is 'stream'"),
        ({"durable": False, "arguments": {**STREAM, "x-max-age": "1h"}},
         f"inequivalent arg 'durable' for {rs(name)}: received 'false' but current is 'true'"),
    ]
    for kw, text in cases:
        ch = fresh_channel(streams)
        assert refusal(lambda: ch.queue_declare(name, **kw)) == ("channel", 406, "PRECONDITION_FAILED - " + text)


# ----------------------------------------------------------------------------- publish and offsets


def test_publish_confirmed_and_first_reads_everything_with_offset_headers(streams):
    name = streams.declare()
    ch = streams.admin()
    ch.basic_publish("", name, b"h0", pika.BasicProperties(
        headers={"a": 1, "x-stream-offset": "mine"}, content_type="text/plain", priority=3, delivery_mode=2,
        message_id="mid", expiration="60000"))
    streams.publish(name, [b"h1", b"h2"])
    ch2, got = streams.consume(name, "first")
    pump(ch2, lambda: len(got) >= 3)
    assert [(o, b) for o, b, _m, _p in got] == [(0, b"h0"), (1, b"h1"), (2, b"h2")]
    _o, _b, method, props = got[0]
    assert (method.redelivered, method.exchange, method.routing_key) == (False, "", name)
    assert props.headers == {"a": 1, "x-stream-offset": 0}
    assert (props.content_type, props.priority, props.delivery_mode, props.message_id, props.expiration) == (
        "text/plain", 3, 2, "mid", "60000")
    assert [p.headers for _o, _b, _m, p in got[1:]] == [{"x-stream-offset": 1}, {"x-stream-offset": 2}]
    assert all(isinstance(o, int) for o, _b, _m, _p in got)
    # declare-ok: message_count counts offsets, consumer_count is 0 for streams even with a consumer
    wait_until(lambda: message_count(streams, name) == 3, timeout=10, message="message_count 3")
    ok = fresh_channel(streams).queue_declare(name, durable=True, arguments=STREAM).method
    assert (ok.message_count, ok.consumer_count) == (3, 0)


def test_offset_numbers(streams):
    name = streams.declare()
    streams.publish(name, [b"m0", b"m1", b"m2", b"m3", b"m4"])
    every = [(i, b"m%d" % i) for i in range(5)]
    assert streams.read(name, 0, expect=5) == every
    assert streams.read(name, 3, expect=2) == every[3:]
    assert streams.read(name, -1, expect=5) == every
    assert streams.read(name, "first", expect=5) == every


def test_offset_past_the_end_waits_for_that_offset(streams):
    name = streams.declare()
    streams.publish(name, [b"m0", b"m1"])
    ch, got = streams.consume(name, 3)
    ch.connection.process_data_events(0.3)
    assert got == []
    streams.publish(name, [b"m2", b"m3", b"m4"])
    pump(ch, lambda: len(got) >= 2)
    ch.connection.process_data_events(0.3)
    assert [(o, b) for o, b, _m, _p in got] == [(3, b"m3"), (4, b"m4")]


def test_offset_next_and_default_get_only_new_messages(streams):
    name = streams.declare()
    streams.publish(name, [b"old"])
    ch1, next_ = streams.consume(name, "next")
    ch2, default = streams.consume(name)
    ch1.connection.process_data_events(0.3)
    ch2.connection.process_data_events(0.1)
    assert next_ == default == []
    streams.publish(name, [b"new"])
    pump(ch1, lambda: next_)
    pump(ch2, lambda: default)
    assert [(o, b) for o, b, _m, _p in next_] == [(o, b) for o, b, _m, _p in default] == [(1, b"new")]


def test_offset_last_is_the_start_of_the_last_chunk(streams):
    """A message published alone (after the previous ones were confirmed) is a chunk of its own on both
    brokers, so `last` starts at it."""
    name = streams.declare()
    streams.publish(name, [b"m0", b"m1", b"m2"])
    assert streams.read(name, "last", expect=1) == [(2, b"m2")]


def test_offset_timestamp_and_interval(streams):
    name = streams.declare()
    streams.publish(name, [b"old"])
    time.sleep(1.1)
    # the next whole second: AMQP timestamps have seconds, chunks milliseconds
    cut = datetime.datetime.fromtimestamp(int(time.time()) + 1, datetime.timezone.utc).replace(tzinfo=None)
    time.sleep(max(0.0, cut.replace(tzinfo=datetime.timezone.utc).timestamp() - time.time()) + 0.05)
    streams.publish(name, [b"new"])
    assert streams.read(name, cut, expect=1) == [(1, b"new")]
    assert streams.read(name, datetime.datetime(2000, 1, 1), expect=2) == [(0, b"old"), (1, b"new")]
    assert streams.read(name, "1h", expect=2) == [(0, b"old"), (1, b"new")]
    assert streams.read(name, "30m", expect=2) == [(0, b"old"), (1, b"new")]
    future = datetime.datetime.utcnow() + datetime.timedelta(hours=1)
    ch, got = streams.consume(name, future)
    ch.connection.process_data_events(0.3)
    assert got == []
    streams.publish(name, [b"later"])
    pump(ch, lambda: got)
    assert [(o, b) for o, b, _m, _p in got] == [(2, b"later")]


@pytest.mark.parametrize("offset, outcome", [
    ("0s", ("channel", 406, "PRECONDITION_FAILED - invalid arg 'x-stream-offset' for {q}: "
                            '{{invalid_stream_offset_arg,{{longstr,<<"0s">>}}}}')),
    ("5", ("channel", 406, "PRECONDITION_FAILED - invalid arg 'x-stream-offset' for {q}: "
                           '{{invalid_stream_offset_arg,{{longstr,<<"5">>}}}}')),
    ("bad", ("connection", 541, "INTERNAL_ERROR")),
    (True, ("connection", 541, "INTERNAL_ERROR")),
])
def test_offset_refused(streams, offset, outcome, rabbitmq_version):
    """An interval without digits crashes 3.10's channel (541); 4.x refuses it as any bad interval."""
    if offset == "bad" and rabbitmq_version == "4.3":
        outcome = ("channel", 406, "PRECONDITION_FAILED - invalid arg 'x-stream-offset' for {q}: "
                                   '{{invalid_stream_offset_arg,{{longstr,<<"bad">>}}}}')
    name = streams.declare()
    ch = fresh_channel(streams)
    ch.basic_qos(prefetch_count=10)
    level, code, text = outcome
    assert refusal(lambda: streams.consume(name, offset, ch=ch)) == (level, code, text.format(q=rs(name)))


# ---------------------------------------------------------------------------------- consume rules


def test_consume_needs_consumer_prefetch(streams, rabbitmq_version):
    """The texts differ by version; 4.x takes a global prefetch as a per-consumer one, so a channel with
    only a global prefetch may consume a stream."""
    name = streams.declare()
    where = rs(name)
    no_prefetch = (f"PRECONDITION_FAILED - consumer prefetch count is not set for '{where}'"
                   if rabbitmq_version == "3.10" else
                   f"PRECONDITION_FAILED - consumer prefetch count is not set for stream {where}")
    ch = fresh_channel(streams)
    assert refusal(lambda: ch.basic_consume(name, lambda *a: None)) == ("channel", 406, no_prefetch)
    ch = fresh_channel(streams)
    ch.basic_qos(prefetch_count=10, global_qos=True)
    if rabbitmq_version == "3.10":
        assert refusal(lambda: ch.basic_consume(name, lambda *a: None)) == ("channel", 406, no_prefetch)
    else:
        assert ch.basic_consume(name, lambda *a: None)
    ch = fresh_channel(streams)
    ch.basic_qos(prefetch_count=10)
    ch.basic_qos(prefetch_count=10, global_qos=True)
    if rabbitmq_version == "3.10":
        assert refusal(lambda: ch.basic_consume(name, lambda *a: None)) == (
            "connection", 540, f"NOT_IMPLEMENTED - {where} does not support global qos")
    else:
        assert ch.basic_consume(name, lambda *a: None)
    ch = fresh_channel(streams)
    ch.basic_qos(prefetch_count=10)
    assert refusal(lambda: ch.basic_consume(name, lambda *a: None, auto_ack=True)) == (
        "connection", 540, "NOT_IMPLEMENTED - automatic acknowledgement not supported by stream "
        f"{'queues ' if rabbitmq_version == '3.10' else ''}{where}")
    ch = fresh_channel(streams)
    ch.basic_qos(prefetch_count=10)
    assert refusal(lambda: ch.basic_consume(name, lambda *a: None, arguments={"x-priority": 5})) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid arg 'x-priority' for {where} of queue type "
        "rabbit_stream_queue")


def test_acks_are_credit_and_remove_nothing(streams):
    name = streams.declare()
    streams.publish(name, [b"m%d" % i for i in range(6)])
    ch, got = streams.consume(name, "first", prefetch=2)
    pump(ch, lambda: len(got) >= 2)
    ch.connection.process_data_events(0.3)
    assert [o for o, *_ in got] == [0, 1]
    ch.basic_ack(got[0][2].delivery_tag)
    pump(ch, lambda: len(got) >= 3)
    ch.connection.process_data_events(0.3)
    assert [o for o, *_ in got] == [0, 1, 2]
    ch.basic_ack(got[2][2].delivery_tag, multiple=True)
    pump(ch, lambda: len(got) >= 5)
    ch.connection.process_data_events(0.3)
    assert [o for o, *_ in got] == [0, 1, 2, 3, 4]
    # a second consumer from first sees everything: acks removed nothing
    assert streams.read(name, "first", expect=6) == [(i, b"m%d" % i) for i in range(6)]
    wait_until(lambda: message_count(streams, name) == 6, timeout=10, message="message_count 6")


def test_exclusive_consume_flag_is_ignored(streams):
    name = streams.declare()
    streams.publish(name, [b"m0"])
    ch = fresh_channel(streams)
    ch.basic_qos(prefetch_count=10)
    ch.basic_consume(name, lambda *a: None, exclusive=True, arguments={"x-stream-offset": "first"})
    assert streams.read(name, "first", expect=1) == [(0, b"m0")]


def test_get_and_purge_are_not_implemented(streams):
    name = streams.declare()
    streams.publish(name, [b"m0"])
    ch = fresh_channel(streams)
    assert refusal(lambda: ch.basic_get(name)) == (
        "connection", 540, f"NOT_IMPLEMENTED - basic.get not supported by stream queues {rs(name)}")
    ch = fresh_channel(streams)
    assert refusal(lambda: ch.queue_purge(name)) == (
        "connection", 540, f"NOT_IMPLEMENTED - queue.purge not supported by stream queues {rs(name)}")


@pytest.mark.parametrize("settle", ["nack", "nack-drop", "reject", "reject-drop", "recover"])
def test_nack_reject_recover_refused(streams, settle, rabbitmq_version):
    """3.10 refuses them (540; 541 for recover); 4.x settles the delivery, giving its credit back, and
    redelivers nothing."""
    name = streams.declare()
    streams.publish(name, [b"m0", b"m1"])
    ch, got = streams.consume(name, "first")
    pump(ch, lambda: len(got) >= 2)
    tag = got[0][2].delivery_tag

    def act():
        if settle.startswith("nack"):
            ch.basic_nack(tag, requeue=settle == "nack")
        elif settle.startswith("reject"):
            ch.basic_reject(tag, requeue=settle == "reject")
        else:
            ch.basic_recover(requeue=True)
        ch.connection.process_data_events(1.0)
        ch.basic_qos(prefetch_count=10)

    if rabbitmq_version == "4.3":
        act()
        assert ch.is_open
        assert [o for o, _b, _m, _p in got] == [0, 1]
        return
    expected = (("connection", 541, "INTERNAL_ERROR") if settle == "recover" else
                ("connection", 540, "NOT_IMPLEMENTED - basic.nack and basic.reject not supported by stream "
                                    f"queues {rs(name)}"))
    assert refusal(act) == expected


def test_unknown_delivery_tag_on_ack(streams):
    name = streams.declare()
    streams.publish(name, [b"m0"])
    ch, got = streams.consume(name, "first")
    pump(ch, lambda: got)

    def act():
        ch.basic_ack(99)
        ch.basic_qos(prefetch_count=10)
    assert refusal(act) == ("channel", 406, "PRECONDITION_FAILED - unknown delivery tag 99")


def test_several_consumers_at_different_offsets(streams):
    name = streams.declare()
    streams.publish(name, [b"m0", b"m1", b"m2"])
    conn = streams.connect()
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    _c, first = streams.consume(name, "first", ch=ch)
    _c, two = streams.consume(name, 2, ch=ch)
    _c, next_ = streams.consume(name, "next", ch=ch)
    other, last = streams.consume(name, "last")
    pump(ch, lambda: len(first) >= 3 and len(two) >= 1)
    pump(other, lambda: last)
    streams.publish(name, [b"m3"])
    pump(ch, lambda: len(first) >= 4 and len(two) >= 2 and next_)
    pump(other, lambda: len(last) >= 2)
    conn.process_data_events(0.3)

    def offsets(got):
        return [o for o, *_ in got]
    assert (offsets(first), offsets(two), offsets(next_), offsets(last)) == (
        [0, 1, 2, 3], [2, 3], [3], [2, 3])
    tags = [m.delivery_tag for _o, _b, m, _p in sorted(first + two + next_, key=lambda g: g[2].delivery_tag)]
    assert tags == list(range(1, 8))   # one delivery-tag sequence per channel


def test_delete_cancels_consumers_and_counts_zero(streams):
    name = streams.declare()
    streams.publish(name, [b"m0", b"m1"])
    ch, got = streams.consume(name, "first")
    cancelled = []
    ch.add_on_cancel_callback(cancelled.append)
    pump(ch, lambda: len(got) >= 2)
    # if-unused and if-empty do not stop a stream's deletion; delete-ok counts 0
    ok = fresh_channel(streams).queue_delete(name, if_unused=True, if_empty=True)
    assert ok.method.message_count == 0
    pump(ch, lambda: cancelled)
    assert cancelled[0].method.NAME == "Basic.Cancel"
    assert ch.is_open


def test_exchange_routed_messages_append_but_dead_letters_are_dropped(streams, rabbitmq_version):
    """A stream bound to an exchange takes what it routes; a classic queue's dead letters routed to it are
    dropped by 3.10, which dead-letters with stateless queue states that its streams ignore
    (rabbit_stream_queue:deliver/2, "TODO what do we do with stateless?"), and appended by 4.x."""
    name = streams.declare()
    x = streams.exchange("fanout")
    admin = streams.admin()
    admin.queue_bind(name, x)
    q = streams.queue(arguments={"x-dead-letter-exchange": x})
    admin.basic_publish("", q, b"dead")
    ch = streams.connect().channel()
    method, _props, _body = ch.basic_get(q)
    ch.basic_reject(method.delivery_tag, requeue=False)
    ch.queue_declare(q, passive=True)   # a round trip after the reject
    admin.basic_publish(x, "rk", b"routed")
    reader, got = streams.consume(name, "first")
    pump(reader, lambda: got)
    reader.connection.process_data_events(0.5)
    if rabbitmq_version == "4.3":
        pump(reader, lambda: len(got) >= 2)
        assert [(o, b, m.exchange, m.routing_key) for o, b, m, _p in got] == [
            (0, b"dead", x, q), (1, b"routed", x, "rk")]
        assert got[0][3].headers["x-first-death-reason"] == "rejected"
        assert got[1][3].headers == {"x-stream-offset": 1}
        return
    assert [(o, b, m.exchange, m.routing_key) for o, b, m, _p in got] == [(0, b"routed", x, "rk")]
    assert got[0][3].headers == {"x-stream-offset": 0}


# ------------------------------------------------------------------------------ segments, retention

# 1000-byte bodies, 2500-byte segments: three one-message chunks fill a segment on both brokers (RabbitMQ
# stores ~150 bytes more per message than the embedded broker; both stay within 8 + 3 x chunk >= 2500 >
# 8 + 2 x chunk).
BODY = 1000
SEGMENT = {"x-stream-max-segment-size-bytes": 2500}


def _bodies(n):
    return [b"%d" % i + b"." * (BODY - len(b"%d" % i)) for i in range(n)]


def test_segment_roll_leaves_an_offset_gap(streams):
    """Each new segment starts with osiris' writer tracking snapshot, one offset no consumer sees."""
    name = streams.declare(SEGMENT)
    bodies = _bodies(7)
    streams.publish(name, bodies)
    got = streams.read(name, "first", expect=7)
    assert [o for o, _b in got] == [0, 1, 2, 4, 5, 6, 8]
    assert [b for _o, b in got] == bodies
    assert streams.read(name, 3, expect=4) == got[3:]
    wait_until(lambda: message_count(streams, name) == 9, timeout=10, message="message_count 9")
    time.sleep(0.3)   # let RabbitMQ's retention evaluations (run on every roll) finish before the delete


def test_retention_by_max_length_bytes_removes_whole_segments(streams):
    name = streams.declare({**SEGMENT, "x-max-length-bytes": 3000})
    bodies = _bodies(7)
    streams.publish(name, bodies)
    # two rolls: the first two segments went, the active one (tracking chunk 7, message 8) stays
    time.sleep(0.5)   # RabbitMQ: a reader opened while retention deletes its segment may never deliver
    wait_until(lambda: streams.read(name, "first", expect=1, quiet=0.2) == [(8, bodies[6])], timeout=10,
               message="retention to leave only the last segment")
    assert streams.read(name, 0, expect=1) == [(8, bodies[6])]
    assert streams.read(name, 5, expect=1) == [(8, bodies[6])]
    wait_until(lambda: message_count(streams, name) == 2, timeout=10, message="message_count 2")
    time.sleep(0.5)   # let RabbitMQ's retention evaluations finish before the stream is deleted


def test_retention_needs_a_segment_roll(streams):
    """Neither limit removes anything from the one (active) segment of a stream."""
    name = streams.declare({"x-max-length-bytes": 3000, "x-max-age": "1s"})
    bodies = _bodies(5)
    streams.publish(name, bodies)
    time.sleep(1.3)
    streams.publish(name, [b"late"])
    assert streams.read(name, "first", expect=6) == [*enumerate(bodies), (5, b"late")]


def test_retention_by_max_age_on_segment_roll(streams):
    name = streams.declare({**SEGMENT, "x-max-age": "1s"})
    bodies = _bodies(4)
    streams.publish(name, bodies[:3])
    time.sleep(1.3)
    streams.publish(name, bodies[3:])
    time.sleep(0.5)   # RabbitMQ: a reader opened while retention deletes its segment may never deliver
    wait_until(lambda: streams.read(name, "first", expect=1, quiet=0.2) == [(4, bodies[3])], timeout=10,
               message="retention by age to remove the first segment")
    time.sleep(0.5)


# ------------------------------------------------------------------------ the header, byte by byte


@pytest.mark.parametrize("props", [
    {},
    {"content_type": "text/plain", "content_encoding": "gzip", "priority": 4},
    {"content_encoding": "gzip", "headers": {"a": "b", "n": 7}, "message_id": "m"},
    {"headers": {"x-stream-offset": "mine", "z": 1}, "timestamp": 1_700_000_000},
])
def test_offset_header_injected_into_raw_content_header(props):
    """with_offset_header walks only to the headers table: every other property and the body size stay as
    published, an x-stream-offset the publisher set is replaced (rabbit_basic:add_header)."""
    header = frames.content_header(123, properties.encode(props))
    out = with_offset_header(header, 2**40 + 5)
    assert frames.decode_content_header(out) == (60, 123)
    got = properties.decode(out[12:])
    got["headers"] = fields.decode_table(got["headers"])
    want = properties.decode(header[12:])
    want["headers"] = {**(props.get("headers") or {}), "x-stream-offset": 2**40 + 5}
    assert got == want
    assert out[:12] == header[:12]


# -------------------------------------------------------------------------- chunks (embedded only)


def test_one_read_is_one_chunk_and_goes_out_whole_on_the_embedded_broker(amqp_broker, unique_name):
    """The embedded broker writes what one socket read brought as one chunk, so `last` starts at the first
    of three publishes sent in one TCP write. RabbitMQ groups what its stream writer finds in its mailbox,
    which for such a burst is usually but not always one chunk: no differential assertion is possible.
    A consumer with credit gets a chunk whole, as from RabbitMQ (rabbit_stream_queue:stream_entries): with
    prefetch 1, the chunk of one message, then after its ack all three of the burst's (from offset 2, the
    two from there)."""
    from pamqp import commands as C
    from pamqp import frame as pframe
    from pamqp.body import ContentBody
    from pamqp.header import ContentHeader

    from helpers import raw_handshake

    s = Streams(amqp_broker.url, unique_name)
    try:
        name = s.declare()
        s.publish(name, [b"alone"])
        rc, _tune = raw_handshake(amqp_broker.url)
        rc.send(1, C.Channel.Open())
        assert isinstance(rc.read_method()[1], C.Channel.OpenOk)
        burst = b"".join(pframe.marshal(f, 1) for body in (b"b0", b"b1", b"b2") for f in (
            C.Basic.Publish(exchange="", routing_key=name), ContentHeader(0, len(body), C.Basic.Properties()),
            ContentBody(body)))
        rc.send_bytes(burst + pframe.marshal(C.Basic.Qos(prefetch_count=1), 1))
        assert isinstance(rc.read_method()[1], C.Basic.QosOk)
        assert s.read(name, "last", expect=3) == [(1, b"b0"), (2, b"b1"), (3, b"b2")]
        rc.sock.close()

        ch, got = s.consume(name, "first", prefetch=1)
        pump(ch, lambda: got)
        ch.connection.process_data_events(0.3)
        assert [(o, b) for o, b, *_ in got] == [(0, b"alone")]
        ch.basic_ack(got[0][2].delivery_tag)
        pump(ch, lambda: len(got) >= 4)
        ch.connection.process_data_events(0.3)
        assert [(o, b) for o, b, *_ in got] == [(0, b"alone"), (1, b"b0"), (2, b"b1"), (3, b"b2")]
        ch, got = s.consume(name, 2, prefetch=1)
        pump(ch, lambda: len(got) >= 2)
        ch.connection.process_data_events(0.3)
        assert [(o, b) for o, b, *_ in got] == [(2, b"b1"), (3, b"b2")]
    finally:
        s.close()


def test_delivered_headers_table_is_sorted(streams):
    """Both versions deliver a stream message's headers sorted by key, x-stream-offset among them (RabbitMQ
    keeps the message as AMQP 1.0); pika keeps the wire order."""
    name = streams.declare()
    streams.admin().basic_publish("", name, b"h", pika.BasicProperties(headers={"z": 1, "a": 2}))
    ch, got = streams.consume(name, "first")
    pump(ch, lambda: got)
    assert list(got[0][3].headers) == ["a", "x-stream-offset", "z"]
