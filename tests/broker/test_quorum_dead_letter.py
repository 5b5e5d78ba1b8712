"""Quorum queues, differential as test_quorum_queues.py (embedded as 3.10, RabbitMQ 3.10, embedded as 4.3,
RabbitMQ 4.3): dead-lettering (reasons, x-death, x-first-death-* and 4.x's x-last-death-*, the delivery count a
dead letter carries on 4.x, cycles, at-least-once), overflow (drop-head, reject-publish and its soft limit,
what counts towards the limits), message TTL and x-expires.
"""

from __future__ import annotations

import time

import pika
import pika.exceptions
import pytest

from helpers import queue_counts
from support import Collector, Env, env, pump, settle  # noqa: F401
from test_quorum_queues import QQ, _wait_count, channel, declare, get_all, publish, refusal, rs

pytestmark = pytest.mark.timeout(120)


def dead_letter_exchange(env: Env, kind: str = "fanout", queue_args: dict | None = None, key: str = "#"):
    """An exchange with one queue bound (classic unless `queue_args` say otherwise): (exchange, queue)."""
    dlx = env.exchange(kind)
    if queue_args is None:
        dlq = env.queue()
    else:
        dlq = declare(env, **queue_args)
    env.admin().queue_bind(dlq, dlx, key)
    return dlx, dlq


def wait_get(ch, q: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(q, auto_ack=True)
        if method is not None:
            return method, props, body
        assert time.monotonic() < deadline, f"nothing arrived in {q}"
        time.sleep(0.02)


def deaths(headers: dict) -> list[tuple]:
    """x-death as (queue, reason, count, exchange, routing keys), newest first."""
    return [(e["queue"], e["reason"], e["count"], e["exchange"], e["routing-keys"]) for e in headers["x-death"]]


def death_headers(headers: dict, version: str) -> dict:
    keys = ["x-first-death-exchange", "x-first-death-queue", "x-first-death-reason"]
    if version == "4.3":
        keys += ["x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"]
    return {k: headers.get(k) for k in sorted(set(keys) | {k for k in headers if k.startswith("x-last-death")})}


# ------------------------------------------------------------------------------------------ dead-lettering


def test_reject_without_requeue_dead_letters_with_routing_key(env, rabbitmq_version):
    dlx, dlq = dead_letter_exchange(env, "topic")
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dl.rk"})
    publish(env, q, [b"r1"], headers={"app": "h"}, expiration="60000")
    ch = channel(env)
    ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=False)
    method, props, body = wait_get(ch, dlq)
    assert (body, method.exchange, method.routing_key) == (b"r1", dlx, "dl.rk")
    # 4.x: the reject counted as a failed delivery, and the count travels: a redelivery in the dead-letter queue
    assert method.redelivered == (rabbitmq_version == "4.3")
    assert props.expiration is None and props.headers["app"] == "h"
    assert deaths(props.headers) == [(q, "rejected", 1, "", [q])]
    assert props.headers["x-death"][0]["original-expiration"] == "60000"
    last = {"x-last-death-exchange": "", "x-last-death-queue": q, "x-last-death-reason": "rejected"}
    assert death_headers(props.headers, rabbitmq_version) == {
        "x-first-death-exchange": "", "x-first-death-queue": q, "x-first-death-reason": "rejected",
        **(last if rabbitmq_version == "4.3" else {})}


def test_nack_without_requeue_is_not_a_failed_delivery(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx})
    publish(env, q, [b"k1"])
    ch = channel(env)
    ch.basic_nack(ch.basic_get(q)[0].delivery_tag, requeue=False)
    method, props, _b = wait_get(ch, dlq)
    assert method.redelivered is False
    assert deaths(props.headers) == [(q, "rejected", 1, "", [q])]


def test_expired_messages_dead_letter(env, rabbitmq_version):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-message-ttl": 200})
    publish(env, q, [b"t1"])
    method, props, body = wait_get(channel(env), dlq)
    assert (body, method.redelivered) == (b"t1", False)
    assert deaths(props.headers) == [(q, "expired", 1, "", [q])]
    assert "original-expiration" not in props.headers["x-death"][0]


def test_expiry_is_checked_at_the_head_only(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx})
    publish(env, q, [b"head"])
    publish(env, q, [b"short"], expiration="100")
    time.sleep(0.5)
    assert queue_counts(env.url, q) == (2, 0)
    assert queue_counts(env.url, dlq) == (0, 0)
    ch = channel(env)
    assert ch.basic_get(q, auto_ack=True)[2] == b"head"
    _m, props, body = wait_get(ch, dlq)
    assert body == b"short" and props.headers["x-death"][0]["original-expiration"] == "100"
    assert queue_counts(env.url, q) == (0, 0)


def test_unacked_message_does_not_expire_and_expires_once_returned(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-message-ttl": 300})
    publish(env, q, [b"held", b"other"])
    ch = channel(env)
    method, _p, _b = ch.basic_get(q)
    time.sleep(0.6)
    assert [b for b, _r, _h in get_all(channel(env), dlq)] == [b"other"]
    ch.basic_nack(method.delivery_tag, requeue=True)
    _m, props, body = wait_get(ch, dlq)
    assert body == b"held" and props.headers["x-death"][0]["reason"] == "expired"
    assert queue_counts(env.url, q) == (0, 0)


def test_lower_of_queue_ttl_and_expiration_applies(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-message-ttl": 5000})
    publish(env, q, [b"short"], expiration="200")
    assert wait_get(channel(env), dlq)[2] == b"short"
    q2 = declare(env, **{"x-dead-letter-exchange": dlx, "x-message-ttl": 200})
    publish(env, q2, [b"long"], expiration="5000")
    _m, props, body = wait_get(channel(env), dlq)
    assert (body, props.expiration) == (b"long", None)
    q3 = declare(env)
    publish(env, q3, [b"kept"], expiration="60000")
    assert channel(env).basic_get(q3, auto_ack=True)[1].expiration == "60000"


def test_zero_ttl_goes_to_a_waiting_consumer_or_expires(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx})
    publish(env, q, [b"zero"], expiration="0")
    assert wait_get(channel(env), dlq)[2] == b"zero"
    conn = env.pika()
    ch = conn.channel()
    got = Collector()
    ch.basic_consume(q, got, auto_ack=True)
    settle(conn, 0.2)
    publish(env, q, [b"zero-consumer"], expiration="0")
    pump(conn, lambda: got)
    assert got.bodies == [b"zero-consumer"]
    assert queue_counts(env.url, dlq) == (0, 0)


@pytest.mark.parametrize("expiration, reason", [
    ("abc", "no_integer"), ("-1", "{value_negative,-1}"), ("1.5", '{leftover_string,".5"}'), ("", "no_integer"),
])
def test_invalid_expiration_is_refused(env, expiration, reason):
    q = declare(env)
    ch = channel(env, confirm=True)
    assert refusal(lambda: ch.basic_publish("", q, b"bad", pika.BasicProperties(expiration=expiration))) == (
        "channel", 406, f"PRECONDITION_FAILED - invalid expiration '{expiration}': {reason}")


def test_chained_deaths(env, rabbitmq_version):
    """Rejected in one quorum queue, expired in a second: x-death newest first, x-first-death-* the first
    death, 4.x's x-last-death-* the last."""
    dlx = env.exchange("direct")
    q2 = declare(env, **{"x-message-ttl": 100, "x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "final"})
    env.admin().queue_bind(q2, dlx, "to-q2")
    dlq = env.queue()
    env.admin().queue_bind(dlq, dlx, "final")
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "to-q2"})
    publish(env, q, [b"chain"], headers={"keep": 1})
    ch = channel(env)
    ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=False)
    method, props, _b = wait_get(ch, dlq)
    assert method.routing_key == "final" and method.redelivered == (rabbitmq_version == "4.3")
    assert props.headers["keep"] == 1
    assert deaths(props.headers) == [(q2, "expired", 1, dlx, ["to-q2"]), (q, "rejected", 1, "", [q])]
    expected = {"x-first-death-exchange": "", "x-first-death-queue": q, "x-first-death-reason": "rejected"}
    if rabbitmq_version == "4.3":
        expected.update({"x-last-death-exchange": dlx, "x-last-death-queue": q2, "x-last-death-reason": "expired"})
    assert death_headers(props.headers, rabbitmq_version) == expected


def test_rejected_back_into_the_same_queue_counts_up(env, rabbitmq_version):
    dlx = env.exchange("fanout")
    q = declare(env, **{"x-dead-letter-exchange": dlx})
    env.admin().queue_bind(q, dlx)
    publish(env, q, [b"loop"])
    ch = channel(env)
    seen = []
    for _ in range(3):
        method, props, _b = wait_get_unacked(ch, q)
        h = props.headers or {}
        seen.append((method.redelivered, {k: h[k] for k in ("x-acquired-count", "x-delivery-count") if k in h},
                     [e["count"] for e in h.get("x-death", [])]))
        ch.basic_reject(method.delivery_tag, requeue=False)
    if rabbitmq_version == "4.3":
        assert seen == [(False, {}, []), (True, {"x-acquired-count": 1, "x-delivery-count": 1}, [1]),
                        (True, {"x-acquired-count": 2, "x-delivery-count": 2}, [2])]
    else:
        assert seen == [(False, {"x-delivery-count": 0}, []), (False, {"x-delivery-count": 0}, [1]),
                        (False, {"x-delivery-count": 0}, [2])]


def wait_get_unacked(ch, q: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(q)
        if method is not None:
            return method, props, body
        assert time.monotonic() < deadline, f"nothing arrived in {q}"
        time.sleep(0.02)


def test_expiry_cycle_drops_the_message_and_missing_dlx_drops(env):
    dlx = env.exchange("fanout")
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-message-ttl": 100})
    env.admin().queue_bind(q, dlx)
    publish(env, q, [b"cycle"])
    time.sleep(0.6)
    assert queue_counts(env.url, q) == (0, 0)
    q2 = declare(env, **{"x-dead-letter-exchange": env.names("missing")})
    publish(env, q2, [b"x"])
    ch = channel(env)
    ch.basic_reject(ch.basic_get(q2)[0].delivery_tag, requeue=False)
    assert queue_counts(env.url, q2) == (0, 0)


def test_delivery_count_travels_to_a_quorum_dead_letter_queue(env, rabbitmq_version):
    dlx, dlq = dead_letter_exchange(env, queue_args={})
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-delivery-limit": 1})
    publish(env, q, [b"dc"])
    ch = channel(env)
    for _ in range(2):
        ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=True)
    method, props, _b = wait_get_unacked(ch, dlq)
    counted = {k: v for k, v in props.headers.items() if k in ("x-acquired-count", "x-delivery-count")}
    if rabbitmq_version == "4.3":
        assert (method.redelivered, counted) == (True, {"x-acquired-count": 2, "x-delivery-count": 2})
    else:
        assert (method.redelivered, counted) == (False, {"x-delivery-count": 0})
    assert queue_counts(env.url, dlq) == (0, 1)


# -------------------------------------------------------------------------------- at-least-once


def test_at_least_once_keeps_unroutable_dead_letters_and_counts_them(env):
    """With reject-publish, at-least-once keeps a dead letter no queue took (not in message_count), and counts
    it against x-max-length."""
    dlx = env.exchange("fanout")
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-dead-letter-strategy": "at-least-once",
                        "x-overflow": "reject-publish", "x-max-length": 1})
    publish(env, q, [b"a"])
    ch = channel(env, confirm=True)
    ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=False)
    time.sleep(0.3)
    assert queue_counts(env.url, q) == (0, 0)
    ch.basic_publish("", q, b"b")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"c")
    assert queue_counts(env.url, q) == (1, 0)


def test_at_least_once_without_reject_publish_is_at_most_once(env):
    dlx = env.exchange("fanout")
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-dead-letter-strategy": "at-least-once",
                        "x-max-length": 1})
    publish(env, q, [b"a"])
    ch = channel(env, confirm=True)
    ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=False)
    time.sleep(0.2)
    ch.basic_publish("", q, b"b")
    ch.basic_publish("", q, b"c")       # drop-head: b goes, nothing is kept for the dead letter
    assert [b for b, _r, _h in get_all(ch, q)] == [b"c"]


def test_at_least_once_delivers_when_routable(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-dead-letter-strategy": "at-least-once",
                        "x-overflow": "reject-publish"})
    publish(env, q, [b"alo"])
    ch = channel(env)
    ch.basic_reject(ch.basic_get(q)[0].delivery_tag, requeue=False)
    _m, props, body = wait_get(ch, dlq)
    assert body == b"alo" and props.headers["x-death"][0]["reason"] == "rejected"


# ----------------------------------------------------------------------------------------------- overflow


def _pub(ch, q, body, **props) -> str:
    try:
        ch.basic_publish("", q, body, pika.BasicProperties(**props) if props else None)
        return "ack"
    except pika.exceptions.NackError:
        return "NACK"


def test_reject_publish_blocks_past_the_limit_and_unblocks_at_80_percent(env):
    q = declare(env, **{"x-overflow": "reject-publish", "x-max-length": 2})
    ch = channel(env, confirm=True)
    assert [_pub(ch, q, b"p%d" % i) for i in range(1, 6)] == ["ack", "ack", "ack", "NACK", "NACK"]
    assert queue_counts(env.url, q) == (3, 0)
    assert ch.basic_get(q, auto_ack=True)[2] == b"p1"
    assert _pub(ch, q, b"p6") == "NACK"
    assert ch.basic_get(q, auto_ack=True)[2] == b"p2"
    assert [_pub(ch, q, b"p%d" % i) for i in (7, 8, 9)] == ["ack", "ack", "NACK"]
    assert [b for b, _r, _h in get_all(ch, q)] == [b"p3", b"p7", b"p8"]
    q10 = declare(env, **{"x-overflow": "reject-publish", "x-max-length": 10})
    assert [_pub(ch, q10, b"%d" % i) for i in range(13)] == ["ack"] * 11 + ["NACK"] * 2
    outcomes = []
    for k in range(3):
        ch.basic_get(q10, auto_ack=True)
        outcomes.append(_pub(ch, q10, b"x%d" % k))
    assert outcomes == ["NACK", "NACK", "ack"]


def test_reject_publish_refuses_a_new_publisher_over_the_limit_and_returns_nothing(env):
    q = declare(env, **{"x-overflow": "reject-publish", "x-max-length": 1})
    ch = channel(env, confirm=True)
    assert [_pub(ch, q, b"a%d" % i) for i in range(3)] == ["ack", "ack", "NACK"]
    ch2 = channel(env, confirm=True)
    assert _pub(ch2, q, b"from-ch2") == "NACK"
    returned = []
    ch.add_on_return_callback(lambda *a: returned.append(a))
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"mandatory", mandatory=True)
    ch.connection.process_data_events(0.2)
    assert returned == [] and queue_counts(env.url, q) == (2, 0)


def test_reject_publish_counts_ready_messages_only(env):
    q = declare(env, **{"x-overflow": "reject-publish", "x-max-length": 2})
    ch = channel(env, confirm=True)
    _pub(ch, q, b"u1")
    _pub(ch, q, b"u2")
    [ch.basic_get(q) for _ in range(2)]
    assert [_pub(ch, q, b"r%d" % i) for i in range(1, 5)] == ["ack", "ack", "ack", "NACK"]
    assert queue_counts(env.url, q)[0] == 3


def test_drop_head_with_unacked_messages(env, rabbitmq_version):
    """Unacked messages do not count; given back, they are over the limit: 4.x drops them first (they are at
    the head), 3.10 without a delivery limit drops the older ready ones (they went to the tail)."""
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-max-length": 2})
    ch = channel(env, confirm=True)
    _pub(ch, q, b"u1")
    _pub(ch, q, b"u2")
    held = [ch.basic_get(q)[0] for _ in range(2)]
    assert [_pub(ch, q, b"r%d" % i) for i in range(1, 4)] == ["ack"] * 3
    _wait_count(env, dlq, 1)
    assert queue_counts(env.url, q)[0] == 2
    ch.basic_nack(held[1].delivery_tag, multiple=True, requeue=True)
    _wait_count(env, dlq, 3)
    kept = [b for b, _r, _h in get_all(ch, q)]
    dropped = [b for b, _r, _h in get_all(ch, dlq)]
    if rabbitmq_version == "4.3":
        assert (kept, dropped) == ([b"r2", b"r3"], [b"r1", b"u1", b"u2"])
    else:
        assert (kept, dropped) == ([b"u1", b"u2"], [b"r1", b"r2", b"r3"])


@pytest.mark.parametrize("limit, headers, kept", [(20, False, {"3.10": 2, "4.3": 1}),
                                                   (24, False, {"3.10": 2, "4.3": 2}),
                                                   (24, True, {"3.10": 2, "4.3": 1})])
def test_max_length_bytes_counts_properties_on_43(env, rabbitmq_version, limit, headers, kept):
    """4.x counts each message's body and encoded properties (10-byte bodies: 12 bytes without properties,
    24 with a small headers table); 3.10 counts bodies."""
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-max-length-bytes": limit})
    ch = channel(env, confirm=True)
    for _ in range(3):
        _pub(ch, q, b"0123456789", **({"headers": {"a": "b"}} if headers else {}))
    _wait_count(env, dlq, 3 - kept[rabbitmq_version])
    assert queue_counts(env.url, q)[0] == kept[rabbitmq_version]


def test_max_length_zero(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-max-length": 0})
    ch = channel(env, confirm=True)
    assert [_pub(ch, q, b"z%d" % i) for i in range(2)] == ["ack", "ack"]
    _wait_count(env, dlq, 2)
    assert queue_counts(env.url, q)[0] == 0
    q2 = declare(env, **{"x-max-length": 0, "x-overflow": "reject-publish"})
    assert [_pub(ch, q2, b"z%d" % i) for i in range(3)] == ["ack", "NACK", "NACK"]
    assert queue_counts(env.url, q2)[0] == 1


def test_reject_publish_dlx_is_drop_head(env):
    dlx, dlq = dead_letter_exchange(env)
    q = declare(env, **{"x-dead-letter-exchange": dlx, "x-max-length": 1, "x-overflow": "reject-publish-dlx"})
    ch = channel(env, confirm=True)
    assert [_pub(ch, q, b"d%d" % i) for i in range(3)] == ["ack", "ack", "ack"]
    _wait_count(env, dlq, 2)
    dropped = [(b, h["x-death"][0]["reason"]) for b, _r, h in get_all(ch, dlq)]
    assert dropped == [(b"d0", "maxlen"), (b"d1", "maxlen")]
    assert [b for b, _r, _h in get_all(ch, q)] == [b"d2"]


# ------------------------------------------------------------------------------------------------ x-expires


def test_unused_queue_is_deleted_at_its_tick(env):
    """x-expires is checked on the queue's 5-second tick: an unused queue with x-expires 1000 is still there
    after 2 s and gone after the first tick past its expiry (5 s after its declaration). Neither publishing
    nor passive declares are use (unlike a classic queue's)."""
    name = env.names("qq")
    env.track_queue(name)
    channel(env).queue_declare(name, durable=True, arguments={**QQ, "x-expires": 1000})
    declared = time.monotonic()
    publish(env, name, [b"m"])          # publishing is not use
    time.sleep(2.0)
    assert queue_counts(env.url, name) is not None
    def exists() -> bool:
        return queue_counts(env.url, name) is not None     # a passive declare

    while exists():
        assert time.monotonic() - declared < 8.0, "the quorum queue was not deleted by x-expires"
        time.sleep(0.1)
    assert time.monotonic() - declared > 4.5
    ch = channel(env)
    assert refusal(lambda: ch.queue_declare(name, passive=True)) == (
        "channel", 404, f"NOT_FOUND - no {rs(name)}")
