"""amqp:// URI parsing (RabbitMQ's URI spec) and password redaction. No broker needed."""

from __future__ import annotations

import logging

import pytest

from spark_amqp.client import ConnectError, Connection, ConnectionParameters, parse_uri, redact

SECRET = "pa55-w0rd-SECRET"


@pytest.mark.parametrize("uri, expected", [
    ("amqp://user:pass@host:10000/vhost",
     dict(username="user", password="pass", host="host", port=10000, vhost="vhost")),
    # percent-decoding of every part (the spec's own example)
    ("amqp://user%61:%61pass@ho%61st:10000/v%2fhost",
     dict(username="usera", password="apass", host="hoast", port=10000, vhost="v/host")),
    ("amqp://guest:guest@127.0.0.1:5672/%2F", dict(host="127.0.0.1", vhost="/")),
    ("amqp://u%40x:p%40ss%2Fw%3Ard%25@h/", dict(username="u@x", password="p@ss/w:rd%", vhost="/")),
    ("amqp://", dict(username="guest", password="guest", host="localhost", port=5672, vhost="/")),
    ("amqp://host", dict(host="host", port=5672, vhost="/")),
    ("amqp://host/", dict(host="host", vhost="/")),          # the spec says ""; see uri.py
    ("amqp:///vhost", dict(host="localhost", vhost="vhost")),
    ("amqp://:10000", dict(host="localhost", port=10000)),
    ("amqp://user@host", dict(username="user", password="")),
    ("amqp://[::1]:5673/v", dict(host="::1", port=5673, vhost="v")),
    ("amqp://[::1]", dict(host="::1", port=5672)),
    ("AMQP://h", dict(scheme="amqp", host="h")),
    ("amqps://h", dict(scheme="amqps", port=5671)),
    ("amqp://h?heartbeat=5&connection_timeout=2500&frame_max=8192&channel_max=16",
     dict(heartbeat=5, connect_timeout=2.5, frame_max=8192, channel_max=16)),
    ("amqp://h/v?auth_mechanism=plain&cacertfile=/x", dict(vhost="v", heartbeat=None)),
])
def test_parse_uri(uri, expected):
    params = parse_uri(uri)
    for key, value in expected.items():
        assert getattr(params, key) == value, key


@pytest.mark.parametrize("uri", [
    f"http://u:{SECRET}@h/",
    f"amqp://u:{SECRET}@h:notaport/",
    f"amqp://u:{SECRET}@h:70000/",
    f"amqp://u:{SECRET}@h/?heartbeat=abc",
    f"amqp://u:{SECRET}@h/a/b",
    f"amqp://u:pa/{SECRET}@h/",     # raw "/" in the password
])
def test_invalid_uri_error_hides_password(uri):
    with pytest.raises(ValueError) as info:
        parse_uri(uri)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)


@pytest.mark.parametrize("uri, expected", [
    (f"amqp://guest:{SECRET}@127.0.0.1:5672/%2F", "amqp://guest:***@127.0.0.1:5672/%2F"),
    (f"amqps://u:{SECRET}@h", "amqps://u:***@h"),
    (f"amqp://u:{SECRET}@h?heartbeat=5", "amqp://u:***@h?heartbeat=5"),
    # raw reserved characters in the password (an invalid URI a user may still type)
    (f"amqp://u:p@ss/w?rd#{SECRET}@h:1/v", "amqp://u:***@h:1/v"),
    (f"  amqp://u:{SECRET}@h", "  amqp://u:***@h"),
    (f"u:{SECRET}@h", "u:***@h"),                                    # scheme forgotten
    (f"failed: amqp://u:{SECRET}@h/v (retrying)", "failed: amqp://u:***@h/v (retrying)"),
    ("amqp://h:5672/v", "amqp://h:5672/v"),                          # nothing to hide
    ("amqp://user@h/v", "amqp://user@h/v"),
    ("not a uri", "not a uri"),
])
def test_redact(uri, expected):
    assert redact(uri) == expected
    assert SECRET not in redact(uri)


def test_redact_is_total():
    assert redact(None) == "None"
    assert redact(12) == "12"


def test_parameters_never_show_the_password():
    params = parse_uri(f"amqp://bob:{SECRET}@h:1/v")
    assert params.password == SECRET
    assert SECRET not in repr(params) and SECRET not in str(params)
    assert params.redacted == "amqp://bob:***@h:1/v"
    assert SECRET not in repr(ConnectionParameters(password=SECRET))


def test_amqps_to_a_port_without_tls_is_a_clear_error(caplog, amqp_broker):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConnectError) as info:
        Connection.open(f"amqps://u:{SECRET}@127.0.0.1:{amqp_broker.port}/", connect_timeout=5)
    assert "TLS" in str(info.value)
    assert SECRET not in str(info.value) and SECRET not in caplog.text