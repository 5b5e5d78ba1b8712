"""Users, vhosts and permissions: the same scenarios on RabbitMQ and on the embedded broker, for each version
(RabbitMQ 3.10 and the embedded broker as 3.10, RabbitMQ 4.3 and the embedded broker as 4.3).

RabbitMQ is set up with rabbitmqctl (add_vhost, add_user, set_permissions, set_topic_permissions; deleted after
the module), then its `export_definitions` output, filtered to this module's vhost and users, is what the
embedded broker is started with: the same users (RabbitMQ's own password hashes), vhost and permissions. Each
scenario asserts the reply codes and texts a client sees, which are RabbitMQ's, on both brokers. Without
RabbitMQ the embedded broker runs the same scenarios from definitions built here (the rabbitmq side skips).

Resource names encode what the test user may do with them: the letters before the first '-' are the
permissions it has on that name (c = configure, w = write, r = read), so "cw-q" may be configured and written
but not read, and "n-q" nothing. Server-named queues (amq.gen-*) may be configured; the default exchange
("amq.default" in permission checks) may not be written by `user`, only by `pub`.
"""

from __future__ import annotations

import urllib.parse
import uuid

import pika
import pika.exceptions
import pytest
from brokers import rabbitmq_setup, rabbitmqctl
from brokers import NODES, require_rabbitmq
from pamqp import commands as C
from spark_amqp_broker import Broker
from spark_amqp_broker.access import hash_password, is_loopback
from spark_amqp_broker.config import BrokerConfig
from spark_amqp_broker.connection import Connection
from spark_amqp_broker.core import BrokerCore

from spark_amqp.codec import frames, methods

TAG = uuid.uuid4().hex[:8]
VHOST = f"perm-{TAG}"
USER, PUB, NOBODY = f"perm-user-{TAG}", f"perm-pub-{TAG}", f"perm-nobody-{TAG}"
IMP = f"perm-impersonator-{TAG}"        # tagged impersonator, same permissions as PUB
USERS = (USER, PUB, NOBODY, IMP)
PASSWORD = f"pw-{TAG}"
CONFIGURE = r"^[^-]*c[^-]*-|^amq\.gen-"
WRITE = r"^[^-]*w[^-]*-"
READ = r"^[^-]*r[^-]*-"
TOPIC_X = "crw-topic"
PERMISSIONS = {USER: (CONFIGURE, WRITE, READ), PUB: ("", r"^amq\.default$", ""), IMP: ("", r"^amq\.default$", "")}
# Topic permissions of USER on TOPIC_X: publish only with keys under "allowed." or the vhost's name, bind
# only with keys that start with the user's own name ({username} and {vhost} are expanded by the broker).
TOPIC = ("^(allowed|{vhost})\\.", "^{username}\\.")


def _local_definitions() -> dict:
    """What export_definitions would write for this module's setup (used when RabbitMQ is not reachable)."""
    return {
        "users": [{"name": u, "password_hash": hash_password(PASSWORD), "tags": ["impersonator"] if u == IMP else [],
                   "hashing_algorithm": "rabbit_password_hashing_sha256", "limits": {}}
                  for u in USERS],
        "vhosts": [{"name": VHOST, "limits": [], "metadata": {"description": "", "tags": []}}],
        "permissions": [{"user": u, "vhost": VHOST, "configure": p[0], "write": p[1], "read": p[2]}
                        for u, p in PERMISSIONS.items()],
        "topic_permissions": [{"user": USER, "vhost": VHOST, "exchange": TOPIC_X, "write": TOPIC[0],
                               "read": TOPIC[1]}],
        "exchanges": [], "queues": [], "bindings": [], "policies": [], "parameters": [],
        "global_parameters": [],
    }


def _rabbitmq_setup(version: str) -> None:
    # 4.x sets topic permissions only on an exchange that exists: declared here (as guest, whose permission on
    # the vhost is not exported: only this module's users are)
    rabbitmqctl("set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*", version=version)
    host, port, _url = NODES[version]
    conn = pika.BlockingConnection(pika.URLParameters(
        f"amqp://guest:guest@{host}:{port}/{urllib.parse.quote(VHOST, safe='')}"))
    conn.channel().exchange_declare(TOPIC_X, "topic")     # as test_topic_permissions declares it
    conn.close()
    for user in USERS:
        rabbitmqctl("add_user", user, PASSWORD, version=version)
    rabbitmqctl("set_user_tags", IMP, "impersonator", version=version)
    for user, (c, w, r) in PERMISSIONS.items():
        rabbitmqctl("set_permissions", "-p", VHOST, user, c, w, r, version=version)
    rabbitmqctl("set_topic_permissions", "-p", VHOST, USER, TOPIC_X, *TOPIC, version=version)


@pytest.fixture(scope="module", params=["3.10", "4.3"])
def world(request):
    """{"version", "rabbitmq": the node's (host, port) or None, "embedded": the embedded Broker behaving as that
    version}: both hold this module's users and vhost."""
    version = CURRENT["version"] = request.param
    with rabbitmq_setup(VHOST, USERS, _rabbitmq_setup, _local_definitions(), version) as (defs, on_rabbit):
        with Broker(port=0, definitions=defs, rabbitmq_version=version) as broker:
            yield {"version": version, "rabbitmq": NODES[version][:2] if on_rabbit else None,
                   "embedded": broker, "definitions": defs}


@pytest.fixture(params=["embedded", "rabbitmq"])
def side(request, world):
    """A function (user, vhost=VHOST, password=PASSWORD) -> amqp:// URL on the broker under test."""
    if request.param == "rabbitmq":
        require_rabbitmq(world["version"])
        host, port = world["rabbitmq"]
    else:
        host, port = "127.0.0.1", world["embedded"].port

    def url(user=USER, vhost=VHOST, password=PASSWORD):
        return f"amqp://{user}:{password}@{host}:{port}/{urllib.parse.quote(vhost, safe='')}"

    return url


@pytest.fixture
def names():
    """name("cw-q") -> "cw-q-<unique>": the permission prefix kept, unique per test run."""
    suffix = uuid.uuid4().hex[:8]
    return lambda prefix: f"{prefix}-{suffix}"


class Session:
    """One pika connection; `run(fn)` runs fn(channel) on a fresh channel and says what the client saw:
    "ok", or (code, text) of the channel.close."""

    def __init__(self, url: str):
        self.conn = pika.BlockingConnection(pika.URLParameters(url))

    def run(self, fn):
        ch = self.conn.channel()
        try:
            fn(ch)
            ch.basic_qos(prefetch_count=0)    # a round trip: asynchronous refusals (publish) surface here
        except pika.exceptions.ChannelClosedByBroker as exc:
            return exc.reply_code, exc.reply_text
        ch.close()
        return "ok"

    def close(self):
        if self.conn.is_open:
            self.conn.close()


@pytest.fixture
def session(side):
    sessions = []

    def make(user=USER):
        s = Session(side(user))
        sessions.append(s)
        return s

    yield make
    for s in sessions:
        s.close()


# The version of the brokers under test (set by `world`): 4.x names the permission refused in its texts.
CURRENT = {"version": "3.10"}


def which(perm: str) -> str:
    return f"{perm} " if CURRENT["version"] == "4.3" else ""


def refused(kind: str, name: str, perm: str, user: str = USER):
    """The 403 of a refused `perm` (configure, write, read) on a resource."""
    return 403, (f"ACCESS_REFUSED - {which(perm)}access to {kind} '{name}' in vhost '{VHOST}' refused for "
                 f"user '{user}'")


# ------------------------------------------------------------------------ operation -> permission


def test_queue_declare_needs_configure(session, names):
    s = session()
    assert s.run(lambda ch: ch.queue_declare(names("c-q"), auto_delete=True)) == "ok"
    assert s.run(lambda ch: ch.queue_declare(names("wr-q"))) == refused("queue", names("wr-q"), "configure")


def test_server_named_queue_is_checked_under_its_amq_gen_name(session):
    s = session()
    declared = []
    assert s.run(lambda ch: declared.append(ch.queue_declare("", exclusive=True).method.queue)) == "ok"
    assert declared[0].startswith("amq.gen-")
    code, text = session(PUB).run(lambda ch: ch.queue_declare("", exclusive=True))
    assert code == 403
    assert text.startswith(f"ACCESS_REFUSED - {which('configure')}access to queue 'amq.gen-") and \
        text.endswith(f"' in vhost '{VHOST}' refused for user '{PUB}'"), text


def test_passive_declares_need_no_permission(session, names):
    s = session()
    q = names("c-q")
    assert s.run(lambda ch: ch.queue_declare(q, auto_delete=True)) == "ok"
    p = session(PUB)     # PUB may configure nothing, and has no permission at all on q or amq.topic
    if CURRENT["version"] == "3.10":
        assert p.run(lambda ch: ch.queue_declare(q, passive=True)) == "ok"
        assert p.run(lambda ch: ch.exchange_declare("amq.topic", passive=True)) == "ok"
    else:    # 4.x: a passive declare needs any one permission on the resource
        assert p.run(lambda ch: ch.queue_declare(q, passive=True)) == refused("queue", q, "configure", PUB)
        assert p.run(lambda ch: ch.exchange_declare("amq.topic", passive=True)) == \
            refused("exchange", "amq.topic", "configure", PUB)
        assert s.run(lambda ch: ch.queue_declare(q, passive=True)) == "ok"    # configure is enough
    who = p if CURRENT["version"] == "3.10" else s     # the permission is checked before the queue is looked up
    assert who.run(lambda ch: ch.queue_declare(names("c-n"), passive=True)) == \
        (404, f"NOT_FOUND - no queue '{names('c-n')}' in vhost '{VHOST}'")


def test_empty_queue_name_is_the_last_declared_one(session, names):
    """The permission is checked on the queue "" stands for; without one declared on the channel: 404."""
    s = session()
    q = names("cr-q")

    def last_declared(ch):
        ch.queue_declare(q, auto_delete=True)
        ch.basic_get("")
        ch.queue_purge("")
        ch.queue_delete("")
    assert s.run(last_declared) == "ok"
    for op in (lambda ch: ch.queue_delete(""), lambda ch: ch.queue_purge(""), lambda ch: ch.basic_get(""),
               lambda ch: ch.queue_bind("", "amq.direct", "k")):
        assert s.run(op) == (404, "NOT_FOUND - no previously declared queue")


def test_queue_delete_needs_configure(session, names):
    s = session()
    assert s.run(lambda ch: ch.queue_delete(names("wr-q"))) == refused("queue", names("wr-q"), "configure")
    assert s.run(lambda ch: ch.queue_delete(names("c-q"))) == "ok"        # absent: ok, as RabbitMQ


def test_exchange_declare_and_delete_need_configure(session, names):
    s = session()
    assert s.run(lambda ch: ch.exchange_declare(names("c-x"), "direct", auto_delete=True)) == "ok"
    assert s.run(lambda ch: ch.exchange_declare(names("rw-x"), "direct")) == refused("exchange", names("rw-x"), "configure")
    assert s.run(lambda ch: ch.exchange_delete(names("rw-x"))) == refused("exchange", names("rw-x"), "configure")
    assert s.run(lambda ch: ch.exchange_delete(names("c-x"))) == "ok"
    # Redeclaring a predeclared exchange needs configure on it too.
    assert s.run(lambda ch: ch.exchange_declare("amq.direct", "direct", durable=True)) == \
        refused("exchange", "amq.direct", "configure")


def test_publish_needs_write_on_the_exchange(session, names):
    s = session()

    def setup(ch):
        ch.exchange_declare(names("cw-x"), "fanout", auto_delete=True)
        ch.exchange_declare(names("c-x"), "fanout", auto_delete=True)
    assert s.run(setup) == "ok"
    assert s.run(lambda ch: ch.basic_publish(names("cw-x"), "k", b"m")) == "ok"
    assert s.run(lambda ch: ch.basic_publish(names("c-x"), "k", b"m")) == refused("exchange", names("c-x"), "write")
    # Refused before the exchange is looked up: no 404 for an exchange one may not write anyway.
    assert s.run(lambda ch: ch.basic_publish(names("n-x"), "k", b"m")) == refused("exchange", names("n-x"), "write")
    assert s.run(lambda ch: ch.basic_publish(names("w-x"), "k", b"m")) == \
        (404, f"NOT_FOUND - no exchange '{names('w-x')}' in vhost '{VHOST}'")


def test_default_exchange_is_amq_default_in_checks(session, names):
    q = names("c-q")
    assert session().run(lambda ch: ch.queue_declare(q, auto_delete=False)) == "ok"
    try:
        assert session().run(lambda ch: ch.basic_publish("", q, b"m")) == refused("exchange", "amq.default", "write")
        assert session(PUB).run(lambda ch: ch.basic_publish("", q, b"m")) == "ok"
    finally:
        session().run(lambda ch: ch.queue_delete(q))


def test_get_consume_and_purge_need_read(session, names):
    s = session()
    assert s.run(lambda ch: ch.queue_declare(names("c-q"), auto_delete=True)) == "ok"
    assert s.run(lambda ch: ch.queue_declare(names("cr-q"), auto_delete=True)) == "ok"
    no_read = names("c-q")
    assert s.run(lambda ch: ch.basic_get(no_read)) == refused("queue", no_read, "read")
    assert s.run(lambda ch: ch.basic_consume(no_read, lambda *a: None)) == refused("queue", no_read, "read")
    assert s.run(lambda ch: ch.queue_purge(no_read)) == refused("queue", no_read, "read")
    assert s.run(lambda ch: ch.basic_get(names("cr-q"))) == "ok"
    assert s.run(lambda ch: ch.queue_purge(names("cr-q"))) == "ok"
    # read is checked before the queue is looked up
    assert s.run(lambda ch: ch.basic_get(names("w-q"))) == refused("queue", names("w-q"), "read")
    assert s.run(lambda ch: ch.basic_get(names("r-q"))) == \
        (404, f"NOT_FOUND - no queue '{names('r-q')}' in vhost '{VHOST}'")


def test_queue_bind_needs_write_on_queue_and_read_on_exchange(session, names):
    s = session()
    qw, qn = names("cw-q"), names("c-q")
    xr, xn = names("cr-x"), names("c-x")

    def setup(ch):
        for q in (qw, qn):
            ch.queue_declare(q, auto_delete=True)
        for x in (xr, xn):
            ch.exchange_declare(x, "direct", auto_delete=True)
    assert s.run(setup) == "ok"
    assert s.run(lambda ch: ch.queue_bind(qn, xr, "k")) == refused("queue", qn, "write")
    assert s.run(lambda ch: ch.queue_bind(qw, xn, "k")) == refused("exchange", xn, "read")
    assert s.run(lambda ch: ch.queue_bind(qw, xr, "k")) == "ok"
    assert s.run(lambda ch: ch.queue_unbind(qn, xr, "k")) == refused("queue", qn, "write")
    assert s.run(lambda ch: ch.queue_unbind(qw, xn, "k")) == refused("exchange", xn, "read")
    assert s.run(lambda ch: ch.queue_unbind(qw, xr, "k")) == "ok"


def test_exchange_bind_needs_write_on_destination_and_read_on_source(session, names):
    s = session()
    dst_w, dst_n, src_r, src_n = names("cw-x"), names("cr-x"), names("cr-x2"), names("cw-x2")

    def setup(ch):
        for x in (dst_w, dst_n, src_r, src_n):
            ch.exchange_declare(x, "fanout", auto_delete=True)
    assert s.run(setup) == "ok"
    assert s.run(lambda ch: ch.exchange_bind(dst_n, src_r)) == refused("exchange", dst_n, "write")
    assert s.run(lambda ch: ch.exchange_bind(dst_w, src_n)) == refused("exchange", src_n, "read")
    assert s.run(lambda ch: ch.exchange_bind(dst_w, src_r)) == "ok"
    assert s.run(lambda ch: ch.exchange_unbind(dst_n, src_r)) == refused("exchange", dst_n, "write")
    assert s.run(lambda ch: ch.exchange_unbind(dst_w, src_r)) == "ok"


def test_dead_letter_and_alternate_exchanges_need_write(session, names):
    s = session()
    q, dlx_ok, dlx_no = names("crw-q"), names("cw-dlx"), names("c-dlx")
    assert s.run(lambda ch: ch.queue_declare(q, auto_delete=True,
                                             arguments={"x-dead-letter-exchange": dlx_no})) == \
        refused("exchange", dlx_no, "write")
    assert s.run(lambda ch: ch.queue_declare(q, auto_delete=True,
                                             arguments={"x-dead-letter-exchange": dlx_ok})) == "ok"
    # A new queue with a DLX needs read on the queue too
    q_noread = names("cw-q")
    assert s.run(lambda ch: ch.queue_declare(q_noread, auto_delete=True,
                                             arguments={"x-dead-letter-exchange": dlx_ok})) == \
        refused("queue", q_noread, "read")
    x = names("cr-x")
    assert s.run(lambda ch: ch.exchange_declare(x, "fanout", auto_delete=True,
                                                arguments={"alternate-exchange": dlx_no})) == \
        refused("exchange", dlx_no, "write")
    assert s.run(lambda ch: ch.exchange_declare(x, "fanout", auto_delete=True,
                                                arguments={"alternate-exchange": dlx_ok})) == "ok"


def test_topic_permissions(session, names):
    s = session()
    q = names("crw-q")
    assert s.run(lambda ch: ch.exchange_declare(TOPIC_X, "topic", auto_delete=False)) == "ok"
    try:
        assert s.run(lambda ch: ch.queue_declare(q, auto_delete=True)) == "ok"
        assert s.run(lambda ch: ch.basic_publish(TOPIC_X, "allowed.x", b"m")) == "ok"
        assert s.run(lambda ch: ch.basic_publish(TOPIC_X, f"{VHOST}.x", b"m")) == "ok"
        assert s.run(lambda ch: ch.basic_publish(TOPIC_X, "other.x", b"m")) == \
            (403, f"ACCESS_REFUSED - {which('write')}access to topic 'other.x' in exchange '{TOPIC_X}' in vhost '{VHOST}' "
                  f"refused for user '{USER}'")
        assert s.run(lambda ch: ch.queue_bind(q, TOPIC_X, f"{USER}.#")) == "ok"
        assert s.run(lambda ch: ch.queue_bind(q, TOPIC_X, "allowed.#")) == \
            (403, f"ACCESS_REFUSED - {which('read')}access to topic 'allowed.#' in exchange '{TOPIC_X}' in vhost "
                  f"'{VHOST}' refused for user '{USER}'")
        # Other topic exchanges have no topic permission for this user: any key goes.
        other = names("crw-t")
        assert s.run(lambda ch: ch.exchange_declare(other, "topic", auto_delete=True)) == "ok"
        # exchange.bind from a topic exchange: the topic read permission on the routing key, too
        assert s.run(lambda ch: ch.exchange_bind(other, TOPIC_X, f"{USER}.x")) == "ok"
        assert s.run(lambda ch: ch.exchange_bind(other, TOPIC_X, "x.y")) == \
            (403, f"ACCESS_REFUSED - {which('read')}access to topic 'x.y' in exchange '{TOPIC_X}' in vhost '{VHOST}' "
                  f"refused for user '{USER}'")
        assert s.run(lambda ch: ch.queue_bind(q, other, "any.#")) == "ok"
        assert s.run(lambda ch: ch.basic_publish(other, "any.x", b"m")) == "ok"
    finally:
        s.run(lambda ch: ch.exchange_delete(TOPIC_X))


def test_impersonation_needs_the_impersonator_tag(session, names):
    q = names("c-q")
    s = session(PUB)
    code, text = s.run(lambda ch: ch.basic_publish("", q, b"m", pika.BasicProperties(user_id=USER)))
    assert (code, text) == (406, f"PRECONDITION_FAILED - user_id property set to '{USER}' but "
                                 f"authenticated user was '{PUB}'")
    assert session(IMP).run(lambda ch: ch.basic_publish("", q, b"m", pika.BasicProperties(user_id=USER))) == "ok"


def test_refusal_orders(session, names):
    """Which check comes first when several would refuse, as rabbit_channel orders them."""
    s = session()
    # exchange.declare: configure before the reserved amq. prefix; queue.declare: the prefix first.
    assert s.run(lambda ch: ch.exchange_declare("amq.nope", "direct")) == refused("exchange", "amq.nope", "configure")
    assert s.run(lambda ch: ch.exchange_declare("amq.c-nope", "direct")) == \
        (403, f"ACCESS_REFUSED - exchange name 'amq.c-nope' contains reserved prefix 'amq.*'")
    assert s.run(lambda ch: ch.queue_declare("amq.nope")) == \
        (403, "ACCESS_REFUSED - queue name 'amq.nope' contains reserved prefix 'amq.*'")
    # exchange.delete: the system exchanges first, then configure
    assert s.run(lambda ch: ch.exchange_delete("amq.direct")) == \
        (403, f"ACCESS_REFUSED - deletion of system exchange 'amq.direct' in vhost '{VHOST}' not allowed")
    # the default exchange cannot be bound, but write on the queue is checked first
    assert s.run(lambda ch: ch.queue_bind(names("c-q"), "", "k")) == refused("queue", names("c-q"), "write")
    # an exclusive queue of another connection: configure (403) before the lock (405)
    other = session()
    q = names("c-q")
    assert other.run(lambda ch: ch.queue_declare(q, exclusive=True)) == "ok"
    assert session(PUB).run(lambda ch: ch.queue_declare(q, exclusive=True)) == refused("queue", q, "configure", PUB)
    assert s.run(lambda ch: ch.queue_declare(q, exclusive=True))[0] == 405
    # internal exchange: write first, then "cannot publish to internal exchange"
    assert s.run(lambda ch: ch.exchange_declare(names("cw-int"), "fanout", auto_delete=True,
                                                internal=True)) == "ok"
    assert session(PUB).run(lambda ch: ch.basic_publish(names("cw-int"), "k", b"m")) == \
        refused("exchange", names("cw-int"), "write", PUB)
    assert s.run(lambda ch: ch.basic_publish(names("cw-int"), "k", b"m")) == \
        (403, f"ACCESS_REFUSED - cannot publish to internal exchange '{names('cw-int')}' in vhost '{VHOST}'")


# ---------------------------------------------------------------------------- connection level


def _connect_error(url: str):
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except pika.exceptions.ProbableAccessDeniedError as exc:
        return exc.args[0]
    except pika.exceptions.ProbableAuthenticationError as exc:
        return exc.args[0]
    return "ok"


def test_vhost_without_permissions_is_530(side):
    text = f"access to vhost '{VHOST}' refused for user '{NOBODY}'"
    assert _connect_error(side(NOBODY)) == f'ConnectionClosedByBroker: (530) "NOT_ALLOWED - {text}"'
    missing = f"missing-{TAG}"
    assert _connect_error(side(USER, vhost=missing)) == \
        f"ConnectionClosedByBroker: (530) 'NOT_ALLOWED - vhost {missing} not found'"
    assert _connect_error(side(PUB)) == "ok"


def test_wrong_password_is_403(side):
    expected = ("ConnectionClosedByBroker: (403) 'ACCESS_REFUSED - Login was refused using authentication "
                "mechanism PLAIN. For details see the broker logfile.'")
    assert _connect_error(side(USER, password="wrong")) == expected
    assert _connect_error(side(f"no-such-user-{TAG}")) == expected
    assert _connect_error(side(USER, password="")) == expected     # blank passwords never log in


def test_the_hashes_rabbitmq_exported_are_checked(world):
    """The embedded broker got RabbitMQ's own salted SHA-256 hashes (when RabbitMQ is there)."""
    users = {u["name"]: u for u in world["definitions"]["users"]}
    assert users[USER]["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    assert world["embedded"].call(lambda core: core.access.users[USER].check(PASSWORD), world["embedded"].core)
    assert not world["embedded"].call(lambda core: core.access.users[USER].check("x"), world["embedded"].core)


# ------------------------------------------------------------------------------- loopback_users


def test_loopback_users_from_loopback_is_allowed():
    with Broker(port=0, users={"guest": "guest", "alice": "pw"}, loopback_users=["alice"]) as b:
        assert _connect_error(f"amqp://alice:pw@127.0.0.1:{b.port}/%2F") == "ok"


def _handshake_from(core: BrokerCore, peer: str, user: str, password: str) -> list:
    """The protocol core as the server drives it, for a connection from `peer` (a non-loopback address no
    test can connect from): protocol header, start-ok with the authentication_failure_close capability."""
    conn = Connection(core, peer=peer)
    core.connection_made(conn)
    conn.receive_data(frames.PROTOCOL_HEADER)
    conn.receive_data(frames.method_frame(0, C.Connection.StartOk(
        client_properties={"capabilities": {"authentication_failure_close": True}}, mechanism="PLAIN",
        response=f"\0{user}\0{password}", locale="en_US")))
    reader = frames.FrameReader(0)
    reader.feed(conn.data_to_send())
    return [methods.unmarshal_method(p) for t, _, p in reader.frames() if t == 1]


@pytest.mark.parametrize("loopback_users,user,allowed", [
    (["guest"], "guest", False), (["guest"], "alice", True), ([], "guest", True), (["alice"], "alice", False)])
def test_loopback_users_from_another_address(loopback_users, user, allowed):
    core = BrokerCore(BrokerConfig(users={"guest": "guest", "alice": "guest"}, loopback_users=loopback_users))
    replies = _handshake_from(core, "192.0.2.7:50000", user, "guest")
    names = [r.name for r in replies]
    if allowed:
        assert names == ["Connection.Start", "Connection.Tune"]
    else:
        assert names == ["Connection.Start", "Connection.Close"]
        assert (replies[1].reply_code, replies[1].reply_text) == (
            403, "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see "
                 "the broker logfile.")


@pytest.mark.parametrize("peer,loopback", [
    ("127.0.0.1:5000", True), ("127.8.9.10:1", True), ("::1:5000", True), ("::ffff:127.0.0.1:9", True),
    ("192.0.2.7:5000", False), ("10.0.0.1:1", False), ("2001:db8::1:5000", False), ("", True)])
def test_is_loopback(peer, loopback):
    assert is_loopback(peer) is loopback
