"""The client's per-message codecs: hand-written fast paths vs the plain pamqp path, in the same run.

What it measures (no broker, one process, pure CPU):

* deliveries parsed/s: a byte stream of ``--messages`` basic.deliver + content header + body frame
  triples (``--size``-byte bodies, typical properties: content_type, delivery_mode, message_id,
  timestamp, two headers), fed in 256 KiB chunks as the reader thread receives them.
  - fast: `FrameParser.feed` -> `Delivery` objects, properties kept as raw bytes (the source's case:
    most properties are rendered later, from the raw bytes or on demand);
  - fast+props: the same, then each delivery's `properties` decoded by pamqp (the worst case);
  - pamqp: frames split with struct (the same way), each frame through `pamqp.frame.unmarshal`, messages
    assembled from Basic.Deliver + ContentHeader + ContentBody (what a client built on pamqp objects does).
* publishes encoded/s: basic.publish + content header + body frames as one bytes object.
  - fast: `encode_publish` with pre-encoded property bytes (the sink encodes a row's properties once);
  - fast+dict: `encode_properties(dict)` per message, then `encode_publish`;
  - pamqp: Basic.Publish + ContentHeader(Basic.Properties) + ContentBody through `pamqp.frame.marshal`.
* ratios fast/pamqp. Each figure is the best of ``--rounds`` (5) runs: the machine is shared, and the
  best run is the one least disturbed by others.

``--end-to-end URL`` (optional, and heavier: run it alone) adds publish (confirms, window 1,000) and
consume (prefetch 1,000, ack multiple every 100) through a broker with this client and with pika.

Run from the repository root::

    python bench/client_hot_paths.py
    python bench/client_hot_paths.py --messages 200000 --size 1000
    python bench/client_hot_paths.py --end-to-end amqp://guest:guest@127.0.0.1:5672/%2F
"""

from __future__ import annotations

import argparse
import datetime
import os
import struct
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pamqp import body as pbody  # noqa: E402
from pamqp import commands as C  # noqa: E402
from pamqp import frame as pframe  # noqa: E402
from pamqp import header as pheader  # noqa: E402

from spark_amqp.client.frames import (FrameParser, encode_properties, encode_publish,  # noqa: E402
                                      shortstr)

FRAME_HEAD = struct.Struct(">BHI")
CHUNK = 256 * 1024


def properties(i: int) -> C.Basic.Properties:
    return C.Basic.Properties(
        content_type="application/json", delivery_mode=2, message_id=f"msg-{i:08d}",
        timestamp=datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
        headers={"source": "bench", "attempt": 1})


def delivery_stream(n: int, size: int) -> bytes:
    body = b"x" * size
    parts = []
    for i in range(n):
        deliver = C.Basic.Deliver("amq.ctag-bench", i + 1, False, "events", "orders.eu")
        parts.append(pframe.marshal(deliver, 1))
        parts.append(pframe.marshal(pheader.ContentHeader(0, size, properties(i)), 1))
        parts.append(pframe.marshal(pbody.ContentBody(body), 1))
    return b"".join(parts)


def chunks(stream: bytes) -> list[bytes]:
    return [stream[i:i + CHUNK] for i in range(0, len(stream), CHUNK)]


def parse_fast(data: list[bytes], decode: bool) -> int:
    parser = FrameParser()
    count = 0
    for chunk in data:
        for ev in parser.feed(chunk):
            if decode:
                ev.properties
            count += 1
    return count


def parse_pamqp(data: list[bytes]) -> int:
    """Split frames with struct, unmarshal each with pamqp, assemble messages from pamqp objects."""
    rest = b""
    messages = []
    current = None
    for chunk in data:
        buf = rest + chunk if rest else chunk
        pos, end_all = 0, len(buf)
        while end_all - pos >= 8:
            size = FRAME_HEAD.unpack_from(buf, pos)[2]
            end = pos + 8 + size
            if end > end_all:
                break
            _, _, frame = pframe.unmarshal(buf[pos:end])
            pos = end
            if isinstance(frame, C.Basic.Deliver):
                current = [frame, None, []]
            elif isinstance(frame, pheader.ContentHeader):
                current[1] = frame
            elif isinstance(frame, pbody.ContentBody):
                current[2].append(frame.value)
                if sum(map(len, current[2])) == current[1].body_size:
                    messages.append((current[0], current[1].properties, b"".join(current[2])))
        rest = buf[pos:]
    return len(messages)


def publish_fast(n: int, size: int, raw_props: bytes) -> int:
    body = b"x" * size
    ex, rk = shortstr("events"), shortstr("orders.eu")
    total = 0
    for _ in range(n):
        total += len(encode_publish(1, ex, rk, False, raw_props, body, 131072))
    return total


def publish_fast_dict(n: int, size: int) -> int:
    body = b"x" * size
    ex, rk = shortstr("events"), shortstr("orders.eu")
    props = {"content_type": "application/json", "delivery_mode": 2, "message_id": "msg-00000001",
             "headers": {"source": "bench", "attempt": 1}}
    total = 0
    for _ in range(n):
        total += len(encode_publish(1, ex, rk, False, encode_properties(props), body, 131072))
    return total


def publish_pamqp(n: int, size: int) -> int:
    body = b"x" * size
    total = 0
    for _ in range(n):
        props = C.Basic.Properties(content_type="application/json", delivery_mode=2,
                                   message_id="msg-00000001", headers={"source": "bench", "attempt": 1})
        data = b"".join([pframe.marshal(C.Basic.Publish(exchange="events", routing_key="orders.eu"), 1),
                         pframe.marshal(pheader.ContentHeader(0, size, props), 1),
                         pframe.marshal(pbody.ContentBody(body), 1)])
        total += len(data)
    return total


def best_rate(fn, n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def end_to_end(url: str, n: int, size: int) -> None:
    import pika

    from spark_amqp.client import Connection

    body = b"x" * size
    raw = encode_properties({"content_type": "application/octet-stream"})
    results = {}
    with Connection.open(url) as conn:
        ch = conn.channel()
        q = ch.queue_declare(f"bench-{uuid.uuid4().hex[:8]}", arguments={"x-expires": 600_000}).name
        ch.confirm_select(window=1000)
        t0 = time.perf_counter()
        for _ in range(n):
            ch.publish("", q, body, raw)
        ch.wait_for_confirms(120)
        results["publish", "ours"] = n / (time.perf_counter() - t0)
        ch.basic_qos(1000)
        t0 = time.perf_counter()
        ch.basic_consume(q)
        got = 0
        since_ack = 0
        while got < n:
            batch = ch.get_deliveries(1000, timeout=10)
            if not batch:
                raise RuntimeError("consume stalled")
            got += len(batch)
            since_ack += len(batch)
            if since_ack >= 100 or got == n:
                ch.basic_ack(batch[-1].delivery_tag, multiple=True)
                since_ack = 0
        results["consume", "ours"] = n / (time.perf_counter() - t0)
        ch.queue_delete(q)

    pconn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        pch = pconn.channel()
        q = pch.queue_declare(f"bench-{uuid.uuid4().hex[:8]}", arguments={"x-expires": 600_000}).method.queue
        pch.confirm_delivery()  # BlockingChannel confirms each publish synchronously: no window in pika's
        props = pika.BasicProperties(content_type="application/octet-stream")  # blocking API
        m = max(n // 10, 1)
        t0 = time.perf_counter()
        for _ in range(m):
            pch.basic_publish("", q, body, props)
        results["publish", "pika"] = m / (time.perf_counter() - t0)
        for _ in range(n - m):
            pch.basic_publish("", q, body, props)
        pch.basic_qos(prefetch_count=1000)
        got = 0
        t0 = time.perf_counter()
        for method, _, _ in pch.consume(q, inactivity_timeout=10):
            if method is None:
                raise RuntimeError("pika consume stalled")
            got += 1
            if got % 100 == 0 or got == n:
                pch.basic_ack(method.delivery_tag, multiple=True)
            if got == n:
                break
        results["consume", "pika"] = n / (time.perf_counter() - t0)
        pch.cancel()
        pch.queue_delete(q)
    finally:
        pconn.close()
    print(f"\nend to end through {url.split('@')[-1]} ({n:,} messages of {size} bytes):")
    for phase in ("publish", "consume"):
        ours, theirs = results[phase, "ours"], results[phase, "pika"]
        print(f"  {phase:8s} ours {ours:>10,.0f} msg/s   pika {theirs:>10,.0f} msg/s   "
              f"ratio {ours / theirs:5.2f}")
    print("  (pika publish: BlockingChannel.confirm_delivery waits for each confirm; ours pipelines)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--end-to-end", metavar="URL")
    args = ap.parse_args()
    n, size, rounds = args.messages, args.size, args.rounds

    data = chunks(delivery_stream(n, size))
    assert parse_fast(data, False) == parse_fast(data, True) == parse_pamqp(data) == n
    raw_props = encode_properties(properties(1))
    assert publish_fast(1, size, raw_props) > 0 and publish_pamqp(1, size) > 0

    parse, publish = "deliveries parsed/s", "publishes encoded/s"
    rows = [
        (parse, "fast (lazy properties)", best_rate(lambda: parse_fast(data, False), n, rounds)),
        (parse, "fast + properties decoded", best_rate(lambda: parse_fast(data, True), n, rounds)),
        (parse, "pamqp", best_rate(lambda: parse_pamqp(data), n, rounds)),
        (publish, "fast (pre-encoded properties)",
         best_rate(lambda: publish_fast(n, size, raw_props), n, rounds)),
        (publish, "fast + properties from a dict", best_rate(lambda: publish_fast_dict(n, size), n, rounds)),
        (publish, "pamqp", best_rate(lambda: publish_pamqp(n, size), n, rounds)),
    ]
    print(f"client hot paths: {n:,} messages of {size} bytes, best of {rounds} "
          f"(Python {sys.version.split()[0]})")
    for what, path, rate in rows:
        print(f"  {what:20s} {path:32s} {rate:>12,.0f}")
    parse_pamqp_rate, publish_pamqp_rate = rows[2][2], rows[5][2]
    print("ratios (fast / pamqp):")
    print(f"  parse:   lazy {rows[0][2] / parse_pamqp_rate:5.1f}x   with properties decoded "
          f"{rows[1][2] / parse_pamqp_rate:5.1f}x")
    print(f"  publish: pre-encoded {rows[3][2] / publish_pamqp_rate:5.1f}x   properties from a dict "
          f"{rows[4][2] / publish_pamqp_rate:5.1f}x")
    if args.end_to_end:
        end_to_end(args.end_to_end, n, size)


if __name__ == "__main__":
    main()
