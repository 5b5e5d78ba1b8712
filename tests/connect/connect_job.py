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


def main() -> None:
    with Broker(port=0) as broker:
        url = broker.url
        with Connection.open(url) as conn:
            ch = conn.channel()
            ch.queue_declare("in")
            ch.queue_declare("out")
            ch.confirm_select()
            for i in range(5):
                ch.publish("", "in", f"hello {i}".encode(), {"headers": {"n": i}})
            ch.wait_for_confirms(timeout=10)

        spark = (SparkSession.builder.remote("local[2]")
                 .config("spark.ui.enabled", "false").getOrCreate())
        print("session:", type(spark).__module__)
        if os.environ.get("REGISTER") == "1":
            from spark_amqp.datasource import AMQPDataSource
            spark.dataSource.register(AMQPDataSource)

        peek = spark.read.format("amqp").option("uri", url).option("queue", "in").load()
        rows = peek.selectExpr("CAST(body AS STRING) AS body", "CAST(headers['n'] AS INT) AS n").collect()
        assert sorted(r.n for r in rows) == [0, 1, 2, 3, 4], rows
        print("batch read:", len(rows), "rows")

        query = (spark.readStream.format("amqp").option("uri", url).option("queue", "in").load()
                 .selectExpr("upper(CAST(body AS STRING)) AS body", "'out' AS routing_key")
                 .writeStream.format("amqp").option("uri", url)
                 .option("checkpointLocation", tempfile.mkdtemp())
                 .trigger(availableNow=True).start())
        query.awaitTermination(180)
        assert query.exception() is None, query.exception()
        deadline = time.monotonic() + 30
        with Connection.open(url) as conn:
            ch = conn.channel()
            while ch.queue_declare("out", passive=True).message_count < 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            ch.basic_consume("out")
            got = []
            while len(got) < 5 and time.monotonic() < deadline:
                got += ch.get_deliveries(5, timeout=2)
            assert sorted(d.body for d in got) == [f"HELLO {i}".encode() for i in range(5)], got
            assert ch.queue_declare("in", passive=True).message_count == 0
        print("stream read and write:", len(got), "messages")
        spark.stop()
    print("CONNECT OK")


if __name__ == "__main__":
    main()
