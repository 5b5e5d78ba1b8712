"""Quorum queues (x-queue-type=quorum), differential: every test runs against the embedded broker as RabbitMQ
3.10, RabbitMQ 3.10, the embedded broker as 4.3 and RabbitMQ 4.3 (``broker_url``, tests/broker/conftest.py),
comparing reply codes and texts exactly; where the versions differ the expectation branches on
``rabbitmq_version``. This file: declare rules and arguments, get / consume / settle, the redelivery counts
and headers, the delivery limit, where returned messages go, priorities, single active consumer, QoS, purge
and delete. Dead-lettering, overflow and TTL are in test_quorum_dead_letter.py.
"""

from __future__ import annotations

import time

import pika
import pytest

from helpers import queue_counts, refusal
from support import Collector, Env, env, pump, settle  # noqa: F401
from test_dead_letter import _raw_get_header, _typed_headers
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)

QQ = {"x-queue-type": "quorum"}


def rs(name: str) -> str:
    return f"queue '{name}' in vhost '/'"


def declare(env: Env, name: str | None = None, **arguments) -> str:
    """A quorum queue (durable, as it must be) with `arguments`, deleted at teardown."""
    name = name or env.names("qq")
    env.track_queue(name)
    env.admin().queue_declare(name, durable=True, arguments={**QQ, **arguments})
    return name


def channel(env: Env, confirm: bool = False):
    ch = env.pika().channel()
    if confirm:
        ch.confirm_delivery()
    return ch


def publish(env: Env, q: str, bodies, ch=None, **props) -> None:
    """Publish with confirms: each message is in the queue when this returns."""
    ch = ch or channel(env, confirm=True)
    for body in bodies:
        ch.basic_publish("", q, body, pika.BasicProperties(**props) if props else None)


def get_all(ch, q: str) -> list[tuple]:
    """basic.get with auto-ack until get-empty: (body, redelivered, headers) in order."""
    out = []
    while True:
        method, props, body = ch.basic_get(q, auto_ack=True)
        if method is None:
            return out
        out.append((body, method.redelivered, props.headers))


def counts(m: int, version: str, acquired: int | None = None):
    """The count headers a delivery carries: 4.x x-acquired-count (every return) and x-delivery-count (failed
    deliveries, once above zero); 3.10 x-delivery-count (every return, once above zero)."""
    if version == "4.3":
        out = {"x-acquired-count": acquired} if acquired else {}
        if m:
            out["x-delivery-count"] = m
        return out or None
    return {"x-delivery-count": m} if m else None


# ---------------------------------------------------------------------------------------------- declare


@pytest.mark.parametrize("kw, text", [
    ({"durable": False}, "invalid property 'non-durable' for {q}"),
    ({"exclusive": True}, "invalid property 'exclusive-owner' for {q}"),
    ({"auto_delete": True}, "invalid property 'auto-delete' for {q}"),
    ({"durable": False, "exclusive": True, "auto_delete": True}, "invalid property 'auto-delete' for {q}"),
], ids=["non-durable", "exclusive", "auto-delete", "all-three"])
def test_declare_refuses_properties(env, kw, text):
    name = env.track_queue(env.names("qq"))
    ch = channel(env)
    kw = {"durable": True, **kw}
    assert refusal(lambda: ch.queue_declare(name, arguments=QQ, **kw)) == (
        "channel", 406, "PRECONDITION_FAILED - " + text.format(q=rs(name)))
    assert queue_counts(env.url, name) is None


@pytest.mark.parametrize("durable", [True, False])
def test_declare_refuses_server_named(env, durable):
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare("", durable=durable, arguments=QQ)) == (
        "channel", 406, "PRECONDITION_FAILED - Cannot declare a server-named queue for type rabbit_quorum_queue")


def test_declare_refuses_reserved_name_and_passive_needs_the_queue(env):
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare("amq.qq-test", durable=True, arguments=QQ)) == (
        "channel", 403, "ACCESS_REFUSED - queue name 'amq.qq-test' contains reserved prefix 'amq.*'")
    name = env.names("qq")
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare(name, passive=True)) == (
        "channel", 404, f"NOT_FOUND - no queue '{name}' in vhost '/'")


@pytest.mark.parametrize("value, reason", [
    ("foo", '''"unsupported queue type 'foo'"'''),
    ("Quorum", '''"unsupported queue type 'Quorum'"'''),
    (1, "{unacceptable_type,signedint}"),
    (b"quorum", "{unacceptable_type,binary}"),
])
def test_declare_refuses_unknown_queue_types(env, value, reason):
    name = env.track_queue(env.names("qq"))
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={"x-queue-type": value})) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid arg 'x-queue-type' for {rs(name)}: {reason}")


def test_empty_queue_type_is_the_default_type_on_43(env, rabbitmq_version):
    """4.x takes x-queue-type="" as the default type (a classic queue); 3.10 refuses it."""
    name = env.track_queue(env.names("q"))
    ch = channel(env)
    if rabbitmq_version == "4.3":
        assert ch.queue_declare(name, durable=True, arguments={"x-queue-type": ""}).method.queue == name
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": ""})
        assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={"x-queue-type": "", "x-max-priority": 5})) == (
            "channel", 406, f"PRECONDITION_FAILED - inequivalent arg 'x-max-priority' for {rs(name)}: received the "
                            "value '5' of type 'signedint' but current is none")   # a classic queue's argument
    else:
        assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={"x-queue-type": ""})) == (
            "channel", 406, f"PRECONDITION_FAILED - invalid arg 'x-queue-type' for {rs(name)}: "
                            '''"unsupported queue type ''"''')


def test_redeclare_must_be_equivalent(env, rabbitmq_version):
    name = declare(env)
    ok = channel(env).queue_declare(name, durable=True, arguments=QQ).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (name, 0, 0)
    for extra in ({"x-foo": 1}, {"x-max-priority": 5}):        # not compared (not a quorum argument)
        channel(env).queue_declare(name, durable=True, arguments={**QQ, **extra})
    # passive: flags and arguments are not looked at
    channel(env).queue_declare(name, passive=True, arguments={"x-queue-type": "classic"})
    no_type = ("received 'classic' but current is 'quorum'" if rabbitmq_version == "4.3" else
               "received none but current is the value 'quorum' of type 'longstr'")
    cases = [
        ({"arguments": None}, f"inequivalent arg 'x-queue-type' for {rs(name)}: {no_type}"),
        ({"arguments": {"x-queue-type": "classic"}},
         f"inequivalent arg 'x-queue-type' for {rs(name)}: received 'classic' but current is 'quorum'"),
        ({"arguments": {"x-queue-type": "stream"}},
         f"inequivalent arg 'x-queue-type' for {rs(name)}: received 'stream' but current is 'quorum'"),
        ({"durable": False, "arguments": QQ},
         f"inequivalent arg 'durable' for {rs(name)}: received 'false' but current is 'true'"),
        ({"auto_delete": True, "arguments": QQ},
         f"inequivalent arg 'auto_delete' for {rs(name)}: received 'true' but current is 'false'"),
        ({"arguments": {**QQ, "x-max-length": 5}},
         f"inequivalent arg 'x-max-length' for {rs(name)}: received the value '5' of type 'signedint' but "
         "current is none"),
        ({"arguments": {**QQ, "x-delivery-limit": 5}},
         f"inequivalent arg 'x-delivery-limit' for {rs(name)}: received the value '5' of type 'signedint' but "
         "current is none"),
        ({"arguments": {**QQ, "x-overflow": "reject-publish"}},
         f"inequivalent arg 'x-overflow' for {rs(name)}: received the value 'reject-publish' of type "
         "'longstr' but current is none"),
        ({"arguments": {**QQ, "x-dead-letter-exchange": "x", "x-dead-letter-strategy": "at-most-once"}},
         f"inequivalent arg 'x-dead-letter-exchange' for {rs(name)}: received the value 'x' of type "
         "'longstr' but current is none"),
        ({"arguments": {**QQ, "x-single-active-consumer": True}},
         f"inequivalent arg 'x-single-active-consumer' for {rs(name)}: received the value 'true' of type "
         "'bool' but current is none"),
        ({"arguments": {**QQ, "x-queue-leader-locator": "client-local"}},
         f"inequivalent arg 'x-queue-leader-locator' for {rs(name)}: received the value 'client-local' of "
         "type 'longstr' but current is none"),
    ]
    for kw, text in cases:
        ch = channel(env)
        kw = {"durable": True, **kw}
        assert refusal(lambda: ch.queue_declare(name, **kw)) == ("channel", 406, "PRECONDITION_FAILED - " + text)
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare(name, durable=True, exclusive=True, arguments=QQ)) == (
        "channel", 405, f"RESOURCE_LOCKED - cannot obtain exclusive access to locked {rs(name)}. It could be "
        "originally declared on another connection or the exclusive property value does not match that of "
        "the original declaration.")


def test_classic_queue_redeclared_as_quorum(env, rabbitmq_version):
    plain = env.queue(durable=True)
    explicit = env.queue(durable=True, arguments={"x-queue-type": "classic"})
    plain_text = ("received 'quorum' but current is 'classic'" if rabbitmq_version == "4.3" else
                  "received the value 'quorum' of type 'longstr' but current is none")
    for name, text in ((plain, plain_text), (explicit, "received 'quorum' but current is 'classic'")):
        ch = channel(env)
        assert refusal(lambda: ch.queue_declare(name, durable=True, arguments=QQ)) == (
            "channel", 406, f"PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for {rs(name)}: {text}")


# ------------------------------------------------------------------------------------------------ arguments

ARGUMENTS = [
    ("x-max-length", 10, None), ("x-max-length", 0, None), ("x-max-length", -1, "{value_negative,-1}"),
    ("x-max-length", "10", '"expected integer, got longstr"'),
    ("x-max-length-bytes", 1000, None), ("x-max-length-bytes", -1, "{value_negative,-1}"),
    ("x-overflow", "reject-publish-dlx", None), ("x-overflow", "bogus", "invalid_overflow"),
    ("x-overflow", 1, "{unacceptable_type,signedint}"),
    ("x-message-ttl", 0, None), ("x-message-ttl", -1, "{value_negative,-1}"),
    ("x-message-ttl", 315360000001, "{value_too_large,315360000001}"),
    ("x-message-ttl", "1000", '"expected integer, got longstr"'),
    ("x-expires", 10000, None), ("x-expires", 0, "{value_zero,0}"), ("x-expires", -5, "{value_negative,-5}"),
    ("x-dead-letter-routing-key", "rk", "routing_key_but_no_dlx_defined"),
    ("x-dead-letter-strategy", "at-least-once", None), ("x-dead-letter-strategy", "bogus", "invalid_dlx_strategy"),
    ("x-delivery-limit", 0, None), ("x-delivery-limit", -1, None), ("x-delivery-limit", "5", None),
    ("x-single-active-consumer", True, None), ("x-single-active-consumer", 1, "{unacceptable_type,signedint}"),
    ("x-single-active-consumer", "true", "{unacceptable_type,longstr}"),
    ("x-quorum-initial-group-size", 3, None), ("x-quorum-initial-group-size", 0, "{value_zero,0}"),
    ("x-quorum-initial-group-size", "3", '"expected integer, got longstr"'),
    ("x-queue-leader-locator", "balanced", None), ("x-queue-leader-locator", "bogus", "invalid_queue_locator_arg"),
    ("x-max-in-memory-length", 5, None), ("x-max-in-memory-length", -1, "{value_negative,-1}"),
    ("x-consumer-timeout", 60000, None), ("x-delayed-retry-type", "all", None),
    ("x-quorum-target-group-size", 3, None), ("x-foo", "bar", None),
]


@pytest.mark.parametrize("key, value, reason", ARGUMENTS, ids=lambda v: repr(v)[:30])
def test_declare_arguments(env, key, value, reason):
    name = env.track_queue(env.names("qq"))
    ch = channel(env)
    if reason is None:
        assert ch.queue_declare(name, durable=True, arguments={**QQ, key: value}).method.queue == name
    else:
        assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={**QQ, key: value})) == (
            "channel", 406, f"PRECONDITION_FAILED - invalid arg '{key}' for {rs(name)}: {reason}")


def test_declare_argument_checks_that_differ_by_version(env, rabbitmq_version):
    """x-consumer-timeout is validated by 4.x only; a dead-letter exchange that is not a string is refused by
    the channel before the other checks, with a text of its own."""
    name = env.track_queue(env.names("qq"))
    ch = channel(env)
    if rabbitmq_version == "4.3":
        assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={**QQ, "x-consumer-timeout": -1})) == (
            "channel", 406, f"PRECONDITION_FAILED - invalid arg 'x-consumer-timeout' for {rs(name)}: "
                            "{value_negative,-1}")
    else:
        ch.queue_declare(name, durable=True, arguments={**QQ, "x-consumer-timeout": -1})
        channel(env).queue_delete(name)
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={**QQ, "x-dead-letter-exchange": 5})) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid type 'signedint' for arg 'x-dead-letter-exchange' in "
                        f"{rs(name)}")


@pytest.mark.parametrize("key, value", [
    ("x-max-priority", 5), ("x-queue-mode", "lazy"), ("x-queue-version", 2),
    ("x-queue-master-locator", "min-masters"), ("x-max-age", "1D"), ("x-stream-max-segment-size-bytes", 1000),
    ("x-initial-cluster-size", 1),
])
def test_other_queue_types_arguments_are_refused(env, key, value):
    name = env.track_queue(env.names("qq"))
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare(name, durable=True, arguments={**QQ, key: value})) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid arg '{key}' for {rs(name)} of queue type "
                        "rabbit_quorum_queue")


# ---------------------------------------------------------------------------------- get, consume, counts


def test_get_and_declare_ok_counts(env):
    """message_count counts ready messages; consumer_count counts consumers and unsettled basic.gets."""
    q = declare(env)
    publish(env, q, [b"m0", b"m1", b"m2", b"m3", b"m4"])
    ch = channel(env)
    assert ch.queue_declare(q, passive=True).method.message_count == 5
    m1, _p, body = ch.basic_get(q)
    assert (body, m1.message_count, m1.redelivered) == (b"m0", 4, False)
    ok = ch.queue_declare(q, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (4, 1)
    m2, _p, body = ch.basic_get(q)
    assert (body, m2.message_count) == (b"m1", 3)
    ok = ch.queue_declare(q, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (3, 2)
    ch.basic_ack(m2.delivery_tag)
    ch.basic_nack(m1.delivery_tag, requeue=True)      # settlements are asynchronous on RabbitMQ
    wait_until(lambda: queue_counts(env.url, q) == (4, 0), message="the get holds to be settled")
    got = Collector()
    tag = ch.basic_consume(q, got)
    pump(ch.connection, lambda: len(got) == 4)
    ok = ch.queue_declare(q, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (0, 1)
    ch.basic_cancel(tag)     # cancelled with four unacked: still counted until they are settled
    assert ch.queue_declare(q, passive=True).method.consumer_count == 1
    ch.basic_ack(got.tags[-1], multiple=True)
    wait_until(lambda: queue_counts(env.url, q) == (0, 0), message="the cancelled consumer to go")
    assert ch.basic_get(q) == (None, None, None)


def test_redelivery_flag_and_count_headers(env, rabbitmq_version):
    """nack(requeue) and basic.recover count as returns, basic.reject(requeue) as a failed delivery (4.x);
    3.10 counts all three alike, and adds x-delivery-count to every basic.get."""
    q = declare(env, **{"x-delivery-limit": 10})
    publish(env, q, [b"m"])
    ch = channel(env)
    seen = []
    for settle_how in ("nack", "reject", "nack", None):
        method, props, _body = ch.basic_get(q)
        seen.append((method.redelivered, props.headers))
        if settle_how == "nack":
            ch.basic_nack(method.delivery_tag, requeue=True)
        elif settle_how == "reject":
            ch.basic_reject(method.delivery_tag, requeue=True)
    if rabbitmq_version == "4.3":
        assert seen == [(False, None), (True, {"x-acquired-count": 1}),
                        (True, {"x-acquired-count": 2, "x-delivery-count": 1}),
                        (True, {"x-acquired-count": 3, "x-delivery-count": 1})]
    else:
        assert seen == [(False, {"x-delivery-count": 0}), (True, {"x-delivery-count": 1}),
                        (True, {"x-delivery-count": 2}), (True, {"x-delivery-count": 3})]
    ch.basic_recover(requeue=True)
    got = Collector()
    ch.basic_consume(q, got)
    pump(ch.connection, lambda: len(got) == 1)
    assert got.items[0][2:4] == (True, b"m")
    headers = got.items[0][4].headers
    assert headers == ({"x-acquired-count": 4, "x-delivery-count": 1} if rabbitmq_version == "4.3" else
                       {"x-delivery-count": 4})


def test_count_headers_are_longs_and_kept_with_the_publishers(env, rabbitmq_version):
    q = declare(env)
    publish(env, q, [b"m"], headers={"app": "h"})
    ch = channel(env)
    method, _p, _b = ch.basic_get(q)
    ch.basic_reject(method.delivery_tag, requeue=True)
    typed = _typed_headers(_raw_get_header(env.url, q))
    if rabbitmq_version == "4.3":
        assert typed == {"app": ("S", b"h"), "x-acquired-count": ("l", 1), "x-delivery-count": ("l", 1)}
    else:
        assert typed == {"app": ("S", b"h"), "x-delivery-count": ("l", 1)}


def test_recover_without_requeue_is_540(env):
    q = declare(env)
    publish(env, q, [b"m"])
    ch = channel(env)
    ch.basic_get(q)
    assert refusal(lambda: ch.basic_recover(requeue=False)) == (
        "connection", 540, "NOT_IMPLEMENTED - requeue=false")


def test_unknown_delivery_tag_and_consumer_arguments(env):
    q = declare(env)
    ch = channel(env)
    assert refusal(lambda: (ch.basic_ack(99), ch.queue_declare(q, passive=True))) == (
        "channel", 406, "PRECONDITION_FAILED - unknown delivery tag 99")
    ch = channel(env)
    assert refusal(lambda: ch.basic_consume(q, lambda *a: None, arguments={"x-priority": "a"})) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid arg 'x-priority' for {rs(q)}: "
                        '"expected integer, got longstr"')
    ch = channel(env)
    assert refusal(lambda: ch.basic_qos(prefetch_size=10)) == (
        "connection", 540, "NOT_IMPLEMENTED - prefetch_size!=0 (10)")


def test_exclusive_consume_is_not_enforced(env):
    q = declare(env)
    ch = channel(env)
    assert ch.basic_consume(q, lambda *a: None, exclusive=True)
    assert ch.basic_consume(q, lambda *a: None)
    assert ch.basic_consume(q, lambda *a: None, exclusive=True)
    assert ch.queue_declare(q, passive=True).method.consumer_count == 3


# ------------------------------------------------------------------------------------------ delivery limit


def _reject_loop(ch, q, attempts: int, requeue_how: str = "reject") -> list:
    """basic.get the one message and give it back `attempts` times; the (redelivered, headers) of each get,
    None once the queue is empty."""
    seen = []
    for _ in range(attempts):
        method, props, _body = ch.basic_get(q)
        if method is None:
            seen.append(None)
            break
        seen.append((method.redelivered, props.headers))
        if requeue_how == "reject":
            ch.basic_reject(method.delivery_tag, requeue=True)
        else:
            ch.basic_nack(method.delivery_tag, requeue=True)
    return seen


def _dead_letter_queue(env: Env) -> tuple[str, str]:
    """A fanout exchange with a classic queue bound: (exchange, queue)."""
    dlx = env.exchange("fanout")
    dlq = env.queue()
    env.admin().queue_bind(dlq, dlx)
    return dlx, dlq


def _wait_count(env: Env, q: str, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while queue_counts(env.url, q)[0] != n:
        assert time.monotonic() < deadline, f"{q} did not reach {n} messages"
        time.sleep(0.05)


def test_default_delivery_limit(env, rabbitmq_version):
    """4.x: 20 unless set, so the 21st reject dead-letters the message; 3.10: no limit."""
    dlx, dlq = _dead_letter_queue(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx})
    publish(env, q, [b"m"])
    seen = _reject_loop(channel(env), q, 23)
    if rabbitmq_version == "4.3":
        assert len(seen) == 22 and seen[-1] is None
        assert seen[20] == (True, {"x-acquired-count": 20, "x-delivery-count": 20})
        _wait_count(env, dlq, 1)
        method, props, _b = channel(env).basic_get(dlq, auto_ack=True)
        assert method.redelivered     # the delivery count came with it
        assert props.headers["x-death"][0]["reason"] == "delivery_limit"
    else:
        assert len(seen) == 23 and seen[-1] == (True, {"x-delivery-count": 22})
        assert queue_counts(env.url, dlq) == (0, 0)


@pytest.mark.parametrize("limit", [2, 0])
def test_delivery_limit_dead_letters(env, rabbitmq_version, limit):
    dlx, dlq = _dead_letter_queue(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-delivery-limit": limit})
    publish(env, q, [b"m"])
    seen = _reject_loop(channel(env), q, limit + 3)
    assert len(seen) == limit + 2 and seen[-1] is None
    assert [s[1] for s in seen[:-1]] == [
        counts(n, rabbitmq_version, acquired=n) if rabbitmq_version == "4.3" else
        {"x-delivery-count": n} for n in range(limit + 1)]
    _wait_count(env, dlq, 1)
    method, props, _b = channel(env).basic_get(dlq, auto_ack=True)
    assert method.redelivered == (rabbitmq_version == "4.3")
    assert [(e["reason"], e["queue"], e["count"]) for e in props.headers["x-death"]] == [("delivery_limit", q, 1)]
    assert (props.headers["x-first-death-reason"], props.headers.get("x-last-death-reason")) == (
        "delivery_limit", "delivery_limit" if rabbitmq_version == "4.3" else None)


def test_nack_and_recover_do_not_count_towards_the_limit_on_43(env, rabbitmq_version):
    """4.x counts failed deliveries only: nack(requeue) loops past the limit; 3.10 counts every return."""
    q = declare(env, **{"x-delivery-limit": 1})
    publish(env, q, [b"m"])
    seen = _reject_loop(channel(env), q, 4, requeue_how="nack")
    if rabbitmq_version == "4.3":
        assert seen == [(False, None), (True, {"x-acquired-count": 1}), (True, {"x-acquired-count": 2}),
                        (True, {"x-acquired-count": 3})]
    else:
        assert seen == [(False, {"x-delivery-count": 0}), (True, {"x-delivery-count": 1}), None]


def test_negative_delivery_limit(env, rabbitmq_version):
    """4.x: unlimited; 3.10: the first return already exceeds it."""
    q = declare(env, **{"x-delivery-limit": -1})
    publish(env, q, [b"m"])
    seen = _reject_loop(channel(env), q, 25)
    if rabbitmq_version == "4.3":
        assert len(seen) == 25 and seen[-1] == (True, {"x-acquired-count": 24, "x-delivery-count": 24})
    else:
        assert seen == [(False, {"x-delivery-count": 0}), None]


def test_a_closed_channel_counts_as_a_failed_delivery(env, rabbitmq_version):
    q = declare(env, **{"x-delivery-limit": 1})
    publish(env, q, [b"m"])
    conn = env.pika()
    rounds = []
    for _ in range(3):
        ch = conn.channel()
        got = Collector()
        ch.basic_consume(q, got)
        settle(conn, 0.4)
        rounds.append([(i[2], i[4].headers) for i in got.items])
        ch.close()
    assert rounds == [[(False, None)], [(True, counts(1, rabbitmq_version, acquired=1))], []]
    assert queue_counts(env.url, q) == (0, 0)


# ----------------------------------------------------------------------------------- where returns go


def _order(ch, q) -> str:
    return " ".join(f"{b.decode()}{'*' if r else ''}" for b, r, _h in get_all(ch, q))


@pytest.mark.parametrize("limit", [None, 5])
def test_requeue_positions(env, rabbitmq_version, limit):
    """4.x: every return goes to the head, in the order the returns happen. 3.10: to the head with a delivery
    limit; without one, nack / reject / recover go to the tail while a closed channel's go to the head."""
    tail = rabbitmq_version == "3.10" and limit is None
    args = {} if limit is None else {"x-delivery-limit": limit}
    results = []

    def fresh():
        q = declare(env, **args)
        publish(env, q, [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"])
        return q, channel(env)

    q, ch = fresh()
    g = [ch.basic_get(q)[0] for _ in range(3)]
    ch.basic_nack(g[1].delivery_tag, requeue=True)
    ch.basic_ack(g[0].delivery_tag)
    ch.basic_ack(g[2].delivery_tag)
    results.append(_order(ch, q))
    q, ch = fresh()
    g = [ch.basic_get(q)[0] for _ in range(3)]
    for i in (2, 0, 1):
        ch.basic_reject(g[i].delivery_tag, requeue=True)
    results.append(_order(ch, q))
    q, ch = fresh()
    g = [ch.basic_get(q)[0] for _ in range(3)]
    ch.basic_nack(g[2].delivery_tag, multiple=True, requeue=True)
    results.append(_order(ch, q))
    q, ch = fresh()
    consumer = ch.connection.channel()
    consumer.basic_qos(prefetch_count=3)
    got = Collector()
    consumer.basic_consume(q, got)
    pump(ch.connection, lambda: len(got) == 3)
    consumer.close()
    # RabbitMQ 4.3 applies a closed channel's returns after its close-ok: read the order once all six are back
    # (a get in between took m3 first, on a busy machine).
    wait_until(lambda: queue_counts(env.url, q)[0] == 6, 10, interval=0.05, message="the closed channel's returns")
    results.append(_order(ch, q))
    if tail:
        assert results == ["m3 m4 m5 m1*", "m3 m4 m5 m2* m0* m1*", "m3 m4 m5 m0* m1* m2*", "m0* m1* m2* m3 m4 m5"]
    else:
        assert results == ["m1* m3 m4 m5", "m2* m0* m1* m3 m4 m5", "m0* m1* m2* m3 m4 m5", "m0* m1* m2* m3 m4 m5"]


def test_returned_message_precedes_later_publishes(env, rabbitmq_version):
    q = declare(env)
    publish(env, q, [b"m0", b"m1", b"m2"])
    ch = channel(env)
    ch.basic_nack(ch.basic_get(q)[0].delivery_tag, requeue=True)
    publish(env, q, [b"m3"])
    assert _order(ch, q) == ("m1 m2 m0* m3" if rabbitmq_version == "3.10" else "m0* m1 m2 m3")


def test_cancelled_consumer_can_still_settle(env, rabbitmq_version):
    q = declare(env, **{"x-delivery-limit": 5})
    publish(env, q, [b"m0", b"m1", b"m2", b"m3"])
    ch = channel(env)
    ch.basic_qos(prefetch_count=3)
    got = Collector()
    tag = ch.basic_consume(q, got)
    pump(ch.connection, lambda: len(got) == 3)
    ch.basic_cancel(tag)
    for t in reversed(got.tags):
        ch.basic_reject(t, requeue=True)
    assert _order(ch, q) == "m2* m1* m0* m3"


# --------------------------------------------------------------------------------- priorities


def test_message_priorities(env, rabbitmq_version):
    """4.x: 32 levels, none = 4, higher first, FIFO within a level; 3.10: FIFO."""
    q = declare(env)
    ch = channel(env, confirm=True)
    prios = [None, 0, 1, 3, 4, 5, 9, 31, 32, 255, None, 5, 0]
    for i, p in enumerate(prios):
        ch.basic_publish("", q, f"#{i}".encode(), pika.BasicProperties(priority=p))
    order = [b.decode() for b, _r, _h in get_all(ch, q)]
    if rabbitmq_version == "4.3":
        assert order == ["#7", "#8", "#9", "#6", "#5", "#11", "#0", "#4", "#10", "#3", "#2", "#1", "#12"]
    else:
        assert order == [f"#{i}" for i in range(len(prios))]


def test_returned_messages_precede_priorities(env, rabbitmq_version):
    q = declare(env, **{"x-delivery-limit": 5})
    ch = channel(env, confirm=True)
    ch.basic_publish("", q, b"low", pika.BasicProperties(priority=0))
    method, _p, _b = ch.basic_get(q)
    ch.basic_publish("", q, b"high", pika.BasicProperties(priority=9))
    ch.basic_nack(method.delivery_tag, requeue=True)
    assert [b for b, _r, _h in get_all(ch, q)] == [b"low", b"high"]


def test_consumer_priorities(env):
    q = declare(env)
    conn = env.pika()
    a, b = conn.channel(), conn.channel()
    a.basic_qos(prefetch_count=2)
    b.basic_qos(prefetch_count=2)
    got_a, got_b = Collector(), Collector()
    a.basic_consume(q, got_a, arguments={"x-priority": 10})
    b.basic_consume(q, got_b)
    settle(conn, 0.2)
    publish(env, q, [b"c0", b"c1", b"c2", b"c3", b"c4"])
    pump(conn, lambda: len(got_a) + len(got_b) == 4)
    settle(conn, 0.3)
    assert (got_a.bodies, got_b.bodies) == ([b"c0", b"c1"], [b"c2", b"c3"])


# --------------------------------------------------------------------------------- single active consumer


def test_single_active_consumer(env, rabbitmq_version):
    q = declare(env, **{"x-single-active-consumer": True})
    publish(env, q, [b"s0", b"s1", b"s2", b"s3"])
    conn = env.pika()
    a, b = conn.channel(), conn.channel()
    a.basic_qos(prefetch_count=2)
    b.basic_qos(prefetch_count=2)
    got_a, got_b = Collector(), Collector()
    tag_a = a.basic_consume(q, got_a)
    b.basic_consume(q, got_b)
    pump(conn, lambda: len(got_a) == 2)
    settle(conn)
    assert (got_a.bodies, got_b.bodies) == ([b"s0", b"s1"], [])
    ok = channel(env).queue_declare(q, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (2, 1)      # the waiting consumer is not counted
    name = "<<\"quorum\">>" if rabbitmq_version == "4.3" else "quorum"
    ch = channel(env)
    assert refusal(lambda: ch.basic_get(q)) == (
        "channel", 405, f"RESOURCE_LOCKED - cannot obtain access to locked {rs(q)}. basic.get operations are "
                        f"not supported by {name} queues with single active consumer")
    a.basic_cancel(tag_a)            # cancelled holding two: the next consumer takes over
    pump(conn, lambda: len(got_b) == 2)
    assert got_b.bodies == [b"s2", b"s3"]
    assert channel(env).queue_declare(q, passive=True).method.consumer_count == 2
    a.close()                        # its two come back; b has no room
    settle(conn)
    assert got_b.bodies == [b"s2", b"s3"]
    assert queue_counts(env.url, q) == (2, 1)


def test_single_active_consumer_priority(env, rabbitmq_version):
    """4.x: a consumer of higher priority takes over; 3.10 keeps the first."""
    q = declare(env, **{"x-single-active-consumer": True})
    conn = env.pika()
    a, b = conn.channel(), conn.channel()
    got_a, got_b = Collector(), Collector()
    a.basic_consume(q, got_a, auto_ack=True, arguments={"x-priority": 1})
    settle(conn, 0.2)
    b.basic_consume(q, got_b, auto_ack=True, arguments={"x-priority": 5})
    settle(conn, 0.3)
    publish(env, q, [b"p0", b"p1", b"p2"])
    pump(conn, lambda: len(got_a) + len(got_b) == 3)
    if rabbitmq_version == "4.3":
        assert (got_a.bodies, got_b.bodies) == ([], [b"p0", b"p1", b"p2"])
    else:
        assert (got_a.bodies, got_b.bodies) == ([b"p0", b"p1", b"p2"], [])


# ------------------------------------------------------------------------------------------------ QoS


def test_global_qos(env, rabbitmq_version):
    """4.x takes a global prefetch as a per-consumer one; 3.10 refuses to consume a quorum queue from a
    channel with a global prefetch (540, the connection)."""
    q = declare(env)
    publish(env, q, [b"g0", b"g1", b"g2", b"g3", b"g4"])
    ch = channel(env)
    ch.basic_qos(prefetch_count=2, global_qos=True)
    got = Collector()
    if rabbitmq_version == "3.10":
        assert refusal(lambda: ch.basic_consume(q, got)) == (
            "connection", 540, f"NOT_IMPLEMENTED - {rs(q)} does not support global qos")
        return
    ch.basic_consume(q, got)
    ch.basic_consume(q, got)
    pump(ch.connection, lambda: len(got) == 4)
    settle(ch.connection)
    assert len(got) == 4


def test_prefetch_is_topped_up_on_ack(env):
    q = declare(env)
    publish(env, q, [b"f0", b"f1", b"f2", b"f3", b"f4"])
    ch = channel(env)
    ch.basic_qos(prefetch_count=2)
    got = Collector()
    ch.basic_consume(q, got)
    pump(ch.connection, lambda: len(got) == 2)
    settle(ch.connection)
    assert got.bodies == [b"f0", b"f1"]
    ch.basic_ack(got.tags[-1], multiple=True)
    pump(ch.connection, lambda: len(got) == 4)
    assert got.bodies == [b"f0", b"f1", b"f2", b"f3"]


# ------------------------------------------------------------------------------------------ purge, delete


def test_purge_keeps_unacked(env):
    q = declare(env)
    publish(env, q, [b"m0", b"m1", b"m2", b"m3", b"m4"])
    ch = channel(env)
    g = [ch.basic_get(q)[0] for _ in range(2)]
    assert ch.queue_purge(q).method.message_count == 3
    ok = ch.queue_declare(q, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (0, 2)
    ch.basic_nack(g[1].delivery_tag, multiple=True, requeue=True)
    assert queue_counts(env.url, q) == (2, 0)
    assert ch.queue_purge(q).method.message_count == 2
    missing = env.names("missing")
    assert refusal(lambda: ch.queue_purge(missing)) == ("channel", 404, f"NOT_FOUND - no {rs(missing)}")


@pytest.mark.parametrize("flags, name", [({"if_empty": True}, "if-empty"), ({"if_unused": True}, "if-unused"),
                                         ({"if_empty": True, "if_unused": True}, "if-unused")])
def test_delete_if_empty_or_unused_is_540(env, flags, name):
    q = declare(env)
    ch = channel(env)
    assert refusal(lambda: ch.queue_delete(q, **flags)) == (
        "connection", 540, f"NOT_IMPLEMENTED - cannot delete {rs(q)}. queue.delete operations with {name} flag "
                           "set are not supported by quorum queues")
    assert channel(env).queue_delete(env.names("missing"), if_empty=True).method.message_count == 0


def test_delete_counts_ready_and_cancels_consumers(env):
    q = declare(env)
    publish(env, q, [b"m0", b"m1", b"m2", b"m3"])
    ch = channel(env)
    ch.basic_get(q)
    assert channel(env).queue_delete(q).method.message_count == 3
    q = declare(env)
    publish(env, q, [b"m0", b"m1", b"m2"])
    conn = env.pika()
    consumer = conn.channel()
    cancels = []
    consumer.add_on_cancel_callback(lambda frame: cancels.append(frame.method.consumer_tag))
    got = Collector()
    tag = consumer.basic_consume(q, got)
    pump(conn, lambda: len(got) == 3)
    assert channel(env).queue_delete(q).method.message_count == 0
    pump(conn, lambda: cancels)
    assert cancels == [tag] and consumer.is_open


def test_counted_deliveries_have_their_headers_table_sorted(env, rabbitmq_version):
    """Both versions deliver a counted message's headers sorted by key (pika keeps the wire order)."""
    q = declare(env)
    publish(env, q, [b"m"], headers={"z": 1, "a": 2, "x-b": 5})
    ch = channel(env)
    ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=True)
    _m, props, _b = ch.basic_get(q, auto_ack=True)
    assert list(props.headers) == (["a", "x-acquired-count", "x-b", "x-delivery-count", "z"]
                                   if rabbitmq_version == "4.3" else ["a", "x-b", "x-delivery-count", "z"])
