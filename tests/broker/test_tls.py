"""The embedded broker's TLS (amqps) listener, over real loopback sockets: pika and py-amqp over TLS,
handshake failures (an untrusting client, plain AMQP on the TLS port), client certificates
(tls_ca / tls_verify_peer), the `amqp-broker` command line with --tls-port, and configuration errors.

The certificates are made at test time with trustme: the plugin's `amqps_*` fixtures for the common case,
a CA of the test's own where a test needs client certificates or a second CA. Ports are ephemeral.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import amqp
import pika
import pika.exceptions
import pytest

from brokers import BrokerProcess
from helpers import PROTOCOL_HEADER, pika_params, safe_close
from spark_amqp_broker import Broker, BrokerConfig
from spark_amqp_broker.pytest_plugin import write_tls_files

trustme = pytest.importorskip("trustme")

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 5.0


# --------------------------------------------------------------------------------------------- helpers


@dataclass
class Pki:
    """A CA of the test's own, with the broker's certificate written to PEM files."""
    ca: "trustme.CA"
    ca_file: str
    cert_file: str
    key_file: str


def make_pki(tmp_path, name: str = "pki") -> Pki:
    d = tmp_path / name
    d.mkdir()
    ca, files = write_tls_files(d)
    return Pki(ca, files.ca_file, files.cert_file, files.key_file)


def client_context(ca_file: str | None = None, *, client_cert=None, tls_max=None) -> ssl.SSLContext:
    """A client context trusting ca_file (the system's CAs when None), optionally with a client
    certificate (a trustme LeafCert) and a highest TLS version."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if client_cert is not None:
        client_cert.configure_cert(ctx)
    if tls_max is not None:
        ctx.maximum_version = tls_max
    return ctx


def pika_tls(url: str, ctx: ssl.SSLContext) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika_params(url, ssl_options=pika.SSLOptions(ctx, server_hostname="localhost")))


def tls_socket(port: int, ctx: ssl.SSLContext, server_hostname: str = "localhost") -> ssl.SSLSocket:
    """A TLS connection to 127.0.0.1:port, handshake done (raises what the handshake raises)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        return ctx.wrap_socket(raw, server_hostname=server_hostname)
    except BaseException:
        raw.close()
        raise


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, BaseException | None]:
    """Everything the peer sends until it closes (EOF, reset or a TLS alert), and how it ended.
    Fails the test when the peer keeps the socket open past `timeout`."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"the broker did not close the socket within {timeout}s (got {data[:64]!r})")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (ssl.SSLError, ConnectionError) as exc:
            return data, exc
        if not chunk:
            return data, None
        data += chunk


def assert_no_connection_start(data: bytes) -> None:
    """An AMQP answer to the protocol header would be connection.start: a method frame (type 1) on
    channel 0 naming the PLAIN mechanism."""
    assert not data.startswith(b"\x01\x00\x00"), f"got an AMQP frame: {data[:32]!r}"
    assert b"PLAIN" not in data, f"got connection.start: {data[:64]!r}"


def open_connections(broker: Broker) -> int:
    return broker.call(lambda: broker.core.open_connections())


def connections(broker: Broker) -> int:
    return broker.call(lambda: len(broker.core.connections))


def publish_consume(conn: pika.BlockingConnection, body: bytes) -> bytes:
    ch = conn.channel()
    ch.confirm_delivery()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, body, mandatory=True)
    for method, _props, got in ch.consume(q, auto_ack=False, inactivity_timeout=TIMEOUT):
        assert method is not None, "no delivery within the timeout"
        ch.basic_ack(method.delivery_tag)
        ch.cancel()
        return got
    raise AssertionError("consume ended without a delivery")


# ---------------------------------------------------------------------------- the amqps_* fixtures


def test_fixtures(amqps_broker, amqps_url, amqps_ca_file):
    assert amqps_url == f"amqps://guest:guest@localhost:{amqps_broker.tls_port}/%2F"
    assert amqps_broker.tls_url == amqps_url
    assert amqps_broker.tls_port not in (0, amqps_broker.port)
    assert Path(amqps_ca_file).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert amqps_broker.url.startswith("amqp://")        # the plain listener is there too


def test_pika_publishes_and_consumes_over_tls(amqps_broker, amqps_url, amqps_ca_file):
    conn = pika_tls(amqps_url, client_context(amqps_ca_file))
    try:
        assert publish_consume(conn, b"over tls") == b"over tls"
        # the broker sees one open connection, and it knows it is TLS only in the I/O layer
        assert open_connections(amqps_broker) == 1
        io = amqps_broker.call(lambda: next(iter(amqps_broker.core.connections)).io)
        assert amqps_broker.call(lambda: io._tls) is True
        assert amqps_broker.call(io._more_to_read) is False
    finally:
        safe_close(conn)


def test_tls_and_plain_clients_share_one_broker(amqps_broker, amqps_url, amqps_ca_file):
    plain = pika.BlockingConnection(pika_params(amqps_broker.url))
    tls = pika_tls(amqps_url, client_context(amqps_ca_file))
    try:
        q = plain.channel().queue_declare("shared-q").method.queue
        tls.channel().basic_publish("", q, b"from tls")
        method, _props, body = plain.channel().basic_get(q, auto_ack=True)
        deadline = time.monotonic() + TIMEOUT
        while method is None and time.monotonic() < deadline:
            time.sleep(0.02)
            method, _props, body = plain.channel().basic_get(q, auto_ack=True)
        assert body == b"from tls"
    finally:
        safe_close(tls)
        safe_close(plain)


def test_confirms_over_tls_all_arrive(amqps_url, amqps_ca_file):
    """Publisher confirms are never held back on TLS connections (_more_to_read is False there)."""
    conn = pika_tls(amqps_url, client_context(amqps_ca_file))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        q = ch.queue_declare("", exclusive=True).method.queue
        for i in range(300):
            ch.basic_publish("", q, b"m%d" % i)      # BlockingChannel waits for each confirm
        assert ch.queue_declare(q, passive=True).method.message_count == 300
    finally:
        safe_close(conn)


def test_large_messages_and_a_deep_queue_over_tls(amqps_url, amqps_ca_file):
    """Bodies spanning many TLS records, and deliveries past the connection's output high-water mark
    (write back-pressure through the TLS transport)."""
    conn = pika_tls(amqps_url, client_context(amqps_ca_file))
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        big = bytes(range(256)) * (3 * 4096)               # 3 MiB
        ch.basic_publish("", q, big)
        for i in range(2000):
            ch.basic_publish("", q, b"%d" % i + b"." * 1000)
        got = []
        for method, _props, body in ch.consume(q, auto_ack=True, inactivity_timeout=TIMEOUT):
            assert method is not None, f"deliveries stopped after {len(got)}"
            got.append(body)
            if len(got) == 2001:
                break
        ch.cancel()
        assert got[0] == big
        assert [b.split(b".")[0] for b in got[1:]] == [b"%d" % i for i in range(2000)]
    finally:
        safe_close(conn)


def test_py_amqp_over_tls(amqps_broker, amqps_ca_file):
    conn = amqp.Connection(
        host=f"localhost:{amqps_broker.tls_port}", userid="guest", password="guest",
        ssl={"ca_certs": amqps_ca_file, "cert_reqs": ssl.CERT_REQUIRED, "server_hostname": "localhost"},
        connect_timeout=TIMEOUT, read_timeout=TIMEOUT, write_timeout=TIMEOUT)
    conn.connect()
    try:
        assert conn.transport.sock.version() in ("TLSv1.2", "TLSv1.3")
        ch = conn.channel()
        q, _, _ = ch.queue_declare("", exclusive=True)
        ch.basic_publish(amqp.Message(b"py-amqp over tls"), exchange="", routing_key=q)
        deadline = time.monotonic() + TIMEOUT
        msg = ch.basic_get(q, no_ack=True)
        while msg is None and time.monotonic() < deadline:
            time.sleep(0.02)
            msg = ch.basic_get(q, no_ack=True)
        assert msg is not None and msg.body == b"py-amqp over tls"
    finally:
        safe_close(conn)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_tls_1_2_or_later(amqps_broker, amqps_ca_file):
    with tls_socket(amqps_broker.tls_port, client_context(amqps_ca_file)) as s:
        assert s.version() in ("TLSv1.2", "TLSv1.3")
    ctx = client_context(amqps_ca_file, tls_max=ssl.TLSVersion.TLSv1_2)
    with tls_socket(amqps_broker.tls_port, ctx) as s:
        assert s.version() == "TLSv1.2"
    # a client offering TLS 1.1 at most (OpenSSL 3 needs security level 0 to offer it at all)
    ctx = client_context(amqps_ca_file)
    try:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
        ctx.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    except (ValueError, ssl.SSLError):
        pytest.skip("this OpenSSL cannot offer TLS 1.1")
    with pytest.raises((ssl.SSLError, ConnectionError)) as info:
        tls_socket(amqps_broker.tls_port, ctx).close()
    if getattr(info.value, "reason", None) in ("NO_CIPHERS_AVAILABLE", "NO_PROTOCOLS_AVAILABLE"):
        pytest.skip(f"this OpenSSL cannot offer TLS 1.1 ({info.value.reason})")   # refused by the client itself
    assert connections(amqps_broker) == 0


# ------------------------------------------------------------------------------ handshake failures


def test_client_not_trusting_the_ca_fails_the_handshake(amqps_broker, amqps_url, amqps_ca_file):
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_socket(amqps_broker.tls_port, client_context(None))   # the system's CAs only
    with pytest.raises(ssl.SSLCertVerificationError):     # pika raises the handshake's error as is
        pika_tls(amqps_url, client_context(None))
    # a certificate for localhost / 127.0.0.1 does not pass for another name
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_socket(amqps_broker.tls_port, client_context(amqps_ca_file), server_hostname="example.com")
    assert connections(amqps_broker) == 0
    conn = pika_tls(amqps_url, client_context(amqps_ca_file))   # the listener still serves
    safe_close(conn)


def test_plain_amqp_on_the_tls_port_gets_no_amqp_answer(amqps_broker):
    with socket.create_connection(("127.0.0.1", amqps_broker.tls_port), timeout=TIMEOUT) as s:
        s.sendall(PROTOCOL_HEADER)
        data, _how = read_until_closed(s)
    assert_no_connection_start(data)
    # whatever came back is at most a TLS alert record (content type 21)
    assert data == b"" or data[:1] == b"\x15", data[:16]
    assert connections(amqps_broker) == 0


def test_silent_client_is_dropped_after_the_tls_handshake_timeout(amqps_broker):
    """A socket that never starts the TLS handshake is closed (RabbitMQ: ssl_handshake_timeout, 5 s)."""
    from spark_amqp_broker import limits
    with socket.create_connection(("127.0.0.1", amqps_broker.tls_port), timeout=TIMEOUT) as s:
        t0 = time.monotonic()
        data, _how = read_until_closed(s, timeout=limits.TLS_HANDSHAKE_TIMEOUT + 10)
        assert time.monotonic() - t0 < limits.TLS_HANDSHAKE_TIMEOUT + 5
    assert_no_connection_start(data)


# ----------------------------------------------------------------------------- client certificates


@pytest.fixture
def pki(tmp_path) -> Pki:
    return make_pki(tmp_path)


def verify_peer_broker(pki: Pki, verify_peer: bool = True) -> Broker:
    return Broker(port=0, tls_port=0, tls_cert=pki.cert_file, tls_key=pki.key_file, tls_ca=pki.ca_file,
                  tls_verify_peer=verify_peer)


def refused(port: int, ctx: ssl.SSLContext) -> bool:
    """True when the broker refuses the TLS client: the handshake fails, or (TLS 1.3, where the client
    finishes its side of the handshake before the server has checked the client's certificate) the
    broker answers the protocol header with a TLS alert and closes instead of connection.start."""
    try:
        s = tls_socket(port, ctx)
    except (ssl.SSLError, ConnectionError):
        return True
    with s:
        try:
            s.sendall(PROTOCOL_HEADER)
        except (ssl.SSLError, ConnectionError):
            return True
        data, how = read_until_closed(s)
    if data.startswith(b"\x01\x00\x00") or b"PLAIN" in data:
        return False
    return how is not None or data == b""


@pytest.mark.parametrize("tls_max", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])
def test_verify_peer_refuses_a_client_without_a_certificate(pki, tls_max):
    with verify_peer_broker(pki) as broker:
        ctx = client_context(pki.ca_file, tls_max=tls_max)
        if tls_max == ssl.TLSVersion.TLSv1_2:
            # in TLS 1.2 the client sees the refusal in the handshake itself
            with pytest.raises((ssl.SSLError, ConnectionError)):
                tls_socket(broker.tls_port, ctx).close()
        assert refused(broker.tls_port, ctx)
        with pytest.raises((pika.exceptions.AMQPConnectionError, ssl.SSLError, ConnectionError)):
            pika_tls(broker.tls_url, client_context(pki.ca_file, tls_max=tls_max))
        assert connections(broker) == 0


def test_verify_peer_accepts_a_client_certificate_from_the_ca(pki):
    with verify_peer_broker(pki) as broker:
        ctx = client_context(pki.ca_file, client_cert=pki.ca.issue_cert("client"))
        conn = pika_tls(broker.tls_url, ctx)
        try:
            assert publish_consume(conn, b"mutual tls") == b"mutual tls"
        finally:
            safe_close(conn)
        # plain clients are still served on the plain port
        plain = pika.BlockingConnection(pika_params(broker.url))
        safe_close(plain)


def test_verify_peer_refuses_a_certificate_from_another_ca(pki, tmp_path):
    other = make_pki(tmp_path, "other")
    with verify_peer_broker(pki) as broker:
        ctx = client_context(pki.ca_file, client_cert=other.ca.issue_cert("client"))
        assert refused(broker.tls_port, ctx)


def test_tls_ca_without_verify_peer_checks_only_presented_certificates(pki, tmp_path):
    """RabbitMQ's verify_peer with fail_if_no_peer_cert = false: no certificate is fine, a bad one is not."""
    other = make_pki(tmp_path, "other")
    with verify_peer_broker(pki, verify_peer=False) as broker:
        safe_close(pika_tls(broker.tls_url, client_context(pki.ca_file)))
        good = client_context(pki.ca_file, client_cert=pki.ca.issue_cert("client"))
        safe_close(pika_tls(broker.tls_url, good))
        bad = client_context(pki.ca_file, client_cert=other.ca.issue_cert("client"))
        assert refused(broker.tls_port, bad)


# ------------------------------------------------------------------------------------ Broker object


def test_broker_without_tls(amqp_broker):
    assert amqp_broker.tls_port is None
    with pytest.raises(RuntimeError, match="no TLS listener"):
        amqp_broker.tls_url


def test_stop_closes_both_listeners(pki):
    broker = Broker(port=0, tls_port=0, tls_cert=pki.cert_file, tls_key=pki.key_file).start()
    ports = (broker.port, broker.tls_port)
    conn = pika_tls(broker.tls_url, client_context(pki.ca_file))
    broker.stop()
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
    with pytest.raises(pika.exceptions.AMQPError):
        conn.channel()          # the TLS client's connection was dropped too
    safe_close(conn)


def test_tls_port_taken_fails_start_and_frees_the_plain_port(pki):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broker = Broker(port=0, tls_port=port, tls_cert=pki.cert_file, tls_key=pki.key_file)
        with pytest.raises(OSError):
            broker.start()
        broker.stop()


# --------------------------------------------------------------------------------------- the CLI


def test_cli_listens_for_tls(pki, tmp_path):
    b = BrokerProcess(["--port", "0", "--tls-port", "0", "--tls-cert", pki.cert_file,
                       "--tls-key", pki.key_file], cwd=tmp_path)
    try:
        plain_port = int(b.wait_for(r"broker listening on 127\.0\.0\.1:(\d+)").group(1))
        tls_port = int(b.wait_for(r"listening for TLS \(amqps\) on 127\.0\.0\.1:(\d+)").group(1))
        assert plain_port != tls_port
        conn = pika_tls(f"amqps://guest:guest@localhost:{tls_port}/%2F", client_context(pki.ca_file))
        try:
            assert publish_consume(conn, b"cli tls") == b"cli tls"
        finally:
            safe_close(conn)
    finally:
        b.stop()


def test_cli_verify_peer(pki, tmp_path):
    b = BrokerProcess(["--port", "0", "--tls-port", "0", "--tls-cert", pki.cert_file, "--tls-key",
                       pki.key_file, "--tls-ca", pki.ca_file, "--tls-verify-peer"], cwd=tmp_path)
    try:
        m = b.wait_for(r"listening for TLS \(amqps\) on 127\.0\.0\.1:(\d+) \(client certificates required\)")
        port = int(m.group(1))
        assert refused(port, client_context(pki.ca_file))
        ctx = client_context(pki.ca_file, client_cert=pki.ca.issue_cert("client"))
        safe_close(pika_tls(f"amqps://guest:guest@localhost:{port}/%2F", ctx))
    finally:
        b.stop()


@pytest.mark.parametrize("args, expected", [
    (["--tls-port", "0"], "tls_cert"),
    (["--tls-port", "0", "--tls-cert", "{cert}"], "tls_key"),
    (["--tls-cert", "{cert}"], "tls_port"),
    (["--tls-port", "0", "--tls-cert", "{cert}", "--tls-key", "{missing}"], "tls_key: cannot read"),
    (["--tls-port", "0", "--tls-cert", "{key}", "--tls-key", "{key}"], "tls_cert"),
    (["--tls-port", "0", "--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-verify-peer"], "tls_ca"),
], ids=["no-cert", "no-key", "no-port", "missing-key", "key-as-cert", "verify-without-ca"])
def test_cli_config_errors_name_the_key(pki, tmp_path, args, expected):
    files = {"cert": pki.cert_file, "key": pki.key_file, "missing": str(tmp_path / "missing.pem")}
    args = [a.format(**files) for a in args]
    proc = subprocess.run([sys.executable, "-m", "spark_amqp_broker", "--port", "0", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error: ") and expected in proc.stderr, proc.stderr
    assert "PRIVATE KEY" not in proc.stderr


# --------------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("kw, expected", [
    (dict(tls_port=0), r"tls_port is set but tls_cert is not"),
    (dict(tls_port=0, tls_cert="{cert}"), r"tls_port is set but tls_key is not"),
    (dict(tls_cert="{cert}", tls_key="{key}"), r"tls_cert, tls_key set but tls_port is not"),
    (dict(tls_ca="{ca}"), r"tls_ca set but tls_port is not"),
    (dict(tls_verify_peer=True), r"tls_verify_peer set but tls_port is not"),
    (dict(tls_port=-1, tls_cert="{cert}", tls_key="{key}"), r"tls_port must be a port number"),
    (dict(tls_port=65536, tls_cert="{cert}", tls_key="{key}"), r"tls_port must be a port number"),
    (dict(tls_port="5671", tls_cert="{cert}", tls_key="{key}"), r"tls_port must be a port number"),
    (dict(port=5671, tls_port=5671, tls_cert="{cert}", tls_key="{key}"), r"tls_port must differ from port"),
    (dict(tls_port=0, tls_cert="{cert}", tls_key="{key}", tls_verify_peer=True),
     r"tls_verify_peer is true but tls_ca is not set"),
    (dict(tls_port=0, tls_cert="{cert}", tls_key="{key}", tls_verify_peer="yes"),
     r"tls_verify_peer must be true or false"),
    (dict(tls_port=0, tls_cert="{missing}", tls_key="{key}"), r"tls_cert: cannot read '.*missing\.pem'"),
    (dict(tls_port=0, tls_cert="{cert}", tls_key="{missing}"), r"tls_key: cannot read '.*missing\.pem'"),
    (dict(tls_port=0, tls_cert="{cert}", tls_key="{key}", tls_ca="{missing}"),
     r"tls_ca: cannot read '.*missing\.pem'"),
    (dict(tls_port=0, tls_cert="{dir}", tls_key="{key}"), r"tls_cert: cannot read"),
])
def test_config_errors_name_the_key(pki, tmp_path, kw, expected):
    files = {"cert": pki.cert_file, "key": pki.key_file, "ca": pki.ca_file,
             "missing": str(tmp_path / "missing.pem"), "dir": str(tmp_path)}
    kw = {k: v.format(**files) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(ValueError, match=expected):
        BrokerConfig(**kw)
    with pytest.raises(ValueError, match=expected):
        Broker(**{"port": 0, **kw})


def _bad_files(pki: Pki, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    other = make_pki(tmp_path, "other")
    return {"junk": str(junk), "other_key": other.key_file, "ca_as_key": pki.ca_file}


@pytest.mark.parametrize("kw, expected", [
    (dict(tls_cert="{junk}"), r"^tls_cert: no PEM certificate could be read from '.*junk\.pem'"),
    (dict(tls_cert="{key}"), r"^tls_cert: no PEM certificate could be read from '.*server\.key'"),
    (dict(tls_key="{junk}"), r"^tls_key: cannot use '.*junk\.pem' as the private key"),
    (dict(tls_key="{ca_as_key}"), r"^tls_key: cannot use '.*ca\.pem' as the private key"),
    (dict(tls_key="{other_key}"), r"^tls_key: .*KEY_VALUES_MISMATCH"),
    (dict(tls_ca="{junk}"), r"^tls_ca: no PEM CA certificate could be read from '.*junk\.pem'"),
])
def test_unusable_pem_files_fail_start_naming_the_key(pki, tmp_path, kw, expected):
    files = {"cert": pki.cert_file, "key": pki.key_file, **_bad_files(pki, tmp_path)}
    kw = {k: v.format(**files) for k, v in kw.items()}
    broker = Broker(port=0, **{"tls_port": 0, "tls_cert": pki.cert_file, "tls_key": pki.key_file, **kw})
    with pytest.raises(ValueError, match=expected) as info:
        broker.start()
    broker.stop()
    message = str(info.value)
    assert "PRIVATE KEY" not in message and "BEGIN" not in message
    key_body = Path(pki.key_file).read_text().splitlines()[1]
    assert key_body not in message


def test_encrypted_key_is_reported_not_prompted_for(pki, tmp_path):
    from cryptography.hazmat.primitives import serialization
    key = serialization.load_pem_private_key(Path(pki.key_file).read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    broker = Broker(port=0, tls_port=0, tls_cert=pki.cert_file, tls_key=str(encrypted))
    with pytest.raises(ValueError, match=r"^tls_key: '.*encrypted\.key' is encrypted"):
        broker.start()
    broker.stop()


def test_toml_tls_keys(pki, tmp_path):
    toml = tmp_path / "broker.toml"
    toml.write_text(f'[broker]\nport = 0\ntls_port = 0\ntls_cert = "{pki.cert_file}"\n'
                    f'tls_key = "{pki.key_file}"\ntls_ca = "{pki.ca_file}"\ntls_verify_peer = true\n')
    config = BrokerConfig.from_toml(str(toml))
    assert (config.tls_port, config.tls_cert, config.tls_key, config.tls_ca, config.tls_verify_peer) == \
        (0, pki.cert_file, pki.key_file, pki.ca_file, True)
    with Broker(config=config) as broker:
        ctx = client_context(pki.ca_file, client_cert=pki.ca.issue_cert("client"))
        safe_close(pika_tls(broker.tls_url, ctx))
    toml.write_text('[broker]\ntls_port = 0\n')
    with pytest.raises(ValueError, match="tls_cert"):
        BrokerConfig.from_toml(str(toml))


# ----------------------------------------------------------------------- SASL EXTERNAL (certificates)


def dn_of(leaf) -> str:
    """The RFC 4514 distinguished name of a trustme certificate, written by cryptography (an
    implementation independent of the broker's), as RabbitMQ's ssl_cert_login_from = distinguished_name
    names the user."""
    from cryptography import x509
    return x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).subject.rfc4514_string()


def external_broker(pki: Pki, users: dict, **options) -> Broker:
    return Broker(port=0, tls_port=0, tls_cert=pki.cert_file, tls_key=pki.key_file, tls_ca=pki.ca_file,
                  tls_verify_peer=True, users={"guest": "guest", **users}, **options)


def pika_external(url: str, ctx: ssl.SSLContext) -> pika.BlockingConnection:
    params = pika_params(url, ssl_options=pika.SSLOptions(ctx, server_hostname="localhost"),
                         credentials=pika.credentials.ExternalCredentials())
    return pika.BlockingConnection(params)


def mechanisms_offered(port: int, ctx: ssl.SSLContext | None) -> list[str]:
    raw = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock = ctx.wrap_socket(raw, server_hostname="localhost") if ctx is not None else raw
    with sock:
        sock.sendall(PROTOCOL_HEADER)
        data = b""
        while len(data) < 7 or len(data) < 8 + int.from_bytes(data[3:7], "big"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    from pamqp import frame as pframe
    start = pframe.unmarshal(data)[2]
    return start.mechanisms.split()


def test_external_logs_in_as_the_certificate_distinguished_name(pki):
    """RabbitMQ's default (ssl_cert_login_from = distinguished_name): the user is the subject's DN; no
    password is asked for (the user's own is ignored), with pika's ExternalCredentials and our client."""
    from spark_amqp.client import Connection
    from spark_amqp.client.tls import TLSOptions

    leaf = pki.ca.issue_cert("client", common_name="alice")
    dn = dn_of(leaf)
    assert dn.startswith("CN=alice,OU=") and ",O=trustme" in dn
    with external_broker(pki, {dn: "a password nobody sends"}) as broker:
        conn = pika_external(broker.tls_url, client_context(pki.ca_file, client_cert=leaf))
        try:
            assert publish_consume(conn, b"who am i") == b"who am i"
            users = broker.call(lambda: sorted(c.user for c in broker.core.connections))
            assert users == [dn]
        finally:
            safe_close(conn)
        tls = TLSOptions(ca=pki.ca_file, cert=leaf.cert_chain_pems[0].bytes().decode(),
                         key=leaf.private_key_pem.bytes().decode())
        with Connection.open(f"amqps://localhost:{broker.tls_port}/%2F", tls=tls,
                             auth_mechanism="EXTERNAL") as ours:
            assert ours.channel().queue_declare("", exclusive=True).name
            assert broker.call(lambda: [c.user for c in broker.core.connections]) == [dn]


def test_external_with_common_name(pki):
    leaf = pki.ca.issue_cert("client", common_name="alice")
    with external_broker(pki, {"alice": "x"}, ssl_cert_login_from="common_name") as broker:
        conn = pika_external(broker.tls_url, client_context(pki.ca_file, client_cert=leaf))
        try:
            assert publish_consume(conn, b"alice") == b"alice"
            assert broker.call(lambda: [c.user for c in broker.core.connections]) == ["alice"]
        finally:
            safe_close(conn)


def test_external_refuses_a_certificate_naming_no_user(pki):
    """The certificate is valid but names no configured user: 403 ACCESS_REFUSED, as a bad password."""
    leaf = pki.ca.issue_cert("client", common_name="mallory")
    with external_broker(pki, {"alice": "x"}, ssl_cert_login_from="common_name") as broker:
        with pytest.raises(pika.exceptions.ProbableAuthenticationError) as err:
            pika_external(broker.tls_url, client_context(pki.ca_file, client_cert=leaf))
        assert "403" in str(err.value) and "EXTERNAL" in str(err.value)


def test_external_is_offered_only_with_a_verified_client_certificate(pki, tmp_path):
    """Offered on TLS connections whose client certificate was verified, never on plain TCP nor on a TLS
    listener without tls_ca (nothing verified there); a client that asks for it anyway is refused as for
    any mechanism not offered (the socket closes, as RabbitMQ does)."""
    leaf = pki.ca.issue_cert("client", common_name="alice")
    with external_broker(pki, {"alice": "x"}, ssl_cert_login_from="common_name") as broker:
        assert mechanisms_offered(broker.tls_port, client_context(pki.ca_file, client_cert=leaf)) == \
            ["PLAIN", "AMQPLAIN", "EXTERNAL"]
        assert mechanisms_offered(broker.port, None) == ["PLAIN", "AMQPLAIN"]
        # PLAIN still works on the verified TLS connection
        conn = pika_tls(broker.tls_url, client_context(pki.ca_file, client_cert=leaf))
        safe_close(conn)
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            pika.BlockingConnection(pika_params(broker.url, credentials=pika.credentials.ExternalCredentials()))
    with Broker(port=0, tls_port=0, tls_cert=pki.cert_file, tls_key=pki.key_file,
                users={"alice": "x"}) as broker:
        ctx = client_context(pki.ca_file, client_cert=leaf)     # presented, but nothing verifies it
        assert mechanisms_offered(broker.tls_port, ctx) == ["PLAIN", "AMQPLAIN"]


def test_ssl_cert_login_from_is_checked(pki):
    with pytest.raises(ValueError, match=r"ssl_cert_login_from must be one of distinguished_name, "
                                         r"common_name, got 'cn'"):
        BrokerConfig(ssl_cert_login_from="cn")


def test_distinguished_name_escaping_is_rabbitmqs():
    """rabbit_cert_info:format_rdn_sequence: reversed RDNs, "+" inside a multi-valued RDN, RFC 4514
    escapes, non-ASCII bytes as \\XX."""
    from spark_amqp_broker.access import cert_login_name
    subject = ((("countryName", "GB"),), (("organizationName", "A, B+C"),),
               (("commonName", "#x "), ("userId", "é")))
    assert cert_login_name(subject, "distinguished_name") == "CN=\\#x\\ +UID=\\C3\\A9,O=A\\, B\\+C,C=GB"
    assert cert_login_name(subject, "common_name") == "#x "
    assert cert_login_name(((("organizationName", "o"),),), "common_name") is None


@pytest.mark.parametrize("target", ["embedded", "rabbitmq"])
def test_external_user_name_is_rabbitmqs(request, tmp_path, target):
    """Differential: the name our broker derives from a certificate (subject with characters RFC 4514
    escapes) is the user RabbitMQ 3.10's rabbitmq_auth_mechanism_ssl logs in as (a second node, verify_peer,
    ssl_cert_login_from at its default). The user is created under that name on both; pika's
    ExternalCredentials logs in, and a certificate naming nobody is refused."""
    from spark_amqp_broker.access import cert_login_name

    if target == "rabbitmq":
        node = request.getfixturevalue("rabbitmq_external")
        ca, ca_file = node.ca, node.ca_file
    else:
        pki = make_pki(tmp_path)
        ca, ca_file = pki.ca, pki.ca_file
    leaf = ca.issue_cert("client", common_name="a, b+c;é", organization_unit_name="#ops ")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "leaf.pem"))
    subject = ssl._ssl._test_decode_cert(str(tmp_path / "leaf.pem"))["subject"]   # as the broker sees it
    name = cert_login_name(subject, "distinguished_name")
    assert name.startswith("CN=a\\, b\\+c\\;\\C3\\A9,OU=\\#ops\\ ,O=trustme"), name
    nobody = ca.issue_cert("client", common_name="nobody")
    if target == "rabbitmq":
        node.ctl("add_user", name, "unused")
        node.ctl("set_permissions", "-p", "/", name, ".*", ".*", ".*")
        url, broker = f"amqps://localhost:{node.tls_port}/%2F", None
    else:
        broker = external_broker(pki, {name: "unused"}, loopback_users=()).start()
        url = broker.tls_url
    try:
        conn = pika_external(url, client_context(ca_file, client_cert=leaf))
        try:
            assert publish_consume(conn, b"external") == b"external"
        finally:
            safe_close(conn)
        with pytest.raises(pika.exceptions.ProbableAuthenticationError) as err:
            pika_external(url, client_context(ca_file, client_cert=nobody))
        assert "ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL" in str(err.value)
    finally:
        if broker is not None:
            broker.stop()
        else:
            node.ctl("delete_user", name)
