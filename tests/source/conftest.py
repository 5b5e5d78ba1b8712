"""Fixtures for the source tests (helpers live in source_helpers.py).

`env`: the broker under test (each broker of `broker_url`) with queue helpers and probes;
`secret_broker`: an embedded broker with a user whose password is easy to search for in error texts;
every streaming query a test leaves running is stopped after it.
"""

from __future__ import annotations

import pytest

from brokers import CONNECTOR_BROKERS, RABBITMQ_KINDS, url_of_broker
from source_helpers import SECRET, Env


@pytest.fixture(params=CONNECTOR_BROKERS)
def broker_url(request) -> str:
    """The connector's tests run against the embedded broker and RabbitMQ 4.3 (brokers.CONNECTOR_BROKERS)."""
    return url_of_broker(request)


@pytest.fixture
def env(request, broker_url, broker_kind, unique_name):
    broker = request.getfixturevalue("amqp_broker") if broker_kind == "embedded" else None
    e = Env(broker_url, broker_kind, broker, unique_name, version=RABBITMQ_KINDS.get(broker_kind))
    yield e
    e.cleanup()


@pytest.fixture
def secret_broker():
    """An embedded broker with a user whose password is `SECRET` (RabbitMQ's users are not ours to add)."""
    from spark_amqp_broker import Broker
    with Broker(port=0, users={"guest": "guest", "spy": SECRET}) as b:
        b.secret_url = f"amqp://spy:{SECRET}@{b.host}:{b.port}/%2F"
        yield b


@pytest.fixture(autouse=True)
def _stop_queries_after(request):
    """Stop whatever streaming query a test left running (only the queries of this pytest process)."""
    yield
    if "spark" in request.fixturenames:
        spark = request.getfixturevalue("spark")
        for q in spark.streams.active:
            try:
                q.stop()
            except Exception:
                pass


