"""pytest plugin (entry point `pytest11`): a running embedded broker for any test suite.

    def test_publish(amqp_url):
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))

`amqp_broker` is a fresh `Broker` per test (it starts in milliseconds), so tests never share queues.
"""

from __future__ import annotations

import pytest

from .embedded import Broker


@pytest.fixture
def amqp_broker():
    """A running embedded AMQP 0-9-1 broker on an ephemeral port, stopped after the test."""
    with Broker(port=0) as broker:
        yield broker


@pytest.fixture
def amqp_url(amqp_broker) -> str:
    """The embedded broker's URL: amqp://guest:guest@127.0.0.1:<port>/%2F"""
    return amqp_broker.url
