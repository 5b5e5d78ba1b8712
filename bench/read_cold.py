"""A scheduled job's read: each Spark drain is the first query of a fresh Spark (a driver process of its
own, no warm-up query), `spark.readStream.format("amqp")` under `trigger(availableNow=True)` into `noop`,
timed from `start()` to termination, against a plain pika consumer (prefetch 1,000, ack every 100) in the
same run.

For each node (`--nodes`: the embedded broker in its own process, RabbitMQ 3.10 at 5672, RabbitMQ 4.3 at
5682) and each case (`--cases`), the same preloaded backlog is drained by pika and by each Spark drain
(`--drains`):

- `source`: default options (acks at each batch's commit);
- `journal`: with `journalPath` on a local disk (acks at the journal write, its default);
- `journal-commit`: with `journalPath` and `ackAt=commit` (acks at the commit, as before early acks).

Printed per drain: msg/s and the ratio to pika; where a run's time goes: Spark's session start (not in the
clock), `start()` to the first trigger (the query's start, the source runner's start, the source's connect
and availableNow count), the first trigger (its phases: the executors' Python workers start there), the
rest of the triggers, the batch count; and on RabbitMQ the node's own work per message (its queue
process's reductions and its schedulers' time: bench/rabbitmq_probe.py), which is where holding deliveries
to a commit shows.

    python bench/read_cold.py [--cases 300000x100,1000000x100] [--nodes embedded,3.10,4.3]
                              [--drains source,journal,journal-commit] [--prefetch N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from broker_vs_rabbitmq import declare_queue, delete_queue, start_embedded, stop_embedded  # noqa: E402
from rabbitmq_probe import CTL_COMMANDS, QueueProbe  # noqa: E402
from read_throughput import parse_cases, pika_drain, preload  # noqa: E402

# The two reference nodes, each with its rabbitmqctl.
NODES = {"3.10": ("amqp://guest:guest@127.0.0.1:5672/%2F", CTL_COMMANDS[0]),
         "4.3": ("amqp://guest:guest@127.0.0.1:5682/%2F", CTL_COMMANDS[1])}
DRAINS = {"source": {}, "journal": {"journalPath": None}, "journal-commit": {"journalPath": None, "ackAt": "commit"}}


def child(url: str, queue: str, n: int, options: dict) -> dict:
    """In a fresh process: one availableNow query, its clock and where its time went."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    t0 = time.time()
    spark = (SparkSession.builder.master("local[2]").appName("bench-read-cold").config("spark.ui.enabled", "false")
             .config("spark.sql.streaming.numRecentProgressUpdates", "100000").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    session = time.time() - t0
    reader = spark.readStream.format("amqp").option("uri", url).option("queue", queue)
    for key, value in options.items():
        reader = reader.option(key, tempfile.mkdtemp(prefix="bench-journal-") if value is None else value)
    checkpoint = tempfile.mkdtemp(prefix="bench-read-cold-")
    started = time.time()
    query = (reader.load().writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    seconds = time.time() - started
    progress = query.recentProgress
    spark.stop()
    first = progress[0]
    first_at = datetime.datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00")).timestamp()
    return {"session": session, "seconds": seconds, "rows": sum(p["numInputRows"] for p in progress),
            "batches": sum(1 for p in progress if p["numInputRows"]), "to_first_trigger": first_at - started,
            "first_trigger": first["durationMs"]["triggerExecution"] / 1000,
            "first_phases": {k: v / 1000 for k, v in first["durationMs"].items() if k != "triggerExecution"}}


def spark_drain(url: str, queue: str, n: int, options: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps([url, queue, n, options])],
                         capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"spark drain failed ({out.returncode}):\n{out.stderr[-3000:]}")
    run = json.loads(lines[-1])
    if run["rows"] < n:
        raise SystemExit(f"spark read {run['rows']} rows, expected {n}")
    return run


def run_case(node: str, url: str, ctl, n: int, size: int, drains: list[str], prefetch: int | None) -> list[str]:
    queue = declare_queue(url)
    lines = []
    try:
        preload(url, queue, n, size)
        pika = pika_drain(url, queue, n, size)
        print(f"\n{node}, {n:,} x {size} B: pika {pika:,.0f} msg/s", flush=True)
        summary = [f"pika {pika:,.0f}"]
        for name in drains:
            preload(url, queue, n, size)
            probe = QueueProbe(queue, ctl) if ctl else None
            with probe or open(os.devnull):
                run = spark_drain(url, queue, n, {**DRAINS[name], **({"prefetch": prefetch} if prefetch else {})})
            rate = run["rows"] / run["seconds"]
            rest = run["seconds"] - run["to_first_trigger"] - run["first_trigger"]
            phases = "  ".join(f"{k} {v:.2f}" for k, v in run["first_phases"].items() if v >= 0.01)
            print(f"  {name:<15} {rate:>9,.0f} msg/s  x pika {rate / pika:.2f}   {run['seconds']:.2f} s: start to "
                  f"first trigger {run['to_first_trigger']:.2f}, first trigger {run['first_trigger']:.2f} "
                  f"({phases}), the rest {rest:.2f}; {run['batches']} batches; session start "
                  f"{run['session']:.1f} s (not clocked)", flush=True)
            inside = probe.describe(n) if probe else None
            if inside:
                print(f"  {'':<15} {inside}", flush=True)
            summary.append(f"{name} {rate:,.0f} ({rate / pika:.2f}x)")
        lines.append(f"{node} {n:,} x {size} B: " + ", ".join(summary))
    finally:
        delete_queue(url, queue)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="300000x100,1000000x100")
    p.add_argument("--nodes", default="embedded,3.10,4.3")
    p.add_argument("--drains", default="source,journal,journal-commit")
    p.add_argument("--prefetch", type=int, default=None, help="the source's prefetch option (default: its own)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    drains = args.drains.split(",")
    for name in drains:
        if name not in DRAINS:
            raise SystemExit(f"--drains: unknown {name!r}; known: {', '.join(DRAINS)}")
    proc = None
    lines = []
    try:
        for node in args.nodes.split(","):
            if node == "embedded":
                proc, target = start_embedded(Path(tempfile.mkdtemp()) / "broker.log")
                url, ctl = target.url, None
            elif node in NODES:
                url, ctl = NODES[node]
            else:
                raise SystemExit(f"--nodes: unknown {node!r}; known: embedded, {', '.join(NODES)}")
            for n, size in parse_cases(args.cases):
                lines += run_case(node, url, ctl, n, size, drains, args.prefetch)
    finally:
        if proc is not None:
            stop_embedded(proc)
    print("\nSummary (docs/performance.md): first query of a fresh Spark, availableNow into noop, msg/s")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
