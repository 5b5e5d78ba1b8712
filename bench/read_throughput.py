"""Read throughput: `spark.readStream.format("amqp")` against a plain pika consumer, same broker, same run.

For each broker (the embedded one in its own process, and RabbitMQ at 127.0.0.1:5672):
  1. preload N messages of S bytes into a fresh queue (pika, confirms);
  2. (a) drain it with a plain pika consumer: prefetch 1,000, basic.ack(multiple) every 100;
  3. preload again; (b) drain it with `spark.readStream.format("amqp")` under `trigger(availableNow=True)`
     into the `noop` sink, timed end to end (query start to termination);
  4. preload again; (c) drain it with our AMQP client alone (no Spark), as the source's driver consumes:
     the rate the broker delivers to a fast consumer, which bounds what the source can reach;
  5. with --journal, preload again; (d) as (b) with the option `journalPath` (a local directory): the
     journal's cost is d/b;
and print msg/s for each, the ratio b/a and c/a, plus the peak resident memory of the driver-side Python
process that runs the source (bounded by prefetch and batch size, not by the backlog).

    python bench/read_throughput.py [--messages 1000000] [--size 100] [--skip-rabbitmq] [--journal]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_vs_rabbitmq import (Consumer, Publisher, Target, declare_queue, delete_queue,  # noqa: E402
                                queue_depth, start_embedded, stop_embedded)
from socket_bytes import Sampler  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
WARM_UP_MESSAGES = 100_000


class PeakRSS(Sampler):
    """Samples the RSS of the JVM's Python child that runs the streaming source (driver side)."""

    MARKER = "python_streaming_source_runner"

    def __init__(self):
        super().__init__(0.2)
        self.peak = 0

    def take(self):
        for p in psutil.Process().children(recursive=True):
            try:
                if any(self.MARKER in part for part in p.cmdline()):
                    self.peak = max(self.peak, p.memory_info().rss)
            except psutil.Error:
                pass


def start_targets(args) -> tuple:
    """A local[2] SparkSession, the embedded broker in its own process, and the brokers to measure
    (--skip-embedded, --skip-rabbitmq): (spark, broker process, embedded Target, [Target, ...])."""
    spark = start_spark()
    proc, embedded = start_embedded(Path(tempfile.mkdtemp()) / "broker.log")
    targets = [] if args.skip_embedded else [embedded]
    if not args.skip_rabbitmq:
        targets.append(Target("rabbitmq", RABBITMQ_URL))
    return spark, proc, embedded, targets


def preload(url: str, queue: str, n: int, size: int) -> None:
    Publisher(url, queue, n, size, 1000, 600).run()
    depth = queue_depth(url, queue)
    if depth != n:
        raise SystemExit(f"preload: expected {n} messages in {queue}, found {depth}")


def pika_drain(url: str, queue: str, n: int, size: int) -> float:
    c = Consumer(url, queue, n, size, 1000, 100, 600)
    c.run()
    return n / (c.t1 - c.t0)


def client_drain(url: str, queue: str, n: int) -> float:
    """The ceiling: our AMQP client alone (no Spark) drains the queue as the source's driver does (manual
    acks, basic.ack multiple per 25,000), with the same prefetch per channel as the source's default."""
    from spark_amqp.client import Connection
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.basic_qos(50_000)
        ch.basic_consume(queue)
        got, t0 = 0, time.perf_counter()
        while got < n:
            batch = ch.get_deliveries(25_000, timeout=10)
            if not batch:
                raise SystemExit(f"client drain: stalled after {got} of {n} messages")
            got += len(batch)
            ch.basic_ack(batch[-1].delivery_tag, multiple=True)
        return n / (time.perf_counter() - t0)


def spark_drain(spark, url: str, queue: str, n: int, prefetch: int | None = None,
                journal: bool = False) -> tuple[float, int]:
    checkpoint = tempfile.mkdtemp(prefix="bench-read-")
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        reader = spark.readStream.format("amqp").option("uri", url).option("queue", queue)
        if prefetch:
            reader = reader.option("prefetch", prefetch)
        if journal:
            reader = reader.option("journalPath", tempfile.mkdtemp(prefix="bench-journal-"))
        q = (reader.load().writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
        q.awaitTermination()
        seconds = time.perf_counter() - t0
    rows = sum(p["numInputRows"] for p in q.recentProgress)
    if rows < n:
        raise SystemExit(f"spark read {rows} rows, expected {n}")
    return n / seconds, rss.peak


def start_spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[2]").appName("bench-read")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--skip-rabbitmq", action="store_true")
    p.add_argument("--skip-embedded", action="store_true")
    p.add_argument("--prefetch", type=int, default=None, help="the source's prefetch option (default: its own)")
    p.add_argument("--journal", action="store_true", help="also measure the source with journalPath")
    args = p.parse_args(argv)

    spark, proc, embedded, targets = start_targets(args)
    # Warm-up: the first query of a session pays for class loading, and the first ~100,000 rows through
    # the JVM for compiling its Arrow-to-row path (about 1 s); a query that has been running is past both.
    results = {}
    try:
        warm = declare_queue(embedded.url)
        preload(embedded.url, warm, WARM_UP_MESSAGES, args.size)
        spark_drain(spark, embedded.url, warm, WARM_UP_MESSAGES)
        for t in targets:
            queue = declare_queue(t.url)
            try:
                preload(t.url, queue, args.messages, args.size)
                a = pika_drain(t.url, queue, args.messages, args.size)
                preload(t.url, queue, args.messages, args.size)
                b, peak = spark_drain(spark, t.url, queue, args.messages, args.prefetch)
                preload(t.url, queue, args.messages, args.size)
                c = client_drain(t.url, queue, args.messages)
                d = None
                if args.journal:
                    preload(t.url, queue, args.messages, args.size)
                    d, _ = spark_drain(spark, t.url, queue, args.messages, args.prefetch, journal=True)
                results[t.name] = (a, b, peak, c, d)
                print(f"{t.name:<9} pika {a:>10,.0f} msg/s   spark {b:>10,.0f} msg/s   ratio b/a {b / a:.2f}   "
                      f"source process peak RSS {peak / 2**20:,.0f} MB   (our client alone, no Spark: "
                      f"{c:,.0f} msg/s, {c / a:.2f} x pika)"
                      + (f"   with journalPath {d:,.0f} msg/s, {d / b:.2f} x without" if d else ""), flush=True)
            finally:
                delete_queue(t.url, queue)
    finally:
        stop_embedded(proc)
        spark.stop()
    line = "; ".join(f"{name}: pika {a:,.0f} msg/s, spark {b:,.0f} msg/s, ratio {b / a:.2f}, "
                     f"source RSS {peak / 2**20:,.0f} MB, client alone {c:,.0f} msg/s ({c / a:.2f})"
                     + (f", with journalPath {d:,.0f} msg/s ({d / b:.2f} x without)" if d else "")
                     for name, (a, b, peak, c, d) in results.items())
    print(f"\nREADME: {args.messages:,} x {args.size} B, availableNow into noop vs pika (prefetch 1000, "
          f"ack every 100): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
