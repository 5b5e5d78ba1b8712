"""`spark.read.format("amqp")`: what the queue holds now; by default the messages go back to the queue
(and come back redelivered), with ack=true they are removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pika
import pytest


def _read(spark, url, queue, **options):
    reader = spark.read.format("amqp").option("uri", url).option("queue", queue)
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load().collect()


def test_batch_read_returns_messages_to_the_queue_by_default(spark, env):
    q = env.queue("batchread")
    bodies = [f"r{i}".encode() for i in range(5)]
    env.publish(q, bodies, [pika.BasicProperties(message_id=str(i)) for i in range(5)])

    rows = _read(spark, env.url, q)
    assert sorted(bytes(r.body) for r in rows) == bodies
    assert {r.message_id for r in rows} == {str(i) for i in range(5)}
    assert {r.queue for r in rows} == {q}
    env.wait_state(q, (5, 0), timeout=10)          # returned to the queue

    rows = _read(spark, env.url, q)
    assert sorted(bytes(r.body) for r in rows) == bodies
    assert all(r.redelivered for r in rows), "messages returned by a read come back redelivered"
    env.wait_state(q, (5, 0), timeout=10)


def test_batch_read_does_not_deliver_before_it_reads(spark, env):
    """Nothing consumed these messages before the read: its rows must not be flagged redelivered (a
    planning step that consumes and gives back would flag them, and count as a delivery attempt)."""
    q = env.queue("batchfresh")
    env.publish(q, [f"f{i}" for i in range(3)])
    rows = _read(spark, env.url, q)
    assert len(rows) == 3
    assert [bytes(r.body) for r in rows if r.redelivered] == [], "the first read saw redelivered copies"


def test_batch_read_with_ack_removes_what_it_read(spark, env):
    q = env.queue("batchack")
    bodies = [f"a{i}".encode() for i in range(5)]
    env.publish(q, bodies)

    rows = _read(spark, env.url, q, ack="true", maxMessages=2)
    assert sorted(bytes(r.body) for r in rows) == bodies[:2]
    env.wait_state(q, (3, 0), timeout=10)

    rows = _read(spark, env.url, q, ack="true")
    assert sorted(bytes(r.body) for r in rows) == bodies[2:]
    env.wait_state(q, (0, 0), timeout=10)


def test_an_executor_reads_large_messages_in_record_batches_the_jvm_takes(env):
    """Executor side alone: 5,000 messages of 4 KB (20 MB) reach Spark's JVM as record batches of at most
    about JVM_BATCH_BYTES of bodies (the message that reaches it is a batch's last), every message once and
    in order, and go back to the queue after the read."""
    from spark_amqp.options import parse
    from spark_amqp.source.arrow_rows import JVM_BATCH_BYTES
    from spark_amqp.source.batch_reader import QueueBatchReader, QueueSlice
    q = env.queue("batchlarge")
    env.publish_bulk(q, [b"%05d" % i + b"x" * 4091 for i in range(5000)])
    reader = QueueBatchReader(parse({"uri": env.url, "queue": q}, "source"))
    batches = list(reader.read(QueueSlice(q, 5000)))
    sizes = [sum(len(b) for b in batch.column("body").to_pylist()) for batch in batches]
    assert len(batches) >= 2 and max(sizes) <= JVM_BATCH_BYTES + 4096, sizes
    bodies = [b for batch in batches for b in batch.column("body").to_pylist()]
    assert [b[:5] for b in bodies] == [b"%05d" % i for i in range(5000)]
    env.wait_state(q, (5000, 0), timeout=30)


def test_batch_read_of_an_empty_queue_is_empty(spark, env):
    q = env.queue("batchempty")
    assert _read(spark, env.url, q) == []


DISCOVERY = textwrap.dedent("""
    import json, os, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    url, queue = sys.argv[1:3]
    out = {}
    # No register call: PySpark must discover the `pyspark_amqp` module on its own.
    out["discovered"] = spark.read.format("amqp").option("uri", url).option("queue", queue).load().count()
    import spark_amqp
    spark_amqp.register(spark)
    out["registered"] = (spark.read.format("amqp").option("uri", url).option("queue", queue)
                         .option("ack", "true").load().count())
    print("RESULT " + json.dumps(out), flush=True)
    spark.stop()
""")


@pytest.mark.own_spark
def test_format_amqp_by_discovery_and_by_register_in_a_fresh_process(amqp_broker, tmp_path):
    """A fresh driver process, so nothing registered the source before format("amqp") is used."""
    with pika.BlockingConnection(pika.URLParameters(amqp_broker.url)) as conn:
        ch = conn.channel()
        ch.queue_declare("discovery")
        for i in range(3):
            ch.basic_publish("", "discovery", b"d%d" % i)
    script = tmp_path / "discovery.py"
    script.write_text(DISCOVERY)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, str(script), amqp_broker.url, "discovery"], capture_output=True,
                          text=True, timeout=180, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    assert json.loads(lines[0][7:]) == {"discovered": 3, "registered": 3}
