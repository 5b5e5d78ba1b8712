"""Differential behaviour tests for dead-lettering: x-dead-letter-exchange / x-dead-letter-routing-key on
reject / nack without requeue, on TTL expiry and on max-length overflow, and the x-death / x-first-death-*
headers RabbitMQ 3.10 adds (the x-death entries are compared field by field, except their time).

Every test takes ``broker_url`` and so runs against the embedded broker and against RabbitMQ 3.10 with the
same assertions.
"""

from __future__ import annotations

import datetime
import struct
import time

import pika
import pika.exceptions
import pytest

from helpers import pika_sync, queue_counts, raw_handshake
from support import Env, amqp_nack, bodies, drain, env, raw_frame, raw_method, read_raw_frame  # noqa: F401
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------------- dead-lettering


def dead_letter_setup(env: Env, source_args: dict | None = None, dlrk: str | None = None):
    """A source queue dead-lettering to a fanout DLX with one bound queue: (source, dlx, dead-letter queue)."""
    dlx = env.exchange("fanout")
    dlq = env.queue()
    env.admin().queue_bind(dlq, dlx)
    args: dict = {"x-dead-letter-exchange": dlx}
    if dlrk is not None:
        args["x-dead-letter-routing-key"] = dlrk
    args.update(source_args or {})
    return env.queue(arguments=args), dlx, dlq


def wait_get(ch, queue: str, timeout: float = 5.0):
    """basic.get (auto-ack) polled until a message arrives: (method, properties, body)."""
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            return method, props, body
        if time.monotonic() > deadline:
            pytest.fail(f"no message arrived in {queue} within {timeout}s")
        time.sleep(0.02)


def xdeath(headers: dict) -> list[dict]:
    """The x-death entries without their time (checked separately: a recent timestamp)."""
    entries = headers["x-death"]
    now = datetime.datetime.now(datetime.timezone.utc)
    out = []
    for entry in entries:
        entry = dict(entry)
        t = entry.pop("time")
        assert isinstance(t, datetime.datetime), t
        assert abs((now - t).total_seconds()) < 120, t
        out.append(entry)
    return out


def first_death(headers: dict) -> tuple:
    return (headers.get("x-first-death-exchange"), headers.get("x-first-death-queue"),
            headers.get("x-first-death-reason"))


def last_death(headers: dict) -> tuple:
    return (headers.get("x-last-death-exchange"), headers.get("x-last-death-queue"),
            headers.get("x-last-death-reason"))


def reject_head(env: Env, queue: str, requeue: bool = False):
    """basic.get the head of ``queue`` on a channel of a new pika connection and reject it; the channel."""
    c = env.pika().channel()
    c.basic_reject(c.basic_get(queue)[0].delivery_tag, requeue=requeue)
    return c


# The headers a dead-lettered message gets beside x-death: x-first-death-*, and on 4.x x-last-death-* too.
FIRST_DEATH = {"x-first-death-exchange", "x-first-death-queue", "x-first-death-reason"}
LAST_DEATH = {"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"}


def death_headers(version: str) -> set:
    return FIRST_DEATH | LAST_DEATH if version == "4.3" else FIRST_DEATH


def test_reject_without_requeue_dead_letters(env, rabbitmq_version):
    q, dlx, dlq = dead_letter_setup(env)
    ch = env.admin()
    props = pika.BasicProperties(message_id="id-1", priority=4, content_type="text/plain",
                                 headers={"app": "value", "n": 7})
    ch.basic_publish("", q, b"payload", props)
    pika_sync(ch)
    conn = env.pika()
    c = conn.channel()
    method, _p, body = c.basic_get(q)
    c.basic_reject(method.delivery_tag, requeue=False)
    dmethod, dprops, dbody = wait_get(ch, dlq)
    assert dbody == b"payload"
    # 4.x counts a basic.reject as a failed delivery and the count travels with the dead letter, so the
    # dead-letter queue delivers it as a redelivery; 3.10 delivers it as new.
    assert (dmethod.exchange, dmethod.routing_key, dmethod.redelivered) == (dlx, q, rabbitmq_version == "4.3")
    assert (dprops.message_id, dprops.priority, dprops.content_type) == ("id-1", 4, "text/plain")
    headers = dprops.headers
    assert set(headers) == {"app", "n", "x-death"} | death_headers(rabbitmq_version)
    assert (headers["app"], headers["n"]) == ("value", 7)
    assert xdeath(headers) == [{"count": 1, "reason": "rejected", "queue": q, "exchange": "",
                                "routing-keys": [q]}]
    assert first_death(headers) == ("", q, "rejected")
    if rabbitmq_version == "4.3":
        assert last_death(headers) == ("", q, "rejected")
    assert queue_counts(env.url, q) == (0, 0)


def test_nack_without_requeue_dead_letters_in_order(env):
    q, _dlx, dlq = dead_letter_setup(env)
    env.publish(q, bodies(3))
    conn = env.pika()
    c = conn.channel()
    tags = [c.basic_get(q)[0].delivery_tag for _ in range(3)]
    c.basic_nack(tags[-1], multiple=True, requeue=False)
    pika_sync(c)
    ch = env.admin()
    got = [wait_get(ch, dlq) for _ in range(3)]
    assert [b for _m, _p, b in got] == bodies(3)
    assert all(xdeath(p.headers)[0]["reason"] == "rejected" for _m, p, _b in got)


def test_nack_with_py_amqp_dead_letters(env):
    q, _dlx, dlq = dead_letter_setup(env)
    env.publish(q, [b"x"])
    conn = env.amqp()
    ch = conn.channel()
    m = ch.basic_get(q)
    amqp_nack(ch, m.delivery_tag, requeue=False)
    got = wait_get(env.admin(), dlq)
    assert got[2] == b"x"
    assert xdeath(got[1].headers)[0]["reason"] == "rejected"


def test_requeue_true_does_not_dead_letter(env):
    q, _dlx, dlq = dead_letter_setup(env)
    env.publish(q, [b"x"])
    c = reject_head(env, q, requeue=True)
    pika_sync(c)
    assert queue_counts(env.url, q) == (1, 0)
    assert queue_counts(env.url, dlq) == (0, 0)


def test_dead_letter_routing_key_override(env):
    dlx = env.exchange("direct")
    dlq = env.queue()
    env.admin().queue_bind(dlq, dlx, "dead")
    q = env.queue(arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dead"})
    x = env.exchange("direct")
    ch = env.admin()
    ch.queue_bind(q, x, "orig")
    ch.basic_publish(x, "orig", b"routed")
    pika_sync(ch)
    reject_head(env, q)
    method, props, body = wait_get(ch, dlq)
    assert (method.exchange, method.routing_key, body) == (dlx, "dead", b"routed")
    assert xdeath(props.headers) == [{"count": 1, "reason": "rejected", "queue": q, "exchange": x,
                                      "routing-keys": ["orig"]}]
    assert first_death(props.headers) == (x, q, "rejected")


def test_dead_letter_without_routing_key_uses_original_keys_including_cc(env):
    dlx = env.exchange("direct")
    dla, dlb = env.queue(), env.queue()
    ch = env.admin()
    ch.queue_bind(dla, dlx, "a")
    ch.queue_bind(dlb, dlx, "b")
    x = env.exchange("direct")
    q = env.queue(arguments={"x-dead-letter-exchange": dlx})
    ch.queue_bind(q, x, "a")
    ch.basic_publish(x, "a", b"cc", pika.BasicProperties(headers={"CC": ["b"]}))
    pika_sync(ch)
    reject_head(env, q)
    ma, pa, _ = wait_get(ch, dla)
    mb, pb, _ = wait_get(ch, dlb)
    assert (ma.routing_key, mb.routing_key) == ("a", "a")
    for props in (pa, pb):
        assert props.headers["CC"] == ["b"]
        assert xdeath(props.headers) == [{"count": 1, "reason": "rejected", "queue": q, "exchange": x,
                                          "routing-keys": ["a", "b"]}]


def test_ttl_expiry_dead_letters(env):
    q, dlx, dlq = dead_letter_setup(env, {"x-message-ttl": 150}, dlrk="after-ttl")
    env.publish(q, [b"e1", b"e2"])
    ch = env.admin()
    got = [wait_get(ch, dlq, 5) for _ in range(2)]
    assert [b for _m, _p, b in got] == [b"e1", b"e2"]
    method, props, _b = got[0]
    assert (method.exchange, method.routing_key) == (dlx, "after-ttl")
    assert xdeath(props.headers) == [{"count": 1, "reason": "expired", "queue": q, "exchange": "",
                                      "routing-keys": [q]}]
    assert first_death(props.headers) == ("", q, "expired")
    assert props.expiration is None
    assert queue_counts(env.url, q) == (0, 0)


def test_per_message_expiration_dead_letters_with_original_expiration(env):
    q, _dlx, dlq = dead_letter_setup(env)
    ch = env.admin()
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="120", headers={"k": "v"}))
    pika_sync(ch)
    _m, props, body = wait_get(ch, dlq, 5)
    assert body == b"short"
    assert props.expiration is None  # removed, recorded in x-death instead
    assert props.headers["k"] == "v"
    assert xdeath(props.headers) == [{"count": 1, "reason": "expired", "queue": q, "exchange": "",
                                      "routing-keys": [q], "original-expiration": "120"}]


def test_rejected_message_with_expiration_records_original_expiration(env):
    q, _dlx, dlq = dead_letter_setup(env)
    ch = env.admin()
    ch.basic_publish("", q, b"r", pika.BasicProperties(expiration="60000"))
    pika_sync(ch)
    reject_head(env, q)
    _m, props, _b = wait_get(ch, dlq)
    assert props.expiration is None
    assert xdeath(props.headers) == [{"count": 1, "reason": "rejected", "queue": q, "exchange": "",
                                      "routing-keys": [q], "original-expiration": "60000"}]


def test_max_length_drop_head_dead_letters_oldest(env):
    q, _dlx, dlq = dead_letter_setup(env, {"x-max-length": 2})
    env.publish(q, bodies(4))
    ch = env.admin()
    got = [wait_get(ch, dlq) for _ in range(2)]
    assert [b for _m, _p, b in got] == [b"m1", b"m2"]
    assert xdeath(got[0][1].headers) == [{"count": 1, "reason": "maxlen", "queue": q, "exchange": "",
                                          "routing-keys": [q]}]
    assert first_death(got[0][1].headers) == ("", q, "maxlen")
    assert drain(ch, q) == [b"m3", b"m4"]


def test_max_length_bytes_drop_head_dead_letters(env):
    q, _dlx, dlq = dead_letter_setup(env, {"x-max-length-bytes": 5})
    env.publish(q, [b"aaa", b"bbb"])
    _m, props, body = wait_get(env.admin(), dlq)
    assert body == b"aaa"
    assert xdeath(props.headers)[0]["reason"] == "maxlen"


def test_reject_publish_dlx_dead_letters_rejected_publishes(env):
    q, _dlx, dlq = dead_letter_setup(env, {"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
    conn = env.pika()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", q, b"kept")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"overflow")
    _m, props, body = wait_get(ch, dlq)
    assert body == b"overflow"
    assert xdeath(props.headers) == [{"count": 1, "reason": "maxlen", "queue": q, "exchange": "",
                                      "routing-keys": [q]}]
    assert drain(ch, q) == [b"kept"]


def test_reject_publish_does_not_dead_letter(env):
    q, _dlx, dlq = dead_letter_setup(env, {"x-max-length": 1, "x-overflow": "reject-publish"})
    env.publish(q, [b"kept", b"refused"])
    assert queue_counts(env.url, dlq) == (0, 0)
    assert drain(env.admin(), q) == [b"kept"]


def test_x_death_count_increments_and_entry_moves_to_front(env):
    q1, q2 = env.names("ring1"), env.names("ring2")
    env.queue(name=q1, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q2})
    env.queue(name=q2, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q1})
    ch = env.admin()
    ch.basic_publish("", q1, b"ring", pika.BasicProperties(headers={"keep": 1}))
    pika_sync(ch)
    conn = env.pika()
    c = conn.channel()

    def bounce(src: str, dst: str):
        method, _p, _b = c.basic_get(src)
        assert method is not None, f"message not in {src}"
        c.basic_reject(method.delivery_tag, requeue=False)
        pika_sync(c)
        wait_until(lambda: queue_counts(env.url, dst) == (1, 0), message=f"the message dead-lettered to {dst}")
        return c.basic_get(dst)  # peek: take it and put it back

    def peek(src: str, dst: str) -> dict:
        method, props, _b = bounce(src, dst)
        c.basic_reject(method.delivery_tag, requeue=True)
        pika_sync(c)
        return props.headers

    h = peek(q1, q2)
    assert xdeath(h) == [{"count": 1, "reason": "rejected", "queue": q1, "exchange": "", "routing-keys": [q1]}]
    h = peek(q2, q1)
    assert xdeath(h) == [
        {"count": 1, "reason": "rejected", "queue": q2, "exchange": "", "routing-keys": [q2]},
        {"count": 1, "reason": "rejected", "queue": q1, "exchange": "", "routing-keys": [q1]},
    ]
    h = peek(q1, q2)
    assert xdeath(h) == [
        {"count": 2, "reason": "rejected", "queue": q1, "exchange": "", "routing-keys": [q1]},
        {"count": 1, "reason": "rejected", "queue": q2, "exchange": "", "routing-keys": [q2]},
    ]
    assert first_death(h) == ("", q1, "rejected")
    assert h["keep"] == 1
    h = peek(q2, q1)
    assert [(e["queue"], e["count"]) for e in xdeath(h)] == [(q2, 2), (q1, 2)]
    assert first_death(h) == ("", q1, "rejected")


def test_same_queue_different_reasons_are_separate_entries(env):
    q1 = env.names("ring")
    q2 = env.names("hold")
    # q1 expires messages into q2; rejecting from q2 goes back to q1
    env.queue(name=q1, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q2,
                                  "x-message-ttl": 150})
    env.queue(name=q2, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q1})
    ch = env.admin()
    ch.basic_publish("", q1, b"m")
    pika_sync(ch)
    conn = env.pika()
    c = conn.channel()
    wait_until(lambda: queue_counts(env.url, q2) == (1, 0), message="the message to expire into q2")
    method, _p, _b = c.basic_get(q2)
    c.basic_reject(method.delivery_tag, requeue=False)  # back to q1, then expires into q2 again
    pika_sync(c)
    _m, props, _b = wait_get(c, q2, 5)
    assert xdeath(props.headers) == [
        {"count": 2, "reason": "expired", "queue": q1, "exchange": "", "routing-keys": [q1]},
        {"count": 1, "reason": "rejected", "queue": q2, "exchange": "", "routing-keys": [q2]},
    ]
    assert first_death(props.headers) == ("", q1, "expired")


def test_expiry_cycle_without_rejection_is_dropped(env):
    q = env.names("self")
    env.queue(name=q, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q,
                                 "x-message-ttl": 100})
    env.publish(q, [b"loop"])
    # dead-lettered to itself once (expired), then the cycle is detected and the message dropped
    wait_until(lambda: queue_counts(env.url, q) == (0, 0), timeout=5)
    time.sleep(0.3)
    assert queue_counts(env.url, q) == (0, 0)
    assert env.admin().basic_get(q) == (None, None, None)


def test_dead_letter_to_missing_exchange_drops_message(env):
    q = env.queue(arguments={"x-dead-letter-exchange": env.names("nonexistent")})
    env.publish(q, [b"x"])
    c = reject_head(env, q)
    pika_sync(c)
    assert c.is_open and c.connection.is_open
    assert queue_counts(env.url, q) == (0, 0)


def test_purge_and_delete_do_not_dead_letter(env):
    q, _dlx, dlq = dead_letter_setup(env)
    env.publish(q, bodies(2))
    ch = env.admin()
    assert ch.queue_purge(q).method.message_count == 2
    env.publish(q, bodies(2))
    ch.queue_delete(q)
    time.sleep(0.2)
    assert queue_counts(env.url, dlq) == (0, 0)


def test_dead_letter_via_named_exchange_records_exchange(env):
    q, _dlx, dlq = dead_letter_setup(env, {"x-message-ttl": 100})
    ch = env.admin()
    ch.queue_bind(q, "amq.topic", "a.b.c")
    ch.basic_publish("amq.topic", "a.b.c", b"t")
    pika_sync(ch)
    _m, props, _b = wait_get(ch, dlq, 5)
    assert xdeath(props.headers) == [{"count": 1, "reason": "expired", "queue": q, "exchange": "amq.topic",
                                      "routing-keys": ["a.b.c"]}]
    assert first_death(props.headers) == ("amq.topic", q, "expired")


# ------------------------------------------------------------------------------ x-death field types


def _parse_value(buf: bytes, i: int):
    tag = buf[i:i + 1]
    i += 1
    simple = {b"t": ">B", b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H", b"I": ">i", b"i": ">I",
              b"l": ">q", b"L": ">Q", b"f": ">f", b"d": ">d", b"T": ">Q"}
    if tag in simple:
        fmt = simple[tag]
        (v,) = struct.unpack_from(fmt, buf, i)
        return (tag.decode(), v), i + struct.calcsize(fmt)
    if tag == b"D":
        scale, v = struct.unpack_from(">Bi", buf, i)
        return ("D", (scale, v)), i + 5
    if tag in (b"S", b"x"):
        (n,) = struct.unpack_from(">I", buf, i)
        return (tag.decode(), buf[i + 4:i + 4 + n]), i + 4 + n
    if tag == b"V":
        return ("V", None), i
    if tag == b"A":
        (n,) = struct.unpack_from(">I", buf, i)
        end, j, items = i + 4 + n, i + 4, []
        while j < end:
            item, j = _parse_value(buf, j)
            items.append(item)
        return ("A", items), end
    if tag == b"F":
        (n,) = struct.unpack_from(">I", buf, i)
        return ("F", _parse_table(buf[i + 4:i + 4 + n])), i + 4 + n
    raise AssertionError(f"unknown field type {tag!r}")


def _parse_table(buf: bytes) -> dict:
    out, i = {}, 0
    while i < len(buf):
        n = buf[i]
        key = buf[i + 1:i + 1 + n].decode()
        value, i = _parse_value(buf, i + 1 + n)
        out[key] = value
    return out


def _typed_headers(header_payload: bytes) -> dict:
    _cls, _w, _size, flags = struct.unpack_from(">HHQH", header_payload, 0)
    i = 14
    for bit in (15, 14):  # content-type, content-encoding precede headers
        if flags & (1 << bit):
            i += 1 + header_payload[i]
    assert flags & (1 << 13), "no headers"
    (n,) = struct.unpack_from(">I", header_payload, i)
    return _parse_table(header_payload[i + 4:i + 4 + n])


def _raw_get_header(url: str, queue: str) -> bytes:
    """basic.get (no-ack) over a raw socket; the content header frame payload as sent by the broker."""
    rc, _tune = raw_handshake(url)
    try:
        rc.send_bytes(raw_frame(1, 1, raw_method(20, 10, b"\x00")))  # channel.open
        assert read_raw_frame(rc)[2][:4] == raw_method(20, 11)
        q = queue.encode()
        get = raw_method(60, 70, struct.pack(">H", 0) + bytes([len(q)]) + q + b"\x01")  # basic.get, no-ack
        rc.send_bytes(raw_frame(1, 1, get))
        _ftype, _c, payload = read_raw_frame(rc)
        assert payload[:4] == raw_method(60, 71), "expected basic.get-ok"
        ftype, _c, header = read_raw_frame(rc)
        assert ftype == 2
        return header
    finally:
        rc.close()


def test_x_death_field_types(env, rabbitmq_version):
    q, _dlx, dlq = dead_letter_setup(env)
    ch = env.admin()
    ch.basic_publish("", q, b"typed", pika.BasicProperties(expiration="60000"))
    pika_sync(ch)
    c = reject_head(env, q)
    pika_sync(c)
    wait_until(lambda: queue_counts(env.url, dlq) == (1, 0))
    headers = _typed_headers(_raw_get_header(env.url, dlq))
    assert {k: v[0] for k, v in headers.items()} == {"x-death": "A", **{k: "S" for k in death_headers(rabbitmq_version)}}
    (entry_type, entries) = headers["x-death"]
    assert [e[0] for e in entries] == ["F"]
    entry = entries[0][1]
    assert {k: v[0] for k, v in entry.items()} == {
        "count": "l", "reason": "S", "queue": "S", "time": "T", "exchange": "S", "routing-keys": "A",
        "original-expiration": "S"}
    assert entry["routing-keys"] == ("A", [("S", q.encode())])
    assert entry["count"] == ("l", 1)
