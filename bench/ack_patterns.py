"""How fast a RabbitMQ node delivers a backlog under each ack pattern a queue-mode source could use, with no
Spark: what the broker itself allows each design of the source, and what it costs the node.

For each node (`--nodes`: RabbitMQ 3.10 at 5672, RabbitMQ 4.3 at 5682) the same preloaded backlog
(`--messages` x 100 B in a classic queue) is drained by each pattern (`--patterns`):

- `pika`: a plain pika consumer, prefetch 1,000, `basic.ack(multiple)` every 100 (the user's reference);
- `flowing`: our client, at the source's default prefetch on RabbitMQ (40,000), `basic.ack(multiple)`
  every 2,000 as it reads: a source that acks each delivery within moments of its arrival (a journal
  written as deliveries arrive);
- `flowing-paused`: the same, but after every batch (20,000, half the prefetch) it stops reading for
  `--pause` s, as a driver that journals and acks only while Spark asks for a batch would;
- `batches`: our client, the same prefetch, each batch of 20,000 acked whole once it is full, then a pause
  of `--pause` s: the source's acks at the journal write, one batch per trigger, as the source does now.

Printed per pattern: msg/s, the ratio to pika, and the node's own work per message (bench/rabbitmq_probe.py:
its schedulers' microseconds in Erlang code, garbage collection and ports, and the queue process's
reductions).

    python bench/ack_patterns.py [--nodes 4.3,3.10] [--messages 1000000] [--pause 0.5]
                                 [--patterns pika,flowing,flowing-paused,batches]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_vs_rabbitmq import declare_queue, delete_queue  # noqa: E402
from rabbitmq_probe import QueueProbe  # noqa: E402
from read_cold import NODES  # noqa: E402
from read_throughput import pika_drain, preload  # noqa: E402

from spark_amqp.source.bounds import RABBITMQ_DEFAULT_PREFETCH as PREFETCH  # noqa: E402

BATCH = PREFETCH // 2   # the source's batch on RabbitMQ with default options: half its prefetch
ACK_EVERY = 2_000


def _client_drain(url: str, queue: str, n: int, take: int, pause_every: int, pause: float,
                  whole_batches: bool) -> float:
    """Our client drains `n`: it takes up to `take` deliveries at a time and acks them (`whole_batches`: only
    once `take` are in), and stops reading for `pause` s after every `pause_every`."""
    from spark_amqp.client import Connection
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.basic_qos(PREFETCH)
        ch.basic_consume(queue)
        got, since, t0 = 0, 0, time.perf_counter()
        while got < n:
            want = min(take, n - got)
            batch = ch.get_deliveries(want, timeout=10)
            while whole_batches and batch and len(batch) < want:
                more = ch.get_deliveries(want - len(batch), timeout=10)
                if not more:
                    break
                batch += more
            if not batch:
                raise SystemExit(f"stalled after {got} of {n} messages")
            got += len(batch)
            since += len(batch)
            ch.basic_ack(batch[-1].delivery_tag, multiple=True)
            if pause_every and since >= pause_every:
                since = 0
                time.sleep(pause)
        return n / (time.perf_counter() - t0)


def patterns(pause: float) -> dict:
    return {
        "pika": lambda url, q, n: pika_drain(url, q, n, 100),
        "flowing": lambda url, q, n: _client_drain(url, q, n, ACK_EVERY, 0, 0.0, False),
        "flowing-paused": lambda url, q, n: _client_drain(url, q, n, ACK_EVERY, BATCH, pause, False),
        "batches": lambda url, q, n: _client_drain(url, q, n, BATCH, BATCH, pause, True),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="4.3,3.10")
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--pause", type=float, default=0.5, help="seconds a paused pattern stops reading")
    p.add_argument("--patterns", default="pika,flowing,flowing-paused,batches")
    args = p.parse_args(argv)
    drains = patterns(args.pause)
    summary = []
    for node in args.nodes.split(","):
        url, ctl = NODES[node]
        queue = declare_queue(url)
        rates = {}
        try:
            for name in args.patterns.split(","):
                preload(url, queue, args.messages, 100)
                probe = QueueProbe(queue, ctl)
                with probe:
                    rates[name] = drains[name](url, queue, args.messages)
                ratio = f"x pika {rates[name] / rates['pika']:.2f}" if "pika" in rates else ""
                inside = probe.describe(args.messages)
                print(f"RabbitMQ {node} {name:<15} {rates[name]:>9,.0f} msg/s  {ratio}  {inside}", flush=True)
        finally:
            delete_queue(url, queue)
        summary.append(f"RabbitMQ {node}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()))
    print("Summary (docs/performance.md): " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
