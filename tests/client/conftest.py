"""Fixtures for the client tests: our own `Connection` to each broker, closed after the test."""

from __future__ import annotations

import pytest

from spark_amqp.client import Connection
from spark_amqp_broker import Broker

from brokers import require_rabbitmq


@pytest.fixture
def amqp_broker():
    """The embedded broker behaving as RabbitMQ 3.10, the version of the reference node `broker_url`
    compares it with here (the broker's own tests cover both versions: tests/broker/conftest.py; the
    connector's tests run the client against RabbitMQ 4.3 too)."""
    with Broker(port=0, rabbitmq_version="3.10") as broker:
        yield broker


@pytest.fixture(params=["embedded", "rabbitmq"])
def broker_url(request) -> str:
    """The client's tests compare it on the embedded broker (as 3.10) and RabbitMQ 3.10: byte-level
    expectations (headers as published, frame_max 4096) are 3.10's."""
    if request.param == "rabbitmq":
        return require_rabbitmq()
    return request.getfixturevalue("amqp_broker").url


@pytest.fixture
def connect(broker_url):
    """A factory of `Connection`s to the broker under test (both brokers via `broker_url`)."""
    opened: list[Connection] = []

    def make(url: str | None = None, **kw) -> Connection:
        conn = Connection.open(url or broker_url, **kw)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.close(timeout=2)
    for conn in opened:  # no reader thread outlives its connection
        conn._reader.join(2)
        assert not conn._reader.is_alive(), f"reader thread of {conn!r} still running"


@pytest.fixture
def channel(connect):
    """A channel on a fresh connection to the broker under test."""
    return connect().channel()
