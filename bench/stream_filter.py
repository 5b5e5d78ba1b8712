"""Stream filtering (`streamFilter`): a batch read of a stream with and without a filter, on RabbitMQ 4.3.

One stream of `--messages` messages of `--size` bytes, published in runs of `--run` messages (one write
each, so RabbitMQ stores a run in chunks of its own), each run with one filter value
(x-stream-filter-value): one run in `--every` has the value read, the others other values. Two such
streams: the matching runs at the end of each `--every` runs, and at their start (then the stream's last 99
runs do not match, and the read's end rests on the last chunk's value added to the filter: docs/source.md,
"Stream filtering"). For each, `spark.read.format("amqp")` in stream mode from earliest,
without and with `streamFilter`, into a sum of the rows' body lengths; the seconds of the read and the bytes
the Spark processes received from the broker (the kernel's per-socket counters, socket_bytes.py).

    python bench/stream_filter.py [--url amqp://guest:guest@127.0.0.1:5682/%2F] [--messages 100000]
                                  [--size 100] [--run 1000] [--every 100]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from socket_bytes import ReceivedBytes  # noqa: E402
from write_throughput import spark_session  # noqa: E402

from spark_amqp.client import Connection  # noqa: E402
from spark_amqp.codec.properties import encode  # noqa: E402


def make_stream(url: str, args, matching_at: int) -> str:
    """A stream whose run number r (of `--every`) has the value "hit" when r % every == matching_at."""
    name = f"bench-filter-{uuid.uuid4().hex[:10]}"
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
        ch.confirm_select()
        body = b"x" * args.size
        for r in range(args.messages // args.run):
            value = "hit" if r % args.every == matching_at else f"v{r % args.every}"
            ch.publish_many("", name, [body] * args.run, [encode({"headers": {"x-stream-filter-value": value}})]
                            * args.run)
            ch.wait_for_confirms(timeout=60)
    return name


def read(spark, url: str, stream: str, **options) -> tuple[int, int, float, int]:
    """(rows, body bytes of the rows, seconds, bytes received from the broker) of one batch read."""
    from pyspark.sql import functions as F

    reader = (spark.read.format("amqp").option("uri", url).option("queue", stream)
              .option("queueType", "stream").option("startingOffsets", "earliest"))
    for k, v in options.items():
        reader = reader.option(k, v)
    with ReceivedBytes(urlparse(url).port or 5672) as received:
        t0 = time.perf_counter()
        row = reader.load().agg(F.count("*").alias("n"), F.sum(F.length("body")).alias("b")).collect()[0]
        took = time.perf_counter() - t0
    return row.n, row.b or 0, took, sum(received.by_pid().values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5682/%2F")
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--run", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    args = p.parse_args()
    spark = spark_session()
    streams = {"matching runs last": make_stream(args.url, args, args.every - 1),
               "matching runs first": make_stream(args.url, args, 0)}
    try:
        warm = next(iter(streams.values()))
        read(spark, args.url, warm)                     # the session's first read starts Python workers
        print(f"{args.messages:,} x {args.size} B, runs of {args.run:,}, one run in {args.every} matching")
        print("| stream | read | rows | seconds | bytes received |")
        print("|---|---|---|---|---|")
        for label, s in streams.items():
            for how, options in (("no filter", {}), ("streamFilter=hit", {"streamFilter": "hit"})):
                n, _bodies, took, received = read(spark, args.url, s, **options)
                print(f"| {label} | {how} | {n:,} | {took:.2f} | {received:,} |")
    finally:
        with Connection.open(args.url) as conn:
            ch = conn.channel()
            for s in streams.values():
                ch.queue_delete(s)
        spark.stop()


if __name__ == "__main__":
    main()
