"""Fixtures for the client tests: our own `Connection` to each broker, closed after the test."""

from __future__ import annotations

import pytest

from spark_amqp.client import Connection


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
