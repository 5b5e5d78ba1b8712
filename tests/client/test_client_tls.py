"""amqps:// with our client against the embedded broker's TLS listener, over real sockets: the happy path, and
every certificate problem failing the connect with an error that says what was wrong and which option fixes
it. Certificates are made at test time by trustme (a throw-away CA)."""

from __future__ import annotations

import datetime

import pytest

from spark_amqp.client import ConnectError, Connection
from spark_amqp.client.tls import TLSOptions
from spark_amqp_broker import Broker

trustme = pytest.importorskip("trustme")

SECRET = "tls-secret-pw"


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


def tls_broker(tmp_path, ca, *names, verify_peer=False, **cert_kw):
    cert = ca.issue_cert(*(names or ("localhost", "127.0.0.1")), **cert_kw)
    key_file = tmp_path / "server.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(key_file))
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return Broker(port=0, tls_port=0, tls_cert=str(key_file), tls_key=str(key_file),
                  tls_ca=str(ca_file) if verify_peer else None, tls_verify_peer=verify_peer,
                  users={"guest": "guest", "spy": SECRET})


def url(broker, host="localhost", user="guest", password="guest"):
    return f"amqps://{user}:{password}@{host}:{broker.tls_port}/%2F"


def ca_text(ca) -> str:
    return ca.cert_pem.bytes().decode()


def round_trip(conn: Connection) -> bytes:
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).name
    ch.confirm_select()
    ch.publish("", q, b"over tls" * 1000)
    ch.wait_for_confirms(timeout=10)
    ch.basic_consume(q)
    got = ch.get_deliveries(1, timeout=10)
    ch.basic_ack(got[0].delivery_tag)
    return got[0].body


def test_amqps_publish_and_consume_with_the_ca_as_a_file_or_as_text(tmp_path, ca):
    with tls_broker(tmp_path, ca) as b:
        with Connection.open(url(b), tls=TLSOptions(ca=str(tmp_path / "ca.pem"))) as conn:
            assert round_trip(conn) == b"over tls" * 1000
        with Connection.open(url(b), tls=TLSOptions(ca=ca_text(ca)), heartbeat=1) as conn:
            assert round_trip(conn) == b"over tls" * 1000
            import time
            time.sleep(2.5)      # heartbeats flow both ways over TLS
            assert conn.is_open


def test_unknown_ca_names_the_option(tmp_path, ca):
    with tls_broker(tmp_path, ca) as b:
        with pytest.raises(ConnectError) as err:
            Connection.open(url(b, password=SECRET, user="spy"), tls=TLSOptions(ca=ca_text(trustme.CA())))
    text = str(err.value)
    assert "CA this client does not trust" in text and "tls.caFile" in text and SECRET not in text


def test_host_name_mismatch_names_the_option_and_server_name_fixes_it(tmp_path, ca):
    with tls_broker(tmp_path, ca, "broker.example") as b:
        with pytest.raises(ConnectError) as err:
            Connection.open(url(b), tls=TLSOptions(ca=ca_text(ca)))
        assert "not for host 'localhost'" in str(err.value) and "tls.serverName" in str(err.value)
        with Connection.open(url(b), tls=TLSOptions(ca=ca_text(ca), server_name="broker.example")) as conn:
            assert round_trip(conn)


def test_expired_certificate_is_named(tmp_path, ca):
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2)
    with tls_broker(tmp_path, ca, not_before=past - datetime.timedelta(days=30), not_after=past) as b:
        with pytest.raises(ConnectError) as err:
            Connection.open(url(b), tls=TLSOptions(ca=ca_text(ca)))
        assert "expired" in str(err.value)
        with Connection.open(url(b), tls=TLSOptions(verify=False)) as conn:   # tls.verify=false: no checks
            assert round_trip(conn)


def test_client_certificate_required_and_given(tmp_path, ca):
    with tls_broker(tmp_path, ca, verify_peer=True) as b:
        with pytest.raises(ConnectError) as err:
            with Connection.open(url(b), tls=TLSOptions(ca=ca_text(ca))) as conn:
                round_trip(conn)   # TLS 1.3: the refusal may only show at the first read
        assert "client certificate" in str(err.value) and "tls.certFile" in str(err.value)
        client = ca.issue_cert("spark-client")
        pem = client.private_key_and_cert_chain_pem.bytes().decode()
        with Connection.open(url(b), tls=TLSOptions(ca=ca_text(ca), cert=pem, key=pem)) as conn:
            assert round_trip(conn)


def test_amqps_to_a_plain_port_and_tls_options_with_amqp_say_what_to_change(tmp_path, ca):
    with tls_broker(tmp_path, ca) as b:
        with pytest.raises(ConnectError) as err:
            Connection.open(f"amqps://spy:{SECRET}@localhost:{b.port}/%2F", tls=TLSOptions(ca=ca_text(ca)),
                            connect_timeout=5)
        assert "TLS" in str(err.value) and SECRET not in str(err.value)
        with pytest.raises(ValueError) as err:
            Connection.open(f"amqp://spy:{SECRET}@localhost:{b.port}/%2F", tls=TLSOptions(ca=ca_text(ca)))
        assert "amqps://" in str(err.value) and SECRET not in str(err.value)


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_auth_mechanisms(amqp_broker, mechanism):
    with Connection.open(amqp_broker.url, auth_mechanism=mechanism) as conn:
        assert conn.channel().queue_declare("", exclusive=True).name


def test_external_needs_a_broker_that_offers_it(amqp_broker):
    with pytest.raises(ConnectError) as err:
        Connection.open(amqp_broker.url, auth_mechanism="EXTERNAL")
    assert "does not offer EXTERNAL" in str(err.value)


def test_against_rabbitmq_over_tls(rabbitmq_tls):
    """The same client against the reference broker's TLS listener (a second RabbitMQ node)."""
    with Connection.open(rabbitmq_tls.url, tls=TLSOptions(ca=rabbitmq_tls.ca_file), heartbeat=2) as conn:
        assert round_trip(conn) == b"over tls" * 1000
        assert conn.server_properties.get("product") in ("RabbitMQ", b"RabbitMQ")
    with pytest.raises(ConnectError) as err:
        Connection.open(rabbitmq_tls.url)   # the system's CAs do not know the test CA
    assert "tls.caFile" in str(err.value)
    host_url = rabbitmq_tls.url.replace("localhost", "127.0.0.1")
    with pytest.raises(ConnectError) as err:
        Connection.open(host_url, tls=TLSOptions(ca=rabbitmq_tls.ca_file, server_name="elsewhere.example"))
    assert "tls.serverName" in str(err.value)
