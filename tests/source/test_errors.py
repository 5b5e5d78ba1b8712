"""Bad options and bad brokers fail the query at its start with an error that says what is wrong, and the
password never shows: not in errors, not in plans, not in progress reports.

Option errors do not depend on the broker, so they run against the embedded broker only, with a user
whose password (`SECRET`) is easy to search for; broker errors run against both brokers.
"""

from __future__ import annotations

import urllib.parse

import pytest

from brokers import free_port
from source_helpers import SECRET, checkpoint, stream
from waiting import wait_until

ERROR_WAIT = 30


def start_error(spark, tmp_path, options: dict, trigger: dict | None = None) -> str:
    """Start a query with `options`; return the text of the error it fails with (fail if it does not)."""
    from pyspark.errors import PySparkException
    from py4j.protocol import Py4JJavaError

    try:
        reader = spark.readStream.format("amqp")
        for k, v in options.items():
            reader = reader.option(k, v)
        query = (reader.load().writeStream.format("noop")
                 .option("checkpointLocation", checkpoint(tmp_path))
                 .trigger(**(trigger or {"processingTime": "200 milliseconds"})).start())
        ended = query.awaitTermination(ERROR_WAIT)
    except (PySparkException, Py4JJavaError, ValueError) as exc:
        return str(exc)
    if not ended:
        query.stop()
        pytest.fail(f"the query with options {options} ran for {ERROR_WAIT} s without failing")
    pytest.fail(f"the query with options {options} ended without an error")


def _secret_free(text: str) -> None:
    assert SECRET not in text, f"the password appears in:\n{text}"
    assert urllib.parse.quote(SECRET) not in text


@pytest.mark.parametrize("options, must_mention", [
    ({"bogus": "1"}, ["bogus", "unknown option"]),
    ({"uri": f"amqpx://spy:{SECRET}@127.0.0.1:5672/%2F"}, ["'uri'", "amqp://"]),
    ({"uri": f"amqp://spy:{SECRET}@127.0.0.1:notaport/%2F"}, ["'uri'"]),
    ({"prefetch": "-5"}, ["'prefetch'", "-5", "positive integer"]),
    ({"prefetch": "0"}, ["'prefetch'", "positive integer"]),
    ({"maxMessagesPerTrigger": "lots"}, ["'maxMessagesPerTrigger'", "lots", "positive integer"]),
    ({"startingOffsets": "earliest"}, ["'startingOffsets'", "queueType=stream"]),
    ({"queueType": "stream", "startingOffsets": "first"}, ["'startingOffsets'", "first", "earliest", "latest"]),
    ({"queueType": "stream", "startingOffsets": '{"other": 5}'}, ["'startingOffsets'", "other", "events"]),
    ({"queueType": "fancy"}, ["'queueType'", "fancy", "classic", "quorum"]),
    ({"declare": "maybe"}, ["'declare'", "maybe", "none", "passive", "declare"]),
    ({"queueArguments": "[1, 2]"}, ["'queueArguments'", "JSON object"]),
    ({"bindingKeys": "a.b"}, ["'bindingKeys'", "'exchange'"]),
    ({"queue": None}, ["'queue'", "required"]),
    ({"queue": "a,a"}, ["'queue'", "twice"]),
    ({"maxBytesPerTrigger": "64MB"}, ["'maxBytesPerTrigger'", "64MB", "positive integer"]),
    ({"queueType": "stream", "handoffPath": "/tmp/h"}, ["'handoffPath'", "/tmp/h", "queue mode only"]),
    ({"handoff": "files"}, ["'handoff'", "files", "auto", "inline"]),
    ({"handoff": "inline", "handoffPath": "/tmp/h"}, ["'handoff'", "inline", "handoffPath", "/tmp/h"]),
    ({"ackAt": "journal"}, ["'ackAt'", "journal", "journalPath"]),
    ({"ackAt": "read", "journalPath": "/tmp/j"}, ["'ackAt'", "read", "journal", "commit"]),
], ids=["unknown", "uri-scheme", "uri-port", "prefetch-negative", "prefetch-zero", "maxMessagesPerTrigger",
        "startingOffsets-queue-mode", "startingOffsets-bad", "startingOffsets-unknown-stream", "queueType-unknown",
        "declare", "queueArguments", "bindingKeys-without-exchange", "queue-missing", "queue-twice",
        "maxBytesPerTrigger", "handoffPath-stream-mode", "handoff-unknown", "handoff-inline-with-handoffPath",
        "ackAt-without-journalPath", "ackAt-unknown"])
def test_bad_option_fails_at_start_naming_it(spark, secret_broker, tmp_path, options, must_mention):
    opts = {"uri": secret_broker.secret_url, "queue": "events", **options}
    opts = {k: v for k, v in opts.items() if v is not None}
    text = start_error(spark, tmp_path, opts)
    for word in must_mention:
        assert word in text, f"the error does not mention {word!r}:\n{text[:2000]}"
    _secret_free(text)


def test_missing_uri_is_named(spark, tmp_path):
    text = start_error(spark, tmp_path, {"queue": "events"})
    assert "'uri'" in text and "required" in text, text[:2000]


def _with_password(url: str, password: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def test_unreachable_broker_is_a_clear_error(spark, tmp_path):
    port = free_port()
    text = start_error(spark, tmp_path, {"uri": f"amqp://guest:{SECRET}@127.0.0.1:{port}/%2F",
                                         "queue": "events", "connectTimeout": "3"})
    assert "cannot reach" in text and f"127.0.0.1:{port}" in text, text[:2000]
    _secret_free(text)


@pytest.mark.parametrize("trigger", [{"processingTime": "200 milliseconds"}, {"availableNow": True}],
                         ids=["processingTime", "availableNow"])
def test_missing_queue_is_a_clear_error(spark, env, tmp_path, trigger):
    missing = env._unique("missing")
    text = start_error(spark, tmp_path, {"uri": env.url, "queue": missing}, trigger)
    assert missing in text and "not found" in text, text[:2000]


def test_refused_credentials_are_a_clear_error(spark, env, tmp_path):
    text = start_error(spark, tmp_path, {"uri": _with_password(env.url, SECRET), "queue": "events"})
    assert "refused the credentials" in text, text[:2000]
    _secret_free(text)


def _publish_one(broker, queue: str) -> None:
    import pika

    with pika.BlockingConnection(pika.URLParameters(broker.url)) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"x")


def _plan_of(df, capsys) -> str:
    capsys.readouterr()
    df.explain(True)
    plan = capsys.readouterr().out
    assert "amqp" in plan
    return plan


def test_password_option_is_not_in_the_dataframe_plan(spark, secret_broker, capsys):
    """`df.explain()` prints the source's options; Spark redacts an option named `password`."""
    url = f"amqp://spy@{secret_broker.host}:{secret_broker.port}/%2F"
    df = (spark.readStream.format("amqp").option("uri", url).option("password", SECRET)
          .option("queue", "plans").load())
    _secret_free(_plan_of(df, capsys))


def test_url_alias_is_not_in_the_dataframe_plan(spark, secret_broker, capsys):
    """Spark's default spark.sql.redaction.options.regex is "(?i)url": the `url` alias is redacted."""
    df = spark.readStream.format("amqp").option("url", secret_broker.secret_url).option("queue", "plans").load()
    _secret_free(_plan_of(df, capsys))


def test_uri_is_not_in_the_dataframe_plan_after_register(spark, secret_broker, capsys):
    """Spark redacts `uri` once spark_amqp.register(spark) has added it to the redaction regex."""
    import spark_amqp

    spark_amqp.register(spark)
    assert "uri" in spark.conf.get("spark.sql.redaction.options.regex")
    _secret_free(_plan_of(stream(spark, secret_broker.secret_url, "plans"), capsys))


def test_password_is_not_in_a_running_query_plan_or_progress(spark, secret_broker, tmp_path, capsys):
    _publish_one(secret_broker, "plans")
    query = (stream(spark, secret_broker.secret_url, "plans").writeStream.format("noop")
             .option("checkpointLocation", checkpoint(tmp_path))
             .trigger(processingTime="200 milliseconds").start())
    wait_until(lambda: any(p["numInputRows"] for p in query.recentProgress) or query.exception(), 60,
               interval=0.1, message="a batch")
    capsys.readouterr()
    query.explain(True)
    running_plan = capsys.readouterr().out
    assert "amqp" in running_plan
    _secret_free(running_plan)
    _secret_free(str(query.recentProgress) + str(query.status) + str(query.lastProgress))
    query.stop()


def test_password_is_not_in_a_failed_query_error(spark, secret_broker, tmp_path):
    text = start_error(spark, tmp_path, {"uri": secret_broker.secret_url, "queue": "no-such-queue"})
    assert "no-such-queue" in text
    _secret_free(text)


@pytest.mark.parametrize("reader", ["readStream", "read"])
def test_a_bad_option_fails_load_itself_with_a_short_message(spark, secret_broker, reader):
    """Where the user looks: `load()` raises (not the query, seconds later), the text names the option
    (Spark hands options over lowercased), suggests the one meant, and is short."""
    df_reader = getattr(spark, reader).format("amqp").option("uri", secret_broker.secret_url)
    with pytest.raises(Exception) as err:
        df_reader.option("queue", "events").option("maxOffsetsPerTrigger", "5").load()
    text = str(err.value)
    assert "maxoffsetspertrigger" in text.lower() and "Did you mean 'maxMessagesPerTrigger'?" in text, text
    assert len(text) < 1200, f"{len(text)} characters:\n{text}"
    _secret_free(text)


def test_a_queue_deleted_under_a_running_query_fails_it_naming_queue_and_vhost(spark, env, tmp_path):
    """The broker cancels the consumer; the source reconnects and finds the queue gone: that fails the query
    (with declare=passive, the default) instead of running empty batches for ever."""
    from source_helpers import Collector

    q = env.queue("deleted")
    env.publish(q, ["before"])
    sink = Collector()
    query = (stream(spark, env.url, q).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds")
             .start())
    wait_until(lambda: sink.rows or query.exception(), 60, interval=0.1, message="the first row")
    env.channel().queue_delete(q)
    wait_until(lambda: not query.isActive, 30, interval=0.2, message="the query to fail")
    text = str(query.exception())
    assert q in text and "vhost '/'" in text and "not found" in text, text[:2000]
