"""Persistence (`--data-dir`): what survives a restart of the embedded broker, checked with real processes.

The broker runs as `python -m spark_amqp_broker --data-dir D` and is stopped with `kill -9` (nothing is
flushed on the way out) or SIGTERM (graceful), then started again on the same directory. What a user
sees is counted: every confirmed persistent message on a durable queue is there exactly once, acked ones
are gone, delivered-but-unacked ones come back with redelivered=true (as RabbitMQ's classic queues do),
transient messages, non-durable and exclusive queues are gone, durable exchanges and bindings route
again. A torn last journal record (truncated, or a flipped byte) is dropped with a WARNING.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pika
import pika.exceptions
import pytest

from spark_amqp_broker import Broker
from brokers import DataDirBroker
from helpers import pika_connect, queue_exists

PERSISTENT = pika.BasicProperties(delivery_mode=2)
TRANSIENT = pika.BasicProperties(delivery_mode=1)


@pytest.fixture
def brokers():
    started: list[DataDirBroker] = []

    def start(data_dir, *extra):
        b = DataDirBroker(data_dir, *extra)
        started.append(b)
        return b
    yield start
    for b in started:
        if b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(timeout=10)


def _get_all(ch, queue_name: str) -> list[tuple[bytes, bool]]:
    out = []
    while True:
        method, _props, body = ch.basic_get(queue_name, auto_ack=True)
        if method is None:
            return out
        out.append((body, method.redelivered))


@pytest.mark.parametrize("how", ["kill", "term"], ids=["kill-9", "sigterm"])
def test_restart_keeps_exactly_the_confirmed_persistent_messages(tmp_path, brokers, how):
    b = brokers(tmp_path / "data")
    conn = pika_connect(b.url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare("px", "direct", durable=True)
    ch.exchange_declare("px-transient", "fanout", durable=False)
    ch.queue_declare("pq", durable=True)
    ch.queue_bind("pq", "px", "k")
    ch.queue_bind("pq", "amq.topic", "t.#")
    ch.queue_declare("tq", durable=False)
    ch.queue_declare("xq", durable=True, exclusive=True)
    for i in range(200):   # each basic_publish returns once its confirm (basic.ack) has arrived
        ch.basic_publish("px", "k", b"p%d" % i, PERSISTENT)
    for i in range(50):
        ch.basic_publish("px", "k", b"t%d" % i, TRANSIENT)
        ch.basic_publish("", "tq", b"tq%d" % i, PERSISTENT)
        ch.basic_publish("", "xq", b"xq%d" % i, PERSISTENT)
    # a consumer acks p0..p19 and holds p20..p29 delivered, unacked
    cch = conn.channel()
    for i in range(30):
        method, _props, body = cch.basic_get("pq", auto_ack=False)
        assert body == b"p%d" % i
        if i < 20:
            cch.basic_ack(method.delivery_tag)
    cch.queue_declare("pq", passive=True)   # a round trip: the acks have been processed
    b.stop(how)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        conn.process_data_events(time_limit=0.5)

    b2 = brokers(tmp_path / "data")
    assert "WARNING" not in b2.log(), b2.log()
    conn2 = pika_connect(b2.url)
    ch2 = conn2.channel()
    assert not queue_exists(b2.url, "tq"), "a non-durable queue survived the restart"
    assert not queue_exists(b2.url, "xq"), "an exclusive queue survived the restart"
    got = _get_all(ch2, "pq")
    bodies = [body for body, _ in got]
    assert len(bodies) == len(set(bodies)), "duplicated after restart"
    assert bodies == [b"p%d" % i for i in range(20, 200)], (len(bodies), bodies[:5])
    redelivered = [body for body, flag in got if flag]
    assert redelivered == [b"p%d" % i for i in range(20, 30)]
    # durable exchange and bindings route again; the transient exchange is gone
    ch2.confirm_delivery()
    ch2.basic_publish("px", "k", b"again", PERSISTENT, mandatory=True)
    ch2.basic_publish("amq.topic", "t.x", b"topic", PERSISTENT, mandatory=True)
    assert [body for body, _ in _get_all(ch2, "pq")] == [b"again", b"topic"]
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        ch2.exchange_declare("px-transient", "fanout", passive=True)
    assert info.value.reply_code == 404
    conn2.close()


def _journal(data_dir) -> str:
    return os.path.join(data_dir, "journal.log")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_torn_last_record_is_dropped_with_a_warning(tmp_path, brokers, damage):
    data = tmp_path / "data"
    b = brokers(data)
    conn = pika_connect(b.url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("torn", durable=True)
    for i in range(10):
        ch.basic_publish("", "torn", b"m%d" % i, PERSISTENT)
    conn.close()
    b.stop("term")
    size = os.path.getsize(_journal(data))
    with open(_journal(data), "r+b") as fh:
        if damage == "truncate":
            fh.truncate(size - 1)      # the last record (m9) is missing its last body byte
        else:
            fh.seek(size - 1)
            last = fh.read(1)
            fh.seek(size - 1)
            fh.write(bytes([last[0] ^ 0xFF]))

    b2 = brokers(data)
    warnings = [line for line in b2.lines if "WARNING" in line]
    assert len(warnings) == 1, b2.log()
    assert "journal.log" in warnings[0] and ("CRC32" in warnings[0] if damage == "flip"
                                             else "written" in warnings[0]), warnings[0]
    conn2 = pika_connect(b2.url)
    assert [body for body, _ in _get_all(conn2.channel(), "torn")] == [b"m%d" % i for i in range(9)]
    conn2.close()
    b2.stop("term")
    b3 = brokers(data)      # the repaired journal starts clean
    assert "WARNING" not in b3.log(), b3.log()


def test_bad_data_dir_is_an_error_naming_it(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "spark_amqp_broker", "--port", "0", "--data-dir",
                           str(not_a_dir)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: data_dir: cannot use '{not_a_dir}'"), proc.stderr


def test_deleted_and_unbound_stay_gone_and_e2e_bindings_survive(tmp_path):
    """In process (Broker(data_dir=...)), stopped and started again: deletes and unbinds are journaled
    too, exchange-to-exchange bindings between durable exchanges come back, and a message requeued by a
    nack keeps its place."""
    data = str(tmp_path / "data")
    with Broker(data_dir=data) as b:
        conn = pika_connect(b.url)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("src", "fanout", durable=True)
        ch.exchange_declare("mid", "direct", durable=True)
        ch.exchange_declare("gone", "direct", durable=True)
        ch.exchange_bind("mid", "src")
        ch.queue_declare("kept", durable=True)
        ch.queue_declare("dropped", durable=True)
        ch.queue_bind("kept", "mid", "r")
        ch.queue_bind("kept", "amq.direct", "unbound")
        ch.queue_unbind("kept", "amq.direct", "unbound")
        ch.basic_publish("", "dropped", b"d", PERSISTENT)
        ch.queue_delete("dropped")
        ch.exchange_delete("gone")
        ch.basic_publish("src", "r", b"one", PERSISTENT)
        ch.basic_publish("src", "r", b"two", PERSISTENT)
        method, _p, _b = ch.basic_get("kept")
        ch.basic_nack(method.delivery_tag, requeue=True)
        ch.queue_declare("kept", passive=True)
        conn.close()
    with Broker(data_dir=data) as b:
        conn = pika_connect(b.url)
        ch = conn.channel()
        assert not queue_exists(b.url, "dropped")
        ch.confirm_delivery()
        ch.basic_publish("src", "r", b"three", PERSISTENT, mandatory=True)
        assert _get_all(ch, "kept") == [(b"one", True), (b"two", False), (b"three", False)]
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish("amq.direct", "unbound", b"x", PERSISTENT, mandatory=True)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            ch.exchange_declare("gone", "direct", passive=True)
        conn.close()


def test_second_broker_on_the_same_data_dir_is_refused(tmp_path, brokers):
    b = brokers(tmp_path / "data")
    proc = subprocess.run([sys.executable, "-m", "spark_amqp_broker", "--port", "0", "--data-dir",
                           str(tmp_path / "data")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: data_dir: '{tmp_path / 'data'}' is in use by another broker"), \
        proc.stderr
    assert b.proc.poll() is None


def test_journal_is_compacted_when_it_outgrows_the_live_data(tmp_path, monkeypatch):
    """Published and acked messages leave dead records behind; past COMPACT_FACTOR x the live bytes the
    journal is rewritten, so its size follows what is queued, not what went through."""
    from spark_amqp_broker import store
    monkeypatch.setattr(store, "COMPACT_MIN_BYTES", 64 << 10)
    data = str(tmp_path / "data")
    body = b"x" * 1000
    with Broker(data_dir=data) as b:
        conn = pika_connect(b.url)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("churn", durable=True)
        ch.basic_publish("", "churn", b"keep", PERSISTENT)
        for _ in range(1000):          # ~1 MB through the queue
            ch.basic_publish("", "churn", body, PERSISTENT)
        keep, _p, _b = ch.basic_get("churn")
        for _ in range(1000):
            method, _p, got = ch.basic_get("churn")
            assert got == body
            ch.basic_ack(method.delivery_tag)
        ch.basic_nack(keep.delivery_tag, requeue=True)
        ch.queue_declare("churn", passive=True)
        size = os.path.getsize(_journal(data))
        assert size < 4 * (64 << 10) + 20_000, size
        conn.close()
    with Broker(data_dir=data) as b:
        conn = pika_connect(b.url)
        assert _get_all(conn.channel(), "churn") == [(b"keep", True)]
        conn.close()


def test_confirms_follow_a_grouped_fsync(tmp_path, monkeypatch):
    """200 persistent publishes sent in one write: every one is confirmed, each body is in the journal by
    the time its confirm arrives, and far fewer fsyncs than messages were needed (group commit)."""
    from pamqp import commands, frame as pframe
    from pamqp.body import ContentBody
    from pamqp.header import ContentHeader
    from helpers import raw_handshake

    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    data = str(tmp_path / "data")
    with Broker(data_dir=data) as b:
        rc, _ = raw_handshake(b.url)
        rc.send(1, commands.Channel.Open())
        rc.read_method()
        rc.send(1, commands.Confirm.Select())
        rc.read_method()
        rc.send(1, commands.Queue.Declare(queue="grouped", durable=True))
        rc.read_method()
        before = len(fsyncs)
        burst = b""
        for i in range(200):
            body = b"g%03d" % i
            burst += (pframe.marshal(commands.Basic.Publish(routing_key="grouped"), 1)
                      + pframe.marshal(ContentHeader(0, len(body), commands.Basic.Properties(delivery_mode=2)), 1)
                      + pframe.marshal(ContentBody(body), 1))
        rc.send_bytes(burst)
        confirmed = 0
        while confirmed < 200:
            _ch, ack = rc.read_method()
            assert isinstance(ack, commands.Basic.Ack), ack
            confirmed = ack.delivery_tag
            with open(_journal(data), "rb") as fh:
                journal = fh.read()
            missing = [i for i in range(confirmed) if b"g%03d" % i not in journal]
            assert not missing, f"confirmed up to {confirmed} but not in the journal: {missing[:5]}"
        grouped = len(fsyncs) - before
        assert 1 <= grouped <= 50, grouped
        rc.close()


def _stream_read(ch, name: str, expect: int) -> list[tuple[int, bytes]]:
    """(x-stream-offset, body) of the first `expect` messages of stream `name` read from `first`, or of
    all there are (nothing more for 0.5 s)."""
    got: list[tuple[int, bytes]] = []
    ch.basic_qos(prefetch_count=1000)

    def on_message(c, method, props, body):
        got.append((props.headers["x-stream-offset"], body))
        c.basic_ack(method.delivery_tag)
    tag = ch.basic_consume(name, on_message, arguments={"x-stream-offset": "first"})
    deadline = time.monotonic() + 10
    idle_since = time.monotonic()
    while len(got) < expect and time.monotonic() < deadline and time.monotonic() - idle_since < 0.5:
        seen = len(got)
        ch.connection.process_data_events(time_limit=0.05)
        if len(got) != seen:
            idle_since = time.monotonic()
    ch.basic_cancel(tag)
    return got


@pytest.mark.parametrize("how", ["kill", "term"], ids=["kill-9", "sigterm"])
def test_stream_log_survives_with_its_offsets_and_retention(tmp_path, brokers, how):
    """A stream comes back with the same messages at the same offsets (chunk boundaries, the tracking
    offsets after each segment roll and what retention removed included), and appends continue after it."""
    b = brokers(tmp_path / "data")
    conn = pika_connect(b.url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("s1", durable=True, arguments={"x-queue-type": "stream",
                                                     "x-stream-max-segment-size-bytes": 2000,
                                                     "x-max-length-bytes": 6000})
    for i in range(60):
        ch.basic_publish("", "s1", b"s%03d" % i + b"." * 100, PERSISTENT)
    before = _stream_read(conn.channel(), "s1", 1000)   # attaching may roll a full segment first
    count = ch.queue_declare("s1", durable=True, passive=True).method.message_count
    assert before and before[0][0] > 0, "retention removed nothing: the test would not check it"
    b.stop(how)

    b2 = brokers(tmp_path / "data")
    assert "WARNING" not in b2.log(), b2.log()
    conn2 = pika_connect(b2.url)
    ch2 = conn2.channel()
    assert ch2.queue_declare("s1", durable=True, passive=True).method.message_count == count
    assert _stream_read(conn2.channel(), "s1", len(before)) == before
    ch2.confirm_delivery()
    ch2.basic_publish("", "s1", b"after", PERSISTENT)
    after = _stream_read(conn2.channel(), "s1", len(before) + 1)
    assert after[-1][1] == b"after" and after[-1][0] > before[-1][0]
    ch2.queue_delete("s1")
    conn2.close()
    assert os.listdir(tmp_path / "data" / "streams") == []


def test_torn_stream_log_is_cut_at_its_last_whole_chunk(tmp_path, brokers):
    data = tmp_path / "data"
    b = brokers(data)
    conn = pika_connect(b.url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("s2", durable=True, arguments={"x-queue-type": "stream"})
    for i in range(5):         # one confirm round trip per publish: one chunk each
        ch.basic_publish("", "s2", b"c%d" % i, PERSISTENT)
    conn.close()
    b.stop("kill")
    (log_file,) = (data / "streams").iterdir()
    with open(log_file, "r+b") as fh:
        fh.truncate(os.path.getsize(log_file) - 3)
    b2 = brokers(data)
    warnings = [line for line in b2.lines if "WARNING" in line]
    assert len(warnings) == 1 and log_file.name in warnings[0], b2.log()
    conn2 = pika_connect(b2.url)
    assert [body for _, body in _stream_read(conn2.channel(), "s2", 4)] == [b"c0", b"c1", b"c2", b"c3"]
    conn2.close()


def test_queues_from_a_definitions_file_keep_persistent_messages(tmp_path):
    """Durable queues a definitions file declares at start are journaled too (their messages survive),
    with data_dir given in the TOML file."""
    import json
    from spark_amqp_broker.config import BrokerConfig
    defs = tmp_path / "defs.json"
    defs.write_text(json.dumps({"queues": [{"name": "from-defs", "vhost": "/", "durable": True,
                                            "auto_delete": False, "arguments": {}}],
                                "permissions": [{"user": "guest", "vhost": "/", "configure": ".*",
                                                 "write": ".*", "read": ".*"}]}))
    toml = tmp_path / "broker.toml"
    toml.write_text(f'[broker]\nport = 0\ndata_dir = "{tmp_path / "data"}"\ndefinitions = "{defs}"\n')
    with Broker(config=BrokerConfig.from_toml(str(toml))) as b:
        conn = pika_connect(b.url)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "from-defs", b"kept", PERSISTENT)
        conn.close()
    with Broker(config=BrokerConfig.from_toml(str(toml))) as b:
        conn = pika_connect(b.url)
        assert _get_all(conn.channel(), "from-defs") == [(b"kept", False)]
        conn.close()


@pytest.mark.parametrize("version", ["3.10", "4.3"])
@pytest.mark.parametrize("how", ["kill", "term"], ids=["kill-9", "sigterm"])
def test_quorum_queue_keeps_every_message_and_its_counts(tmp_path, brokers, version, how):
    """A quorum queue keeps every confirmed message, transient ones too (RabbitMQ's quorum queues persist
    all), with the counts of the returns so far: a rejected message comes back at the head with them, one
    delivered and unacked at the stop comes back as from a consumer gone (counted, at the head)."""
    b = brokers(tmp_path / "data", "--rabbitmq-version", version)
    conn = pika_connect(b.url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("qq", durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 5})
    for i in range(5):
        ch.basic_publish("", "qq", b"m%d" % i, TRANSIENT if i % 2 else PERSISTENT)
    held = conn.channel()
    method, _props, body = held.basic_get("qq")
    assert body == b"m0"
    held.basic_reject(method.delivery_tag, requeue=True)      # m0: counted once, at the head
    held.basic_ack(held.basic_get("qq")[0].delivery_tag)       # m0 again: acked, gone
    held.basic_get("qq")                                        # m1: delivered, unacked at the stop
    held.queue_declare("qq", passive=True)                      # a round trip: all of it processed
    b.stop(how)

    b2 = brokers(tmp_path / "data", "--rabbitmq-version", version)
    assert "WARNING" not in b2.log(), b2.log()
    ch2 = pika_connect(b2.url).channel()
    ok = ch2.queue_declare("qq", durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 5})
    assert ok.method.message_count == 4
    got = []
    while True:
        method, props, body = ch2.basic_get("qq", auto_ack=True)
        if method is None:
            break
        got.append((body, method.redelivered, props.headers))
    first = {"x-acquired-count": 1, "x-delivery-count": 1} if version == "4.3" else {"x-delivery-count": 1}
    fresh = None if version == "4.3" else {"x-delivery-count": 0}
    assert got == [(b"m1", True, first), (b"m2", False, fresh), (b"m3", False, fresh), (b"m4", False, fresh)]
