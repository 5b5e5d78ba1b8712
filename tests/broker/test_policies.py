"""Policies, operator policies and vhost default queue types, against the four brokers (tests/broker/conftest.py).

A policy is set on whichever broker the test runs against: the embedded broker's API (`Broker.set_policy`), or
the node's `rabbitmqctl set_policy` (3.10: the host's rabbitmqctl; 4.3: ../shared/rabbitmq4/ctl.sh). Counts,
dead letters, reply codes and texts, and rabbitmqctl's refusal texts are compared exactly.
"""

from __future__ import annotations

import json
import time
import uuid

import pika
import pytest

from brokers import rabbitmqctl, require_rabbitmq
from spark_amqp_broker import Broker
from spark_amqp_broker.config import BrokerConfig

from support import Env, env  # noqa: F401  (the env fixture)

SETTLE = 0.3          # RabbitMQ applies a policy asynchronously: a moment after rabbitmqctl returns


class Policies:
    """Sets and clears policies on the broker under test; clears what is left at teardown."""

    def __init__(self, target, broker):
        self.target, self.broker = target, broker
        self.live: list[tuple] = []
        self.token = uuid.uuid4().hex[:8]     # names unique to the test (the nodes are shared), order kept

    def set(self, name, pattern, definition, *, vhost="/", apply_to="all", priority=0, operator=False, raw=False):
        """None, or the refusal text (what rabbitmqctl prints after "Validation failed")."""
        kind = "operator_policy" if operator else "policy"
        name = f"{self.token}-{name}"
        try:
            if self.broker is not None:
                setter = self.broker.set_operator_policy if operator else self.broker.set_policy
                setter(name, pattern, definition, vhost=vhost, apply_to=apply_to, priority=priority)
            else:
                rabbitmqctl(f"set_{kind}", "-p", vhost, "--apply-to", apply_to, "--priority", str(priority),
                            name, pattern, json.dumps(definition), version=self.target.version)
                time.sleep(SETTLE)
        except (ValueError, RuntimeError) as exc:
            return str(exc) if raw else refusal(str(exc))
        self.live.append((kind, name, vhost))
        return None

    def clear(self, name, *, vhost="/", operator=False):
        kind = "operator_policy" if operator else "policy"
        name = f"{self.token}-{name}"
        self.live.remove((kind, name, vhost))
        if self.broker is not None:
            (self.broker.clear_operator_policy if operator else self.broker.clear_policy)(name, vhost)
        else:
            rabbitmqctl(f"clear_{kind}", "-p", vhost, name, version=self.target.version)
            time.sleep(SETTLE)

    def close(self):
        for kind, name, vhost in list(self.live):
            self.clear(name[len(self.token) + 1:], vhost=vhost, operator=kind == "operator_policy")


def refusal(text: str) -> str:
    """The reason of a refused policy: the embedded broker's error, or rabbitmqctl's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


@pytest.fixture
def policy(request, broker_target, broker_url):
    broker = None
    if broker_target.kind == "embedded":
        broker = request.getfixturevalue("embedded_310" if broker_target.version == "3.10" else "embedded_43")
    p = Policies(broker_target, broker)
    yield p
    p.close()


def count(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def wait_count(ch, queue: str, n: int, timeout: float = 3.0) -> int:
    deadline = time.monotonic() + timeout
    while (got := count(ch, queue)) != n and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def gets(ch, queue: str) -> list[bytes]:
    out = []
    while (m := ch.basic_get(queue, auto_ack=True))[0] is not None:
        out.append(m[2])
    return out


def durable_queue(env, ch, qtype: str, **arguments) -> str:
    name = env.track_queue(env.names(f"pol-{qtype}"))
    ch.queue_declare(name, durable=True, arguments={"x-queue-type": qtype, **arguments})
    return name


# ------------------------------------------------------------------------------ runtime changes


@pytest.mark.parametrize("qtype", ["classic", "quorum"])
def test_max_length_policy_drops_from_the_head_at_once_and_clearing_restores_the_arguments(
        env, policy, qtype, rabbitmq_version):
    conn = env.pika()
    ch = conn.channel()
    dlx = env.exchange("fanout")
    dead = env.queue()
    ch.queue_bind(dead, dlx)
    q = durable_queue(env, ch, qtype, **{"x-dead-letter-exchange": dlx})
    env.publish(q, [b"m%d" % i for i in range(10)])
    assert policy.set("lim", f"^{q}$", {"max-length": 3}, apply_to="queues") is None
    assert wait_count(ch, q, 3) == 3
    assert wait_count(ch, dead, 7) == 7
    dropped = [b"m%d" % i for i in range(7)]
    if qtype == "quorum" and rabbitmq_version == "3.10":
        dropped.reverse()          # 3.10's rabbit_fifo dead-letters what it drops at once newest first
    assert gets(ch, dead) == dropped
    policy.clear("lim")
    env.publish(q, [b"n%d" % i for i in range(5)])
    assert wait_count(ch, q, 8) == 8
    assert wait_count(ch, dead, 0) == 0


@pytest.mark.parametrize("qtype", ["classic", "quorum"])
def test_message_ttl_policy_applies_to_messages_enqueued_after_it(env, policy, qtype):
    ch = env.pika().channel()
    before = durable_queue(env, ch, qtype)
    after = durable_queue(env, ch, qtype)
    env.publish(before, [b"a", b"b"])
    assert policy.set("ttl", f"^({before}|{after})$", {"message-ttl": 100}, apply_to="queues") is None
    env.publish(after, [b"c", b"d"])
    time.sleep(0.5)
    assert wait_count(ch, after, 0) == 0
    assert count(ch, before) == 2


@pytest.mark.parametrize("qtype", ["classic", "quorum"])
def test_argument_and_policy_resolved_per_key(env, policy, qtype):
    """max-length: the lower of the two; overflow: the argument's on a classic queue, the policy's on a quorum
    queue (rabbit_amqqueue_process res_arg, rabbit_quorum_queue policy_has_precedence)."""
    ch = env.pika().channel()
    ch.confirm_delivery()
    q = durable_queue(env, ch, qtype, **{"x-max-length": 2, "x-overflow": "drop-head"})
    assert policy.set("res", f"^{q}$", {"max-length": 5, "overflow": "reject-publish"}) is None
    nacked = 0
    for i in range(4):
        try:
            ch.basic_publish("", q, b"o%d" % i)
        except pika.exceptions.NackError:
            nacked += 1
    if qtype == "classic":
        assert (nacked, count(ch, q), gets(ch, q)) == (0, 2, [b"o2", b"o3"])
    else:
        assert (nacked, count(ch, q)) == (1, 3)


def test_highest_priority_wins(env, policy):
    """(Between equal priorities RabbitMQ takes the first in its store's order: not compared here.)"""
    ch = env.pika().channel()
    q = env.queue()
    assert policy.set("pb", f"^{q}$", {"max-length": 4}, priority=1) is None
    assert policy.set("pa", f"^{q}$", {"max-length": 3}) is None
    env.publish(q, [b"x"] * 6)
    assert wait_count(ch, q, 4) == 4
    assert policy.set("pc", q[3:9], {"max-length": 1}, priority=2) is None      # unanchored search
    assert wait_count(ch, q, 1) == 1


def test_a_policy_with_a_key_the_type_does_not_take_does_not_match(env, policy):
    ch = env.pika().channel()
    q = env.queue()
    assert policy.set("mix", f"^{q}$", {"max-length": 1, "max-age": "1h"}, priority=5) is None
    assert policy.set("low", f"^{q}$", {"max-length": 4}, priority=1) is None
    env.publish(q, [b"x"] * 6)
    assert wait_count(ch, q, 4) == 4


def test_operator_policy_lower_value_wins(env, policy):
    ch = env.pika().channel()
    q = env.queue()
    assert policy.set("pol", f"^{q}$", {"max-length": 5}) is None
    assert policy.set("op", f"^{q}$", {"max-length": 2}, apply_to="queues", operator=True) is None
    env.publish(q, [b"x"] * 6)
    assert wait_count(ch, q, 2) == 2
    policy.clear("op", operator=True)
    env.publish(q, [b"x"] * 6)
    assert wait_count(ch, q, 5) == 5


def test_alternate_exchange_policy(env, policy):
    ch = env.pika().channel()
    x = env.exchange("direct")
    ae = env.exchange("fanout")
    caught = env.queue()
    ch.queue_bind(caught, ae)
    assert policy.set("ae", f"^{x}$", {"alternate-exchange": ae}, apply_to="exchanges") is None
    ch.basic_publish(x, "nowhere", b"lost")
    assert wait_count(ch, caught, 1) == 1


def test_quorum_only_policy(env, policy, rabbitmq_version):
    ch = env.pika().channel()
    classic, quorum = durable_queue(env, ch, "classic"), durable_queue(env, ch, "quorum")
    error = policy.set("qq", f"^({classic}|{quorum})$", {"max-length": 1}, apply_to="quorum_queues")
    if rabbitmq_version == "3.10":
        assert error == "apply-to 'quorum_queues' unrecognised; should be 'queues', 'exchanges' or 'all'"
        return
    assert error is None
    env.publish(classic, [b"x"] * 3)
    env.publish(quorum, [b"x"] * 3)
    assert (wait_count(ch, quorum, 1), count(ch, classic)) == (1, 3)


REFUSED = [
    ({"max-length": "ten"}, "all", {"3.10": '<<"ten">> is not a valid maximum length'}),
    ({"max-lengthz": 1}, "all", {"3.10": '[{<<"max-lengthz">>,1}] are not recognised policy settings'}),
    ({"message-ttl": -1, "expires": 0}, "all", {"3.10": "0 is not a valid queue expiry"}),
    ({"dead-letter-exchange": 1}, "all", {"3.10": "1 is not a valid dead letter exchange name"}),
    ({"overflow": "x"}, "all", {"3.10": '<<"x">> is not a valid overflow value'}),
    ({"max-age": "1x"}, "all", {"3.10": '<<"1x">> is not a valid max age'}),
    ({"delivery-limit": -1}, "all", {"3.10": "-1 is not a valid delivery limit", "4.3": None}),
    ({"ha-mode": "all"}, "all", {"3.10": None,
                                 "4.3": '[{<<"ha-mode">>,<<"all">>}] are not recognised policy settings'}),
    ({}, "all", {"3.10": "no policy provided"}),
    ({"max-length": 1}, "bogus", {
        "3.10": "apply-to 'bogus' unrecognised; should be 'queues', 'exchanges' or 'all'",
        "4.3": "apply-to 'bogus' unrecognised; should be one of: 'queues', 'classic_queues',  'quorum_queues', "
               "'streams', 'exchanges', or 'all'"}),
]


@pytest.mark.parametrize("definition, apply_to, texts", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_definitions(policy, unique_name, definition, apply_to, texts, rabbitmq_version):
    expected = texts.get(rabbitmq_version, texts["3.10"])
    assert policy.set(unique_name("bad"), "^never-matches-", definition, apply_to=apply_to) == expected


def test_refused_pattern(policy, unique_name):
    error = policy.set(unique_name("bad"), "(", {"max-length": 1}, raw=True)
    assert "pattern should be regular expression but is invalid: {" in error


# ------------------------------------------------------------------------------ vhost default queue type

def _node_vhost(version: str, dqt: str | None):
    name = f"pol-dqt-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", name, *(["--default-queue-type", dqt] if dqt else []), version=version)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*", version=version)
    return name


@pytest.fixture(params=["embedded", "rabbitmq"])
def quorum_vhost(request):
    """(URL of a vhost whose default queue type is quorum, vhost name) on the embedded broker as 4.3 or the
    4.3 node."""
    if request.param == "embedded":
        with Broker(vhosts=("/", {"name": "dqt", "default_queue_type": "quorum"})) as b:
            yield b.url.rsplit("/", 1)[0] + "/dqt", "dqt"
        return
    url = require_rabbitmq("4.3")
    name = _node_vhost("4.3", "quorum")
    try:
        yield url.rsplit("/", 1)[0] + "/" + name, name
    finally:
        rabbitmqctl("delete_vhost", name, version="4.3")


def _outcome(conn_box, fn):
    try:
        fn()
        return "ok"
    except pika.exceptions.ChannelClosedByBroker as exc:
        conn_box[1] = conn_box[0].channel()
        return (exc.reply_code, exc.reply_text)


def test_default_queue_type_quorum(quorum_vhost):
    url, vhost = quorum_vhost
    conn = pika.BlockingConnection(pika.URLParameters(url))
    box = [conn, conn.channel()]
    try:
        seen = {
            "durable": _outcome(box, lambda: box[1].queue_declare("d1", durable=True)),
            "transient": _outcome(box, lambda: box[1].queue_declare("d2")),
            "exclusive": _outcome(box, lambda: box[1].queue_declare("d3", durable=True, exclusive=True)),
            "server-named": _outcome(box, lambda: box[1].queue_declare("", durable=True)),
            "redeclare": _outcome(box, lambda: box[1].queue_declare("d1", durable=True)),
            "as classic": _outcome(box, lambda: box[1].queue_declare(
                "d1", durable=True, arguments={"x-queue-type": "classic"})),
            "transient again": _outcome(box, lambda: box[1].queue_declare("d2")),
            "priority": _outcome(box, lambda: box[1].queue_declare(
                "d4", durable=True, arguments={"x-max-priority": 5})),
        }
        assert seen == {
            "durable": "ok", "transient": "ok", "exclusive": "ok",
            "server-named": (406, "PRECONDITION_FAILED - Cannot declare a server-named queue for type "
                                  "rabbit_quorum_queue"),
            "redeclare": "ok",
            "as classic": (406, f"PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'd1' in vhost "
                                f"'{vhost}': received 'classic' but current is 'quorum'"),
            "transient again": "ok",
            "priority": (406, f"PRECONDITION_FAILED - invalid arg 'x-max-priority' for queue 'd4' in vhost "
                              f"'{vhost}' of queue type rabbit_quorum_queue"),
        }
    finally:
        for q in ("d1", "d2"):
            box[1].queue_delete(q)
        conn.close()


def test_default_queue_type_ignored_as_310(caplog):
    with Broker(rabbitmq_version="3.10", vhosts=("/", {"name": "dqt", "default_queue_type": "quorum"})) as b:
        conn = pika.BlockingConnection(pika.URLParameters(b.url.rsplit("/", 1)[0] + "/dqt"))
        conn.channel().queue_declare("d", durable=True)
        assert b.call(lambda: b.core.vhosts["dqt"].queues["d"].queue_type) == "classic"
        conn.close()
    assert "default_queue_type 'quorum' ignored: RabbitMQ 3.10 has no default queue type" in caplog.text


# ------------------------------------------------------------------------------ sources


def test_definitions_exported_by_the_43_node(unique_name):
    """The 4.3 node's own export (a quorum-default vhost, a quorum queue, a policy, an exchange with an
    alternate-exchange policy) loaded into the embedded broker: both behave the same."""
    url = require_rabbitmq("4.3")
    vhost = _node_vhost("4.3", "quorum")
    try:
        rabbitmqctl("set_policy", "-p", vhost, "--apply-to", "quorum_queues", "lim", "^q", '{"max-length":2}',
                    version="4.3")
        rabbitmqctl("set_policy", "-p", vhost, "--apply-to", "exchanges", "ae", "^x$",
                    '{"alternate-exchange":"amq.fanout"}', version="4.3")
        node_url = url.rsplit("/", 1)[0] + "/" + vhost
        conn = pika.BlockingConnection(pika.URLParameters(node_url))
        ch = conn.channel()
        ch.queue_declare("q1", durable=True)
        ch.exchange_declare("x", "direct", durable=True)
        ch.queue_declare("caught", durable=True, arguments={"x-queue-type": "classic"})
        ch.queue_bind("caught", "amq.fanout")
        conn.close()
        doc = json.loads(rabbitmqctl("export_definitions", "-", version="4.3"))
        with Broker(definitions=doc) as b:
            assert not [s for s in b.core.definitions_skipped if "polic" in s]
            embedded_url = b.url.rsplit("/", 1)[0] + "/" + vhost
            results = [_scenario(u, vhost) for u in (node_url, embedded_url)]
        assert results[0] == results[1]
        assert results[0][0] == 2
    finally:
        rabbitmqctl("delete_vhost", vhost, version="4.3")


def _scenario(url: str, vhost: str):
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", "q1", b"m%d" % i)
    ch.basic_publish("x", "nowhere", b"to-ae")
    time.sleep(SETTLE)
    depth = count(ch, "q1")
    caught = wait_count(ch, "caught", 1)
    box = [conn, ch]
    redeclare = _outcome(box, lambda: box[1].queue_declare("q1", durable=True, arguments={"x-queue-type": "classic"}))
    conn.close()
    return depth, caught, redeclare


def test_toml_policies_and_vhost_default_queue_type(tmp_path):
    path = tmp_path / "broker.toml"
    path.write_text("""
[broker]
vhosts = ["/", { name = "shop", default_queue_type = "quorum" }]

[[policies]]
name = "limit"
vhost = "shop"
pattern = "^orders"
apply_to = "quorum_queues"
priority = 1
definition = { max-length = 2 }

[[operator_policies]]
name = "cap"
pattern = ".*"
definition = { message-ttl = 60000 }
""")
    config = BrokerConfig.from_toml(str(path))
    assert config.vhost_default_queue_types == {"shop": "quorum"}
    assert [(p.kind, p.vhost, p.name, p.priority) for p in config.policy_list] == [
        ("policy", "shop", "limit", 1), ("operator_policy", "/", "cap", 0)]
    with Broker(config=config) as b:
        conn = pika.BlockingConnection(pika.URLParameters(b.url.rsplit("/", 1)[0] + "/shop"))
        ch = conn.channel()
        ch.queue_declare("orders", durable=True)
        for i in range(4):
            ch.basic_publish("", "orders", b"m")
        assert wait_count(ch, "orders", 2) == 2
        conn.close()
    path.write_text('[[policies]]\nname = "bad"\npattern = "^a"\ndefinition = { max-length = "x" }\n')
    with pytest.raises(ValueError, match=r"policies\[0\] \('bad'\): <<\"x\">> is not a valid maximum length"):
        BrokerConfig.from_toml(str(path))


@pytest.mark.parametrize("version", ["3.10", "4.3"])
def test_policies_set_by_the_api_survive_a_restart(tmp_path, version):
    def publish_and_count(b, q):
        conn = pika.BlockingConnection(pika.URLParameters(b.url))
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"} if q.startswith("qq") else {})
        for i in range(4):
            ch.basic_publish("", q, b"m", pika.BasicProperties(delivery_mode=2))
        time.sleep(0.05)
        n = count(ch, q)
        conn.close()
        return n

    with Broker(rabbitmq_version=version, data_dir=str(tmp_path)) as b:
        b.set_policy("lim", "^(qq|cq)$", {"max-length": 3}, apply_to="queues")
        b.set_policy("gone", "^nothing$", {"max-length": 1})
        b.clear_policy("gone")
        assert (publish_and_count(b, "qq"), publish_and_count(b, "cq")) == (3, 3)
    with Broker(rabbitmq_version=version, data_dir=str(tmp_path)) as b:
        assert b.call(lambda: [p.name for p in b.core.policies.list("policy")]) == ["lim"]
        assert (publish_and_count(b, "qq"), publish_and_count(b, "cq")) == (3, 3)
        b.clear_policy("lim")
    with Broker(rabbitmq_version=version, data_dir=str(tmp_path)) as b:
        assert b.call(lambda: b.core.policies.list("policy")) == []
        assert (publish_and_count(b, "qq"), publish_and_count(b, "cq")) == (7, 7)
