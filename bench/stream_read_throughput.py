"""Stream-mode read throughput: `readStream` over stream queues against a plain pika consumer, same run.

For each broker (the embedded one in its own process, and RabbitMQ at 127.0.0.1:5672), and for each
layout (one stream of N messages, and two streams of N/2):
  1. publish the messages (S bytes each) into fresh stream queues (pika, confirms); a stream keeps them,
     so both readers below read the same stored messages;
  2. (a) one plain pika consumer reads every stream from `first` (x-stream-offset), prefetch 1,000 per
     consumer, basic.ack(multiple) every 100 deliveries (acks are credit on a stream);
  3. (b) `spark.readStream.format("amqp").option("queueType", "stream")`, startingOffsets=earliest,
     `trigger(availableNow=True)` into the `noop` sink, timed end to end (query start to termination);
and print msg/s for each and the ratio b/a. With --super-stream N the layout is instead a super stream of
N partitions (made as `rabbitmq-streams add_super_stream` makes it, by `spark_amqp_broker.streams`), filled
partition by partition: pika reads every partition on one channel, and the source reads it with
`superStream`. While (b) runs, the kernel's per-socket counters (`ss`, see
socket_bytes.py) give the bytes each process received from the broker; the driver's share (its Python
source process) against everything the query received shows that the message data does not pass
through the driver.

    python bench/stream_read_throughput.py [--messages 1000000] [--size 100] [--min-partitions 2]
                                           [--skip-rabbitmq] [--skip-embedded] [--super-stream N]
                                           [--rabbitmq-url URL]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pika

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_vs_rabbitmq import Consumer, Publisher, stop_embedded  # noqa: E402
from read_throughput import start_targets  # noqa: E402
from socket_bytes import ReceivedBytes  # noqa: E402

# The driver-side Python process of a streaming Python data source (PySpark's runner module).
DRIVER_MARKER = "streaming_source_runner"
WARM_UP_MESSAGES = 50_000
# Segment size of the benchmark's streams: RabbitMQ's default (500 MB) would keep 1,000,000 x 100 B in one.
SEGMENT_BYTES = 50_000_000


class StreamConsumer(Consumer):
    """Consumer (broker_vs_rabbitmq) reading one or more streams from `first` on one channel."""

    def __init__(self, url: str, streams: list[str], n: int, size: int):
        super().__init__(url, streams[0], n, size, prefetch=1000, ack_every=100, timeout=900)
        self.streams = streams

    def _on_qos_ok(self, _frame):
        self.t0 = time.perf_counter()
        for s in self.streams:
            self.channel.basic_consume(s, self._on_message, auto_ack=False,
                                       arguments={"x-stream-offset": "first"})


def declare_streams(url: str, count: int) -> list[str]:
    names = [f"bench-stream-{uuid.uuid4().hex[:10]}" for _ in range(count)]
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for name in names:
            ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream",
                                                            "x-stream-max-segment-size-bytes": SEGMENT_BYTES})
    finally:
        conn.close()
    return names


def delete_streams(url: str, names: list[str]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for name in names:
            ch.queue_delete(name)
    finally:
        conn.close()


def declare_super_stream(url: str, partitions: int) -> tuple[str, list[str]]:
    """A super stream as `add_super_stream NAME --partitions N` makes it, with the benchmark's segments."""
    from spark_amqp_broker import streams, super_streams
    name = f"bench-super-{uuid.uuid4().hex[:10]}"
    plan = super_streams.plan(name, partitions=partitions,
                              arguments={"x-stream-max-segment-size-bytes": SEGMENT_BYTES})
    streams.add_super_stream(url, plan)
    return name, [f"{name}-{i}" for i in range(partitions)]


def delete_super_stream(url: str, name: str, partitions: list[str]) -> None:
    from spark_amqp_broker import streams
    streams.delete_super_stream(url, name, partitions)


def fill(url: str, streams: list[str], n: int, size: int) -> None:
    for s in streams:
        Publisher(url, s, n // len(streams), size, 1000, 900).run()


def pika_read(url: str, streams: list[str], n: int, size: int) -> float:
    c = StreamConsumer(url, streams, n, size)
    c.run()
    return n / (c.t1 - c.t0)


def spark_read(spark, url: str, streams: list[str], n: int, min_partitions: int | None,
               super_stream: str | None = None):
    """(msg/s, bytes the driver's source process received, bytes every process received)."""
    checkpoint = tempfile.mkdtemp(prefix="bench-stream-")
    reader = spark.readStream.format("amqp").option("uri", url).option("startingOffsets", "earliest")
    if super_stream:
        reader = reader.option("superStream", super_stream)
    else:
        reader = reader.option("queue", ",".join(streams)).option("queueType", "stream")
    if min_partitions:
        reader = reader.option("minPartitions", min_partitions)
    port = urlparse(url).port or 5672
    with ReceivedBytes(port) as received:
        t0 = time.perf_counter()
        q = (reader.load().writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
        q.awaitTermination()
        seconds = time.perf_counter() - t0
    rows = sum(p["numInputRows"] for p in q.recentProgress)
    if rows != n:
        raise SystemExit(f"spark read {rows} rows, expected {n}")
    driver, others = received.received_by(DRIVER_MARKER)
    return n / seconds, driver, driver + others


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--min-partitions", type=int, default=None,
                   help="the source's minPartitions (default: one partition per stream)")
    p.add_argument("--skip-rabbitmq", action="store_true")
    p.add_argument("--skip-embedded", action="store_true")
    p.add_argument("--super-stream", type=int, default=None, metavar="N",
                   help="read a super stream of N partitions instead of one and two streams")
    p.add_argument("--rabbitmq-url", default=None,
                   help="the RabbitMQ node to measure (default amqp://guest:guest@127.0.0.1:5672/%%2F)")
    args = p.parse_args(argv)

    spark, proc, embedded, targets = start_targets(args)
    if args.rabbitmq_url:
        targets = [t if t.name != "rabbitmq" else type(t)("rabbitmq", args.rabbitmq_url) for t in targets]
    results = []
    try:
        warm = declare_streams(embedded.url, 1)
        fill(embedded.url, warm, WARM_UP_MESSAGES, args.size)
        spark_read(spark, embedded.url, warm, WARM_UP_MESSAGES, None)   # class loading, JIT
        delete_streams(embedded.url, warm)
        for t in targets:
            for count in ([args.super_stream] if args.super_stream else (1, 2)):
                if args.super_stream:
                    name, streams = declare_super_stream(t.url, count)
                else:
                    name, streams = None, declare_streams(t.url, count)
                try:
                    fill(t.url, streams, args.messages, args.size)
                    a = pika_read(t.url, streams, args.messages, args.size)
                    b, driver, total = spark_read(spark, t.url, streams, args.messages, args.min_partitions, name)
                finally:
                    if name:
                        delete_super_stream(t.url, name, streams)
                    else:
                        delete_streams(t.url, streams)
                data = args.messages * args.size
                results.append((t.name, count, a, b, driver, total, data))
                print(f"{t.name:<9} {count} stream(s)  pika {a:>9,.0f} msg/s   spark {b:>9,.0f} msg/s   "
                      f"ratio b/a {b / a:.2f}   driver received {driver:,} B = {100 * driver / data:.3f}% of "
                      f"the bodies read (all processes: {total:,} B)", flush=True)
    finally:
        stop_embedded(proc)
        spark.stop()
    line = "; ".join(f"{name} {count} stream{'s' if count > 1 else ''}: pika {a:,.0f} msg/s, spark {b:,.0f} "
                     f"msg/s, ratio {b / a:.2f}, driver {100 * driver / data:.2f}%"
                     for name, count, a, b, driver, _, data in results)
    print(f"\nSummary (docs/performance.md): {args.messages:,} x {args.size} B, stream mode availableNow into noop vs pika from "
          f"first (prefetch 1000, ack every 100): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
