"""The main job: `python -m spark_amqp_demo` (or `spark-amqp-demo`).

Starts the embedded broker, publishes a stream of sample order events to a topic exchange, runs a
Structured Streaming pipeline that reads them with `format("amqp")`, converts amounts to EUR and flags large
orders, and publishes the results with `format("amqp")` to a second exchange; prints live progress (batches,
rows, rates, queue depths) and, at the end, what arrived. Needs nothing but the install.

It lives beside the connector, not in it: the connector (`spark_amqp`) never imports the broker.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from spark_amqp.client import Connection
from spark_amqp_broker import Broker

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"   # the repository's conf/, when run from it
RATES_TO_EUR = {"EUR": 1.0, "USD": 0.92, "GBP": 1.17, "CHF": 1.04}
COUNTRIES = ["de", "fr", "uk", "ch", "us"]


def load_config(path: Path | None) -> dict:
    path = path or CONF_DIR / "demo.toml"
    if path.exists():
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    return {}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m spark_amqp_demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", type=Path, default=None, help="TOML file (default conf/demo.toml)")
    p.add_argument("--events", type=int, default=None, help="sample events to publish")
    p.add_argument("--rate", type=float, default=None, help="events per second (0 = as fast as possible)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    return p.parse_args(argv)


def sample_event(i: int, rng: random.Random) -> dict:
    currency = rng.choice(list(RATES_TO_EUR))
    return {"order_id": i, "country": rng.choice(COUNTRIES), "currency": currency,
            "amount": round(rng.uniform(5, 2500), 2)}


def publish_events(url: str, count: int, rate: float, done: threading.Event, stats: dict) -> None:
    """A producer as a real application would be: publisher confirms, persistent JSON messages."""
    rng = random.Random(42)
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.confirm_select(window=1000)
        start = time.monotonic()
        for i in range(count):
            event = sample_event(i, rng)
            ch.publish("orders", f"order.{event['country']}", json.dumps(event).encode(),
                       {"content_type": "application/json", "delivery_mode": 2, "message_id": f"order-{i}",
                        "app_id": "demo-shop"})
            stats["published"] = i + 1
            if rate:
                ahead = (i + 1) / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
        ch.wait_for_confirms(timeout=60)
    done.set()


def declare_topology(url: str) -> None:
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.exchange_declare("orders", "topic", durable=True)
        ch.queue_declare("orders.all", durable=True)
        ch.queue_bind("orders.all", "orders", "order.#")
        ch.exchange_declare("orders.eur", "topic", durable=True)
        ch.queue_declare("orders.eur.large", durable=True)
        ch.queue_bind("orders.eur.large", "orders.eur", "large.#")
        ch.queue_declare("orders.eur.all", durable=True)
        ch.queue_bind("orders.eur.all", "orders.eur", "#")


def queue_depths(url: str, names: list[str]) -> dict:
    with Connection.open(url) as conn:
        ch = conn.channel()
        return {n: ch.queue_declare(n, passive=True).message_count for n in names}


def build_pipeline(spark, url: str, checkpoint: str, cfg: dict):
    from pyspark.sql import functions as F

    schema = "order_id LONG, country STRING, currency STRING, amount DOUBLE"
    rates = F.create_map(*[x for k, v in RATES_TO_EUR.items() for x in (F.lit(k), F.lit(v))])
    orders = (spark.readStream.format("amqp")
              .option("uri", url)
              .option("queue", "orders.all")
              .option("maxMessagesPerTrigger", cfg.get("max_messages_per_trigger", 5000))
              .load())
    events = orders.select(F.from_json(F.col("body").cast("string"), schema).alias("e"), "message_id")
    results = (events
               .select("e.*", "message_id")
               .withColumn("amount_eur", F.round(F.col("amount") * rates[F.col("currency")], 2))
               .withColumn("size", F.when(F.col("amount_eur") >= 1000, "large").otherwise("regular"))
               .select(F.to_json(F.struct("order_id", "country", "amount_eur", "size")).alias("body"),
                       F.concat_ws(".", "size", "country").alias("routing_key"),
                       F.lit("application/json").alias("content_type"),
                       "message_id"))
    return (results.writeStream.format("amqp")
            .option("uri", url)
            .option("exchange", "orders.eur")
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime=f"{cfg.get('trigger_seconds', 1.0)} seconds")
            .start())


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config)
    count = args.events if args.events is not None else cfg.get("events", {}).get("count", 20000)
    rate = args.rate if args.rate is not None else cfg.get("events", {}).get("rate", 4000)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    broker_cfg = cfg.get("broker", {})
    workdir = tempfile.mkdtemp(prefix="spark-amqp-demo-")
    print("== starting the embedded AMQP broker")
    with Broker(host=broker_cfg.get("host", "127.0.0.1"), port=broker_cfg.get("port", 0)) as broker:
        url = broker.url
        print(f"   listening on {broker.host}:{broker.port}")
        declare_topology(url)
        print("== starting Spark (local[2])")
        spark = start_spark()
        stats = {"published": 0}
        done = threading.Event()
        producer = threading.Thread(target=publish_events, args=(url, count, rate, done, stats), daemon=True)
        query = build_pipeline(spark, url, os.path.join(workdir, "checkpoint"), cfg.get("pipeline", {}))
        print(f"== publishing {count} order events at {rate or 'max'}/s; pipeline orders.all -> EUR -> orders.eur")
        producer.start()
        ok = watch(query, url, count, stats, done, args.timeout)
        query.stop()
        report(url, count)
        spark.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def start_spark():
    from pyspark.sql import SparkSession

    log4j = CONF_DIR / "log4j2.properties"
    builder = (SparkSession.builder.master("local[2]").appName("spark-amqp-demo")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2"))
    if log4j.exists():
        builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile={log4j}")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def watch(query, url: str, count: int, stats: dict, done: threading.Event, timeout: float) -> bool:
    """Print one line per micro-batch until every event has come out of the pipeline."""
    start = time.monotonic()
    seen = [-1, 0]   # last batch id printed, rows printed so far
    while time.monotonic() - start < timeout:
        if query.exception() is not None:
            print(f"!! the query failed: {query.exception()}")
            return False
        depths = queue_depths(url, ["orders.all", "orders.eur.all"])
        print_progress(query, stats, depths, seen)
        if done.is_set() and depths["orders.eur.all"] >= count:
            # The last batch's progress event follows its commit, by up to a trigger or two.
            settle = time.monotonic() + 10.0
            while True:
                print_progress(query, stats, queue_depths(url, ["orders.all", "orders.eur.all"]), seen)
                if seen[1] >= count or time.monotonic() > settle:
                    return True
                time.sleep(0.25)
        time.sleep(0.5)
    print(f"!! not every event arrived within {timeout:.0f} s")
    return False


def print_progress(query, stats: dict, depths: dict, seen: list) -> None:
    for progress in query.recentProgress:
        if progress["batchId"] <= seen[0] or not progress["numInputRows"]:
            continue
        seen[0] = progress["batchId"]
        seen[1] += progress["numInputRows"]
        print(f"   batch {progress['batchId']:>3}: {progress['numInputRows']:>6} rows "
              f"{progress.get('processedRowsPerSecond', 0):>9.0f} rows/s | published {stats['published']:>6} "
              f"| backlog {backlog(progress)} | results {depths['orders.eur.all']:>6}")


def backlog(progress) -> str:
    """The source's backlog from the query's progress (its reportLatestOffset): ready in the broker,
    and delivered to the query but not yet acked."""
    latest = progress["sources"][0].get("latestOffset") if progress.get("sources") else None
    if not latest:
        return "?"
    queue = json.loads(latest).get("queues", {}).get("orders.all") or {}
    return f"{queue.get('ready', '?')!s:>6} ready {queue.get('unacked', '?')!s:>6} unacked"


def report(url: str, count: int) -> None:
    with Connection.open(url) as conn:
        ch = conn.channel()
        total = ch.queue_declare("orders.eur.all", passive=True).message_count
        large = ch.queue_declare("orders.eur.large", passive=True).message_count
        ch.basic_consume("orders.eur.large")
        sample = ch.get_deliveries(3, timeout=2.0)
    print(f"== done: {count} events in, {total} results out ({large} large orders routed to orders.eur.large)")
    for d in sample:
        print(f"   {d.routing_key:<12} {d.body.decode()}")


if __name__ == "__main__":
    sys.exit(main())
