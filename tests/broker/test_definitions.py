"""RabbitMQ's definitions file loaded into the embedded broker, and the TOML / keyword configuration of users,
vhosts and permissions.

The topology test is differential: a vhost is built on RabbitMQ over AMQP (exchanges of each type, an
alternate exchange, queues with arguments, queue and exchange-to-exchange bindings), exported with
`rabbitmqctl export_definitions`, and loaded into an embedded broker; both brokers then answer the same
passive declares, equivalence checks (same 406 texts) and routing. Without RabbitMQ the embedded broker is
checked against a definitions document written here in RabbitMQ's export format.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import urllib.parse
import uuid

import pika
import pika.exceptions
import pytest
from brokers import free_port, rabbitmq_setup, rabbitmqctl
from brokers import NODES, RABBITMQ_HOST, RABBITMQ_PORT, require_rabbitmq
from spark_amqp_broker import Broker
from spark_amqp_broker.access import MD5, SHA256, SHA512, hash_password
from spark_amqp_broker.config import BrokerConfig
from waiting import wait_until

TAG = uuid.uuid4().hex[:8]
VHOST = f"defs-{TAG}"
QUEUE_ARGS = {"x-message-ttl": 60000, "x-max-length": 100, "x-dead-letter-exchange": "dlx"}


def _build_topology(url: str) -> None:
    """The topology under test, declared over AMQP (on RabbitMQ before the export)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare("dlx", "fanout", durable=True)
    ch.exchange_declare("unrouted", "fanout", durable=True)
    ch.exchange_declare("orders", "direct", durable=True, arguments={"alternate-exchange": "unrouted"})
    ch.exchange_declare("events", "topic", durable=True)
    ch.exchange_declare("audit", "headers", durable=False)   # (export_definitions leaves out internal ones)
    ch.queue_declare("orders.q", durable=True, arguments=QUEUE_ARGS)
    ch.queue_declare("events.q", durable=True)
    ch.queue_declare("unrouted.q", durable=False)
    ch.queue_declare("dead.q", durable=True)
    ch.queue_bind("orders.q", "orders", "new")
    ch.queue_bind("events.q", "events", "order.*.created")
    ch.queue_bind("unrouted.q", "unrouted", "")
    ch.queue_bind("dead.q", "dlx", "")
    ch.exchange_bind("events", "orders", "new")          # orders --new--> events (exchange destination)
    ch.queue_bind("events.q", "audit", "", arguments={"x-match": "any", "kind": "order"})
    conn.close()


def _local_definitions() -> dict:
    """The export RabbitMQ 3.10 writes for _build_topology (used when RabbitMQ is not reachable)."""
    def x(name, type_, durable=True, arguments=None):
        return {"name": name, "vhost": VHOST, "type": type_, "durable": durable, "auto_delete": False,
                "arguments": arguments or {}}

    def q(name, durable=True, arguments=None):
        return {"name": name, "vhost": VHOST, "durable": durable, "auto_delete": False,
                "arguments": arguments or {}, "type": "classic"}

    def b(source, dest, key, dtype="queue", arguments=None):
        return {"source": source, "vhost": VHOST, "destination": dest, "destination_type": dtype,
                "routing_key": key, "arguments": arguments or {}}

    return {
        "rabbit_version": "3.10.8", "rabbitmq_version": "3.10.8", "product_name": "RabbitMQ",
        "product_version": "3.10.8",
        "users": [{"name": "guest", "password_hash": hash_password("guest"), "tags": ["administrator"],
                   "hashing_algorithm": SHA256, "limits": {}}],
        "vhosts": [{"name": VHOST, "limits": [], "metadata": {"description": "", "tags": []}}],
        "permissions": [{"user": "guest", "vhost": VHOST, "configure": ".*", "write": ".*", "read": ".*"}],
        "topic_permissions": [], "parameters": [], "global_parameters": [], "policies": [],
        "queues": [q("orders.q", arguments=QUEUE_ARGS), q("events.q"), q("unrouted.q", durable=False),
                   q("dead.q")],
        "exchanges": [x("dlx", "fanout"), x("unrouted", "fanout"),
                      x("orders", "direct", arguments={"alternate-exchange": "unrouted"}), x("events", "topic"),
                      x("audit", "headers", durable=False)],
        "bindings": [b("orders", "orders.q", "new"), b("events", "events.q", "order.*.created"),
                     b("unrouted", "unrouted.q", ""), b("dlx", "dead.q", ""),
                     b("orders", "events", "new", "exchange"),
                     b("audit", "events.q", "", arguments={"x-match": "any", "kind": "order"})],
    }


def _rabbitmq_setup(version: str) -> None:
    rabbitmqctl("set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*", version=version)
    host, port, _url = NODES[version]
    _build_topology(f"amqp://guest:guest@{host}:{port}/{VHOST}")


@pytest.fixture(scope="module", params=["3.10", "4.3"])
def topology(request):
    """The topology exported from the RabbitMQ node of each version and loaded into an embedded broker
    behaving as that version."""
    version = request.param
    with rabbitmq_setup(VHOST, ("guest",), _rabbitmq_setup, _local_definitions(), version) as (defs, on_rabbit):
        with Broker(port=0, definitions=defs, rabbitmq_version=version) as broker:
            yield {"version": version, "embedded": broker, "rabbitmq": on_rabbit, "definitions": defs}


@pytest.fixture(params=["embedded", "rabbitmq"])
def url(request, topology):
    if request.param == "rabbitmq":
        host, port, _url = NODES[topology["version"]]
        require_rabbitmq(topology["version"])
        return f"amqp://guest:guest@{host}:{port}/{urllib.parse.quote(VHOST, safe='')}"
    return f"amqp://guest:guest@127.0.0.1:{topology['embedded'].port}/{urllib.parse.quote(VHOST, safe='')}"


def _outcome(url, fn):
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        try:
            result = fn(ch)
            ch.basic_qos(prefetch_count=0)
        except pika.exceptions.ChannelClosedByBroker as exc:
            return exc.reply_code, exc.reply_text
        return result if isinstance(result, dict) else "ok"
    finally:
        if conn.is_open:
            conn.close()


def test_export_was_loaded_completely(topology):
    assert topology["embedded"].core.definitions_skipped == []
    names = {q["name"] for q in topology["definitions"]["queues"]}
    assert names == {"orders.q", "events.q", "unrouted.q", "dead.q"}


def test_exported_queues_and_exchanges_exist(url):
    def passive(ch):
        for q in ("orders.q", "events.q", "unrouted.q", "dead.q"):
            ch.queue_declare(q, passive=True)
        for x in ("dlx", "unrouted", "orders", "events", "audit"):
            ch.exchange_declare(x, passive=True)
    assert _outcome(url, passive) == "ok"


def test_exported_flags_and_arguments_are_kept(url):
    """Equivalent redeclares pass; inequivalent ones get RabbitMQ's 406 texts, naming what was exported."""
    assert _outcome(url, lambda ch: ch.queue_declare("orders.q", durable=True, arguments=QUEUE_ARGS)) == "ok"
    # (The embedded broker's texts for inequivalent x-arguments differ from RabbitMQ's in how values are
    # quoted, a difference older than definitions: only the code and the argument's name are compared.)
    code, text = _outcome(url, lambda ch: ch.queue_declare("orders.q", durable=True, arguments={
        **QUEUE_ARGS, "x-message-ttl": 5}))
    assert (code, text.split(":")[0]) == (406, f"PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for "
                                               f"queue 'orders.q' in vhost '{VHOST}'")
    assert _outcome(url, lambda ch: ch.queue_declare("unrouted.q", durable=True)) == (
        406, f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'unrouted.q' in vhost '{VHOST}': "
             "received 'true' but current is 'false'")
    assert _outcome(url, lambda ch: ch.exchange_declare("events", "direct", durable=True)) == (
        406, f"PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'events' in vhost '{VHOST}': "
             "received 'direct' but current is 'topic'")
    assert _outcome(url, lambda ch: ch.exchange_declare("audit", "headers", durable=True)) == (
        406, f"PRECONDITION_FAILED - inequivalent arg 'durable' for exchange 'audit' in vhost '{VHOST}': "
             "received 'true' but current is 'false'")


def test_exported_bindings_route(url):
    """orders --new--> orders.q and --new--> events (exchange binding) --order.*.created?--> events.q (no:
    the key is "new"); an unroutable key goes to the alternate exchange's queue."""
    def scenario(ch):
        for q in ("orders.q", "events.q", "unrouted.q"):
            ch.queue_purge(q)
        ch.confirm_delivery()
        ch.basic_publish("orders", "new", b"n1")
        ch.basic_publish("orders", "other", b"o1")
        ch.basic_publish("events", "order.eu.created", b"e1")
        got = {}
        for q in ("orders.q", "events.q", "unrouted.q"):
            _, _, body = ch.basic_get(q, auto_ack=True)
            got[q] = body
        return got
    assert _outcome(url, scenario) == {"orders.q": b"n1", "events.q": b"e1", "unrouted.q": b"o1"}


# ------------------------------------------------------------------------ what is not supported


def test_unsupported_items_are_reported_by_name(caplog):
    doc = {
        "rabbit_version": "3.10.8",
        "users": [
            {"name": "ok-user", "password_hash": hash_password("pw"), "hashing_algorithm": SHA256, "tags": [],
             "limits": {"max-connections": 10}},
            {"name": "bcrypt-user", "password_hash": "AAAA", "hashing_algorithm": "rabbit_password_hashing_bcrypt",
             "tags": []}],
        "vhosts": [{"name": "v", "limits": [["max-queues", 5]]}],
        "permissions": [{"user": "ok-user", "vhost": "v", "configure": ".*", "write": ".*", "read": ".*"}],
        "policies": [{"vhost": "v", "name": "ha-all", "pattern": ".*", "apply-to": "queues",
                      "definition": {"ha-mode": "all"}, "priority": 0}],
        "parameters": [{"vhost": "v", "component": "shovel", "name": "move", "value": {}}],
        "global_parameters": [{"name": "cluster_name", "value": "prod"}],
        "queues": [{"name": "qq", "vhost": "v", "durable": True, "auto_delete": False, "type": "quorum",
                    "arguments": {"x-queue-type": "quorum"}},
                   {"name": "bad", "vhost": "v", "durable": True, "auto_delete": False,
                    "arguments": {"x-max-length": -1}},
                   {"name": "classic", "vhost": "v", "durable": True, "auto_delete": False, "arguments": {}},
                   {"name": "lost", "vhost": "nowhere", "durable": True, "auto_delete": False,
                    "arguments": {}}],
        "exchanges": [{"name": "x", "vhost": "v", "type": "x-consistent-hash", "durable": True,
                       "auto_delete": False, "internal": False, "arguments": {}}],
        "bindings": [{"source": "amq.direct", "vhost": "v", "destination": "qq", "destination_type": "queue",
                      "routing_key": "k", "arguments": {}},
                     {"source": "amq.direct", "vhost": "v", "destination": "bad", "destination_type": "queue",
                      "routing_key": "k", "arguments": {}},
                     {"source": "amq.direct", "vhost": "v", "destination": "classic",
                      "destination_type": "queue", "routing_key": "k", "arguments": {}}],
        "shovels": [],
    }
    caplog.set_level(logging.WARNING, logger="broker.definitions")
    with Broker(port=0, definitions=doc) as b:
        skipped = b.core.definitions_skipped
        assert "classic" in b.core.vhosts["v"].queues
        assert b.core.vhosts["v"].queues["qq"].queue_type == "quorum"
        assert "bcrypt-user" not in b.core.access.users
    expected = [
        "unknown key 'shovels'",
        "parameter 'move' of component 'shovel' in vhost 'v'",
        "global parameter 'cluster_name'",
        "limits of user 'ok-user'",
        "user 'bcrypt-user': unsupported hashing_algorithm 'rabbit_password_hashing_bcrypt'",
        "limits of vhost 'v'",
        # 4.x has no classic mirroring: RabbitMQ 4.3 refuses the policy as the embedded broker does
        "policy 'ha-all' in vhost 'v': [{<<\"ha-mode\">>,<<\"all\">>}] are not recognised policy settings",
        "exchange 'x' in vhost 'v': PRECONDITION_FAILED - unknown exchange type 'x-consistent-hash'",
        "queue 'bad' in vhost 'v': PRECONDITION_FAILED - invalid arg 'x-max-length'",
        "queue 'lost' in vhost 'nowhere': the vhost is not defined",
        "binding from exchange 'amq.direct' to queue 'bad' with routing key 'k' in vhost 'v': no such queue",
    ]
    assert len(skipped) == len(expected), skipped
    for want, got in zip(expected, skipped):
        assert got.startswith(want), (want, got)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for item in skipped:
        assert any(item in line for line in logged), item


def test_definitions_that_are_not_definitions_are_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        BrokerConfig(definitions=str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        BrokerConfig(definitions=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"permissions\[0\]\.write must be a regular expression"):
        BrokerConfig(definitions={"users": [], "vhosts": [{"name": "v"}], "permissions": [
            {"user": "guest", "vhost": "v", "configure": ".*", "write": None, "read": ".*"}]})
    with pytest.raises(ValueError, match=r"queues\[0\]\.name must be a string"):
        BrokerConfig(definitions={"queues": [{"vhost": "/"}]})


# ------------------------------------------------------------------------------ password hashes


@pytest.mark.parametrize("algorithm", [SHA256, SHA512, MD5])
def test_users_with_each_hashing_algorithm_log_in(algorithm):
    doc = {"users": [{"name": "h", "password_hash": hash_password("s3cret", algorithm),
                      "hashing_algorithm": algorithm, "tags": []}],
           "vhosts": [{"name": "/"}],
           "permissions": [{"user": "h", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}]}
    with Broker(port=0, definitions=doc) as b:
        pika.BlockingConnection(pika.URLParameters(f"amqp://h:s3cret@127.0.0.1:{b.port}/%2F")).close()
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            pika.BlockingConnection(pika.URLParameters(f"amqp://h:wrong@127.0.0.1:{b.port}/%2F"))


@pytest.mark.parametrize("version,algorithm", [("3.5.7", MD5), ("3.6.0", SHA256), (None, SHA256)])
def test_exports_without_hashing_algorithm(version, algorithm):
    """Before 3.6.1 exports named no hashing algorithm: MD5 up to 3.5, as RabbitMQ's import assumes."""
    doc = {"users": [{"name": "old", "password_hash": hash_password("pw", algorithm), "tags": ""}]}
    if version:
        doc["rabbit_version"] = version
    config = BrokerConfig(definitions=doc)
    assert config.access.users["old"].hashing_algorithm == algorithm
    assert config.access.users["old"].check("pw")


@pytest.mark.rabbitmq
def test_hashes_are_rabbitmqs():
    """RabbitMQ accepts a user imported with our hash_password's output (the other way round, RabbitMQ's
    hashes in the embedded broker, is test_permissions' setup: RabbitMQ 3.10's rabbitmqctl has no
    hash_password command)."""
    require_rabbitmq()
    user = f"defs-hash-{TAG}"
    doc = {"users": [{"name": user, "password_hash": hash_password("s3cret"), "hashing_algorithm": SHA256,
                      "tags": []}],
           "permissions": [{"user": user, "vhost": "/", "configure": "", "write": "", "read": ""}]}
    # A file the CLI can read (3.10's import_definitions does not read standard input).
    fd, path = tempfile.mkstemp(prefix="spark-amqp-defs-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh)
    os.chmod(path, 0o644)
    try:
        rabbitmqctl("import_definitions", path)
        pika.BlockingConnection(pika.URLParameters(
            f"amqp://{user}:s3cret@{RABBITMQ_HOST}:{RABBITMQ_PORT}/%2F")).close()
    finally:
        os.unlink(path)
        try:
            rabbitmqctl("delete_user", user)
        except RuntimeError:
            pass            # the import failed before creating it


# ------------------------------------------------------------------- TOML, keywords, command line


def test_toml_users_permissions_and_topic_permissions(tmp_path):
    path = tmp_path / "broker.toml"
    path.write_text(f'''
[broker]
vhosts = ["/", "orders"]
loopback_users = []

[users]
guest = "guest"
alice = {{ password_hash = "{hash_password('alice-pw')}", tags = ["impersonator"] }}

[permissions.alice]
orders = ["^alice\\\\.", ".*", {{}}]
''')
    with pytest.raises(ValueError, match=r"permissions\.alice\.orders\.read must be a regular expression"):
        BrokerConfig.from_toml(str(path))
    path.write_text(path.read_text().replace('{}]', '".*"]') + '''
[topic_permissions.alice.orders]
"amq.topic" = { write = "^eu\\\\.", read = ".*" }
''')
    config = BrokerConfig.from_toml(str(path))
    ac = config.access
    assert ac.users["alice"].tags == ("impersonator",)
    assert ac.users["alice"].check("alice-pw") and not ac.users["alice"].check("guest")
    assert set(ac.permissions) == {("alice", "orders")}
    assert set(ac.topic_permissions) == {("alice", "orders", "amq.topic")}
    assert not ac.open_vhosts
    with Broker(config=config) as b:
        conn = pika.BlockingConnection(pika.URLParameters(f"amqp://alice:alice-pw@127.0.0.1:{b.port}/orders"))
        ch = conn.channel()
        ch.queue_declare("alice.q", auto_delete=True)
        ch.basic_publish("amq.topic", "eu.x", b"m")
        ch.basic_publish("", "alice.q", b"m", pika.BasicProperties(user_id="someone-else"))   # impersonator
        ch.basic_qos(prefetch_count=0)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
            ch.basic_publish("amq.topic", "us.x", b"m")
            ch.basic_qos(prefetch_count=0)
        assert ei.value.reply_code == 403
        assert ei.value.reply_text == ("ACCESS_REFUSED - write access to topic 'us.x' in exchange 'amq.topic' in vhost "
                                       "'orders' refused for user 'alice'")
        conn.close()


@pytest.mark.parametrize("kwargs,message", [
    ({"permissions": {"bob": {"/": [".*", ".*", ".*"]}}}, "permissions: no such user 'bob'"),
    ({"permissions": {"guest": {"v": [".*", ".*", ".*"]}}}, "permissions.guest: no such vhost 'v'"),
    ({"permissions": {"guest": {"/": ["(", ".*", ".*"]}}}, r"permissions.guest./.configure: invalid regular"),
    ({"users": {"bob": {"password": 12345}}}, "users.bob.password must be a string"),
    ({"users": {"bob": {"password_hash": "not base64!"}}}, "users.bob.password_hash is not base64"),
    ({"users": {"bob": {"password": "x", "hashing_algorithm": "bcrypt"}}}, "users.bob.hashing_algorithm"),
    ({"users": {"bob": {"pasword": "s3cret-xyz"}}}, r"users.bob: unknown keys \['pasword'\]"),
    ({"loopback_users": "guest"}, "loopback_users must be a list"),
])
def test_bad_access_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message) as ei:
        BrokerConfig(**kwargs)
    assert "s3cret" not in str(ei.value) and "12345" not in str(ei.value)


def test_without_permissions_every_user_may_use_every_vhost():
    """Backwards compatible: users as name -> password and several vhosts, no permissions given."""
    with Broker(port=0, users={"guest": "guest", "bob": "pw"}, vhosts=("/", "other")) as b:
        for vhost in ("%2F", "other"):
            conn = pika.BlockingConnection(pika.URLParameters(f"amqp://bob:pw@127.0.0.1:{b.port}/{vhost}"))
            ch = conn.channel()
            ch.queue_declare("", exclusive=True)
            ch.exchange_declare("anything", "topic", auto_delete=True)
            conn.close()
        assert b.url == f"amqp://guest:guest@127.0.0.1:{b.port}/%2F"


def test_url_needs_a_plain_password():
    with Broker(port=0, users={"h": {"password_hash": hash_password("x")}}) as b:
        with pytest.raises(ValueError, match="no user has a plain password"):
            b.url


def test_command_line_definitions(tmp_path):
    defs = tmp_path / "defs.json"
    defs.write_text(json.dumps({
        "users": [{"name": "cli", "password_hash": hash_password("cli-pw"), "hashing_algorithm": SHA256,
                   "tags": []}],
        "vhosts": [{"name": "cli-vhost"}],
        "permissions": [{"user": "cli", "vhost": "cli-vhost", "configure": ".*", "write": ".*", "read": ".*"}],
        "queues": [{"name": "from-file", "vhost": "cli-vhost", "durable": True, "auto_delete": False,
                    "arguments": {}}]}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spark_amqp_broker", "--port", str(port),
                             "--definitions", str(defs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"amqp://cli:cli-pw@127.0.0.1:{port}/cli-vhost"

        def connect():
            try:
                return pika.BlockingConnection(pika.URLParameters(url))
            except pika.exceptions.AMQPConnectionError:
                return None
        conn = wait_until(connect, timeout=20, message="the broker started with --definitions")
        conn.channel().queue_declare("from-file", passive=True)
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    bad = subprocess.run([sys.executable, "-m", "spark_amqp_broker", "--port", "0", "--definitions",
                          str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: definitions: cannot read"), bad.stderr


def test_toml_definitions_key(tmp_path):
    defs = tmp_path / "defs.json"
    defs.write_text(json.dumps({"vhosts": [{"name": "from-toml"}], "users": [
        {"name": "t", "password_hash": hash_password("t-pw"), "tags": ["management"]}],
        "permissions": [{"user": "t", "vhost": "from-toml", "configure": ".*", "write": ".*", "read": ".*"}]}))
    toml = tmp_path / "broker.toml"
    toml.write_text(f'[broker]\ndefinitions = "{defs}"\n')
    config = BrokerConfig.from_toml(str(toml))
    assert config.all_vhosts == ("/", "from-toml")
    assert config.access.users["t"].tags == ("management",)
    # guest (from the default users) has no permissions now that definitions give some: no vhost for it
    assert not config.access.vhost_allowed("guest", "/", True)
    assert config.access.vhost_allowed("t", "from-toml", True)
