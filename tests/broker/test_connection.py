"""Connection-level behaviour, differential: every test using ``broker_url`` runs against the embedded
broker and against RabbitMQ 3.10 with the same assertions (RabbitMQ's observed behaviour is the truth).

Tests named ``test_embedded_only_*`` run only against the embedded broker (RabbitMQ's settings cannot be
changed safely from a test here).
"""

from __future__ import annotations

import socket
import time

import amqp
import amqp.exceptions
import pika
import pika.exceptions
import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import header as pheader
from pamqp import frame as pframe
from pamqp import heartbeat as pheartbeat

from brokers import MIN_FRAME_MAX
from helpers import (PROTOCOL_HEADER, RawConnection, amqp_connect, parse_url, pika_connect,
                     raw_handshake, raw_socket, recv_until_closed, safe_close)
from waiting import wait_until

EXPECTED_CAPABILITIES = (
    "publisher_confirms", "basic.nack", "consumer_cancel_notify", "exchange_exchange_bindings",
    "connection.blocked", "authentication_failure_close", "per_consumer_qos",
)

AUTH_FAILURE_CLOSE = {"capabilities": {"authentication_failure_close": True}}


def _with_url(url: str, *, user: str | None = None, password: str | None = None,
              vhost: str | None = None) -> str:
    u = parse_url(url)
    vh = vhost if vhost is not None else u.vhost
    vh_enc = "%2F" if vh == "/" else vh
    return f"amqp://{user or u.user}:{password or u.password}@{u.host}:{u.port}/{vh_enc}"


def _start_raw(url: str) -> tuple[RawConnection, C.Connection.Start]:
    rc = RawConnection(raw_socket(url))
    rc.send_bytes(PROTOCOL_HEADER)
    got = rc.read_method()
    assert got is not None, "server closed the socket instead of sending connection.start"
    ch, start = got
    assert ch == 0 and isinstance(start, C.Connection.Start), start
    return rc, start


# ------------------------------------------------------------------------------- protocol header


@pytest.mark.parametrize("header", [
    b"AMQP\x00\x00\x08\x00",          # AMQP 0-8 style
    b"AMQP\x00\x00\x09\x00",          # 0-9-0
    b"AMQP\x00\x00\x09\x02",          # unknown revision
    b"AMQP\x01\x00\x00\x00",          # AMQP 1.0
    b"AMQX\x00\x00\x09\x01",          # not AMQP at all
    b"HTTP/1.1 GET /\r\n\r\n",
], ids=["0-8", "0-9-0", "0-9-2", "1-0", "AMQX", "http"])
def test_bad_protocol_header_gets_supported_header_and_close(broker_url, header, rabbitmq_version):
    """The server's header in reply: 0-9-1's (4.x: for an AMQP 0-9-x header only; for any other, AMQP 1.0's
    with the SASL layer), then the socket closes."""
    s = raw_socket(broker_url)
    try:
        s.sendall(header)
        amqp09 = header[:6] == b"AMQP\x00\x00" and header[6] >= 9
        expected = b"AMQP\x00\x00\x09\x01" if rabbitmq_version == "3.10" or amqp09 else b"AMQP\x03\x01\x00\x00"
        assert recv_until_closed(s, timeout=10) == expected
    finally:
        s.close()


def test_good_protocol_header_gets_connection_start(broker_url):
    rc, start = _start_raw(broker_url)
    try:
        assert (start.version_major, start.version_minor) == (0, 9)
        assert set(start.mechanisms.split()) >= {"PLAIN", "AMQPLAIN"}
        assert "en_US" in start.locales.split()
        caps = start.server_properties["capabilities"]
        for cap in EXPECTED_CAPABILITIES:
            assert caps.get(cap) is True, cap
    finally:
        rc.close()


def test_broker_still_serves_after_bad_header(broker_url):
    s = raw_socket(broker_url)
    s.sendall(b"GARBAGE!")
    recv_until_closed(s)
    s.close()
    conn = pika_connect(broker_url)
    try:
        assert conn.channel().is_open
    finally:
        conn.close()


# ------------------------------------------------------------------------------ server properties


def test_server_properties_capabilities_pika(broker_url):
    conn = pika_connect(broker_url)
    try:
        props = conn._impl.server_properties
        assert "product" in props
        caps = props["capabilities"]
        for cap in EXPECTED_CAPABILITIES:
            assert caps.get(cap) is True, cap
    finally:
        conn.close()


def test_server_properties_capabilities_py_amqp(broker_url):
    conn = amqp_connect(broker_url)
    try:
        caps = conn.server_properties["capabilities"]
        for cap in EXPECTED_CAPABILITIES:
            assert caps.get(cap) is True, cap
        # py-amqp turns on the features the server announces
        assert conn.server_capabilities.get("consumer_cancel_notify") is True
    finally:
        conn.close()


# ------------------------------------------------------------------------------------ authentication


def test_plain_auth_pika(broker_url):
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        ok = ch.queue_declare("", exclusive=True)
        assert ok.method.queue.startswith("amq.gen-")
    finally:
        conn.close()


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_auth_mechanisms_py_amqp(broker_url, mechanism):
    conn = amqp_connect(broker_url, login_method=mechanism)
    try:
        ch = conn.channel()
        name, _count, _consumers = ch.queue_declare("", exclusive=True)
        assert name.startswith("amq.gen-")
    finally:
        conn.close()


@pytest.mark.parametrize("user,password", [("guest", "wrong"), ("no-such-user", "guest")],
                         ids=["bad-password", "unknown-user"])
def test_bad_credentials_pika_403(broker_url, user, password):
    with pytest.raises((pika.exceptions.ProbableAuthenticationError,
                        pika.exceptions.AuthenticationError)) as ei:
        pika_connect(_with_url(broker_url, user=user, password=password))
    # pika wraps the broker's connection.close (it announces authentication_failure_close)
    text = str(ei.value)
    assert "403" in text and "ACCESS_REFUSED" in text, text


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_bad_password_py_amqp_403(broker_url, mechanism):
    with pytest.raises(amqp.exceptions.AccessRefused) as ei:
        amqp_connect(broker_url, password="wrong", login_method=mechanism)
    assert ei.value.reply_code == 403


def test_bad_password_raw_with_capability_gets_close_403(broker_url):
    rc, _start = _start_raw(broker_url)
    try:
        rc.send(0, C.Connection.StartOk(client_properties=AUTH_FAILURE_CLOSE, mechanism="PLAIN",
                                        response="\0guest\0wrong", locale="en_US"))
        got = rc.read_method(timeout=10)
        assert got is not None, "socket closed without connection.close"
        ch, frame = got
        assert ch == 0 and isinstance(frame, C.Connection.Close), frame
        assert frame.reply_code == 403
        assert frame.reply_text.startswith("ACCESS_REFUSED")
        rc.send(0, C.Connection.CloseOk())
        rc.wait_closed(timeout=10)
    finally:
        rc.close()


def test_bad_password_raw_without_capability_closes_silently(broker_url):
    rc, _start = _start_raw(broker_url)
    try:
        rc.send(0, C.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                        response="\0guest\0wrong", locale="en_US"))
        frames = rc.wait_closed(timeout=10)
        assert frames == []
    finally:
        rc.close()


@pytest.mark.parametrize("mechanism,response", [("CRAM-MD5", "x"), ("PLAIN", "no-nul-separators")],
                         ids=["unsupported-mechanism", "malformed-plain"])
def test_unusable_auth_closes_connection_without_tune(broker_url, mechanism, response):
    rc, _start = _start_raw(broker_url)
    try:
        rc.send(0, C.Connection.StartOk(client_properties=AUTH_FAILURE_CLOSE, mechanism=mechanism,
                                        response=response, locale="en_US"))
        frames = rc.wait_closed(timeout=10)
        assert not any(isinstance(f, C.Connection.Tune) for f in frames), frames
    finally:
        rc.close()


# ------------------------------------------------------------------------------------------- vhost


def test_unknown_vhost_pika_530(broker_url):
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as ei:
        pika_connect(_with_url(broker_url, vhost="no-such-vhost"))
    text = str(ei.value)
    assert "530" in text and "NOT_ALLOWED" in text, text


def test_unknown_vhost_py_amqp_530(broker_url):
    with pytest.raises(amqp.exceptions.NotAllowed) as ei:
        amqp_connect(broker_url, virtual_host="no-such-vhost")
    assert ei.value.reply_code == 530
    assert (ei.value.method_sig or (10, 40)) == (10, 40)   # connection.open


def test_unknown_vhost_raw_close_530_on_channel_zero(broker_url):
    rc, _tune = raw_handshake(broker_url, open_vhost=False)
    try:
        rc.send(0, C.Connection.Open(virtual_host="no-such-vhost"))
        ch, frame = rc.read_method()
        assert ch == 0 and isinstance(frame, C.Connection.Close), frame
        assert frame.reply_code == 530
        assert (frame.class_id, frame.method_id) == (10, 40)
        rc.send(0, C.Connection.CloseOk())
        rc.wait_closed()
    finally:
        rc.close()


# -------------------------------------------------------------------------------------------- tune


def test_tune_proposes_defaults(broker_url):
    rc, tune = raw_handshake(broker_url)
    try:
        assert tune.channel_max == 2047
        assert tune.frame_max == 131072
        assert tune.heartbeat == 60
    finally:
        rc.close()


def test_pika_negotiates_lower_values(broker_url):
    conn = pika_connect(broker_url, heartbeat=5, frame_max=8192, channel_max=10)
    try:
        params = conn._impl.params
        assert (params.heartbeat, params.frame_max, params.channel_max) == (5, 8192, 10)
        assert conn.channel().is_open
    finally:
        conn.close()


def test_py_amqp_negotiates_lower_values(broker_url):
    conn = amqp_connect(broker_url, heartbeat=7, frame_max=8192, channel_max=10)
    try:
        # py-amqp adopts the server's channel_max/frame_max proposal and the lower heartbeat
        assert (conn.heartbeat, conn.frame_max, conn.channel_max) == (7, 131072, 2047)
        assert conn.server_heartbeat == 60
    finally:
        conn.close()


def test_small_frame_max_large_message_round_trip(broker_url, unique_name, rabbitmq_version):
    """With the smallest frame_max (4096; 8192 on 4.x) a 50 kB message is split by both sides and arrives
    intact."""
    payload = bytes(range(256)) * 200
    conn = pika_connect(broker_url, frame_max=MIN_FRAME_MAX[rabbitmq_version])
    try:
        ch = conn.channel()
        q = ch.queue_declare(unique_name("q"), exclusive=True).method.queue
        ch.basic_publish("", q, payload)
        method, _props, body = None, None, None
        deadline = time.monotonic() + 5
        while method is None and time.monotonic() < deadline:
            method, _props, body = ch.basic_get(q, auto_ack=True)
        assert body == payload
    finally:
        conn.close()


def test_server_respects_negotiated_frame_max_when_delivering(broker_url, unique_name, rabbitmq_version):
    frame_max = MIN_FRAME_MAX[rabbitmq_version]
    payload = b"z" * 20_000
    rc, _tune = raw_handshake(broker_url, frame_max=frame_max)
    q = unique_name("q")
    try:
        rc.send(1, C.Channel.Open())
        assert isinstance(rc.read_method()[1], C.Channel.OpenOk)
        rc.send(1, C.Queue.Declare(queue=q, exclusive=True))
        assert isinstance(rc.read_method()[1], C.Queue.DeclareOk)
        rc.send(1, C.Basic.Publish(exchange="", routing_key=q))
        rc.send(1, pheader.ContentHeader(0, len(payload), C.Basic.Properties()))
        step = frame_max - 8
        for i in range(0, len(payload), step):
            rc.send(1, pbody.ContentBody(payload[i:i + step]))
        got = b""
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            rc.send(1, C.Basic.Get(queue=q, no_ack=True))
            ch, frame = rc.read_method()
            if isinstance(frame, C.Basic.GetEmpty):
                time.sleep(0.02)
                continue
            assert isinstance(frame, C.Basic.GetOk), frame
            ch, hdr = rc.read_method()
            assert isinstance(hdr, pheader.ContentHeader) and hdr.body_size == len(payload)
            while len(got) < len(payload):
                ch, frame = rc.read_method()
                assert isinstance(frame, pbody.ContentBody), frame
                # frame size = 7 header octets + payload + frame-end octet
                assert len(frame.value) + 8 <= frame_max
                got += frame.value
        assert got == payload
    finally:
        rc.close()


def test_frame_above_negotiated_frame_max_is_501(broker_url, rabbitmq_version):
    rc, _tune = raw_handshake(broker_url, frame_max=MIN_FRAME_MAX[rabbitmq_version])
    try:
        rc.send(1, C.Channel.Open())
        assert isinstance(rc.read_method()[1], C.Channel.OpenOk)
        rc.send(1, C.Basic.Publish(exchange="", routing_key="nowhere"))
        rc.send(1, pheader.ContentHeader(0, 10_000, C.Basic.Properties()))
        rc.send(1, pbody.ContentBody(b"x" * 10_000))
        ch, frame = rc.read_method()
        assert ch == 0 and isinstance(frame, C.Connection.Close), frame
        assert frame.reply_code == 501
        rc.send(0, C.Connection.CloseOk())
        rc.wait_closed()
    finally:
        rc.close()


def test_channel_count_limited_by_negotiated_channel_max(broker_url):
    """RabbitMQ counts open channels: the (channel_max+1)-th channel.open is a 530 connection error."""
    rc, _tune = raw_handshake(broker_url, channel_max=3)
    try:
        for n in (1, 2, 3):
            rc.send(n, C.Channel.Open())
            ch, frame = rc.read_method()
            assert (ch, type(frame)) == (n, C.Channel.OpenOk)
        rc.send(4, C.Channel.Open())
        ch, frame = rc.read_method()
        assert ch == 0 and isinstance(frame, C.Connection.Close), frame
        assert frame.reply_code == 530
        rc.send(0, C.Connection.CloseOk())
        rc.wait_closed()
    finally:
        rc.close()


def test_closed_channels_do_not_count_against_channel_max(broker_url):
    rc, _tune = raw_handshake(broker_url, channel_max=2)
    try:
        for n in (1, 2, 3, 4, 5):
            rc.send(n, C.Channel.Open())
            ch, frame = rc.read_method()
            assert (ch, type(frame)) == (n, C.Channel.OpenOk)
            rc.send(n, C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
            ch, frame = rc.read_method()
            assert (ch, type(frame)) == (n, C.Channel.CloseOk)
    finally:
        rc.close()


def test_channel_number_above_channel_max_is_accepted(broker_url):
    """RabbitMQ 3.10 limits the number of open channels, not the channel number itself."""
    rc, _tune = raw_handshake(broker_url, channel_max=10)
    try:
        rc.send(11, C.Channel.Open())
        ch, frame = rc.read_method()
        assert (ch, type(frame)) == (11, C.Channel.OpenOk)
    finally:
        rc.close()


@pytest.mark.parametrize("tune_ok", [
    dict(channel_max=0, frame_max=131072, heartbeat=0),      # 0 = unlimited, above the server's 2047
    dict(channel_max=10, frame_max=10_000_000, heartbeat=0),  # above the server's frame_max
    dict(channel_max=10, frame_max=100, heartbeat=0),        # below the minimum frame size (4096)
], ids=["channel_max-0", "frame_max-too-big", "frame_max-too-small"])
def test_tune_ok_out_of_range_closes_connection(broker_url, tune_ok):
    rc, _start = _start_raw(broker_url)
    u = parse_url(broker_url)
    try:
        rc.send(0, C.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                        response=f"\0{u.user}\0{u.password}", locale="en_US"))
        ch, tune = rc.read_method()
        assert isinstance(tune, C.Connection.Tune)
        rc.send(0, C.Connection.TuneOk(**tune_ok))
        rc.send(0, C.Connection.Open(virtual_host=u.vhost))
        frames = rc.wait_closed(timeout=10)
        assert not any(isinstance(f, C.Connection.OpenOk) for f in frames), frames
    finally:
        rc.close()


# -------------------------------------------------------------------------------------- heartbeats


def test_silent_client_with_heartbeat_is_disconnected(broker_url):
    """Negotiate heartbeat=1 then send nothing: the server sends heartbeats and drops us in seconds."""
    rc, _tune = raw_handshake(broker_url, heartbeat=1)
    try:
        t0 = time.monotonic()
        frames = rc.wait_closed(timeout=10)
        elapsed = time.monotonic() - t0
        assert any(isinstance(f, pheartbeat.Heartbeat) for f in frames), frames
        assert 1.0 <= elapsed <= 10
        # no connection.close is sent for a missed heartbeat (RabbitMQ just closes the socket)
        assert all(isinstance(f, pheartbeat.Heartbeat) for f in frames), frames
    finally:
        rc.close()


def test_silent_py_amqp_client_is_disconnected(broker_url):
    conn = amqp_connect(broker_url, heartbeat=1)
    try:
        sock = conn.sock
        deadline = time.monotonic() + 10
        closed = False
        sock.settimeout(0.5)
        while time.monotonic() < deadline:
            try:
                data = sock.recv(4096)   # read raw: py-amqp never answers (no heartbeat_tick)
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
            if not data:
                closed = True
                break
        assert closed, "server kept a silent heartbeat=1 connection open for 10 s"
    finally:
        safe_close(conn)


def test_heartbeating_client_stays_connected(broker_url):
    conn = pika_connect(broker_url, heartbeat=1)
    try:
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.2)
        assert conn.is_open
        ch = conn.channel()
        assert ch.queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")
    finally:
        safe_close(conn)


def test_server_sends_heartbeats_at_negotiated_interval(broker_url):
    rc, _tune = raw_handshake(broker_url, heartbeat=2)
    try:
        # keep ourselves alive and count the server's heartbeats over ~4.5 s
        beats = 0
        deadline = time.monotonic() + 4.5
        next_beat = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if time.monotonic() >= next_beat:
                rc.send_bytes(b"\x08\x00\x00\x00\x00\x00\x00\xce")
                next_beat += 0.5
            rc.sock.settimeout(0.1)
            try:
                chunk = rc.sock.recv(4096)
            except socket.timeout:
                continue
            assert chunk, "server closed a heartbeating connection"
            rc.buf += chunk
            while True:
                try:
                    n, _ch, frame = pframe.unmarshal(rc.buf)
                except Exception:
                    break
                if not n:
                    break
                rc.buf = rc.buf[n:]
                if isinstance(frame, pheartbeat.Heartbeat):
                    beats += 1
        assert beats >= 1
    finally:
        rc.close()


def test_heartbeat_zero_silent_client_is_not_disconnected(broker_url):
    rc, _tune = raw_handshake(broker_url, heartbeat=0)
    try:
        rc.sock.settimeout(2.5)
        try:
            data = rc.sock.recv(4096)
        except socket.timeout:
            data = None
        assert data is None, f"server sent {data!r} to a heartbeat=0 connection"
        rc.send(1, C.Channel.Open())
        assert isinstance(rc.read_method()[1], C.Channel.OpenOk)
    finally:
        rc.close()


# ------------------------------------------------------------------------------------------- close


def test_client_close_gets_close_ok_and_socket_closed(broker_url):
    rc, _tune = raw_handshake(broker_url)
    try:
        rc.send(1, C.Channel.Open())
        assert isinstance(rc.read_method()[1], C.Channel.OpenOk)
        rc.send(0, C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
        ch, frame = rc.read_method()
        assert ch == 0 and isinstance(frame, C.Connection.CloseOk), frame
        # the client that sent close closes the socket; the server sends nothing more
        rc.sock.settimeout(1.0)
        try:
            extra = rc.sock.recv(4096)
        except socket.timeout:
            extra = b""
        except OSError:
            extra = b""
        assert extra == b""
    finally:
        rc.close()


def test_pika_close(broker_url):
    conn = pika_connect(broker_url)
    ch = conn.channel()
    conn.close()
    assert conn.is_closed and ch.is_closed


def test_py_amqp_close(broker_url):
    conn = amqp_connect(broker_url)
    conn.channel()
    conn.close()
    assert not conn.connected


def test_other_connections_unaffected_by_connection_error(broker_url, unique_name):
    good = pika_connect(broker_url)
    try:
        gch = good.channel()
        q = gch.queue_declare(unique_name("q"), exclusive=True).method.queue
        bad = amqp_connect(broker_url)
        bch = bad.channel()
        with pytest.raises(amqp.exceptions.AMQPError):
            bch.basic_qos(10, 0, False)    # prefetch_size: 540, a connection error on every version
        assert not bad.connected
        safe_close(bad)
        gch.basic_publish("", q, b"still here")
        wait_until(lambda: gch.queue_declare(q, passive=True).method.message_count == 1)
        assert gch.basic_get(q, auto_ack=True)[2] == b"still here"
    finally:
        good.close()


# ------------------------------------------------------------------------- embedded only: blocked


def watched_publisher(url: str) -> tuple[pika.BlockingConnection, list[str]]:
    """A pika connection and the list its connection.blocked / unblocked notifications are appended to."""
    events: list[str] = []
    conn = pika_connect(url)
    conn.add_on_connection_blocked_callback(lambda _c, _m: events.append("blocked"))
    conn.add_on_connection_unblocked_callback(lambda _c, _m: events.append("unblocked"))
    return conn, events


def test_embedded_only_memory_watermark_blocks_and_unblocks_publishers(unique_name):
    """Embedded broker only: RabbitMQ's watermark cannot be changed safely from a test here."""
    from spark_amqp_broker import Broker

    with Broker(port=0, memory_high_watermark=64 * 1024) as b:
        pub, events = watched_publisher(b.url)
        admin = pika_connect(b.url)
        try:
            pch = pub.channel()
            q = unique_name("q")
            pch.queue_declare(q)
            # 70,000 bytes: the 7th message crosses the 65,536-byte watermark, none is left in flight
            # (a broker may stop reading a blocked publisher's socket, as RabbitMQ does)
            for _ in range(7):
                pch.basic_publish("", q, b"x" * 10_000)

            def saw(what):
                pub.process_data_events(time_limit=0.05)
                return what in events

            wait_until(lambda: saw("blocked"), timeout=10, message="connection.blocked")
            assert "unblocked" not in events
            ach = admin.channel()
            ach.queue_purge(q)
            wait_until(lambda: saw("unblocked"), timeout=10, message="connection.unblocked")
            assert events == ["blocked", "unblocked"]
            # publishing works again
            pch.basic_publish("", q, b"after")
            wait_until(lambda: ach.queue_declare(q, passive=True).method.message_count >= 1)
            ach.queue_delete(q)
        finally:
            safe_close(pub)
            safe_close(admin)


def test_embedded_only_memory_watermark_does_not_flap(unique_name):
    """A publisher that heeds connection.blocked, and a consumer that drains slower than it publishes,
    keep the queue around the watermark for 4 s. The alarm is decided once a second on the broker's clock
    (as RabbitMQ's vm_memory_monitor), so the publisher sees a handful of blocked/unblocked frames; checked
    per message, as it once was, it saw hundreds (568 in 15 s)."""
    from spark_amqp_broker import Broker

    with Broker(port=0, memory_high_watermark=64 * 1024) as b:
        pub, events = watched_publisher(b.url)
        con = pika_connect(b.url)
        try:
            pch, cch = pub.channel(), con.channel()
            q = unique_name("q")
            pch.queue_declare(q)
            end = time.monotonic() + 4.0
            while time.monotonic() < end:
                if not events or events[-1] == "unblocked":
                    for _ in range(3):
                        pch.basic_publish("", q, b"x" * 2_000)
                for _ in range(1 if not events or events[-1] == "unblocked" else 20):
                    if cch.basic_get(q, auto_ack=True)[0] is None:
                        break
                pub.process_data_events(time_limit=0.005)
            assert "blocked" in events, "the publisher never went over the watermark"
            assert len(events) <= 10, events
            for first, second in zip(events, events[1:]):
                assert first != second, events     # strictly alternating
            cch.queue_delete(q)
        finally:
            safe_close(pub)
            safe_close(con)


def test_embedded_only_stop_closes_connections_with_320():
    """`Broker.stop()` in-process does what SIGTERM does: connection.close 320 CONNECTION_FORCED with
    RabbitMQ's shutdown text to every open connection, and it waits for the close-ok (pika answers it while
    it reads), so the client learns why instead of seeing a reset socket."""
    import threading

    from spark_amqp_broker import Broker

    b = Broker(port=0).start()
    conn = pika_connect(b.url)
    closed_by: list = []
    stopped_in: list[float] = []

    def stop():
        started = time.monotonic()
        b.stop()
        stopped_in.append(time.monotonic() - started)

    stopper = threading.Thread(target=stop)
    try:
        conn.channel()
        stopper.start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                conn.process_data_events(time_limit=0.05)
        except pika.exceptions.ConnectionClosedByBroker as exc:
            closed_by.append((exc.reply_code, exc.reply_text))
        stopper.join(timeout=10)
    finally:
        b.stop()
        safe_close(conn)
    assert closed_by == [(320, "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'")]
    assert stopped_in and stopped_in[0] < 0.45, stopped_in   # the close-ok came; no wait for the grace
