"""Hostile input over raw TCP: malformed, oversized and out-of-order frames.

Every case drives a correct handshake with pamqp (``helpers.raw_handshake``), then sends bytes a broken or
hostile client might send. The broker must answer with ``connection.close`` carrying the reply code
RabbitMQ 3.10 uses (observed against 127.0.0.1:5672 with these exact bytes), close the socket, and keep
serving everybody else: after each case a fresh pika client does a publish + get round trip.

The single-connection cases are differential (``broker_url``: embedded and RabbitMQ) because they are
safe to run against the shared RabbitMQ: each only kills its own connection. The flood of 200 garbage
connections and the memory checks run against the embedded broker only.

Observed RabbitMQ 3.10 behaviour the expectations encode:

* frame errors (size above the negotiated frame_max, bad frame-end octet, unknown frame type, a method
  frame too short to hold class and method ids, random bytes) -> connection.close 501 FRAME_ERROR; the
  socket closes about 3 s later (RabbitMQ cannot parse the close-ok it waits for);
* a method on a channel that was never opened, or a channel-class method on channel 0 -> 504 CHANNEL_ERROR;
* a content header or body with no basic.publish before it, a body or a method where the content header
  must come, a heartbeat on a non-zero channel, a content header on channel 0 -> 505 UNEXPECTED_FRAME;
* an unknown class or method id -> RabbitMQ 3.10 drops the socket *without* a connection.close (its
  reader crashes on ``unknown_method_id``). The spec's answer is 540 NOT_IMPLEMENTED (or 503
  COMMAND_INVALID); either is accepted, and so is a bare close, but the socket must close;
* a message whose body is larger than max_message_size -> channel.close 406 PRECONDITION_FAILED (class
  60, method 40) once the body has arrived; the connection stays open.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from typing import Callable

import psutil
import pytest
from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader

from brokers import MIN_FRAME_MAX, require_rabbitmq
from spark_amqp_broker import Broker
from helpers import (
    PROTOCOL_HEADER,
    RawConnection,
    pika_connect,
    raw_handshake,
    raw_socket,
    safe_close,
)

FRAME_END = b"\xce"
# rabbit.max_message_size's default per version (checked with rabbitmqctl): 128 MiB on 3.10, 16 MiB on 4.3.
MAX_MESSAGE_SIZE = {"3.10": 134217728, "4.3": 16777216}
RABBITMQ_MAX_MESSAGE_SIZE = MAX_MESSAGE_SIZE["3.10"]

# ------------------------------------------------------------------------------------------ helpers


def raw_frame(frame_type: int, channel: int, payload: bytes, end: bytes = FRAME_END) -> bytes:
    """A frame built by hand: type, channel, size, payload, frame-end (so it can be made wrong)."""
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + end


def method_payload(class_id: int, method_id: int, args: bytes = b"") -> bytes:
    return struct.pack(">HH", class_id, method_id) + args


def open_channel(rc: RawConnection, channel: int = 1) -> None:
    rc.send(channel, commands.Channel.Open())
    got = rc.read_method()
    assert got is not None, "connection closed instead of channel.open-ok"
    assert got[0] == channel and isinstance(got[1], commands.Channel.OpenOk), got


def await_connection_close(rc: RawConnection, timeout: float = 10.0) -> commands.Connection.Close | None:
    """Read until connection.close (answered with close-ok) or EOF; then require the socket to close.

    Returns the connection.close frame, or None if the broker closed the socket without one.
    Frames other than connection.close before it are a failure (nothing else was asked for).
    """
    deadline = time.monotonic() + timeout
    close = None
    while True:
        got = rc.read_method(max(0.01, deadline - time.monotonic()))
        if got is None:
            return None
        channel, frame = got
        if isinstance(frame, commands.Connection.Close):
            assert channel == 0, f"connection.close on channel {channel}"
            close = frame
            break
        pytest.fail(f"expected connection.close, got {frame!r} on channel {channel}")
    try:
        rc.send(0, commands.Connection.CloseOk())
    except OSError:
        pass  # the broker may close right after connection.close; that is fine
    rest = rc.wait_closed(max(0.01, deadline - time.monotonic()))
    assert not rest, f"frames after connection.close: {rest!r}"
    return close


def assert_broker_serves(url: str, unique_name: Callable[[str], str]) -> None:
    """A fresh pika client can still declare, publish and get on the broker."""
    conn = pika_connect(url)
    try:
        ch = conn.channel()
        q = unique_name("hostile-rt")
        ch.queue_declare(q, exclusive=True, auto_delete=True)
        body = f"still serving {q}".encode()
        ch.basic_publish("", q, body)
        deadline = time.monotonic() + 5
        while True:
            method, _props, got = ch.basic_get(q, auto_ack=True)
            if method is not None:
                break
            assert time.monotonic() < deadline, "published message never became available to basic.get"
            time.sleep(0.01)
        assert got == body
        ch.queue_delete(q)
    finally:
        safe_close(conn)


def close_desc(close: commands.Connection.Close | None) -> str:
    if close is None:
        return "socket closed without connection.close"
    return f"connection.close {close.reply_code} {close.reply_text!r} ({close.class_id},{close.method_id})"


# ------------------------------------------------------------------ one bad frame, one connection

Action = Callable[[RawConnection], None]


def _random_bytes(seed: int) -> Action:
    # With these seeds the first octet is not a valid frame type and the size field is far above
    # frame_max; RabbitMQ answers frame_too_large (501), a broker checking the type first says
    # unknown frame (501): the same code either way.
    return lambda rc: rc.send_bytes(random.Random(seed).randbytes(4096))


def _oversized_body_frame(rc: RawConnection) -> None:
    # frame_max negotiated to the version's smallest (see FRAME_MAX below): a 10,000-octet body frame is too large.
    open_channel(rc)
    rc.send(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
    rc.send(1, pheader.ContentHeader(body_size=10_000))
    rc.send_bytes(raw_frame(3, 1, b"x" * 10_000))


def _oversized_method_frame(rc: RawConnection) -> None:
    rc.send_bytes(raw_frame(1, 0, method_payload(10, 40) + b"\x00" * 10_000))


def _bad_frame_end(rc: RawConnection) -> None:
    open_channel(rc)
    good = pframe.marshal(commands.Basic.Qos(prefetch_count=1), 1)
    rc.send_bytes(good[:-1] + b"\x00")


def _unknown_frame_type(rc: RawConnection) -> None:
    rc.send_bytes(raw_frame(9, 0, b"abc"))


def _unknown_frame_type_on_channel(rc: RawConnection) -> None:
    open_channel(rc)
    rc.send_bytes(raw_frame(9, 1, b"abc"))


def _empty_method_frame(rc: RawConnection) -> None:
    rc.send_bytes(raw_frame(1, 1, b""))


def _method_on_unopened_channel(rc: RawConnection) -> None:
    rc.send(5, commands.Queue.Declare(queue="", exclusive=True))


def _channel_method_on_channel_zero(rc: RawConnection) -> None:
    rc.send(0, commands.Queue.Declare(queue="", exclusive=True))


def _header_without_publish(rc: RawConnection) -> None:
    open_channel(rc)
    rc.send(1, pheader.ContentHeader(body_size=3))


def _body_without_publish(rc: RawConnection) -> None:
    open_channel(rc)
    rc.send(1, pbody.ContentBody(b"abc"))


def _body_before_header(rc: RawConnection) -> None:
    open_channel(rc)
    rc.send(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
    rc.send(1, pbody.ContentBody(b"abc"))


def _method_instead_of_header(rc: RawConnection) -> None:
    open_channel(rc)
    rc.send(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
    rc.send(1, commands.Basic.Qos(prefetch_count=1))


def _heartbeat_on_channel(rc: RawConnection) -> None:
    open_channel(rc)
    rc.send_bytes(raw_frame(8, 1, b""))


def _header_on_channel_zero(rc: RawConnection) -> None:
    rc.send(0, pheader.ContentHeader(body_size=3))


FRAME_MAX = None      # the smallest frame_max the version lets a client negotiate (brokers.MIN_FRAME_MAX)

# (id, action, tune-ok frame_max, expected connection.close reply code)
ERROR_CASES: list[tuple[str, Action, int, int]] = [
    ("random-bytes-seed-0", _random_bytes(0), 131072, 501),
    ("random-bytes-seed-5", _random_bytes(5), 131072, 501),
    ("body-frame-above-frame-max", _oversized_body_frame, FRAME_MAX, 501),
    ("method-frame-above-frame-max", _oversized_method_frame, FRAME_MAX, 501),
    ("bad-frame-end-octet", _bad_frame_end, 131072, 501),
    ("unknown-frame-type", _unknown_frame_type, 131072, 501),
    ("unknown-frame-type-on-open-channel", _unknown_frame_type_on_channel, 131072, 501),
    ("method-frame-without-ids", _empty_method_frame, 131072, 501),
    ("method-on-unopened-channel", _method_on_unopened_channel, 131072, 504),
    ("channel-method-on-channel-0", _channel_method_on_channel_zero, 131072, 504),
    ("content-header-without-publish", _header_without_publish, 131072, 505),
    ("content-body-without-publish", _body_without_publish, 131072, 505),
    ("content-body-before-header", _body_before_header, 131072, 505),
    ("method-where-header-expected", _method_instead_of_header, 131072, 505),
    ("heartbeat-on-channel-1", _heartbeat_on_channel, 131072, 505),
    ("content-header-on-channel-0", _header_on_channel_zero, 131072, 505),
]


@pytest.mark.parametrize("action,frame_max,code",
                         [pytest.param(a, fm, c, id=i) for i, a, fm, c in ERROR_CASES])
def test_bad_frame_closes_connection_with_reply_code(broker_url, unique_name, action, frame_max, code,
                                                     rabbitmq_version):
    rc, _tune = raw_handshake(broker_url, frame_max=frame_max or MIN_FRAME_MAX[rabbitmq_version])
    try:
        action(rc)
        close = await_connection_close(rc)
    finally:
        rc.close()
    assert close is not None, f"expected connection.close {code}, got: {close_desc(close)}"
    assert close.reply_code == code, close_desc(close)
    assert_broker_serves(broker_url, unique_name)


UNKNOWN_METHOD_CASES = [
    pytest.param(0, 99, 99, False, id="unknown-class-on-channel-0"),
    pytest.param(1, 99, 99, True, id="unknown-class-on-open-channel"),
    pytest.param(1, 60, 99, True, id="unknown-basic-method-on-open-channel"),
    pytest.param(3, 99, 99, False, id="unknown-class-on-unopened-channel"),
]


@pytest.mark.parametrize("channel,class_id,method_id,open_first", UNKNOWN_METHOD_CASES)
def test_unknown_class_or_method_closes_connection(broker_url, unique_name,
                                                   channel, class_id, method_id, open_first):
    """RabbitMQ 3.10 drops the socket silently; the spec says 540 (or 503). The socket must close."""
    rc, _tune = raw_handshake(broker_url)
    try:
        if open_first:
            open_channel(rc, channel)
        rc.send_bytes(raw_frame(1, channel, method_payload(class_id, method_id)))
        close = await_connection_close(rc)
    finally:
        rc.close()
    # RabbitMQ 3.10: close is None (silent drop). A connection.close must carry 540 or 503.
    if close is not None:
        assert close.reply_code in (540, 503), close_desc(close)
    assert_broker_serves(broker_url, unique_name)


def _publish_frames() -> bytes:
    return (pframe.marshal(commands.Basic.Publish(exchange="", routing_key="nowhere"), 1)
            + pframe.marshal(pheader.ContentHeader(body_size=10), 1)
            + pframe.marshal(pbody.ContentBody(b"0123456789"), 1))


@pytest.mark.parametrize("cut", [1, 6, 7, 11, 30, -9, -1], ids=lambda c: f"cut{c}")
def test_truncated_frame_then_half_close(broker_url, unique_name, cut):
    """A frame cut short, then EOF from the client: the broker closes its side and keeps serving."""
    rc, _tune = raw_handshake(broker_url)
    try:
        open_channel(rc)
        data = _publish_frames()
        rc.send_bytes(data[:cut])
        rc.sock.shutdown(socket.SHUT_WR)
        frames = rc.wait_closed(10.0)
    finally:
        rc.close()
    # RabbitMQ sends nothing (the peer is gone); a connection.close would be harmless, nothing else is.
    assert all(isinstance(f, commands.Connection.Close) for f in frames), frames
    assert_broker_serves(broker_url, unique_name)


def test_truncated_frames_then_abortive_close(amqp_broker, unique_name):
    """Many connections reset (RST) in the middle of a frame, at every cut point of a publish."""
    data = _publish_frames()
    for cut in range(1, len(data)):
        rc, _tune = raw_handshake(amqp_broker.url)
        open_channel(rc)
        rc.send_bytes(data[:cut])
        rc.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        rc.close()
    assert_broker_serves(amqp_broker.url, unique_name)


# ------------------------------------------------------------------------------- message size


def _publish_oversized(rc: RawConnection, body_size: int) -> None:
    """basic.publish + header + body_size octets of body, streamed in frame_max-sized frames."""
    rc.send(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
    rc.send(1, pheader.ContentHeader(body_size=body_size))
    chunk = 131072 - 8
    frame = pframe.marshal(pbody.ContentBody(b"x" * chunk), 1)
    sent = 0
    try:
        while sent + chunk <= body_size:
            rc.send_bytes(frame)
            sent += chunk
        if body_size > sent:
            rc.send(1, pbody.ContentBody(b"x" * (body_size - sent)))
    except OSError as e:
        pytest.fail(f"the broker dropped the connection after {sent} body octets: {e!r}")


@pytest.mark.parametrize("target", ["embedded-1MiB", "embedded-3.10", "rabbitmq-3.10", "embedded-4.3",
                                    "rabbitmq-4.3"])
def test_message_above_max_message_size_is_refused_on_the_channel(target, unique_name):
    """406 PRECONDITION_FAILED on the channel, the connection stays usable; the embedded broker's default limit
    is RabbitMQ's for the version it behaves as."""
    broker = None
    kind, _, version = target.partition("-")
    if kind == "rabbitmq":
        url, limit = require_rabbitmq(version), MAX_MESSAGE_SIZE[version]
    elif version == "1MiB":
        broker = Broker(port=0, max_message_size=1 << 20).start()
        url, limit = broker.url, 1 << 20
    else:
        broker = Broker(port=0, rabbitmq_version=version).start()
        url, limit = broker.url, MAX_MESSAGE_SIZE[version]  # our default must equal RabbitMQ's
    try:
        rc, _tune = raw_handshake(url)
        try:
            open_channel(rc)
            _publish_oversized(rc, limit + 1)
            got = rc.read_method(timeout=30)
            assert got is not None, "socket closed instead of channel.close 406"
            channel, frame = got
            assert isinstance(frame, commands.Channel.Close) and channel == 1, \
                f"expected channel.close on channel 1, got {frame!r} on channel {channel}"
            assert frame.reply_code == 406, (frame.reply_code, frame.reply_text)
            assert (frame.class_id, frame.method_id) == (60, 40), (frame.class_id, frame.method_id)
            rc.send(1, commands.Channel.CloseOk())
            # the connection survived: reopen the channel and close the connection cleanly
            open_channel(rc, 1)
            rc.send(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
            got = rc.read_method()
            assert got is not None and isinstance(got[1], commands.Connection.CloseOk), got
        finally:
            rc.close()
        assert_broker_serves(url, unique_name)
    finally:
        if broker is not None:
            broker.stop()


@pytest.mark.parametrize("declared", [RABBITMQ_MAX_MESSAGE_SIZE, 2**62],
                         ids=["declared-128MiB", "declared-2e62"])
def test_declared_body_size_is_not_preallocated(amqp_broker, unique_name, declared):
    """A header announcing a huge body, followed by a trickle: no allocation of the announced size.

    Whatever the broker answers (nothing yet, as RabbitMQ 3.10 does, or an early 406 on the channel),
    its memory must not grow by the announced size and other clients must keep working.
    """
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    rc, _tune = raw_handshake(amqp_broker.url)
    try:
        open_channel(rc)
        rc.send(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
        rc.send(1, pheader.ContentHeader(body_size=declared))
        rc.send(1, pbody.ContentBody(b"x" * 100_000))
        rc.sock.settimeout(1.0)
        try:
            data = rc.sock.recv(65536)
        except socket.timeout:
            data = None
        if data is not None:
            rc.buf += data
            assert data, "the broker dropped the connection"
            _ch, frame = pframe.unmarshal(rc.buf)[1:]
            assert isinstance(frame, commands.Channel.Close) and frame.reply_code == 406, frame
        assert_broker_serves(amqp_broker.url, unique_name)
        grown = proc.memory_info().rss - rss_before
        assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB after a header declaring {declared}"
    finally:
        rc.close()


# ------------------------------------------------------------------------- a flood of garbage


def test_200_garbage_connections_while_a_good_client_works(amqp_broker, unique_name):
    url = amqp_broker.url
    n = 200
    # Half complete the handshake and then send garbage; half send garbage instead of the protocol header.
    socks: list[tuple[str, socket.socket]] = []
    try:
        for i in range(n):
            if i % 2 == 0:
                rc, _ = raw_handshake(url)
                socks.append(("after-handshake", rc.sock))
            else:
                socks.append(("pre-handshake", raw_socket(url)))

        stop = threading.Event()
        round_trips: list[float] = []
        errors: list[BaseException] = []

        def good_client() -> None:
            try:
                conn = pika_connect(url)
                ch = conn.channel()
                q = unique_name("good-client")
                ch.queue_declare(q, exclusive=True)
                i = 0
                while not stop.is_set():
                    t0 = time.monotonic()
                    body = f"m{i}".encode()
                    ch.basic_publish("", q, body)
                    while True:
                        method, _p, got = ch.basic_get(q, auto_ack=True)
                        if method is not None:
                            break
                        if time.monotonic() - t0 > 10:
                            raise AssertionError(f"message {i} not available after 10 s")
                    if got != body:
                        raise AssertionError(f"round trip {i}: got {got!r}, expected {body!r}")
                    round_trips.append(time.monotonic() - t0)
                    i += 1
                conn.close()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        good = threading.Thread(target=good_client, daemon=True)
        good.start()
        wait_deadline = time.monotonic() + 10
        while not round_trips and not errors and time.monotonic() < wait_deadline:
            time.sleep(0.01)
        assert round_trips, f"the good client made no round trip before the flood: {errors}"
        before_flood = len(round_trips)

        def flood(part: list[tuple[str, socket.socket]], seed: int) -> None:
            rnd = random.Random(seed)
            for _ in range(4):
                for _kind, s in part:
                    try:
                        s.sendall(rnd.randbytes(rnd.randint(1, 16384)))
                    except OSError:
                        pass

        workers = [threading.Thread(target=flood, args=(socks[k::4], k), daemon=True) for k in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
        assert not any(w.is_alive() for w in workers), "sending garbage blocked for 60 s"

        # Every garbage connection must be closed by the broker.
        deadline = time.monotonic() + 30
        still_open = []
        for kind, s in socks:
            s.settimeout(0.05)
            while True:
                try:
                    chunk = s.recv(65536)
                except socket.timeout:
                    if time.monotonic() > deadline:
                        still_open.append(kind)
                        break
                    continue
                except OSError:
                    break
                if not chunk:
                    break
        assert not still_open, f"{len(still_open)} garbage connections still open after 30 s: {still_open[:5]}"

        # The good client kept working during the flood.
        t_end = time.monotonic() + 5
        while len(round_trips) < before_flood + 20 and not errors and time.monotonic() < t_end:
            time.sleep(0.01)
        stop.set()
        good.join(timeout=15)
        assert not errors, f"the well-behaved client failed: {errors[0]!r}"
        assert not good.is_alive(), "the well-behaved client hung"
        assert len(round_trips) >= before_flood + 20, \
            f"only {len(round_trips) - before_flood} round trips since the flood began"
        assert max(round_trips) < 5.0, f"slowest round trip {max(round_trips):.2f}s"
    finally:
        for _kind, s in socks:
            s.close()
    assert_broker_serves(url, unique_name)


def test_garbage_instead_of_protocol_header_gets_our_header_and_a_close(broker_url, rabbitmq_version):
    """Spec 4.2.2: a bad protocol header is answered with the server's own header (4.x: AMQP 1.0's with SASL),
    then the socket closes."""
    s = raw_socket(broker_url)
    try:
        s.sendall(b"GET / HT")  # exactly 8 octets, as long as a protocol header
        data = b""
        while True:
            try:
                chunk = s.recv(64)
            except socket.timeout:
                pytest.fail(f"socket still open after 5 s (got {data!r})")
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    assert data == (PROTOCOL_HEADER if rabbitmq_version == "3.10" else b"AMQP\x03\x01\x00\x00"), data
