"""Read throughput: `spark.readStream.format("amqp")` (queue mode) against a plain pika consumer and against
our own client alone, same broker, same run, with the CPU each process spent per message.

For each broker (the embedded one in its own process, and RabbitMQ at 127.0.0.1:5672) and each case
(`--cases`, default 1,000,000 x 100 B and 250,000 x 4 KB):
  1. preload the messages into a fresh queue (pika, confirms);
  2. (pika) drain it with a plain pika consumer: prefetch 1,000, basic.ack(multiple) every 100;
  3. preload again, run a short query on another queue (Spark stops its idle Python processes after about a
     minute: see `rewarm`), then (source) drain it with `spark.readStream.format("amqp")` under
     `trigger(availableNow=True)` into the `noop` sink, timed end to end (query start to termination), with
     default options (on local[2], `handoff=auto` hands batches over as files after the first);
     then again (inline) with `handoff=inline`: every batch inside Spark's tasks, as on a cluster without
     a shared filesystem;
  4. preload again; (ceiling) drain it with our AMQP client alone (no Spark), as the source's driver
     consumes: the rate the broker delivers to a fast consumer, which bounds what the source can reach;
  5. preload again; (batched) drain it with the source's own consumer (`QueueConsumer`) driven as the
     source drives it, without Spark: each batch acked only when the next is taken, after a pause of
     --batch-pause seconds standing for Spark's cycle: what the ack-at-commit discipline alone costs;
  6. (floor) Spark's floor, no broker: a Python streaming source (bench/spark_floor.py) that hands Spark
     the source's own full batches as the source's own files, as many rows as the case: what Spark alone
     allows the source, so that source/floor is the share of it the connector keeps;
  7. with --journal, preload again; (journal) as (source) with the option `journalPath`;
and print msg/s and MB/s (bodies) for each, the ratios source/pika, source/ceiling and source/floor, the
peak resident memory of the driver-side Python process that runs the source, and for every drain the CPU
microseconds per message of each process role (bench/process_cpu.py: broker, source, executors, jvm,
bench), and for each Spark drain the seconds its batches spent in each of Spark's phases (latestOffset: the
source waiting for and taking a batch; addBatch: partitions built and tasks run; walCommit/commitOffsets:
the checkpoint's offset and commit logs). On RabbitMQ each drain also prints the node's own split of its
time per message (bench/rabbitmq_probe.py: its schedulers in Erlang code, garbage collection and ports, and
the queue process's reductions), which is where holding deliveries to a commit shows.

    python bench/read_throughput.py [--cases 1000000x100,250000x4096] [--skip-rabbitmq] [--skip-embedded]
                                    [--journal] [--batch-pause 0.3] [--rounds 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_vs_rabbitmq import (Consumer, Publisher, Target, declare_queue, delete_queue,  # noqa: E402
                                find_listener, queue_depth, start_embedded, stop_embedded)
from process_cpu import SOURCE_MARKER, CpuByRole, format_breakdown  # noqa: E402
from rabbitmq_probe import QueueProbe  # noqa: E402
from socket_bytes import Sampler  # noqa: E402

import spark_floor  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
# Messages of each warm-up query (see main): the first measured drains must find Spark's paths compiled.
WARM_UP_MESSAGES = 1_000_000
# Messages of the short query run right before each measured Spark drain (see `rewarm`).
REWARM_MESSAGES = 20_000


class PeakRSS(Sampler):
    """Samples the RSS of the JVM's Python child that runs the streaming source (driver side)."""

    def __init__(self):
        super().__init__(0.25)
        self.peak = 0

    def take(self):
        for p in psutil.Process().children(recursive=True):
            try:
                if any(SOURCE_MARKER in part for part in p.cmdline()):
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
        targets.append(Target("rabbitmq", RABBITMQ_URL, find_listener(RABBITMQ_URL)))
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
    acks, basic.ack multiple per 25,000), with the prefetch per channel of the source's default on our broker
    (50,000), acking as it reads: what the broker gives a consumer that holds nothing back."""
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


def batched_drain(url: str, queue: str, n: int, pause: float) -> float:
    """The source's consumer without Spark: batches of half the prefetch, filled as the source fills its
    availableNow batches, each acked when the next is taken (as `latestOffset` acks the committed batch
    before planning the next), `pause` s between batches."""
    from spark_amqp.options import parse
    from spark_amqp.source.consumer import QueueConsumer
    from spark_amqp.source.queue_mode import wait_to_fill
    consumer = QueueConsumer(parse({"uri": url, "queue": queue}, "source"), sized_start=True)
    consumer.connect(consume=False)
    try:
        seq, got, t0 = 0, 0, time.perf_counter()
        consumer.start_consuming()
        while got < n:
            seq += 1
            consumer.ack_through(seq - 1)
            cap = consumer.batch_size()
            wait_to_fill(consumer, cap)
            batch = consumer.take(seq, cap)
            if not batch.count and not consumer.wait_pending(1, 10):
                raise SystemExit(f"batched drain: stalled after {got} of {n} messages")
            got += batch.count
            time.sleep(pause)
        consumer.ack_through(seq)
        return n / (time.perf_counter() - t0)
    finally:
        consumer.close()


def spark_drain(spark, url: str, queue: str, n: int, prefetch: int | None = None,
                journal: bool = False, inline: bool = False) -> tuple[float, "SparkRun"]:
    reader = spark.readStream.format("amqp").option("uri", url).option("queue", queue)
    if prefetch:
        reader = reader.option("prefetch", prefetch)
    if journal:
        reader = reader.option("journalPath", tempfile.mkdtemp(prefix="bench-journal-"))
    if inline:
        reader = reader.option("handoff", "inline")
    return timed_query(reader, n)


def floor_drain(spark, n: int, size: int) -> tuple[float, "SparkRun"]:
    """Spark's floor (bench/spark_floor.py): the source's full batches of `size`-byte bodies, served as
    files with no broker, until at least `n` rows (whole batches) have gone through Spark."""
    directory = tempfile.mkdtemp(prefix="bench-floor-")
    try:
        files, rows = spark_floor.write_slices(directory, size)
        reader = (spark.readStream.format(spark_floor.NAME).option("files", ",".join(files))
                  .option("dir", directory).option("batches", -(-n // rows)))
        return timed_query(reader, n)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def timed_query(reader, n: int) -> tuple[float, "SparkRun"]:
    """Run `reader` under availableNow into `noop`, timed from the query's start to its end: (rows/s,
    SparkRun). At least `n` rows must go through."""
    checkpoint = tempfile.mkdtemp(prefix="bench-read-")
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        q = (reader.load().writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
        q.awaitTermination()
        seconds = time.perf_counter() - t0
    run = SparkRun(rss.peak, seconds, q.recentProgress)
    if run.rows < n:
        raise SystemExit(f"spark read {run.rows} rows, expected {n}")
    return run.rows / seconds, run


class SparkRun:
    """What a Spark drain leaves besides its rate: the source process's peak RSS, and where the query's
    time went by Spark's own per-batch phases (`durationMs` of each progress event, summed over the run)."""

    PHASES = ("latestOffset", "queryPlanning", "addBatch", "walCommit", "commitOffsets")

    def __init__(self, peak_rss: int, seconds: float, progress: list):
        self.peak_rss = peak_rss
        self.seconds = seconds
        self.batches = sum(1 for p in progress if p["numInputRows"])
        self.rows = sum(p["numInputRows"] for p in progress)
        self.phase_seconds = {name: sum(p["durationMs"].get(name, 0) for p in progress) / 1000
                              for name in self.PHASES}

    def describe(self) -> str:
        phases = "  ".join(f"{name} {s:.1f}" for name, s in self.phase_seconds.items())
        other = self.seconds - sum(self.phase_seconds.values())
        return (f"source process peak RSS {self.peak_rss / 2**20:,.0f} MB; {self.batches} batches; "
                f"seconds: {phases}  other {other:.1f} (query start and stop, triggers)")


def start_spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # Spark's Python workers import bench/spark_floor.py by name: they inherit this PYTHONPATH.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    from pyspark.sql import SparkSession
    # A drain's rows are counted from its progress events: keep them all (Spark keeps the last 100, and a
    # drain with --prefetch 20000 runs 100 batches and a last empty one).
    spark = (SparkSession.builder.master("local[2]").appName("bench-read")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.streaming.numRecentProgressUpdates", "100000").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(spark_floor.FloorSource)
    return spark


def measure(target: Target, n: int, drain, queue: str | None = None) -> tuple[float, dict, object, str | None]:
    """Run `drain()` (returns msg/s, or (msg/s, extra)) under a CPU sampler: (msg/s, CPU us per message by
    role, extra, RabbitMQ's own split of its time or None). Per message of the `n` drained, or of the rows a
    Spark drain reports (the floor's last batch is whole). On RabbitMQ, `queue` is probed from the node
    (bench/rabbitmq_probe.py), outside the sampler's window."""
    probe = QueueProbe(queue) if queue and target.name == "rabbitmq" else None
    with probe or contextlib.nullcontext(), CpuByRole(target.process, interval=0.25) as cpu:
        result = drain()
    rate, extra = result if isinstance(result, tuple) else (result, None)
    per = getattr(extra, "rows", n)
    return rate, cpu.per_message(per), extra, probe.describe(per) if probe else None


SPARK_DRAINS = ("source", "inline", "floor", "journal")


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        try:
            n, size = item.lower().split("x")
            cases.append((int(n), int(size)))
        except ValueError:
            raise SystemExit(f"--cases: '{item}' is not MESSAGESxBYTES (e.g. 1000000x100)") from None
    return cases


def rewarm(spark, url: str, queue: str, size: int) -> None:
    """A short query (REWARM_MESSAGES) right before a measured Spark drain, on another queue of the same
    broker. Spark stops the Python processes it starts for a query (the planners' daemons and the
    executors' workers) once they have been idle for about a minute; a measured drain that follows a pika
    drain and two preloads (more than a minute on a slow machine) would otherwise pay their start-up:
    measured, 3.9 s of CPU in those processes against 0.6 s warm, and 48,794 msg/s against 59,970
    (1,000,000 x 100 B, embedded broker, a machine on which pika read 22,825 msg/s)."""
    preload(url, queue, REWARM_MESSAGES, size)
    spark_drain(spark, url, queue, REWARM_MESSAGES)


def run_case(spark, t: Target, n: int, size: int, args) -> dict:
    queue = declare_queue(t.url)
    warm = declare_queue(t.url)
    rows = {}
    try:
        drains = [("pika", lambda: pika_drain(t.url, queue, n, size)),
                  ("source", lambda: spark_drain(spark, t.url, queue, n, args.prefetch)),
                  ("inline", lambda: spark_drain(spark, t.url, queue, n, args.prefetch, inline=True)),
                  ("ceiling", lambda: client_drain(t.url, queue, n)),
                  ("batched", lambda: batched_drain(t.url, queue, n, args.batch_pause)),
                  ("floor", lambda: floor_drain(spark, n, size))]
        if args.journal:
            drains.append(("journal", lambda: spark_drain(spark, t.url, queue, n, args.prefetch, journal=True)))
        for name, drain in drains:
            if name != "floor":
                preload(t.url, queue, n, size)
            if name in SPARK_DRAINS:
                rewarm(spark, t.url, warm, size)
            rows[name] = measure(t, n, drain, None if name == "floor" else queue)
    finally:
        delete_queue(t.url, queue)
        delete_queue(t.url, warm)
    return rows


def report(name: str, n: int, size: int, rows: dict) -> str:
    pika, source, inline, ceiling, batched, floor = (rows[k][0] for k in ("pika", "source", "inline", "ceiling",
                                                                           "batched", "floor"))
    print(f"\n{name}, {n:,} x {size} B")
    for label, (rate, cpu, run, inside_rabbitmq) in rows.items():
        print(f"  {label:<8} {rate:>10,.0f} msg/s {rate * size / 1e6:>8.1f} MB/s   CPU us/msg: "
              f"{format_breakdown(cpu)}")
        if run is not None:
            print(f"  {'':<8} {run.describe()}")
        if inside_rabbitmq:
            print(f"  {'':<8} {inside_rabbitmq}")
    journal = rows.get("journal")
    summary = (f"source/pika {source / pika:.2f}, source/ceiling {source / ceiling:.2f}; inline/pika "
               f"{inline / pika:.2f}, inline/ceiling {inline / ceiling:.2f}; ceiling/pika {ceiling / pika:.2f}; "
               f"batched/ceiling {batched / ceiling:.2f}, source/batched {source / batched:.2f}; "
               f"source/floor {source / floor:.2f}, floor/pika {floor / pika:.2f}"
               + (f"; journal/source {journal[0] / source:.2f}" if journal else ""))
    print(f"  {summary}", flush=True)
    return (f"{name} {n:,} x {size} B: pika {pika:,.0f}, source {source:,.0f}, inline {inline:,.0f}, "
            f"ceiling {ceiling:,.0f}, batched {batched:,.0f}, floor {floor:,.0f} msg/s; {summary}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1000000x100,250000x4096",
                   help="comma-separated MESSAGESxBYTES (default: 1000000x100,250000x4096)")
    p.add_argument("--skip-rabbitmq", action="store_true")
    p.add_argument("--skip-embedded", action="store_true")
    p.add_argument("--prefetch", type=int, default=None, help="the source's prefetch option (default: its own)")
    p.add_argument("--journal", action="store_true", help="also measure the source with journalPath")
    p.add_argument("--rounds", type=int, default=1,
                   help="drain each case this many times in a row (each round reported: this machine is noisy)")
    p.add_argument("--batch-pause", type=float, default=0.3,
                   help="seconds the 'batched' drain pauses per batch, standing for Spark's cycle (default 0.3: "
                        "addBatch plus commit in the source's runs)")
    args = p.parse_args(argv)
    # A benchmark stopped with `kill` must still stop its embedded broker and Spark (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = parse_cases(args.cases)

    spark, proc, embedded, targets = start_targets(args)
    # Warm-up: the first queries of a session pay for class loading and for the JIT compiling Spark's paths
    # (the JVM's compiler threads took 10-19 us per message of a 250,000-message query after one warm-up
    # query, measured by thread); a query that has been running is past both, as a long-running pipeline
    # is. One warm-up query of the source inside the tasks, one with handoff files, one of the floor, each
    # of a million rows: after three of 100,000 the first measured source drain still spent 3.0 us of JVM
    # CPU per message against 1.7 in a second round, and read 158,698 msg/s against 178,585
    # (1,000,000 x 100 B, embedded broker; pika 117,273 and 115,662).
    lines = []
    try:
        warm = declare_queue(embedded.url)
        for inline in (True, False):
            preload(embedded.url, warm, WARM_UP_MESSAGES, 100)
            spark_drain(spark, embedded.url, warm, WARM_UP_MESSAGES, inline=inline)
        floor_drain(spark, WARM_UP_MESSAGES, 100)    # its executors' workers import bench/spark_floor.py
        for t in targets:
            for n, size in cases:
                for _ in range(args.rounds):
                    lines.append(report(t.name, n, size, run_case(spark, t, n, size, args)))
    finally:
        stop_embedded(proc)
        spark.stop()
    print("\nSummary (docs/performance.md): availableNow into noop; pika: prefetch 1000, ack every 100; ceiling: our client alone")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
