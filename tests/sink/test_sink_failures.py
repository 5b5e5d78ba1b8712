"""How the sink fails, on both brokers: bad schemas before any task runs, a returned mandatory message, a
nacked publish, and the broker connection cut in the middle of a micro-batch (the query fails, a restart
re-runs the batch, and no message the broker had confirmed is missing; deterministic ids let consumers
drop what the retry sent twice)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from proxies import Proxy
from sink_helpers import cut_sink_connections
from spark_amqp.pyspark_versions import ADMISSION_CONTROL   # PySpark >= 4.2
from waiting import wait_until


def write(df, url, **options):
    w = df.write.format("amqp").mode("append").option("uri", url)
    for k, v in options.items():
        w = w.option(k, v)
    w.save()


# ----------------------------------------------------------------------------------- bad schemas


@pytest.mark.parametrize("select, expected", [
    (["CAST(id AS STRING) AS body", "id AS extra", "'x' AS other"],
     "unknown column(s) for the amqp sink: 'extra', 'other'"),
    (["CAST(id AS STRING) AS body", "CAST(id AS STRING) AS priority"],
     "column 'priority' has type string, expected int"),
    (["id AS body"], "column 'body' has type bigint, expected binary or string"),
    (["map('a', 1) AS headers", "CAST(id AS STRING) AS body"],
     "column 'headers' has type map<string,int>, expected map<string,string>"),
    (["CAST(id AS STRING) AS routing_key"], "needs a column 'body' (binary or string)"),
])
def test_a_bad_schema_fails_the_write_before_anything_is_published(spark, broker_url, admin, unique_name,
                                                                   select, expected):
    queue = admin.queue(unique_name("schema"))
    df = spark.range(5).selectExpr(*select)
    with pytest.raises(Exception) as err:
        write(df, broker_url, routingKey=queue)
    assert expected in str(err.value)
    assert "guest:guest@" not in str(err.value)
    assert admin.depth(queue) == 0


def test_unknown_columns_can_be_ignored(spark, broker_url, admin, unique_name):
    queue = admin.queue(unique_name("ignore"))
    df = spark.range(5, numPartitions=1).selectExpr("CAST(id AS STRING) AS body", "id * 2 AS extra")
    write(df, broker_url, routingKey=queue, ignoreUnknownColumns="true")
    assert sorted(int(b) for _, _, b in admin.drain(queue)) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------ broker refusals


def test_bad_credentials_fail_the_task_without_showing_the_password(spark, broker_url, admin, unique_name):
    queue = admin.queue(unique_name("auth"))
    bad_url = broker_url.replace("guest:guest@", "guest:Wrong-Secret-42@")
    df = spark.range(3, numPartitions=1).selectExpr("CAST(id AS STRING) AS body")
    with pytest.raises(Exception) as err:
        write(df, bad_url, routingKey=queue)
    msg = str(err.value)
    assert "cannot open a publishing channel to amqp://guest:***@" in msg
    assert "403" in msg or "ACCESS_REFUSED" in msg or "access refused" in msg.lower()
    assert "Wrong-Secret-42" not in msg
    write(spark.range(0).selectExpr("CAST(id AS STRING) AS body"), bad_url, routingKey=queue)  # no rows: no connection
    assert admin.depth(queue) == 0


def test_mandatory_with_an_unroutable_key_fails_naming_exchange_and_key(spark, broker_url, admin, unique_name):
    exchange = admin.exchange(unique_name("ex"))
    queue = admin.queue(unique_name("bound"))
    admin.ch.queue_bind(queue, exchange, "routed")
    df = spark.range(6, numPartitions=1).selectExpr(
        "CAST(id AS STRING) AS body", "CASE WHEN id = 3 THEN 'nowhere' ELSE 'routed' END AS routing_key")

    with pytest.raises(Exception) as err:
        write(df, broker_url, exchange=exchange, mandatory="true")
    msg = str(err.value)
    assert "1 message(s) could not be routed and came back (mandatory=true): 312 NO_ROUTE" in msg
    assert f"exchange '{exchange}', routing key 'nowhere'" in msg
    assert sorted(int(b) for _, _, b in admin.drain(queue)) == [0, 1, 2, 4, 5]  # the routable ones arrived

    write(df, broker_url, exchange=exchange)   # without mandatory the broker drops it silently
    assert len(admin.drain(queue)) == 5


def test_a_nacked_publish_fails_the_write_with_a_clear_error(spark, broker_url, admin, unique_name):
    queue = admin.queue(unique_name("full"), {"x-max-length": 5, "x-overflow": "reject-publish"})
    df = spark.range(20, numPartitions=1).selectExpr("CAST(id AS STRING) AS body")
    with pytest.raises(Exception) as err:
        write(df, broker_url, routingKey=queue)
    msg = str(err.value)
    assert "the broker nacked 15 of 20 message(s) published to exchange '' (the default exchange)" in msg
    assert "x-overflow=reject-publish" in msg
    assert admin.depth(queue) == 5


# -------------------------------------------------------------------------------- connection cut


@pytest.mark.parametrize("cut_by", ["network", "broker"])
def test_connection_cut_mid_batch_loses_no_confirmed_message(spark, broker_url, broker_kind, node_version, request,
                                                             admin, unique_name, tmp_path, cut_by):
    """The sink publishes through a slow link (a rate-limited `proxies.Proxy`); while both tasks of the batch
    are publishing, the link is cut (`network`: both sockets reset) or the broker closes the sink's
    connections (`broker`: the embedded broker aborts them through its core; RabbitMQ: `rabbitmqctl
    close_connection`, 320 CONNECTION_FORCED, for the sink's two connections only). The query fails with the
    sink's error; restarted from its checkpoint it re-runs the batch with the same message ids; afterwards
    every row is in the queue, and every message the failed task reported as confirmed is there too."""
    queue = admin.queue(unique_name("cut"))
    src, chk = tmp_path / "in", tmp_path / "chk"
    src.mkdir()
    per_file = 10_000
    for f in range(2):   # two files: two partitions, two tasks
        (src / f"{f}.csv").write_text("".join(f"{n}\n" for n in range(f * per_file, (f + 1) * per_file)))

    def start(url):
        rows = spark.readStream.schema("n long").csv(str(src)).selectExpr("CAST(n AS STRING) AS body")
        # PySpark 4.0/4.1 print the sink's options in a failed query's error: there docs/source.md says to pass
        # the URI as `url` (or the password as `password`), which Spark's default redaction hides.
        uri_key = "uri" if ADMISSION_CONTROL else "url"
        return (rows.writeStream.format("amqp").option(uri_key, url).option("routingKey", queue)
                .option("messageId", "deterministic").option("checkpointLocation", str(chk))
                .option("confirmTimeout", "20").trigger(availableNow=True).start())

    link = Proxy.to(broker_url, rate=50_000)   # about 700 messages/s per connection: 10,000 take 15 s
    q = None
    try:
        q = start(link.url_for(broker_url))
        wait_until(lambda: admin.depth(queue) >= 500, 60, message="the first published messages")
        wait_until(lambda: link.connections == 2, 10, message="both tasks publishing")
        if cut_by == "network":
            link.cut()
        else:
            broker = request.getfixturevalue("amqp_broker") if broker_kind == "embedded" else None
            assert cut_sink_connections(broker, q.id, node_version or "3.10") == 2
        with pytest.raises(Exception) as failed:   # StreamingQueryException
            q.awaitTermination(60)
    finally:
        link.cut()
        if q is not None:
            q.stop()
    error = str(failed.value)
    assert "failed while publishing" in error, error[:2000]
    if cut_by == "broker" and broker_kind != "embedded":
        assert "320 CONNECTION_FORCED - cut by the sink tests" in error
    assert "guest:guest@" not in error
    confirmed = re.search(r"\(batch 0, partition (\d+), attempt \d+\).*?(\d+) message\(s\) published in this "
                          r"task, (\d+) of them confirmed", error, re.S)
    assert confirmed, error[:2000]
    partition, reported = int(confirmed.group(1)), int(confirmed.group(3))
    assert reported > 0

    first = admin.drain(queue)
    first_ids = Counter(p.message_id for _, p, _ in first)
    from_that_task = sum(c for i, c in first_ids.items() if i.startswith(f"{q.id}:0:{partition}:"))
    assert from_that_task >= reported, "a message the broker had confirmed is missing"
    assert 500 <= len(first) < 2 * per_file

    q2 = start(broker_url)   # restart from the checkpoint, straight to the broker: batch 0 runs again
    assert q2.awaitTermination(90) and q2.exception() is None, q2.exception()
    second = admin.drain(queue)
    bodies_by_id = {}
    for _, props, body in first + second:
        assert bodies_by_id.setdefault(props.message_id, body) == body, "one id, two different messages"
    assert sorted(int(b) for b in bodies_by_id.values()) == list(range(2 * per_file))
    assert len(second) == 2 * per_file                        # the retry published the whole batch again
    assert set(first_ids) <= {p.message_id for _, p, _ in second}   # same ids: the duplicates can be dropped
