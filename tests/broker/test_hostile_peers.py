"""Hostile peers: secrets never echoed, refused logins and protocol errors logged, SIGTERM closes clients.

* `--user` with a malformed value never shows the value (it may hold a password);
* a refused login and every connection.close the broker sends for an error are logged at WARNING, naming
  the peer and the user, never the password (RabbitMQ logs "... refused for user 'x' ..." likewise);
* SIGTERM: `python -m spark_amqp_broker` closes every open connection with connection.close 320
  CONNECTION_FORCED (RabbitMQ's text: "broker forced connection closure with reason 'shutdown'") and
  exits 0.
"""

from __future__ import annotations

import logging
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pika
import pika.exceptions
import pytest
from pamqp import commands

from spark_amqp_broker import Broker
from helpers import PROTOCOL_HEADER, RawConnection, pika_connect, raw_handshake


# ----------------------------------------------------------------------------- --user is not echoed


@pytest.mark.parametrize("value", ["bob=SeCrEt-42", "SeCrEt-42", ":SeCrEt-42"],
                         ids=["equals-sign", "no-separator", "empty-name"])
def test_malformed_user_value_is_not_echoed(tmp_path, value):
    proc = subprocess.run([sys.executable, "-m", "spark_amqp_broker", "--port", "0", "--user", value],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error: --user expects NAME:PASSWORD"), proc.stderr
    assert "SeCrEt" not in proc.stderr and "SeCrEt" not in proc.stdout
    assert "bob" not in proc.stderr


# -------------------------------------------------------- refused logins and protocol errors logged

PASSWORD = "Pa55-w0rd-XYZ"


@pytest.fixture
def logged_broker(caplog):
    caplog.set_level(logging.INFO, logger="broker")
    with Broker(port=0, users={"alice": PASSWORD}, vhosts=("/", "other")) as broker:
        yield broker


def _warnings(caplog, needle: str, timeout: float = 5.0) -> list[logging.LogRecord]:
    """The broker's WARNING records containing `needle` (waiting for the broker thread to log them)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in caplog.records if r.name.startswith("broker")
                 and r.levelno == logging.WARNING and needle in r.getMessage()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def _assert_no_secret(caplog, secret: str = PASSWORD) -> None:
    for r in caplog.records:
        assert secret not in r.getMessage(), r.getMessage()
    assert secret not in caplog.text


def _start_ok(port: int, mechanism: str, response, capabilities=True):
    """Protocol header and start-ok; returns the RawConnection and its local address."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    rc = RawConnection(sock)
    rc.send_bytes(PROTOCOL_HEADER)
    _, start = rc.read_method()
    assert isinstance(start, commands.Connection.Start)
    props = {"product": "hostile-peer-test"}
    if capabilities:
        props["capabilities"] = {"authentication_failure_close": True}
    rc.send(0, commands.Connection.StartOk(client_properties=props, mechanism=mechanism,
                                           response=response, locale="en_US"))
    return rc, "{}:{}".format(*sock.getsockname()[:2])


@pytest.mark.parametrize("user, password, capabilities", [
    ("alice", "wrong-" + PASSWORD, True),
    ("mallory", PASSWORD, True),
    ("alice", "wrong-" + PASSWORD, False),
], ids=["wrong-password", "unknown-user", "no-auth-failure-close"])
def test_refused_login_is_logged_without_password(logged_broker, caplog, user, password, capabilities):
    rc, local = _start_ok(logged_broker.port, "PLAIN", f"\0{user}\0{password}", capabilities)
    try:
        frames = rc.wait_closed()
    finally:
        rc.close()
    if capabilities:
        assert [f.reply_code for f in frames if isinstance(f, commands.Connection.Close)] == [403]
    found = _warnings(caplog, "refused")
    assert len(found) == 1, caplog.text
    msg = found[0].getMessage()
    assert f"user '{user}'" in msg and local in msg and "PLAIN" in msg, msg
    _assert_no_secret(caplog, password)


def test_refused_amqplain_login_is_logged_without_password(logged_broker, caplog):
    table = (b"\x05LOGINS" + struct.pack(">I", 5) + b"alice"
             + b"\x08PASSWORDS" + struct.pack(">I", 9) + b"bad-" + PASSWORD[:5].encode())
    rc, local = _start_ok(logged_broker.port, "AMQPLAIN", table.decode("latin-1"))
    try:
        rc.wait_closed()
    finally:
        rc.close()
    msg = _warnings(caplog, "refused")[0].getMessage()
    assert "user 'alice'" in msg and local in msg and "AMQPLAIN" in msg, msg
    _assert_no_secret(caplog, "bad-" + PASSWORD[:5])


def test_unknown_mechanism_is_logged(logged_broker, caplog):
    rc, local = _start_ok(logged_broker.port, "CRAM-MD5", f"\0alice\0{PASSWORD}")
    try:
        rc.wait_closed()
    finally:
        rc.close()
    msg = _warnings(caplog, "refused")[0].getMessage()
    assert "CRAM-MD5" in msg and local in msg, msg
    _assert_no_secret(caplog)


def test_vhost_refused_is_logged(logged_broker, caplog):
    url = f"amqp://alice:{PASSWORD}@127.0.0.1:{logged_broker.port}/nowhere"
    rc, _ = raw_handshake(url, open_vhost=False)
    local = "{}:{}".format(*rc.sock.getsockname()[:2])
    try:
        rc.send(0, commands.Connection.Open(virtual_host="nowhere"))
        frames = rc.wait_closed()
    finally:
        rc.close()
    assert [f.reply_code for f in frames if isinstance(f, commands.Connection.Close)] == [530]
    found = _warnings(caplog, "refused")
    assert len(found) == 1, caplog.text
    msg = found[0].getMessage()
    assert "vhost 'nowhere'" in msg and "user 'alice'" in msg and local in msg, msg
    _assert_no_secret(caplog)


def test_protocol_error_close_is_logged(logged_broker, caplog):
    url = f"amqp://alice:{PASSWORD}@127.0.0.1:{logged_broker.port}/%2F"
    rc, _ = raw_handshake(url)
    local = "{}:{}".format(*rc.sock.getsockname()[:2])
    try:
        rc.send_bytes(struct.pack(">BHI", 9, 0, 0) + b"\xce")     # unknown frame type: 501
        frames = rc.wait_closed(timeout=10)
    finally:
        rc.close()
    assert [f.reply_code for f in frames if isinstance(f, commands.Connection.Close)] == [501]
    msg = _warnings(caplog, "FRAME_ERROR")[0].getMessage()
    assert local in msg and "user 'alice'" in msg, msg
    _assert_no_secret(caplog)


# ------------------------------------------------------------------ SIGTERM: 320 CONNECTION_FORCED


def test_sigterm_closes_connections_with_connection_forced(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "spark_amqp_broker", "--port", "0"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put(None)],
                              daemon=True)
    reader.start()
    conns = []
    try:
        deadline = time.monotonic() + 20
        port = None
        while port is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"the broker exited early: {seen}"
            seen.append(line)
            m = re.search(r"broker listening on 127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
        raw, _ = raw_handshake(url)
        conns.append(raw)
        polite, _ = raw_handshake(url)        # answers close-ok
        conns.append(polite)
        client = pika_connect(url)
        client.channel().queue_declare("", exclusive=True)

        proc.send_signal(signal.SIGTERM)

        for rc in (raw, polite):
            got = rc.read_method(timeout=10)
            assert got is not None, "socket closed without connection.close"
            channel, close = got
            assert channel == 0 and isinstance(close, commands.Connection.Close), close
            assert close.reply_code == 320
            assert close.reply_text == "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"
            assert (close.class_id, close.method_id) == (0, 0)
        polite.send(0, commands.Connection.CloseOk())
        polite.wait_closed(timeout=10)
        raw.wait_closed(timeout=10)                 # no close-ok: dropped after the grace period
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                client.process_data_events(time_limit=0.1)
        assert info.value.reply_code == 320
        assert proc.wait(timeout=15) == 0
    finally:
        for rc in conns:
            rc.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=10)
        proc.stderr.close()
