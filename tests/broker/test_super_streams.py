"""Super streams, differential: the embedded broker as RabbitMQ 4.3 and a RabbitMQ 4.3 node.

A super stream is made on each broker by its own tool, `Broker.add_super_stream` on the embedded broker and
`rabbitmq-streams add_super_stream` (../shared/rabbitmq4/ctl.sh) on RabbitMQ, and by this package's command,
`python -m spark_amqp_broker.streams`, an AMQP client that works against both. What a client can see must be
the same on both brokers, whichever tool made it: the exchange and the streams answer passive declares and
equivalence checks with the same texts, and a publish to the exchange lands in the partition its key names.
What no AMQP client can see (the arguments of bindings) is compared on what each broker holds: RabbitMQ's
definitions export, the embedded broker's state. RabbitMQ 3.10 is left out: super streams are 4.x's here.
Every super stream a test makes is deleted at teardown (on the shared node too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pika
import pytest

from brokers import RABBITMQ4_CTL, rabbitmqctl, require_rabbitmq
from targets import TARGETS_43, Target, targets_fixture
from spark_amqp_broker import Broker

from helpers import pika_connect, refusal, safe_close
from support import Env
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "spark_amqp_broker.streams"]


broker_target = targets_fixture(TARGETS_43)    # this module's brokers: the embedded broker as 4.3 and the 4.3 node


class SuperStreams:
    """Makes and deletes super streams on the broker under test with `tool`: "native" (the embedded broker's
    API, or RabbitMQ's rabbitmq-streams) or "cli" (python -m spark_amqp_broker.streams). Deletes what is
    left at teardown."""

    def __init__(self, target, broker, url):
        self.target, self.broker, self.url = target, broker, url
        self.made: list[str] = []

    def name(self) -> str:
        return f"ss-{uuid.uuid4().hex[:8]}"

    def add(self, tool, name, *, partitions=None, binding_keys=None) -> tuple[int, str]:
        """(0, "") when made, else (exit status or 1, the refusal's text)."""
        self.made.append(name)
        opts = []
        if partitions is not None:
            opts += ["--partitions", str(partitions)]
        if binding_keys is not None:
            opts += ["--binding-keys", ",".join(binding_keys)]
        if tool == "native" and self.broker is not None:
            try:
                self.broker.add_super_stream(name, partitions, binding_keys)
            except ValueError as exc:
                return 1, str(exc)
            return 0, ""
        if tool == "native":
            cmd = [RABBITMQ4_CTL, "rabbitmq-streams", "add_super_stream", name, *opts]
        else:
            cmd = [*CLI, "--url", self.url, "add_super_stream", name, *opts]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return out.returncode, "" if out.returncode == 0 else out.stdout + out.stderr

    def delete(self, tool, name) -> tuple[int, str]:
        if tool == "native" and self.broker is not None:
            try:
                self.broker.delete_super_stream(name)
            except ValueError as exc:
                return 1, str(exc)
            return 0, ""
        if tool == "native":
            cmd = [RABBITMQ4_CTL, "rabbitmq-streams", "delete_super_stream", name]
        else:
            cmd = [*CLI, "--url", self.url, "delete_super_stream", name]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return out.returncode, "" if out.returncode == 0 else out.stdout + out.stderr

    def held(self, name) -> dict:
        """What the broker holds of super stream `name`: its exchange, the streams named after it and the
        bindings from it, as a definitions export writes them (without the vhost)."""
        if self.broker is None:
            doc = json.loads(rabbitmqctl("export_definitions", "-", "--format", "json", version="4.3"))
            exchanges = [{k: x[k] for k in ("name", "type", "durable", "auto_delete", "arguments")}
                         for x in doc["exchanges"] if x["name"] == name]
            queues = [{k: q[k] for k in ("name", "durable", "auto_delete", "arguments")}
                      for q in doc["queues"] if q["name"].startswith(name + "-")]
            bindings = [{k: b[k] for k in ("destination", "routing_key", "arguments")}
                        for b in doc["bindings"] if b["source"] == name]
        else:
            def read():
                v = self.broker.core.vhosts["/"]
                x = v.exchanges.get(name)
                return ([{"name": x.name, "type": x.type_name, "durable": x.durable, "auto_delete": x.auto_delete,
                          "arguments": dict(x.arguments)}] if x else [],
                        [{"name": q.name, "durable": q.durable, "auto_delete": q.auto_delete,
                          "arguments": dict(q.arguments)} for q in v.queues.values() if q.name.startswith(name + "-")],
                        [{"destination": d.name, "routing_key": key, "arguments": dict(args)}
                         for (d, key, _f), args in (x.bindings.items() if x else ())])
            exchanges, queues, bindings = self.broker.call(read)
        return {"exchanges": exchanges, "queues": sorted(queues, key=lambda q: q["name"]),
                "bindings": sorted(bindings, key=lambda b: b["arguments"].get("x-stream-partition-order", -1))}

    def close(self):
        """Delete what the test made, over AMQP (quicker than rabbitmq-streams on the node): the exchanges and
        every stream name a test here gives a partition."""
        env = Env(self.url, None)
        for name in self.made:
            env.track_exchange(name)
            for k in ("0", "1", "2", "eu", "us", "ap"):
                env.track_queue(f"{name}-{k}")
        env.close()


@pytest.fixture
def supers(request, broker_target, broker_url):
    broker = request.getfixturevalue("embedded_43") if broker_target.kind == "embedded" else None
    s = SuperStreams(broker_target, broker, broker_url)
    yield s
    s.close()


def expected(name, keys) -> dict:
    """What RabbitMQ 4.3.6's add_super_stream makes (measured with export_definitions)."""
    return {
        "exchanges": [{"name": name, "type": "direct", "durable": True, "auto_delete": False,
                       "arguments": {"x-super-stream": True}}],
        "queues": sorted(({"name": f"{name}-{k}", "durable": True, "auto_delete": False,
                           "arguments": {"x-queue-leader-locator": "balanced", "x-queue-type": "stream"}}
                          for k in keys), key=lambda q: q["name"]),
        "bindings": [{"destination": f"{name}-{k}", "routing_key": k, "arguments": {"x-stream-partition-order": i}}
                     for i, k in enumerate(keys)],
    }


LAYOUTS = {"partitions": (dict(partitions=3), ["0", "1", "2"]),
           "binding-keys": (dict(binding_keys=["eu", "us", "ap"]), ["eu", "us", "ap"])}


@pytest.mark.parametrize("tool", ["native", "cli"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_super_stream_is_a_direct_exchange_streams_and_ordered_bindings(supers, tool, layout):
    kw, keys = LAYOUTS[layout]
    name = supers.name()
    assert supers.add(tool, name, **kw) == (0, "")
    assert supers.held(name) == expected(name, keys)


@pytest.mark.parametrize("tool", ["native", "cli"])
def test_clients_see_the_same_exchange_and_streams(supers, broker_url, tool):
    name = supers.name()
    assert supers.add(tool, name, partitions=2) == (0, "")
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        ch.exchange_declare(name, passive=True)
        ch.exchange_declare(name, "direct", durable=True, arguments={"x-super-stream": True})
        ch.exchange_declare(name, "direct", durable=True)      # exchange arguments are not compared
        for k in ("0", "1"):
            ok = ch.queue_declare(f"{name}-{k}", passive=True).method
            assert (ok.message_count, ok.consumer_count) == (0, 0)
            ch.queue_declare(f"{name}-{k}", durable=True,
                             arguments={"x-queue-type": "stream", "x-queue-leader-locator": "balanced"})
        assert refusal(lambda: conn.channel().queue_declare(f"{name}-0", durable=True,
                                                            arguments={"x-queue-type": "stream"})) == (
            "channel", 406, f"PRECONDITION_FAILED - inequivalent arg 'x-queue-leader-locator' for queue "
                            f"'{name}-0' in vhost '/': received none but current is the value 'balanced' of "
                            f"type 'longstr'")
        assert refusal(lambda: conn.channel().exchange_declare(name, "fanout", durable=True)) == (
            "channel", 406, f"PRECONDITION_FAILED - inequivalent arg 'type' for exchange '{name}' in vhost '/': "
                            f"received 'fanout' but current is 'direct'")
        assert refusal(lambda: conn.channel().queue_declare(f"{name}-2", passive=True))[1] == 404
    finally:
        safe_close(conn)


@pytest.mark.parametrize("tool", ["native", "cli"])
def test_publishing_to_the_exchange_routes_by_binding_key(supers, broker_url, tool):
    name = supers.name()
    assert supers.add(tool, name, binding_keys=["eu", "us", "ap"]) == (0, "")
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for key, n in (("eu", 3), ("us", 1), ("ap", 2)):    # mandatory and confirmed: each one routed
            for i in range(n):
                ch.basic_publish(name, key, f"{key}{i}".encode(), mandatory=True)
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish(name, "0", b"nowhere", mandatory=True)
        reader = conn.channel()
        reader.basic_qos(prefetch_count=10)
        got = {key: [] for key in ("eu", "us", "ap")}
        for key in got:
            reader.basic_consume(f"{name}-{key}", lambda _c, _m, _p, body, k=key: got[k].append(body),
                                 arguments={"x-stream-offset": "first"})
        wait_until(lambda: sum(map(len, got.values())) >= 6 or conn.process_data_events(0.05), 10,
                   message="6 deliveries")
        conn.process_data_events(0.3)
        assert got == {"eu": [b"eu0", b"eu1", b"eu2"], "us": [b"us0"], "ap": [b"ap0", b"ap1"]}
    finally:
        safe_close(conn)


@pytest.mark.parametrize("tool", ["native", "cli"])
def test_delete_removes_the_exchange_and_its_streams(supers, broker_url, tool):
    name = supers.name()
    assert supers.add(tool, name, partitions=3) == (0, "")
    assert supers.delete(tool, name) == (0, "")
    assert supers.held(name) == {"exchanges": [], "queues": [], "bindings": []}
    code, text = supers.delete(tool, name)
    assert code != 0 and "stream_not_found" in text


@pytest.mark.parametrize("tool", ["native", "cli"])
def test_refusals(supers, broker_url, tool):
    name = supers.name()
    assert supers.add(tool, name, partitions=1) == (0, "")
    code, text = supers.add(tool, name, partitions=1)
    assert code != 0 and f"there is already an exchange named {name}" in text
    # a stream of that name exists already: nothing is made
    other = supers.name()
    conn = pika_connect(broker_url)
    try:
        conn.channel().queue_declare(f"{other}-1", durable=True, arguments={"x-queue-type": "stream"})
        code, text = supers.add(tool, other, partitions=2)
        assert code != 0 and f"there is already a queue named {other}-1" in text
        assert supers.held(other)["exchanges"] == []
        assert refusal(lambda: conn.channel().queue_declare(f"{other}-0", passive=True))[1] == 404
        conn.channel().queue_delete(f"{other}-1")
    finally:
        safe_close(conn)
    code, text = supers.add(tool, supers.name(), partitions=2, binding_keys=["a", "b"])
    assert code != 0 and "Specify --partitions or --binding-keys, not both." in text


def test_embedded_super_stream_survives_a_restart(tmp_path):
    with Broker(data_dir=str(tmp_path)) as broker:
        assert broker.add_super_stream("orders", binding_keys="eu, us") == ["orders-eu", "orders-us"]
        conn = pika_connect(broker.url)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("orders", "us", b"one")
        safe_close(conn)
    with Broker(data_dir=str(tmp_path)) as broker:
        supers = SuperStreams(Target("embedded", "4.3"), broker, broker.url)
        assert supers.held("orders") == expected("orders", ["eu", "us"])
        conn = pika_connect(broker.url)
        assert conn.channel().queue_declare("orders-us", passive=True).method.message_count == 1
        safe_close(conn)
        broker.delete_super_stream("orders")
        assert supers.held("orders") == {"exchanges": [], "queues": [], "bindings": []}


def test_cli_usage_errors_exit_64_without_connecting():
    for args in (["add_super_stream", "x", "--partitions", "0"],
                 ["add_super_stream", "x", "--partitions", "2", "--binding-keys", "a"],
                 ["add_super_stream", "x", "--max-age", "1h"]):
        out = subprocess.run([*CLI, "--url", "amqp://guest:guest@127.0.0.1:1/%2F", *args], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 64, out.stderr
