"""RabbitMQ's consumer timeout under a query whose triggers are longer than it: the broker takes back
deliveries the source holds unacked, and the source must never read them again silently.

The brokers: RabbitMQ 3.10 (the session's second 3.10 node, `rabbitmq_tls`, reached on its plain listener,
with `consumer_timeout` and `channel_tick_interval` set at run time and restored: the shared node's would
reach every other test's channels), where the timeout closes the channel (406); RabbitMQ 4.3 and the
embedded broker (as 4.3, its default), where only quorum queues time out (here by the queue argument
`x-consumer-timeout`) and the broker cancels the consumer. A publisher adds 20 messages/s throughout, as in production; the trigger is 7 s, the timeout 3 s.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from brokers import require_rabbitmq
from source_helpers import Collector, ConfirmedPublisher, Env, checkpoint, run_available_now, stream
from spark_amqp.pyspark_versions import ADMISSION_CONTROL
from waiting import wait_until

TIMEOUT_MS = 3000
TRIGGER = "7 seconds"


@pytest.fixture(params=["embedded", "rabbitmq", "rabbitmq4"])
def timing_out(request, unique_name):
    """(Env, queue) on a broker whose consumer timeout is TIMEOUT_MS for that queue."""
    if request.param == "rabbitmq":
        node = request.getfixturevalue("rabbitmq_tls")
        env = Env(node.tcp_url, "rabbitmq", None, unique_name)
        node.ctl("eval", f"application:set_env(rabbit, consumer_timeout, {TIMEOUT_MS}).")
        node.ctl("eval", "application:set_env(rabbit, channel_tick_interval, 1000).")
        try:
            yield env, env.queue("timeout")
        finally:
            node.ctl("eval", "application:set_env(rabbit, consumer_timeout, 1800000).")
            node.ctl("eval", "application:set_env(rabbit, channel_tick_interval, 60000).")
            env.cleanup()
    else:
        if request.param == "embedded":
            broker = request.getfixturevalue("amqp_broker")
            env = Env(broker.url, "embedded", broker, unique_name)
        else:
            env = Env(require_rabbitmq("4.3"), "rabbitmq4", None, unique_name, version="4.3")
        try:
            yield env, env.quorum_queue("timeout", **{"x-consumer-timeout": TIMEOUT_MS})
        finally:
            env.cleanup()


def _timeouts_in_progress(query) -> int:
    """How many consumer timeouts the source reported in the query's progress (PySpark 4.2+)."""
    seen = 0
    for p in query.recentProgress:
        latest = json.loads(p["sources"][0]["latestOffset"] or "null") or {}
        seen = max(seen, (latest.get("consumerTimeouts") or {}).get("count", 0))
    return seen


def _ids(bodies) -> Counter:
    return Counter(int(b.decode()[1:]) for b in bodies)


def test_a_trigger_longer_than_the_timeout_fails_the_query_saying_why(spark, timing_out, tmp_path):
    """Without a journal (onConsumerTimeout=fail, the default) the query fails with the cause and the fixes;
    drained afterwards, nothing is lost and no message was read more than twice."""
    env, q = timing_out
    chk = checkpoint(tmp_path)
    publisher = ConfirmedPublisher(env.url, q, total=10_000, pause=0.05)
    publisher.start()
    first = Collector()
    query = (stream(spark, env.url, q).writeStream.foreachBatch(first).option("checkpointLocation", chk)
             .trigger(processingTime=TRIGGER).start())
    try:
        wait_until(lambda: query.exception() is not None, 60, interval=0.2, message="the query to fail")
    finally:
        publisher.stop()
    text = str(query.exception())
    for words in ("timed out", "consumer timeout", "journalPath", "trigger interval", "consumerTimeout",
                  "onConsumerTimeout=continue"):
        assert words in text, f"{words!r} not in the query's error: {text}"

    second = Collector()
    run_available_now(lambda: stream(spark, env.url, q).writeStream.foreachBatch(second)
                      .option("checkpointLocation", chk).trigger(availableNow=True).start(), timeout=90)
    seen = _ids(first.bodies() + second.bodies())
    lost = [i for i in publisher.confirmed if not seen[i]]
    assert not lost, f"lost {len(lost)} of {len(publisher.confirmed)}: {lost[:10]}"
    assert max(seen.values()) <= 2, f"read more than twice: {[i for i, n in seen.items() if n > 2][:10]}"
    assert env.channel().queue_declare(q, passive=True).method.message_count == 0


def _read_while_publishing(spark, env, q, tmp_path, **options):
    """A 7 s-trigger query over `q` while the publisher adds 20 messages/s, until three batches with rows
    and every confirmed message are in; returns (query, ids read and how often) with the query running."""
    publisher = ConfirmedPublisher(env.url, q, total=10_000, pause=0.05)
    publisher.start()
    sink = Collector()
    query = (stream(spark, env.url, q, **options).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime=TRIGGER).start())
    try:
        wait_until(lambda: len([b for b in sink.batches.values() if b]) >= 3 or query.exception(), 90,
                   interval=0.2, message="three batches with rows")
    finally:
        publisher.stop()
    confirmed = set(publisher.confirmed)
    wait_until(lambda: confirmed <= set(_ids(sink.bodies())) or query.exception(), 60, interval=0.2,
               message="every published message")
    assert query.exception() is None, query.exception()
    return query, _ids(sink.bodies())


def test_with_a_journal_a_timeout_costs_nothing(spark, timing_out, tmp_path):
    """With journalPath each batch is acked at its journal write; what the broker still takes back (received
    between triggers) is read once: the query goes on, pauses its consumers between triggers from then on,
    and loses nothing and reads nothing twice."""
    env, q = timing_out
    query, seen = _read_while_publishing(spark, env, q, tmp_path, journalPath=str(tmp_path / "journal"))
    if ADMISSION_CONTROL:
        timeouts = _timeouts_in_progress(query)
        assert timeouts >= 1, "the broker never timed the consumer out: nothing was tested"
        # From the first timeout on, the consumers pause between triggers: the broker has nothing to time
        # out again (a source that went on consuming was timed out at every trigger, and fell behind).
        assert timeouts <= 2, f"the broker timed the consumer out {timeouts} times"
    query.stop()
    assert max(seen.values()) == 1, f"read twice: {[i for i, n in seen.items() if n > 1][:10]}"


def test_consumer_timeout_option_outlasts_a_quorum_queues_timeout_on_rabbitmq_4(spark, unique_name, tmp_path):
    """consumerTimeout (the consumer argument x-consumer-timeout) takes precedence over the queue's own
    3 s on RabbitMQ 4.3: triggers of 7 s run without a timeout, each message read once."""
    env = Env(require_rabbitmq("4.3"), "rabbitmq4", None, unique_name, version="4.3")
    try:
        q = env.quorum_queue("timeout", **{"x-consumer-timeout": TIMEOUT_MS})
        query, seen = _read_while_publishing(spark, env, q, tmp_path, consumerTimeout=120_000)
        if ADMISSION_CONTROL:
            assert _timeouts_in_progress(query) == 0
        query.stop()
        assert max(seen.values()) == 1, f"read twice: {[i for i, n in seen.items() if n > 1][:10]}"
    finally:
        env.cleanup()


def test_consumer_timeout_option_on_a_classic_queue_of_rabbitmq_4_fails_naming_it(spark, unique_name, tmp_path):
    """RabbitMQ 4.x refuses x-consumer-timeout for a classic queue (whose consumers it never times out)."""
    env = Env(require_rabbitmq("4.3"), "rabbitmq4", None, unique_name, version="4.3")
    try:
        q = env.queue("classic")
        query = (stream(spark, env.url, q, consumerTimeout=60_000).writeStream.format("noop")
                 .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="1 second").start())
        wait_until(lambda: query.exception() is not None, 60, interval=0.2, message="the query to fail")
        text = str(query.exception())
        assert "option 'consumerTimeout'" in text and "60000" in text and "quorum" in text, text
    finally:
        env.cleanup()


@pytest.mark.parametrize("broker_url", ["embedded"], indirect=True)
def test_triggers_far_apart_hold_nothing_between_them(spark, env, tmp_path):
    """Between triggers 10 s or more apart the source stops its consumers: what arrives waits in the queue
    (ready), not in the source (unacked), and the next trigger reads it."""
    q = env.queue("apart")
    env.publish(q, [f"a{i}" for i in range(10)])
    sink = Collector()
    query = (stream(spark, env.url, q).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="11 seconds").start())
    wait_until(lambda: len(sink.rows) >= 10 or query.exception(), 60, interval=0.1, message="the first rows")
    # Spark aligns processing-time triggers to the clock, so the first two may come closer than 11 s; the c
    # rows come with a trigger at least the second after that, 11 s after the one before it.
    env.publish(q, [f"b{i}" for i in range(5)])
    wait_until(lambda: len(sink.rows) >= 15 or query.exception(), 30, interval=0.1, message="the b rows")
    env.publish(q, [f"c{i}" for i in range(5)])
    wait_until(lambda: len(sink.rows) >= 20 or query.exception(), 30, interval=0.1, message="the c rows")
    env.publish(q, [f"d{i}" for i in range(5)])
    time.sleep(1.0)
    ready, unacked = env.state(q)
    assert ready == 5, (f"between triggers far apart the queue held {ready} ready, {unacked} unacked: the source "
                        "took deliveries to hold until the next trigger")
    wait_until(lambda: len(sink.rows) >= 25 or query.exception(), 30, interval=0.1, message="the d rows")
    assert query.exception() is None, query.exception()
    query.stop()
    assert sorted(sink.bodies()) == sorted(f"{p}{i}".encode() for p, n in (("a", 10), ("b", 5), ("c", 5), ("d", 5))
                                           for i in range(n))
