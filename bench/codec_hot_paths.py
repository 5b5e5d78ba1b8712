"""The codec's hand-written per-message paths vs the same work through pamqp objects, in the same run.

`spark_amqp.codec.methods` writes a few methods by hand because they run once per message; this benchmark
is why (its figures are quoted in that module's docstring). No broker, one process, pure CPU; each figure
is the best of ``--rounds`` (5) runs, since the best run is the one least disturbed by the rest of the
machine. ``--messages`` (100,000) messages of ``--size`` (100) bytes, typical properties (content_type,
delivery_mode, message_id, timestamp, two headers):

* publish + content, encode (client, sink): `methods.encode_publish_message` from pre-encoded property
  bytes, and from a properties dict (`properties.encode` per message) vs pamqp Basic.Publish +
  ContentHeader(Basic.Properties) + ContentBody through `pamqp.frame.marshal`;
* publish + content, decode (broker): `FrameReader` + `decode_publish` + `decode_content_header`
  (properties kept raw) vs `pamqp.frame.unmarshal` of each frame;
* deliver + content, encode (broker): `deliver_frames` (the content header passed through raw) vs pamqp;
* deliver + content, decode (client, source): the client's `EventParser` (whole deliveries, properties
  raw; and with `properties` decoded by pamqp, the worst case) vs pamqp objects assembled into messages;
* basic.ack, encode and decode (a consumer's acks, a broker's confirms).

``--end-to-end URL`` (optional, heavier: run it alone) adds publish (confirms, window 1,000) and consume
(prefetch 1,000, ack multiple every 100) through a broker with our client and with pika.

    python bench/codec_hot_paths.py
    python bench/codec_hot_paths.py --messages 200000 --size 1000
    python bench/codec_hot_paths.py --end-to-end amqp://guest:guest@127.0.0.1:5672/%2F
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

from spark_amqp.client.events import EventParser  # noqa: E402
from spark_amqp.codec import frames, methods  # noqa: E402
from spark_amqp.codec.properties import encode as encode_properties  # noqa: E402

FRAME_HEAD = struct.Struct(">BHI")
CHUNK = 256 * 1024
EX, RK = methods.shortstr("events"), methods.shortstr("orders.eu")


def properties(i: int) -> C.Basic.Properties:
    return C.Basic.Properties(
        content_type="application/json", delivery_mode=2, message_id=f"msg-{i:08d}",
        timestamp=datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
        headers={"source": "bench", "attempt": 1})


def chunks(stream: bytes) -> list[bytes]:
    return [stream[i:i + CHUNK] for i in range(0, len(stream), CHUNK)]


def pamqp_split(data: list[bytes]):
    """Frames split with struct, each unmarshalled by pamqp (what a client built on pamqp objects does)."""
    rest = b""
    for chunk in data:
        buf = rest + chunk if rest else chunk
        pos, end_all = 0, len(buf)
        while end_all - pos >= 8:
            size = FRAME_HEAD.unpack_from(buf, pos)[2]
            end = pos + 8 + size
            if end > end_all:
                break
            yield pframe.unmarshal(buf[pos:end])[2]
            pos = end
        rest = buf[pos:]


def assemble_pamqp(data: list[bytes], method_type) -> int:
    """Messages assembled from pamqp's method, ContentHeader and ContentBody objects."""
    messages = []
    current = None
    for frame in pamqp_split(data):
        if isinstance(frame, method_type):
            current = [frame, None, []]
        elif isinstance(frame, pheader.ContentHeader):
            current[1] = frame
        elif isinstance(frame, pbody.ContentBody):
            current[2].append(frame.value)
            if sum(map(len, current[2])) == current[1].body_size:
                messages.append((current[0], current[1].properties, b"".join(current[2])))
    return len(messages)


# --- publish -------------------------------------------------------------------------------------

def publish_stream(n: int, size: int) -> bytes:
    raw = encode_properties(properties(1))
    body = b"x" * size
    return b"".join(methods.encode_publish_message(1, EX, RK, False, raw, body, 131072) for _ in range(n))


def publish_encode_fast(n: int, size: int, raw_props: bytes) -> int:
    body = b"x" * size
    total = 0
    for _ in range(n):
        total += len(methods.encode_publish_message(1, EX, RK, False, raw_props, body, 131072))
    return total


def publish_encode_fast_dict(n: int, size: int) -> int:
    body = b"x" * size
    props = {"content_type": "application/json", "delivery_mode": 2, "message_id": "msg-00000001",
             "headers": {"source": "bench", "attempt": 1}}
    total = 0
    for _ in range(n):
        total += len(methods.encode_publish_message(1, EX, RK, False, encode_properties(props), body, 131072))
    return total


def publish_encode_pamqp(n: int, size: int) -> int:
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


def publish_decode_fast(data: list[bytes]) -> int:
    """The broker's path: frames split, publish arguments and the header's body size read, properties and
    body kept as bytes."""
    reader = frames.FrameReader(131072)
    count = 0
    for chunk in data:
        reader.feed(chunk)
        for ftype, _channel, payload in reader.frames():
            if ftype == frames.FRAME_METHOD:
                methods.decode_publish(payload)
            elif ftype == frames.FRAME_HEADER:
                frames.decode_content_header(payload)
            elif ftype == frames.FRAME_BODY:
                count += 1
    return count


# --- deliver -------------------------------------------------------------------------------------

def deliver_encode_fast(n: int, size: int) -> tuple[int, bytes]:
    """The broker's path: basic.deliver by hand, the content header passed through as received."""
    header = frames.content_header(size, encode_properties(properties(1)))
    body = b"x" * size
    ctag = methods.shortstr("amq.ctag-bench")
    parts = []
    for i in range(n):
        parts += methods.deliver_frames(1, ctag, i + 1, False, EX, RK, header, body, 131072)
    return n, b"".join(parts)


def deliver_encode_pamqp(n: int, size: int) -> tuple[int, bytes]:
    props = properties(1)
    body = b"x" * size
    parts = []
    for i in range(n):
        parts.append(pframe.marshal(C.Basic.Deliver("amq.ctag-bench", i + 1, False, "events", "orders.eu"), 1))
        parts.append(pframe.marshal(pheader.ContentHeader(0, size, props), 1))
        parts.append(pframe.marshal(pbody.ContentBody(body), 1))
    return n, b"".join(parts)


def deliver_decode_fast(data: list[bytes], decode: bool) -> int:
    parser = EventParser()
    count = 0
    for chunk in data:
        for ev in parser.feed(chunk):
            if decode:
                ev.properties
            count += 1
    return count


# --- ack -----------------------------------------------------------------------------------------

def ack_encode_fast(n: int) -> bytes:
    return b"".join(methods.encode_ack(1, i + 1, False) for i in range(n))


def ack_encode_pamqp(n: int) -> bytes:
    return b"".join(pframe.marshal(C.Basic.Ack(i + 1, False), 1) for i in range(n))


def ack_decode_fast(data: list[bytes]) -> int:
    reader = frames.FrameReader(131072)
    count = 0
    for chunk in data:
        reader.feed(chunk)
        for _ftype, _channel, payload in reader.frames():
            methods.decode_ack(payload)
            count += 1
    return count


def ack_decode_pamqp(data: list[bytes]) -> int:
    return sum(1 for frame in pamqp_split(data) if isinstance(frame, C.Basic.Ack))


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

    published = chunks(publish_stream(n, size))
    delivered = chunks(deliver_encode_fast(n, size)[1])
    acks = chunks(ack_encode_fast(n))
    raw_props = encode_properties(properties(1))
    # both paths produce and read the same bytes
    assert deliver_encode_fast(3, size)[1] == deliver_encode_pamqp(3, size)[1]
    assert ack_encode_fast(3) == ack_encode_pamqp(3)
    assert publish_decode_fast(published) == assemble_pamqp(published, C.Basic.Publish) == n
    assert deliver_decode_fast(delivered, False) == assemble_pamqp(delivered, C.Basic.Deliver) == n
    assert ack_decode_fast(acks) == ack_decode_pamqp(acks) == n

    rate = lambda fn: best_rate(fn, n, rounds)  # noqa: E731
    pairs = [
        ("publish + content  encode", "pre-encoded properties",
         rate(lambda: publish_encode_fast(n, size, raw_props)), rate(lambda: publish_encode_pamqp(n, size))),
        ("publish + content  encode", "properties from a dict",
         rate(lambda: publish_encode_fast_dict(n, size)), None),
        ("publish + content  decode", "properties raw",
         rate(lambda: publish_decode_fast(published)), rate(lambda: assemble_pamqp(published, C.Basic.Publish))),
        ("deliver + content  encode", "header passed through",
         rate(lambda: deliver_encode_fast(n, size)), rate(lambda: deliver_encode_pamqp(n, size))),
        ("deliver + content  decode", "properties raw",
         rate(lambda: deliver_decode_fast(delivered, False)),
         rate(lambda: assemble_pamqp(delivered, C.Basic.Deliver))),
        ("deliver + content  decode", "properties decoded",
         rate(lambda: deliver_decode_fast(delivered, True)), None),
        ("basic.ack          encode", "", rate(lambda: ack_encode_fast(n)), rate(lambda: ack_encode_pamqp(n))),
        ("basic.ack          decode", "", rate(lambda: ack_decode_fast(acks)), rate(lambda: ack_decode_pamqp(acks))),
    ]
    print(f"codec hot paths: {n:,} messages of {size} bytes, best of {rounds} (Python {sys.version.split()[0]}), "
          "operations per second")
    print(f"  {'method':26s} {'ours':24s} {'ours/s':>12s} {'pamqp/s':>12s} {'ratio':>7s}")
    pamqp_rate = None
    for what, how, ours, theirs in pairs:
        pamqp_rate = theirs if theirs is not None else pamqp_rate
        print(f"  {what:26s} {how:24s} {ours:>12,.0f} {pamqp_rate:>12,.0f} {ours / pamqp_rate:>6.1f}x")
    if args.end_to_end:
        end_to_end(args.end_to_end, n, size)


if __name__ == "__main__":
    main()
