"""Fixtures of the sink tests (helpers live in sink_helpers.py)."""

from __future__ import annotations

import pytest

from brokers import CONNECTOR_BROKERS, RABBITMQ4_URL, require_rabbitmq4, url_of_broker
from sink_helpers import Admin, SuperStreams


@pytest.fixture(params=CONNECTOR_BROKERS)
def broker_url(request) -> str:
    """The connector's tests run against the embedded broker and RabbitMQ 4.3 (brokers.CONNECTOR_BROKERS)."""
    return url_of_broker(request)


@pytest.fixture
def admin(broker_url):
    a = Admin(broker_url)
    yield a
    a.close()


@pytest.fixture(params=["embedded", "rabbitmq4"])
def stream_broker_url(request) -> str:
    """The brokers with super streams (RabbitMQ 3.11+): the embedded broker (as 4.3) and the RabbitMQ 4.3
    node, whose super streams its own CLI makes."""
    if request.param == "rabbitmq4":
        return require_rabbitmq4()
    return request.getfixturevalue("amqp_broker").url


@pytest.fixture
def super_streams(stream_broker_url):
    """Makes super streams on the broker under test and deletes them afterwards (sink_helpers.SuperStreams)."""
    a = Admin(stream_broker_url)
    made = SuperStreams(a, on_rabbitmq=stream_broker_url == RABBITMQ4_URL)
    yield made
    made.close()
    a.close()


@pytest.fixture
def embedded_super_streams(amqp_broker):
    """As super_streams, on the embedded broker only: for what the sink does the same on every broker."""
    a = Admin(amqp_broker.url)
    yield SuperStreams(a, on_rabbitmq=False)
    a.close()
