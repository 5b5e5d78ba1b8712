"""What persistence (`--data-dir`) costs a publisher that waits for confirms, next to RabbitMQ.

Why: with a data directory a confirm is sent only once its message is fsynced, so the publish rate
depends on how well fsyncs are grouped (one per read cycle / timer tick, for every publish read in it).
This measures the same pipelined publisher (pika SelectConnection, confirms, at most ``--window``
unconfirmed; see broker_vs_rabbitmq.py) publishing ``--messages`` persistent (delivery_mode=2) messages
of ``--size`` bytes to a durable queue on:

* the embedded broker without ``--data-dir`` (nothing is written),
* the embedded broker with ``--data-dir`` (a fresh directory under ``--dir``, default the system temp dir:
  a real disk, not tmpfs, for the figure to mean anything),
* RabbitMQ (``--rabbitmq-url``), which writes persistent messages on durable queues to disk too,

in the same run, ``--rounds`` times alternating the order, then consumes them back (pika, prefetch 1,000,
ack every 100), and prints the medians of both rates and the ratios with-data-dir / without and
with-data-dir / RabbitMQ. Queues carry x-expires (10 min) and are deleted.

Run from the repository root::

    python bench/broker_persistence.py
    python bench/broker_persistence.py --messages 50000 --rounds 5 --skip-rabbitmq
    python bench/broker_persistence.py --messages 100000 --size 1024      # the durability issue's case
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pika

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_vs_rabbitmq import (DEFAULT_RABBITMQ_URL, QUEUE_EXPIRES_MS, REPO_ROOT, Consumer,  # noqa: E402
                                Publisher, delete_queue, free_port, stop_embedded, wait_for_port)

PERSISTENT = pika.BasicProperties(delivery_mode=2)


class PersistentPublisher(Publisher):
    def _pump(self):
        publish = self.channel.basic_publish
        stop = min(self.n, self.confirmed + self.window)
        while self.published < stop:
            publish("", self.queue, self.body, PERSISTENT)
            self.published += 1


def start(data_dir: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "spark_amqp_broker", "--port", str(port), "--log-level", "WARNING"]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    wait_for_port("127.0.0.1", port, time.monotonic() + 30, proc)
    return proc, f"amqp://guest:guest@127.0.0.1:{port}/%2F"


def rates(url: str, args) -> tuple[float, float]:
    """(publish msg/s, consume msg/s): the persistent messages published with confirms, then consumed
    back (prefetch 1,000, ack multiple every 100) from the durable queue."""
    name = f"bench-persist-{uuid.uuid4().hex[:12]}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare(name, durable=True, arguments={"x-expires": QUEUE_EXPIRES_MS})
    conn.close()
    try:
        pub = PersistentPublisher(url, name, args.messages, args.size, args.window, args.timeout)
        pub.run()
        con = Consumer(url, name, args.messages, args.size, 1000, 100, args.timeout)
        con.run()
        return args.messages / (pub.t1 - pub.t0), args.messages / (con.t1 - con.t0)
    finally:
        delete_queue(url, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--window", type=int, default=1_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--dir", default=None, help="where the data directory is made (default: temp dir)")
    p.add_argument("--rabbitmq-url", default=DEFAULT_RABBITMQ_URL)
    p.add_argument("--skip-rabbitmq", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="broker-persist-") as tmp:
        plain, plain_url = start(None)
        durable, durable_url = start(str(Path(tmp) / "data"))
        targets = {"embedded": plain_url, "embedded --data-dir": durable_url}
        if not args.skip_rabbitmq:
            targets["RabbitMQ"] = args.rabbitmq_url
        measured: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        try:
            for r in range(args.rounds):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for name in order:
                    measured[name].append(rates(targets[name], args))
                print(f"round {r + 1}: " + ", ".join(f"{n} publish {measured[n][-1][0]:,.0f}/s consume "
                                                     f"{measured[n][-1][1]:,.0f}/s" for n in targets), flush=True)
        finally:
            stop_embedded(plain)
            stop_embedded(durable)
    pub = {name: statistics.median(p for p, _ in v) for name, v in measured.items()}
    con = {name: statistics.median(c for _, c in v) for name, v in measured.items()}
    print(f"\npersistent messages, durable queue, confirms, window {args.window}, {args.size} B, "
          f"{args.messages} per round, median of {args.rounds}:")
    for name in measured:
        print(f"  {name:22s} publish {pub[name]:10,.0f} msg/s   consume {con[name]:10,.0f} msg/s")
    d = "embedded --data-dir"
    line = (f"Summary (docs/performance.md): persistent, durable queue, {args.messages:,} x {args.size} B: --data-dir publish "
            f"{pub[d]:,.0f} msg/s ({pub[d] / pub['embedded']:.2f}x no data dir), consume {con[d]:,.0f} msg/s "
            f"({con[d] / con['embedded']:.2f}x)")
    if "RabbitMQ" in measured:
        line += (f"; vs RabbitMQ 3.10: publish {pub[d] / pub['RabbitMQ']:.2f}x ({pub['RabbitMQ']:,.0f}), "
                 f"consume {con[d] / con['RabbitMQ']:.2f}x ({con['RabbitMQ']:,.0f}) (targets >= 1.0)")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
