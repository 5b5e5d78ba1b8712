"""Exchanges: routing by type, the default and amq.* exchanges, declare/delete rules, exchange-to-exchange
bindings, auto-delete and alternate exchanges.

Differential: every test runs against the embedded broker and RabbitMQ 3.10 (``broker_url``) with the same
assertions. Publishes go through confirm-mode channels, so once basic_publish returns the message is routed
and basic.get sees it (no sleeps).
"""

from __future__ import annotations

import amqp
import pika
import pika.exceptions
import pytest

from helpers import amqp_connect, close_outcome, drain_get, exchange_exists, pika_connect
from waiting import wait_until

# -------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def unique_name(unique_name, broker_url):
    """The conftest factory, plus: every name handed out is deleted as an exchange at teardown.

    Auto-delete exchanges that never got a binding (or sit in a binding cycle) are never removed by the
    broker, and RabbitMQ is shared: leave nothing behind. Deleting a missing exchange is a no-op.
    """
    names: list[str] = []

    def make(prefix: str = "") -> str:
        name = unique_name(prefix)
        names.append(name)
        return name

    yield make
    if names:
        c = pika_connect(broker_url)
        try:
            ch = c.channel()
            for name in names:
                ch.exchange_delete(name)
        except Exception:
            pass
        finally:
            try:
                c.close()
            except Exception:
                pass


@pytest.fixture
def conn(broker_url):
    c = pika_connect(broker_url)
    yield c
    try:
        if c.is_open:
            c.close()
    except Exception:
        pass


@pytest.fixture
def ch(conn):
    """A confirm-mode channel: publishes are routed when basic_publish returns."""
    c = conn.channel()
    c.confirm_delivery()
    return c


def _queue(ch, key_bindings=(), exchange=None) -> str:
    q = ch.queue_declare("", exclusive=True).method.queue
    for key in key_bindings:
        ch.queue_bind(q, exchange, key)
    return q


def _publish(ch, exchange, key, body, headers=None, mandatory=False):
    """Publish on a confirm channel; returns False when the message came back unroutable (mandatory)."""
    try:
        ch.basic_publish(exchange, key, body, pika.BasicProperties(headers=headers), mandatory=mandatory)
    except pika.exceptions.UnroutableError:
        return False
    return True


def _bodies(ch, q):
    return drain_get(ch, q)


# ---------------------------------------------------------------------------------------- direct


def test_direct_routes_by_exact_key(ch, unique_name):
    x = unique_name("direct")
    ch.exchange_declare(x, "direct", auto_delete=True)
    qa = _queue(ch, ["a"], x)
    qb = _queue(ch, ["b"], x)
    qab = _queue(ch, ["a", "b"], x)
    for key in ["a", "b", "c", "A", "a.b", ""]:
        _publish(ch, x, key, key.encode())
    assert _bodies(ch, qa) == [b"a"]
    assert _bodies(ch, qb) == [b"b"]
    assert _bodies(ch, qab) == [b"a", b"b"]


def test_direct_same_binding_twice_delivers_once(ch, unique_name):
    x = unique_name("direct")
    ch.exchange_declare(x, "direct", auto_delete=True)
    q = _queue(ch, ["k", "k"], x)
    _publish(ch, x, "k", b"one")
    assert _bodies(ch, q) == [b"one"]


def test_direct_empty_key_binding(ch, unique_name):
    x = unique_name("direct")
    ch.exchange_declare(x, "direct", auto_delete=True)
    q = _queue(ch, [""], x)
    _publish(ch, x, "", b"empty")
    _publish(ch, x, "x", b"x")
    assert _bodies(ch, q) == [b"empty"]


# ---------------------------------------------------------------------------------------- fanout


def test_fanout_ignores_key_and_delivers_once_per_queue(ch, unique_name):
    x = unique_name("fanout")
    ch.exchange_declare(x, "fanout", auto_delete=True)
    q1 = _queue(ch, ["ignored"], x)
    q2 = _queue(ch, ["one", "two"], x)      # two bindings, still one copy
    for key in ["", "k", "z.y"]:
        _publish(ch, x, key, key.encode() or b"-")
    assert _bodies(ch, q1) == [b"-", b"k", b"z.y"]
    assert _bodies(ch, q2) == [b"-", b"k", b"z.y"]


def test_fanout_without_bindings_drops(ch, unique_name):
    x = unique_name("fanout")
    ch.exchange_declare(x, "fanout", auto_delete=True)
    try:
        assert _publish(ch, x, "", b"lost", mandatory=True) is False
    finally:
        ch.exchange_delete(x)          # never bound: auto-delete would keep it


# ----------------------------------------------------------------------------------------- topic

TOPIC_KEYS = ["", "a", "b", "a.b", "a.b.c", "a..b", ".a", "a.", ".", "..", "b.a", "a.a", "a.x.b",
              "a.x.y.b", "x.a", "#", "*", "a.*", "A.B"]


def _words(s: str) -> list[str]:
    return [] if s == "" else s.split(".")


def _topic_match(pattern: list[str], key: list[str]) -> bool:
    """Reference semantics (checked against RabbitMQ 3.10): "" has no words, "a." has two."""
    if not pattern:
        return not key
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_topic_match(rest, key[i:]) for i in range(len(key) + 1))
    if not key:
        return False
    if head == "*" or head == key[0]:
        return _topic_match(rest, key[1:])
    return False


# Observed on RabbitMQ 3.10.8 (kept literal for the trickiest patterns so the reference itself is checked)
TOPIC_OBSERVED = {
    "*": ["#", "*", "a", "b"],
    "#.a": [".a", "a", "a.a", "b.a", "x.a"],
    "a.#.b": ["a..b", "a.b", "a.x.b", "a.x.y.b"],
    "a.*.b": ["a..b", "a.x.b"],
    "": [""],
    "*.a.#": [".a", "a.a", "b.a", "x.a"],
    "a.*.#": ["a.", "a.*", "a..b", "a.a", "a.b", "a.b.c", "a.x.b", "a.x.y.b"],
}

TOPIC_PATTERNS = ["#", "*", "a.*", "*.b", "a.#", "#.a", "#.b", "a.#.b", "a.*.b", "*.*", "#.#", "a.#.#.b",
                  "", "a..b", "*.a.#", "#.*", "a.b", "*.#", "#.*.#", "a.*.#", ".", "a.", ".a"]


def test_topic_reference_matches_observations():
    for pattern, expected in TOPIC_OBSERVED.items():
        got = sorted(k for k in TOPIC_KEYS if _topic_match(_words(pattern), _words(k)))
        assert got == sorted(expected), pattern


@pytest.mark.parametrize("pattern", TOPIC_PATTERNS, ids=[p or "<empty>" for p in TOPIC_PATTERNS])
def test_topic_pattern(ch, unique_name, pattern):
    x = unique_name("topic")
    ch.exchange_declare(x, "topic", auto_delete=True)
    q = _queue(ch, [pattern], x)
    for key in TOPIC_KEYS:
        _publish(ch, x, key, key.encode())
    got = sorted(b.decode() for b in _bodies(ch, q))
    expected = sorted(k for k in TOPIC_KEYS if _topic_match(_words(pattern), _words(k)))
    assert got == expected


def test_topic_overlapping_bindings_deliver_once(ch, unique_name):
    x = unique_name("topic")
    ch.exchange_declare(x, "topic", auto_delete=True)
    q = _queue(ch, ["a.*", "*.b", "#", "a.b"], x)
    _publish(ch, x, "a.b", b"once")
    assert _bodies(ch, q) == [b"once"]


def test_topic_unbind_one_of_several_patterns(ch, unique_name):
    x = unique_name("topic")
    ch.exchange_declare(x, "topic", auto_delete=True)
    q = _queue(ch, ["a.*", "#.c"], x)
    ch.queue_unbind(q, x, "a.*")
    _publish(ch, x, "a.b", b"ab")
    _publish(ch, x, "b.c", b"bc")
    assert _bodies(ch, q) == [b"bc"]


def test_topic_long_keys(ch, unique_name):
    x = unique_name("topic")
    ch.exchange_declare(x, "topic", auto_delete=True)
    q = _queue(ch, ["#.end", "w0.#.w59"], x)
    long_key = ".".join(f"w{i}" for i in range(60))     # 229 octets: a shortstr holds 255
    _publish(ch, x, long_key, b"long")
    _publish(ch, x, long_key + ".end", b"long-end")
    assert _bodies(ch, q) == [b"long", b"long-end"]


# --------------------------------------------------------------------------------------- headers

# binding arguments -> which message header sets it matches (observed on RabbitMQ 3.10.8 with py-amqp)
HEADER_MESSAGES = {
    "none": None,
    "empty": {},
    "a1": {"a": "1"},
    "a1b2": {"a": "1", "b": 2},
    "a1b3": {"a": "1", "b": 3},
    "a2b2": {"a": "2", "b": 2},
    "a1b2c": {"a": "1", "b": 2, "c": "x"},
    "aint1": {"a": 1},
    "n1": {"n": 1},
    "n1s": {"n": "1"},
    "n1f": {"n": 1.0},
    "ntrue": {"n": True},
    "nbig": {"n": 2 ** 40},
    "ftrue": {"f": True},
    "f1": {"f": 1},
    "fl": {"fl": 1.5},
    "v1": {"v": "anything"},
    "vnone": {"v": None},
    "xo": {"x-other": "z"},
    "xoa": {"x-other": "z", "a": "1"},
    "t": {"t": {"k": "v"}},
    "l": {"l": [1, 2]},
}
ALL_MESSAGES = sorted(HEADER_MESSAGES)

HEADER_BINDINGS = {
    "all-ab": ({"x-match": "all", "a": "1", "b": 2}, ["a1b2", "a1b2c"]),
    "any-ab": ({"x-match": "any", "a": "1", "b": 2}, ["a1", "a1b2", "a1b2c", "a1b3", "a2b2", "xoa"]),
    "default-is-all": ({"a": "1", "b": 2}, ["a1b2", "a1b2c"]),
    "all-no-keys": ({"x-match": "all"}, ALL_MESSAGES),
    "any-no-keys": ({"x-match": "any"}, []),
    "no-arguments": ({}, ALL_MESSAGES),
    "int-1": ({"n": 1}, ["n1", "n1f"]),                 # numeric equality (3.10); not "1", not true
    "str-1": ({"n": "1"}, ["n1s"]),
    "bool-true": ({"f": True}, ["ftrue"]),               # true is not 1
    "double": ({"fl": 1.5}, ["fl"]),
    "void-means-present": ({"v": None}, ["v1", "vnone"]),
    "x-keys-ignored-all": ({"x-match": "all", "x-other": "z", "a": "1"},
                           ["a1", "a1b2", "a1b2c", "a1b3", "xoa"]),
    "x-keys-ignored-any": ({"x-match": "any", "x-other": "z"}, []),
    "big-int": ({"n": 2 ** 40}, ["nbig"]),
    "table": ({"t": {"k": "v"}}, ["t"]),
    "array": ({"l": [1, 2]}, ["l"]),
}


@pytest.fixture
def amqp_conn(broker_url):
    c = amqp_connect(broker_url, confirm_publish=True)
    yield c
    try:
        c.close()
    except Exception:
        pass


def _amqp_drain(ch, q):
    out = []
    while True:
        m = ch.basic_get(q, no_ack=True)
        if m is None:
            return out
        out.append(m.body.decode() if isinstance(m.body, (bytes, bytearray)) else m.body)


# 4.x compares values exactly: the integer 1 no longer matches the double 1.0.
HEADER_BINDINGS_43 = {"int-1": ({"n": 1}, ["n1"])}


@pytest.mark.parametrize("binding", list(HEADER_BINDINGS))
def test_headers_exchange(amqp_conn, unique_name, binding, rabbitmq_version):
    args, expected = (HEADER_BINDINGS_43 if rabbitmq_version == "4.3" else {}).get(binding, HEADER_BINDINGS[binding])
    ch = amqp_conn.channel()
    x = unique_name("headers")
    ch.exchange_declare(x, "headers", auto_delete=True)
    q = ch.queue_declare("", exclusive=True)[0]
    ch.queue_bind(q, x, "routing-key-is-ignored", arguments=args)
    for name, headers in HEADER_MESSAGES.items():
        ch.basic_publish(amqp.Message(name.encode(), application_headers=headers), x, "rk")
    assert sorted(_amqp_drain(ch, q)) == sorted(expected)


def test_headers_unbind_with_arguments(ch, unique_name):
    x = unique_name("headers")
    ch.exchange_declare(x, "headers", auto_delete=True)
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, x, "", arguments={"x-match": "any", "a": "1"})
    ch.queue_bind(q, x, "", arguments={"x-match": "any", "b": "2"})
    ch.queue_unbind(q, x, "", arguments={"x-match": "any", "a": "1"})
    _publish(ch, x, "", b"a", headers={"a": "1"})
    _publish(ch, x, "", b"b", headers={"b": "2"})
    assert _bodies(ch, q) == [b"b"]


def test_headers_via_pika(ch, unique_name):
    x = unique_name("headers")
    ch.exchange_declare(x, "headers", auto_delete=True)
    q_all = ch.queue_declare("", exclusive=True).method.queue
    q_any = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q_all, x, "", arguments={"x-match": "all", "format": "pdf", "type": "report"})
    ch.queue_bind(q_any, x, "", arguments={"x-match": "any", "format": "pdf", "type": "report"})
    _publish(ch, x, "", b"both", headers={"format": "pdf", "type": "report"})
    _publish(ch, x, "", b"one", headers={"format": "pdf", "type": "log"})
    _publish(ch, x, "", b"none", headers={"format": "zip"})
    assert _bodies(ch, q_all) == [b"both"]
    assert _bodies(ch, q_any) == [b"both", b"one"]


# -------------------------------------------------------------------------------- default exchange


def test_default_exchange_routes_by_queue_name(ch, unique_name):
    q = ch.queue_declare(unique_name("q"), exclusive=True).method.queue
    assert _publish(ch, "", q, b"direct-to-queue", mandatory=True) is True
    assert _publish(ch, "", q + "-nope", b"nowhere", mandatory=True) is False
    assert _bodies(ch, q) == [b"direct-to-queue"]


def test_default_exchange_server_named_queue(ch):
    q = ch.queue_declare("", exclusive=True).method.queue
    _publish(ch, "", q, b"hello")
    assert _bodies(ch, q) == [b"hello"]


@pytest.mark.parametrize("op", ["bind", "unbind", "declare", "declare-passive", "delete", "e2e-source",
                                "e2e-destination"])
def test_default_exchange_is_off_limits(conn, unique_name, op):
    ch = conn.channel()
    q = ch.queue_declare(unique_name("q"), exclusive=True).method.queue
    bad = conn.channel()
    fn = {
        "bind": lambda: bad.queue_bind(q, "", q),
        "unbind": lambda: bad.queue_unbind(q, "", q),
        "declare": lambda: bad.exchange_declare("", "direct", durable=True),
        "declare-passive": lambda: bad.exchange_declare("", passive=True),
        "delete": lambda: bad.exchange_delete(""),
        "e2e-source": lambda: bad.exchange_bind("amq.fanout", "", "k"),
        "e2e-destination": lambda: bad.exchange_bind("", "amq.fanout", "k"),
    }[op]
    assert close_outcome(fn) == ("channel", 403)
    assert conn.is_open
    # and it still routes
    ch.confirm_delivery()
    assert _publish(ch, "", q, b"still", mandatory=True) is True


def test_publish_to_amq_default_name_is_404(conn):
    ch = conn.channel()
    assert close_outcome(lambda: (ch.basic_publish("amq.default", "x", b""), ch.basic_qos())) == ("channel", 404)


# ------------------------------------------------------------------------------ amq.* exchanges

AMQ_EXCHANGES = [("amq.direct", "direct"), ("amq.fanout", "fanout"), ("amq.topic", "topic"),
                 ("amq.headers", "headers"), ("amq.match", "headers")]


@pytest.mark.parametrize("name,type_", AMQ_EXCHANGES)
def test_predeclared_exchange_passive(conn, name, type_):
    ch = conn.channel()
    ch.exchange_declare(name, passive=True)
    ch.exchange_declare(name, type_, passive=True)
    ch.exchange_declare(name, "fanout" if type_ != "fanout" else "direct", passive=True)  # passive: no check
    # an equivalent (durable, same type) active declare is accepted
    ch.exchange_declare(name, type_, durable=True)
    assert ch.is_open


@pytest.mark.parametrize("name,type_", AMQ_EXCHANGES)
def test_predeclared_exchange_not_equivalent_is_406(conn, name, type_):
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_declare(name, type_, durable=False)) == ("channel", 406)


@pytest.mark.parametrize("name", [n for n, _ in AMQ_EXCHANGES])
def test_predeclared_exchange_cannot_be_deleted(conn, name):
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_delete(name)) == ("channel", 403)
    assert exchange_exists(_url_of(conn), name)


def _url_of(conn) -> str:
    p = conn._impl.params
    vh = "%2F" if p.virtual_host == "/" else p.virtual_host
    return f"amqp://{p.credentials.username}:{p.credentials.password}@{p.host}:{p.port}/{vh}"


def test_amq_prefix_reserved_for_declare_but_passive_is_404(conn, unique_name):
    ch = conn.channel()
    name = "amq." + unique_name("custom")
    assert close_outcome(lambda: ch.exchange_declare(name, "direct")) == ("channel", 403)
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_declare(name, passive=True)) == ("channel", 404)
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_delete(name)) == ("channel", 403)


def test_routing_through_predeclared_exchanges(ch, unique_name):
    key = unique_name("key")
    qd = _queue(ch, [key], "amq.direct")
    qt = _queue(ch, [key + ".#"], "amq.topic")
    qf = _queue(ch, [""], "amq.fanout")
    qh = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(qh, "amq.headers", "", arguments={"k": key})
    qm = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(qm, "amq.match", "", arguments={"k": key})
    _publish(ch, "amq.direct", key, b"d")
    _publish(ch, "amq.topic", key + ".x.y", b"t")
    _publish(ch, "amq.fanout", "whatever", b"f")
    _publish(ch, "amq.headers", "", b"h", headers={"k": key})
    _publish(ch, "amq.match", "", b"m", headers={"k": key})
    assert _bodies(ch, qd) == [b"d"]
    assert _bodies(ch, qt) == [b"t"]
    assert b"f" in _bodies(ch, qf)      # amq.fanout is shared with other tests: only ours must be there
    assert _bodies(ch, qh) == [b"h"]
    assert _bodies(ch, qm) == [b"m"]


# -------------------------------------------------------------------------------- declare / delete


def test_declare_passive_missing_is_404(conn, unique_name):
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_declare(unique_name("x"), passive=True)) == ("channel", 404)


def test_declare_then_passive_and_redeclare(conn, unique_name):
    ch = conn.channel()
    x = unique_name("x")
    ch.exchange_declare(x, "topic", durable=True)
    try:
        ch.exchange_declare(x, passive=True)
        ch.exchange_declare(x, "topic", durable=True)                       # equivalent: fine
        ch.exchange_declare(x, "topic", durable=True, arguments={"x-unknown": 1})   # unknown args ignored
        ch.exchange_declare(x, "direct", durable=False, passive=True)      # passive ignores properties
    finally:
        ch.exchange_delete(x)
    assert not exchange_exists(_url_of(conn), x)


EQUIVALENCE = {
    "type": (dict(exchange_type="direct"), dict(exchange_type="fanout")),
    "durable-added": (dict(exchange_type="direct"), dict(exchange_type="direct", durable=True)),
    "durable-removed": (dict(exchange_type="direct", durable=True), dict(exchange_type="direct")),
    "auto-delete": (dict(exchange_type="direct"), dict(exchange_type="direct", auto_delete=True)),
    "internal-added": (dict(exchange_type="direct"), dict(exchange_type="direct", internal=True)),
    "internal-removed": (dict(exchange_type="direct", internal=True), dict(exchange_type="direct")),
    "alternate-exchange-added": (dict(exchange_type="direct"),
                                 dict(exchange_type="direct", arguments={"alternate-exchange": "ae"})),
    "alternate-exchange-changed": (dict(exchange_type="direct", arguments={"alternate-exchange": "ae1"}),
                                   dict(exchange_type="direct", arguments={"alternate-exchange": "ae2"})),
    "alternate-exchange-removed": (dict(exchange_type="direct", arguments={"alternate-exchange": "ae"}),
                                   dict(exchange_type="direct")),
}


@pytest.mark.parametrize("case", list(EQUIVALENCE))
def test_declare_equivalence_mismatch_is_406(conn, unique_name, case):
    first, second = EQUIVALENCE[case]
    setup = conn.channel()
    x = unique_name("x")
    setup.exchange_declare(x, **first)
    try:
        ch = conn.channel()
        assert close_outcome(lambda: ch.exchange_declare(x, **second)) == ("channel", 406)
        assert conn.is_open
        # the original is untouched
        setup.exchange_declare(x, **first)
    finally:
        setup.exchange_delete(x)


def test_delete_missing_exchange_is_ok(conn, unique_name):
    ch = conn.channel()
    ch.exchange_delete(unique_name("never-declared"))
    assert ch.is_open


def test_delete_if_unused(conn, unique_name):
    ch = conn.channel()
    x = unique_name("x")
    ch.exchange_declare(x, "direct")
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, x, "k")
    try:
        bad = conn.channel()
        assert close_outcome(lambda: bad.exchange_delete(x, if_unused=True)) == ("channel", 406)
        assert exchange_exists(_url_of(conn), x)
        ch.queue_unbind(q, x, "k")
        ch.exchange_delete(x, if_unused=True)
        assert not exchange_exists(_url_of(conn), x)
    finally:
        ch.exchange_delete(x)


def test_delete_if_unused_counts_only_outgoing_e2e_bindings(conn, unique_name):
    ch = conn.channel()
    src, dst = unique_name("src"), unique_name("dst")
    ch.exchange_declare(src, "fanout")
    ch.exchange_declare(dst, "fanout")
    ch.exchange_bind(dst, src)
    try:
        bad = conn.channel()
        assert close_outcome(lambda: bad.exchange_delete(src, if_unused=True)) == ("channel", 406)
        ch.exchange_delete(dst, if_unused=True)      # only a destination: "unused"
        assert not exchange_exists(_url_of(conn), dst)
    finally:
        ch.exchange_delete(src)
        ch.exchange_delete(dst)


def test_delete_exchange_removes_its_bindings(ch, unique_name):
    x = unique_name("x")
    ch.exchange_declare(x, "direct")
    q = _queue(ch, ["k"], x)
    ch.exchange_delete(x)
    ch.exchange_declare(x, "direct")
    try:
        assert _publish(ch, x, "k", b"after", mandatory=True) is False
        assert _bodies(ch, q) == []
    finally:
        ch.exchange_delete(x)


def test_delete_exchange_keeps_bound_queue(ch, unique_name):
    x = unique_name("x")
    ch.exchange_declare(x, "direct")
    q = _queue(ch, ["k"], x)
    ch.exchange_delete(x)
    assert ch.queue_declare(q, passive=True).method.queue == q


# -------------------------------------------------------------------------------------- internal


def test_internal_exchange_rejects_publish_but_routes_from_e2e(conn, ch, unique_name):
    internal, front = unique_name("internal"), unique_name("front")
    ch.exchange_declare(internal, "fanout", internal=True, auto_delete=True)
    ch.exchange_declare(front, "fanout", auto_delete=True)
    q = _queue(ch, [""], internal)
    ch.exchange_bind(internal, front)
    pub = conn.channel()
    assert close_outcome(lambda: (pub.basic_publish(internal, "", b"direct"), pub.basic_qos())) == ("channel", 403)
    _publish(ch, front, "", b"via-front")
    assert _bodies(ch, q) == [b"via-front"]
    ch.exchange_declare(internal, passive=True)       # passive declare of an internal exchange is fine


# --------------------------------------------------------------------------- exchange-to-exchange


def test_e2e_bind_routes_by_binding_key(ch, unique_name):
    src, dst = unique_name("src"), unique_name("dst")
    ch.exchange_declare(src, "direct")       # not auto-delete: it must survive the unbind
    ch.exchange_declare(dst, "fanout", auto_delete=True)
    try:
        q = _queue(ch, [""], dst)
        ch.exchange_bind(dst, src, "k")
        _publish(ch, src, "k", b"yes")
        _publish(ch, src, "other", b"no")
        assert _bodies(ch, q) == [b"yes"]
        ch.exchange_unbind(dst, src, "k")
        assert _publish(ch, src, "k", b"after-unbind", mandatory=True) is False
        assert _bodies(ch, q) == []
    finally:
        ch.exchange_delete(src)


def test_e2e_topic_chain_keeps_routing_key(ch, unique_name):
    a, b = unique_name("a"), unique_name("b")
    ch.exchange_declare(a, "topic", auto_delete=True)
    ch.exchange_declare(b, "direct", auto_delete=True)
    ch.exchange_bind(b, a, "orders.#")
    q = _queue(ch, ["orders.eu.new"], b)
    _publish(ch, a, "orders.eu.new", b"1")
    _publish(ch, a, "orders.us.new", b"2")      # reaches b, no queue there for this key
    _publish(ch, a, "billing.eu.new", b"3")
    assert _bodies(ch, q) == [b"1"]


def test_e2e_diamond_and_cycle_deliver_once(ch, unique_name):
    top, left, right = unique_name("top"), unique_name("left"), unique_name("right")
    for x in (top, left, right):
        ch.exchange_declare(x, "fanout", auto_delete=True)
    ch.exchange_bind(left, top)
    ch.exchange_bind(right, top)
    ch.exchange_bind(top, left)       # a cycle
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, left)
    ch.queue_bind(q, right)
    ch.queue_bind(q, top)
    try:
        _publish(ch, top, "", b"once")
        assert _bodies(ch, q) == [b"once"]
    finally:
        for x in (top, left, right):       # the cycle keeps auto-delete from ever firing
            ch.exchange_delete(x)


def test_e2e_direct_queue_and_exchange_bindings(ch, unique_name):
    src, dst = unique_name("src"), unique_name("dst")
    ch.exchange_declare(src, "direct", auto_delete=True)
    ch.exchange_declare(dst, "direct", auto_delete=True)
    q_src = _queue(ch, ["k"], src)
    q_dst = _queue(ch, ["k"], dst)
    ch.exchange_bind(dst, src, "k")
    _publish(ch, src, "k", b"both")
    assert _bodies(ch, q_src) == [b"both"]
    assert _bodies(ch, q_dst) == [b"both"]


def test_e2e_bind_missing_is_404_unbind_missing_is_ok(conn, unique_name):
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_bind("amq.fanout", unique_name("nope"))) == ("channel", 404)
    ch = conn.channel()
    assert close_outcome(lambda: ch.exchange_bind(unique_name("nope"), "amq.fanout")) == ("channel", 404)
    ch = conn.channel()
    ch.exchange_unbind(unique_name("nope"), "amq.fanout")                 # missing destination
    ch.exchange_unbind("amq.fanout", unique_name("nope"))                 # missing source
    ch.exchange_unbind(unique_name("nope"), unique_name("nope"))          # both missing
    ch.exchange_unbind("amq.direct", "amq.fanout", unique_name("no-such-binding"))
    assert ch.is_open


# ---------------------------------------------------------------------------------- auto-delete


def test_auto_delete_exchange_removed_when_last_queue_unbound(ch, conn, unique_name):
    url = _url_of(conn)
    x = unique_name("ad")
    ch.exchange_declare(x, "direct", auto_delete=True)
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, x, "k1")
    ch.queue_bind(q, x, "k2")
    ch.queue_unbind(q, x, "k1")
    assert exchange_exists(url, x)                    # one binding left
    ch.queue_unbind(q, x, "k2")
    wait_until(lambda: not exchange_exists(url, x), message="the auto-delete exchange to go")


def test_auto_delete_exchange_removed_when_bound_queue_deleted(ch, conn, unique_name):
    url = _url_of(conn)
    x = unique_name("ad")
    ch.exchange_declare(x, "direct", auto_delete=True)
    q = ch.queue_declare(unique_name("q")).method.queue
    ch.queue_bind(q, x, "k")
    ch.queue_delete(q)
    wait_until(lambda: not exchange_exists(url, x), message="the auto-delete exchange to go")


def test_auto_delete_exchange_never_bound_survives(ch, conn, unique_name):
    url = _url_of(conn)
    x = unique_name("ad")
    ch.exchange_declare(x, "direct", auto_delete=True)
    try:
        assert exchange_exists(url, x)
        conn.process_data_events(time_limit=0.3)
        assert exchange_exists(url, x)
    finally:
        ch.exchange_delete(x)


def test_auto_delete_source_removed_when_e2e_binding_goes(ch, conn, unique_name):
    url = _url_of(conn)
    src, dst = unique_name("src"), unique_name("dst")
    ch.exchange_declare(src, "fanout", auto_delete=True)
    ch.exchange_declare(dst, "fanout", auto_delete=True)
    try:
        ch.exchange_bind(dst, src)
        ch.exchange_unbind(dst, src)
        wait_until(lambda: not exchange_exists(url, src), message="the auto-delete source exchange to go")
        assert exchange_exists(url, dst)     # a destination's auto-delete is about its own bindings
    finally:
        ch.exchange_delete(dst)
        ch.exchange_delete(src)


def test_auto_delete_source_removed_when_destination_deleted(ch, conn, unique_name):
    url = _url_of(conn)
    src, dst = unique_name("src"), unique_name("dst")
    ch.exchange_declare(src, "fanout", auto_delete=True)
    ch.exchange_declare(dst, "fanout")
    ch.exchange_bind(dst, src)
    ch.exchange_delete(dst)
    wait_until(lambda: not exchange_exists(url, src), message="the auto-delete source exchange to go")


# ------------------------------------------------------------------------------ alternate-exchange


def _with_ae(ch, unique_name, ae_type="fanout"):
    ae = unique_name("ae")
    ch.exchange_declare(ae, ae_type, auto_delete=True)
    aq = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(aq, ae, "")
    x = unique_name("x")
    ch.exchange_declare(x, "direct", auto_delete=True, arguments={"alternate-exchange": ae})
    xq = _queue(ch, ["k"], x)
    return x, xq, ae, aq


def test_alternate_exchange_gets_unroutable(ch, unique_name):
    x, xq, _ae, aq = _with_ae(ch, unique_name)
    assert _publish(ch, x, "k", b"routed", mandatory=True) is True
    assert _publish(ch, x, "other", b"unroutable", mandatory=True) is True   # AE took it: no return
    assert _bodies(ch, xq) == [b"routed"]
    assert _bodies(ch, aq) == [b"unroutable"]


def test_alternate_exchange_keeps_routing_key(ch, unique_name):
    ae = unique_name("ae")
    ch.exchange_declare(ae, "direct", auto_delete=True)
    aq = _queue(ch, ["wanted"], ae)
    x = unique_name("x")
    ch.exchange_declare(x, "direct", auto_delete=True, arguments={"alternate-exchange": ae})
    _publish(ch, x, "wanted", b"w")
    assert _publish(ch, x, "unwanted", b"u", mandatory=True) is False   # AE cannot route it either
    assert _bodies(ch, aq) == [b"w"]


def test_alternate_exchange_missing_returns_mandatory(ch, unique_name):
    x = unique_name("x")
    ch.exchange_declare(x, "direct", auto_delete=True, arguments={"alternate-exchange": unique_name("absent")})
    q = _queue(ch, ["k"], x)
    assert _publish(ch, x, "k", b"routed", mandatory=True) is True
    assert _publish(ch, x, "nope", b"lost", mandatory=True) is False
    assert _bodies(ch, q) == [b"routed"]


def test_alternate_exchange_chain(ch, unique_name):
    ae2 = unique_name("ae2")
    ch.exchange_declare(ae2, "fanout", auto_delete=True)
    q2 = _queue(ch, [""], ae2)
    ae1 = unique_name("ae1")
    ch.exchange_declare(ae1, "direct", auto_delete=True, arguments={"alternate-exchange": ae2})
    q1 = _queue(ch, ["one"], ae1)
    x = unique_name("x")
    ch.exchange_declare(x, "direct", auto_delete=True, arguments={"alternate-exchange": ae1})
    _publish(ch, x, "one", b"to-ae1")
    _publish(ch, x, "two", b"to-ae2")
    assert _bodies(ch, q1) == [b"to-ae1"]
    assert _bodies(ch, q2) == [b"to-ae2"]


def test_alternate_exchange_cycle_terminates(ch, unique_name):
    a, b = unique_name("a"), unique_name("b")
    ch.exchange_declare(a, "direct", arguments={"alternate-exchange": b})
    ch.exchange_declare(b, "direct", arguments={"alternate-exchange": a})
    try:
        assert _publish(ch, a, "zz", b"loop", mandatory=True) is False
    finally:
        ch.exchange_delete(a)
        ch.exchange_delete(b)


def test_alternate_exchange_on_fanout_without_queues(ch, unique_name):
    ae = unique_name("ae")
    ch.exchange_declare(ae, "fanout", auto_delete=True)
    aq = _queue(ch, [""], ae)
    x = unique_name("x")
    ch.exchange_declare(x, "fanout", auto_delete=True, arguments={"alternate-exchange": ae})
    try:
        _publish(ch, x, "any", b"to-ae")
        assert _bodies(ch, aq) == [b"to-ae"]
    finally:
        ch.exchange_delete(x)
