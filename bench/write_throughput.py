"""Throughput of the amqp sink, `df.write.format("amqp")`, against a plain pika publisher, same broker, same run.

What it measures:

* ours: a cached DataFrame of ``--messages`` (1,000,000) rows, 2 partitions (local[2]: two tasks publish in
  parallel), one column ``body`` of ``--size`` (100) bytes (row i: i zero-padded to 100 digits), written
  with ``df.write.format("amqp").mode("append")`` to a fresh queue through the default exchange
  (``routingKey`` = the queue), publisher confirms, window 1,000 per task (the default ``publishWindow``).
  Timed around the ``save()`` call: planning, task start, connecting, publishing, waiting for every
  confirm (the Arrow writer, ``spark_amqp.sink.writer.AMQPWriter``).
* pika: the same messages (same bodies, same queue, same broker) from one pika ``SelectConnection`` with
  publisher confirms and at most 1,000 unconfirmed (``bench/broker_vs_rabbitmq.py``'s ``Publisher``),
  timed from the first publish to the last confirm.
* both against our embedded broker (a subprocess, ``python -m spark_amqp_broker --port <free port>``) and against
  RabbitMQ (``--rabbitmq-url``), ``--rounds`` times each (median), alternating which of ours/pika goes
  first. After each run the queue must hold exactly ``--messages`` messages (else the run fails), and is
  purged; queues are deleted at the end and carry ``x-expires`` so an interrupted run leaves nothing.
* CPU seconds of the broker per message, to show where the time goes (with 2 cores, the broker and the
  publishers share them).
* the broker's ceiling (``--ceiling``, on by default): the same messages from 2 bare publishers (our AMQP
  client, one process each, window 1,000, no Spark), once per broker: the most any 2 publishers got
  through that broker on this machine in this run, so ours/ceiling says how much of it the sink uses.

Prints msg/s for each and the ratio ours/pika per broker (target >= 2.0).

Run (repository root; takes the Spark lock so that only one Spark job runs on this machine at a time)::

    flock /tmp/spark.lock python bench/write_throughput.py
    flock /tmp/spark.lock python bench/write_throughput.py --messages 200000 --rounds 1 --skip-rabbitmq
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import pika  # noqa: E402

from broker_vs_rabbitmq import (DEFAULT_RABBITMQ_URL, BenchError, Publisher, Target, find_listener,  # noqa: E402
                                start_embedded, stop_embedded)

QUEUE_EXPIRES_MS = 600_000


class SamePublisher(Publisher):
    """bench/broker_vs_rabbitmq.py's pika publisher, sending row i's body (i zero-padded) like the DataFrame."""

    def _pump(self):
        publish = self.channel.basic_publish
        queue = self.queue
        size = self.size
        stop = min(self.n, self.confirmed + self.window)
        i = self.published
        while i < stop:
            publish("", queue, f"{i:0{size}d}".encode())
            i += 1
        self.published = i


def pika_run(url: str, queue: str, n: int, size: int, window: int) -> float:
    pub = SamePublisher(url, queue, n, size, window, timeout=600)
    pub.size = size
    pub.run()
    return n / (pub.t1 - pub.t0)


def _bare_publisher(url: str, queue: str, start: int, stop: int, size: int, window: int, ready, go) -> None:
    from spark_amqp.client import Connection

    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.confirm_select(window=window)
        ready.set()
        go.wait(30)
        publish = ch.publish
        for i in range(start, stop):
            publish("", queue, f"{i:0{size}d}".encode(), b"\x00\x00")
        ch.wait_for_confirms(120)


def ceiling_run(url: str, queue: str, n: int, size: int, window: int = 1000, procs: int = 2) -> float:
    """What the broker accepts from `procs` bare publishers (our client, no Spark, one process each, same
    messages, same window as the sink's tasks): the most the sink could reach on this machine."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    go = ctx.Event()
    readies, workers = [], []
    for k in range(procs):
        ready = ctx.Event()
        w = ctx.Process(target=_bare_publisher,
                        args=(url, queue, k * n // procs, (k + 1) * n // procs, size, window, ready, go))
        w.start()
        readies.append(ready)
        workers.append(w)
    for r in readies:
        r.wait(30)
    t0 = time.perf_counter()
    go.set()
    for w in workers:
        w.join(600)
        if w.exitcode != 0:
            raise BenchError(f"a bare publisher failed (exit code {w.exitcode})")
    return n / (time.perf_counter() - t0)


def spark_session():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("amqp-write-bench")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "2g")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def ours_run(df, url: str, queue: str, n: int) -> float:
    t0 = time.perf_counter()
    (df.write.format("amqp").mode("append").option("uri", url).option("routingKey", queue).save())
    return n / (time.perf_counter() - t0)


class Admin:
    """Declares, counts, purges and deletes the benchmark's queues (pika BlockingConnection)."""

    def __init__(self, url: str):
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.ch = self.conn.channel()
        self.queues: list[str] = []

    def declare(self, name: str) -> str:
        self.ch.queue_declare(name, arguments={"x-expires": QUEUE_EXPIRES_MS})
        self.queues.append(name)
        return name

    def count(self, name: str) -> int:
        return self.ch.queue_declare(name, passive=True).method.message_count

    def expect(self, name: str, n: int, what: str) -> None:
        deadline = time.monotonic() + 10
        while (got := self.count(name)) != n and time.monotonic() < deadline:
            time.sleep(0.1)
        if got != n:
            raise BenchError(f"{what}: the queue holds {got} messages, expected {n}")
        self.ch.queue_purge(name)

    def close(self) -> None:
        for q in self.queues:
            try:
                self.ch.queue_delete(q)
            except Exception:
                pass
        try:
            self.conn.close()
        except Exception:
            pass


def cpu(target: Target) -> float:
    return target.server_cpu() or 0.0


def bench_broker(spark, df, target: Target, args) -> dict:
    admin = Admin(target.url)
    results: dict[str, list[float]] = {"ours": [], "pika": []}
    server_cpu: dict[str, list[float]] = {k: [] for k in results}
    try:
        queue = admin.declare(f"bench-write-{uuid.uuid4().hex[:10]}")
        warm = df.limit(20_000)
        ours_run(warm, target.url, queue, 20_000)   # start the Python workers and JIT the JVM side first
        admin.expect(queue, 20_000, "warm-up")
        for r in range(args.rounds):
            order = ["ours", "pika"] if r % 2 == 0 else ["pika", "ours"]
            for who in order:
                c0 = cpu(target)
                if who == "pika":
                    rate = pika_run(target.url, queue, args.messages, args.size, args.window)
                else:
                    rate = ours_run(df, target.url, queue, args.messages)
                used = cpu(target) - c0
                admin.expect(queue, args.messages, f"{target.name} {who} round {r + 1}")
                results[who].append(rate)
                server_cpu[who].append(used / args.messages * 1e6)
                label = {"ours": "ours (Arrow writer)", "pika": "pika"}[who]
                print(f"  round {r + 1} {target.name:9s} {label:20s} {rate:>10,.0f} msg/s   "
                      f"broker CPU {used / args.messages * 1e6:5.1f} µs/msg", flush=True)
        if args.ceiling:
            c0 = cpu(target)
            rate = ceiling_run(target.url, queue, args.messages, args.size)
            used = cpu(target) - c0
            admin.expect(queue, args.messages, f"{target.name} ceiling")
            results["ceiling"] = [rate]
            server_cpu["ceiling"] = [used / args.messages * 1e6]
            print(f"  ceiling {target.name:9s} {'2 bare publishers':20s} {rate:>10,.0f} msg/s   "
                  f"broker CPU {used / args.messages * 1e6:5.1f} µs/msg", flush=True)
    finally:
        admin.close()
    return {k: (statistics.median(v), statistics.median(server_cpu[k])) for k, v in results.items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--window", type=int, default=1000, help="pika's unconfirmed window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rabbitmq-url", default=DEFAULT_RABBITMQ_URL)
    ap.add_argument("--skip-rabbitmq", action="store_true")
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="skip the bare 2-publisher run that measures the broker's ceiling")
    args = ap.parse_args(argv)

    from pyspark.sql.datasource import DataSourceArrowWriter
    from spark_amqp.sink.writer import AMQPWriter
    if not issubclass(AMQPWriter, DataSourceArrowWriter):
        raise BenchError("format('amqp') should use the Arrow writer")
    spark = spark_session()
    n, size = args.messages, args.size
    df = (spark.range(n, numPartitions=2)
          .selectExpr(f"CAST(lpad(CAST(id AS STRING), {size}, '0') AS BINARY) AS body").cache())
    if df.count() != n or df.rdd.getNumPartitions() != 2:
        raise BenchError("the DataFrame must have the rows in 2 partitions")
    print(f"{n:,} rows x {size} B bodies, 2 partitions, local[2]; pika window {args.window}; "
          f"{args.rounds} round(s); {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}", flush=True)

    summary = {}
    proc = None
    try:
        if not args.skip_embedded:
            log_path = Path(tempfile.gettempdir()) / f"bench-write-broker-{os.getpid()}.log"
            proc, target = start_embedded(log_path)
            print(f"embedded broker: pid {proc.pid}, {target.url}", flush=True)
            summary["embedded"] = bench_broker(spark, df, target, args)
            stop_embedded(proc)
            proc = None
        if not args.skip_rabbitmq:
            target = Target("rabbitmq", args.rabbitmq_url, find_listener(args.rabbitmq_url))
            print(f"RabbitMQ: {args.rabbitmq_url.split('@')[-1]}", flush=True)
            summary["rabbitmq"] = bench_broker(spark, df, target, args)
    finally:
        if proc is not None:
            stop_embedded(proc)
        df.unpersist()
        spark.stop()

    print(f"\nmedian of {args.rounds}            msg/s   broker CPU µs/msg   ratio /pika")
    line = []
    for broker, res in summary.items():
        pika_rate = res["pika"][0]
        for who in ["ours", "pika"] + (["ceiling"] if "ceiling" in res else []):
            rate, c = res[who]
            ratio = f"{rate / pika_rate:6.2f}" if who != "pika" else ""
            print(f"  {broker:9s} {who:8s} {rate:>12,.0f}   {c:10.1f}          {ratio}")
        if "ceiling" in res:
            print(f"  {broker:9s} ours (Arrow) / ceiling: {res['ours'][0] / res['ceiling'][0]:.2f}")
        r = res["ours"][0] / pika_rate
        met = "met" if r >= 2.0 else "NOT met"
        line.append(f"{broker} ours: {res['ours'][0]:,.0f} vs pika {pika_rate:,.0f} msg/s = {r:.2f} "
                    f"(target >= 2.0: {met})")
        if "ceiling" in res:
            line.append(f"{broker} ceiling (2 bare publishers, no Spark): {res['ceiling'][0]:,.0f} msg/s = "
                        f"{res['ceiling'][0] / pika_rate:.2f} x pika")
    print("\nSummary (docs/performance.md): " + "; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
