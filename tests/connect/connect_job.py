"""Run by test_spark_connect.py in its own process (a Spark Connect session cannot share a process with the
suite's classic SparkSession): a read and a write through Spark Connect against the embedded broker.

Prints one line per check and "CONNECT OK" at the end."""

import os
import sys
import tempfile
import time

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from pyspark.sql import SparkSession  # noqa: E402

from spark_amqp.client import Connection  # noqa: E402
from spark_amqp_broker import Broker  # noqa: E402


def check(spark, url: str, tag: str) -> None:
    """A batch read and a streaming read -> write through the Connect session, on queues of their own."""
    source, target = f"in-{tag}", f"out-{tag}"
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.queue_declare(source)
        ch.queue_declare(target)
        ch.confirm_select()
        for i in range(5):
            ch.publish("", source, f"hello {i}".encode(), {"headers": {"n": i}})
        ch.wait_for_confirms(timeout=10)

    peek = spark.read.format("amqp").option("uri", url).option("queue", source).load()
    rows = peek.selectExpr("CAST(body AS STRING) AS body", "CAST(headers['n'] AS INT) AS n").collect()
    assert sorted(r.n for r in rows) == [0, 1, 2, 3, 4], rows
    print(f"{tag}: batch read:", len(rows), "rows")

    query = (spark.readStream.format("amqp").option("uri", url).option("queue", source).load()
             .selectExpr("upper(CAST(body AS STRING)) AS body", f"'{target}' AS routing_key")
             .writeStream.format("amqp").option("uri", url)
             .option("checkpointLocation", tempfile.mkdtemp())
             .trigger(availableNow=True).start())
    query.awaitTermination(180)
    assert query.exception() is None, query.exception()
    deadline = time.monotonic() + 30
    with Connection.open(url) as conn:
        ch = conn.channel()
        while ch.queue_declare(target, passive=True).message_count < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        ch.basic_consume(target)
        got = []
        while len(got) < 5 and time.monotonic() < deadline:
            got += ch.get_deliveries(5, timeout=2)
        assert sorted(d.body for d in got) == [f"HELLO {i}".encode() for i in range(5)], got
        assert ch.queue_declare(source, passive=True).message_count == 0
    print(f"{tag}: stream read and write:", len(got), "messages")


def main() -> None:
    """One Connect server (a start costs tens of seconds): first with the source as PySpark discovers it,
    then after registering it explicitly, as docs/source.md tells Connect users to."""
    with Broker(port=0) as broker:
        spark = (SparkSession.builder.remote("local[2]")
                 .config("spark.ui.enabled", "false").getOrCreate())
        print("session:", type(spark).__module__)
        check(spark, broker.url, "discovered")
        from spark_amqp.datasource import AMQPDataSource
        spark.dataSource.register(AMQPDataSource)
        check(spark, broker.url, "registered")
        spark.stop()
    print("CONNECT OK")


if __name__ == "__main__":
    main()
