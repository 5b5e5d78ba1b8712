"""Fuzzing the embedded broker with malformed frames over raw sockets (seeded, reproducible).

A seeded generator makes a few thousand hostile inputs from well-formed frames: truncations (with the frame
size fixed up, so the payload itself is short, or left wrong), bit flips, wrong frame sizes, random class
and method ids with random arguments, publishes whose property lists are mutated (headers with nested
tables and arrays, routed through a headers exchange and a dead-lettering queue, in and out of a
transaction), and field tables in method arguments (queue.declare, exchange.bind, basic.consume).

Each case gets its own connection: the handshake, the setup and the case's bytes go out pipelined in one
write, then a sync (tx.commit, channel.open on a fresh channel), then our half of the socket is shut, so
the broker always reaches the end of what was sent and closes. Asserted for every case: no reply code 541
INTERNAL_ERROR (neither connection.close nor channel.close), no error logged by the broker (no
traceback); afterwards a fresh connection works. RabbitMQ is not fuzzed (a shared broker; it answers a
malformed property list or field table with 541 itself, see test_hostile_input.py and docs/broker.md).
"""

from __future__ import annotations

import collections
import datetime
import logging
import random
import socket
import struct
import time

import pika
import pika.exceptions
import pytest
from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader

from spark_amqp_broker import Broker
from helpers import PROTOCOL_HEADER, RawConnection, pika_connect, raw_handshake, safe_close

SEED = 0x5EED_A3
CASES = 3000
FRAME_END = b"\xce"
TIME_BUDGET = 60.0


def frame(channel: int, obj) -> bytes:
    return pframe.marshal(obj, channel)


def raw_frame(ftype: int, channel: int, payload: bytes, end: bytes = FRAME_END) -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + end


def handshake_bytes() -> bytes:
    """Protocol header to channel setup, pipelined: the broker reads it in order without replies."""
    out = [PROTOCOL_HEADER,
           frame(0, commands.Connection.StartOk(client_properties={"product": "fuzz"}, mechanism="PLAIN",
                                                response="\0guest\0guest", locale="en_US")),
           frame(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0)),
           frame(0, commands.Connection.Open(virtual_host="/")),
           frame(1, commands.Channel.Open()),
           frame(3, commands.Channel.Open()),
           frame(3, commands.Tx.Select())]
    return b"".join(out)


def setup_bytes() -> bytes:
    """Topology the cases publish into (idempotent, sent on every connection): a headers exchange bound
    to a bounded queue, and a queue whose messages expire at once into that exchange (dead-lettering
    rewrites the headers table: x-death)."""
    ch = 1
    return b"".join([
        frame(ch, commands.Exchange.Declare(exchange="fuzz.hx", exchange_type="headers")),
        frame(ch, commands.Queue.Declare(queue="fuzz.q", arguments={"x-max-length": 20})),
        frame(ch, commands.Queue.Bind(queue="fuzz.q", exchange="fuzz.hx",
                                      arguments={"x-match": "any", "a": 1, "CC": "x"})),
        frame(ch, commands.Queue.Declare(queue="fuzz.ttl", arguments={
            "x-message-ttl": 0, "x-dead-letter-exchange": "fuzz.hx", "x-max-length": 20})),
    ])


# ------------------------------------------------------------------------------------ the generator


def random_value(rng: random.Random, depth: int):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-2**31, 2**31)
    if kind == 1:
        return rng.random() * 1000
    if kind == 2:
        return "".join(rng.choice("abcxyzé€\n") for _ in range(rng.randrange(8)))
    if kind == 3:
        return bool(rng.randrange(2))
    if kind == 4:
        return None
    if kind == 5:
        return rng.randrange(2**40)
    if kind in (6, 7):
        return random_table(rng, depth + 1)
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def random_table(rng: random.Random, depth: int = 0) -> dict:
    keys = ["a", "b", "CC", "BCC", "x-death", "x-match", "k" * rng.randrange(1, 40)]
    table = {rng.choice(keys): random_value(rng, depth) for _ in range(rng.randrange(5))}
    if "CC" in table and rng.randrange(2):
        table["CC"] = [rng.choice(["fuzz.q", "x", "y"]) for _ in range(rng.randrange(3))]
    if "x-death" in table and rng.randrange(2):
        table["x-death"] = [{"queue": "q", "reason": "expired", "count": 1, "exchange": "",
                             "routing-keys": ["q"]}]
    return table


def random_properties(rng: random.Random) -> commands.Basic.Properties:
    kw = {}
    if rng.randrange(2):
        kw["headers"] = random_table(rng)
    if rng.randrange(3) == 0:
        kw["priority"] = rng.randrange(256)
    if rng.randrange(3) == 0:
        kw["expiration"] = rng.choice(["0", "10", "-1", "abc", "99999999999999999999", ""])
    if rng.randrange(3) == 0:
        kw["user_id"] = rng.choice(["guest", "other", ""])
    if rng.randrange(3) == 0:
        kw["content_type"] = "text/plain"
    if rng.randrange(4) == 0:
        kw["timestamp"] = datetime.datetime.fromtimestamp(rng.randrange(2**31), datetime.UTC)
    if rng.randrange(4) == 0:
        kw["message_id"] = "m" * rng.randrange(10)
    return commands.Basic.Properties(**kw)


def a_publish(rng: random.Random, channel: int) -> list[bytes]:
    body = bytes(rng.randrange(256) for _ in range(rng.randrange(20)))
    target = rng.choice([("", "fuzz.q"), ("fuzz.hx", ""), ("", "fuzz.ttl"), ("", "nowhere"), ("amq.topic", "a.b")])
    props = random_properties(rng)
    out = [frame(channel, commands.Basic.Publish(exchange=target[0], routing_key=target[1],
                                                 mandatory=bool(rng.randrange(2)))),
           frame(channel, pheader.ContentHeader(body_size=len(body), properties=props))]
    if body:
        out.append(frame(channel, pbody.ContentBody(body)))
    return out


def a_method(rng: random.Random, channel: int) -> bytes:
    choice = rng.randrange(8)
    if choice == 0:
        m = commands.Queue.Declare(queue=rng.choice(["", "fuzz.a", "fuzz.q"]), arguments=random_table(rng))
    elif choice == 1:
        m = commands.Exchange.Bind(destination="fuzz.hx", source="amq.headers", arguments=random_table(rng))
    elif choice == 2:
        m = commands.Basic.Consume(queue="fuzz.q", arguments=random_table(rng))
    elif choice == 3:
        m = commands.Queue.Bind(queue="fuzz.q", exchange="fuzz.hx", arguments=random_table(rng))
    elif choice == 4:
        m = commands.Exchange.Declare(exchange="fuzz.x", exchange_type="headers", arguments=random_table(rng))
    elif choice == 5:
        m = commands.Basic.Ack(delivery_tag=rng.randrange(5), multiple=bool(rng.randrange(2)))
    elif choice == 6:
        m = commands.Basic.Qos(prefetch_count=rng.randrange(100))
    else:
        m = commands.Basic.Get(queue="fuzz.q", no_ack=bool(rng.randrange(2)))
    return frame(channel, m)


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One structural mutation of a frame (bytes include the 7-byte frame header and the frame end)."""
    ftype, channel, size = struct.unpack_from(">BHI", data)
    payload = data[7:-1]
    how = rng.randrange(9)
    if how == 0 and payload:        # payload truncated, frame size fixed up (decode errors)
        return raw_frame(ftype, channel, payload[:rng.randrange(len(payload))])
    if how == 1:                    # raw truncation (framing inconsistent)
        return data[:rng.randrange(len(data))]
    if how == 2 and payload:        # bit flips in the payload, framing intact
        p = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(p))
            p[i] ^= 1 << rng.randrange(8)
        return raw_frame(ftype, channel, bytes(p))
    if how == 3:                    # bit flips anywhere
        p = bytearray(data)
        i = rng.randrange(len(p))
        p[i] ^= 1 << rng.randrange(8)
        return bytes(p)
    if how == 4:                    # wrong size field
        wrong = rng.choice([0, 1, size - 1, size + 1, size * 2, 2**32 - 1, rng.randrange(2**32)])
        return struct.pack(">BHI", ftype, channel, max(0, wrong) & 0xFFFFFFFF) + data[7:]
    if how == 5 and payload:        # bytes inserted into the payload
        i = rng.randrange(len(payload) + 1)
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6)))
        return raw_frame(ftype, channel, payload[:i] + junk + payload[i:])
    if how == 6 and len(payload) > 1:   # bytes removed from the middle of the payload
        i = rng.randrange(len(payload))
        return raw_frame(ftype, channel, payload[:i] + payload[i + rng.randrange(1, 5):])
    if how == 7:                    # a length inside the payload set to a big value
        p = bytearray(payload)
        if len(p) >= 4:
            i = rng.randrange(len(p) - 3)
            p[i:i + 4] = struct.pack(">I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, len(p), len(p) + 1]))
        return raw_frame(ftype, channel, bytes(p))
    return raw_frame(ftype, rng.choice([0, 1, 2, 3, 9]), payload)     # another channel


def a_case(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.randrange(6)
    channel = rng.choice([1, 1, 3])
    if kind == 0:       # a publish with one of its frames mutated
        frames = a_publish(rng, channel)
        i = rng.randrange(len(frames))
        frames[i] = mutate(rng, frames[i])
        return "publish", b"".join(frames)
    if kind == 1:       # a content header with a mutated property list (flags and values)
        frames = a_publish(rng, channel)
        header = frames[1][7:-1]
        props = bytearray(header[12:])
        if rng.randrange(2) and len(props) >= 2:
            props[0:2] = struct.pack(">H", rng.randrange(65536) & 0xFFFE)   # random flags, no continuation
        elif props:
            props[rng.randrange(len(props))] ^= 1 << rng.randrange(8)
        if rng.randrange(2) and props:
            props = props[:rng.randrange(len(props))]
        frames[1] = raw_frame(2, channel, header[:12] + bytes(props))
        return "properties", b"".join(frames)
    if kind == 2:       # a method with field-table arguments, mutated
        return "method", mutate(rng, a_method(rng, channel))
    if kind == 3:       # random class and method ids with random arguments
        class_id = rng.choice([10, 20, 40, 50, 60, 85, 90, rng.randrange(65536)])
        method_id = rng.choice([10, 11, 20, 21, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, rng.randrange(65536)])
        args = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        return "random-method", raw_frame(1, rng.choice([0, channel]), struct.pack(">HH", class_id, method_id) + args)
    if kind == 4:       # random bytes shaped like a frame of a random type
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(30)))
        return "random-frame", raw_frame(rng.choice([1, 2, 3, 4, 8, rng.randrange(256)]), channel, payload)
    # several well-formed frames then a mutated one
    frames = a_publish(rng, channel) + [a_method(rng, channel)]
    frames[-1] = mutate(rng, frames[-1])
    return "sequence", b"".join(frames)


# --------------------------------------------------------------------------------------- the test


def run_case(port: int, prefix: bytes, case: bytes, sync: bytes) -> list:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    rc = RawConnection(sock)
    try:
        sock.sendall(prefix + case + sync)
        sock.shutdown(socket.SHUT_WR)
        return rc.wait_closed(timeout=10)
    finally:
        rc.close()


def test_fuzzed_frames_never_get_internal_error(caplog):
    caplog.set_level(logging.ERROR, logger="broker")     # warnings (every refused frame) are not kept
    rng = random.Random(SEED)
    prefix = handshake_bytes() + setup_bytes()
    sync = frame(3, commands.Tx.Commit()) + frame(2, commands.Channel.Open())
    outcomes: collections.Counter = collections.Counter()
    started = time.monotonic()
    with Broker(port=0) as broker:
        for n in range(CASES):
            kind, case = a_case(rng)
            frames = run_case(broker.port, prefix, case, sync)
            closes = [f for f in frames if isinstance(f, (commands.Connection.Close, commands.Channel.Close))]
            for close in closes:
                assert close.reply_code != 541, (n, kind, case.hex(), close)
                outcomes[(kind, type(close).__name__, close.reply_code)] += 1
            if not closes:
                outcomes[(kind, "none", 0)] += 1
            errors = [r for r in caplog.records if r.name.startswith("broker") and r.levelno >= logging.ERROR]
            assert not errors, (n, kind, case.hex(), caplog.text[-3000:])     # a traceback was logged
            assert time.monotonic() - started < TIME_BUDGET, f"only {n} cases in {TIME_BUDGET}s"
        # the broker still serves: a raw handshake and a pika round trip
        rc, _ = raw_handshake(broker.url)
        rc.close()
        conn = pika_connect(broker.url)
        try:
            ch = conn.channel()
            q = ch.queue_declare("", exclusive=True).method.queue
            ch.basic_publish("", q, b"after the fuzz")
            assert ch.basic_get(q, auto_ack=True)[2] == b"after the fuzz"
        finally:
            safe_close(conn)
    # every kind of case ran, and malformed input was answered with frame or syntax errors
    assert {k for k, _, _ in outcomes} == {"publish", "properties", "method", "random-method",
                                           "random-frame", "sequence"}
    codes = {code for _, _, code in outcomes}
    assert 501 in codes and 505 in codes, outcomes


# ------------------------------------------- the undecodable cases, one by one (against RabbitMQ too)

def _ss(s: bytes) -> bytes:
    return bytes([len(s)]) + s


def _method_frame(channel: int, class_id: int, method_id: int, args: bytes) -> bytes:
    return raw_frame(1, channel, struct.pack(">HH", class_id, method_id) + args)


_PUBLISH_TO_Q = _method_frame(1, 60, 40, b"\0\0" + _ss(b"") + _ss(b"fuzz-absent") + b"\0")


def _header(props: bytes) -> bytes:
    return raw_frame(2, 1, struct.pack(">HHQ", 60, 0, 0) + props)


# (bytes after channel 1 is open, RabbitMQ 3.10's answer: code, class, method; measured)
UNDECODABLE_ARGUMENTS = {
    "publish-cut-short": (_method_frame(1, 60, 40, b"\0\0\x05ab"), (501, 60, 40)),
    "publish-without-arguments": (_method_frame(1, 60, 40, b""), (501, 60, 40)),
    "queue-declare-cut-short": (_method_frame(1, 50, 10, b"\0\0\x05ab"), (501, 50, 10)),
    "queue-declare-arguments-past-end": (
        _method_frame(1, 50, 10, b"\0\0" + _ss(b"q") + b"\0" + struct.pack(">I", 10) + b"\x01a"), (501, 50, 10)),
    "ack-cut-short": (_method_frame(1, 60, 80, b"\0\0\0"), (501, 60, 80)),
}

# RabbitMQ 3.10 answers these with 541 INTERNAL_ERROR (class 0, method 0): its decoder crashes on the
# property list. The embedded broker answers 501 FRAME_ERROR.
UNDECODABLE_PROPERTIES = {
    "headers-table-past-end": _PUBLISH_TO_Q + _header(b"\x20\x00" + struct.pack(">I", 10) + b"\x01a"),
    "headers-unknown-field-type": _PUBLISH_TO_Q + _header(b"\x20\x00" + struct.pack(">I", 4) + b"\x01aZ\x00"),
    "headers-nested-table-past-end": _PUBLISH_TO_Q + _header(
        b"\x20\x00" + struct.pack(">I", 8) + b"\x01aF" + struct.pack(">I", 40) + b"\x00"),
    "priority-missing": _PUBLISH_TO_Q + _header(b"\x08\x00"),
    "expiration-past-end": _PUBLISH_TO_Q + _header(struct.pack(">H", 0x0100) + b"\x0a12"),
}


def _close_after(url: str, data: bytes) -> commands.Connection.Close | None:
    rc, _ = raw_handshake(url)
    try:
        rc.send(1, commands.Channel.Open())
        got = rc.read_method()
        assert got is not None and isinstance(got[1], commands.Channel.OpenOk), got
        rc.send_bytes(data)
        close = None
        while True:
            got = rc.read_method(timeout=10)
            if got is None:
                return close
            if isinstance(got[1], commands.Connection.Close):
                close = got[1]
                rc.send(0, commands.Connection.CloseOk())
    finally:
        rc.close()


@pytest.mark.parametrize("name", sorted(UNDECODABLE_ARGUMENTS))
def test_undecodable_arguments_are_frame_errors(broker_url, name):
    data, expected = UNDECODABLE_ARGUMENTS[name]
    close = _close_after(broker_url, data)
    assert close is not None, "socket closed without connection.close"
    assert (close.reply_code, close.class_id, close.method_id) == expected, close.reply_text
    assert close.reply_text.startswith("FRAME_ERROR - ")


@pytest.mark.parametrize("name", sorted(UNDECODABLE_PROPERTIES))
def test_undecodable_properties_are_frame_errors(amqp_url, caplog, name):
    caplog.set_level(logging.ERROR, logger="broker")
    close = _close_after(amqp_url, UNDECODABLE_PROPERTIES[name])
    assert close is not None, "socket closed without connection.close"
    assert close.reply_code == 501, close.reply_text
    assert close.reply_text.startswith("FRAME_ERROR - ")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("x_match, text", [
    (True, "Invalid x-match field type bool (value true); expected longstr"),
    ("bogus", 'Invalid x-match field value <<"bogus">>; expected all, any, all-with-x, or any-with-x'),
], ids=["bool", "unknown-mode"])
def test_headers_binding_with_bad_x_match_is_refused(broker_url, unique_name, x_match, text):
    """Found by the fuzzer: a non-string x-match used to crash routing (541). RabbitMQ refuses the bind."""
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        x = unique_name("fuzz-hx")
        ch.exchange_declare(x, "headers", auto_delete=True)
        q = ch.queue_declare("", exclusive=True).method.queue
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            ch.queue_bind(q, x, arguments={"x-match": x_match})
        assert info.value.reply_code == 406
        assert info.value.reply_text == f"PRECONDITION_FAILED - {text}"
        ch = conn.channel()
        ch.exchange_delete(x)
    finally:
        safe_close(conn)
