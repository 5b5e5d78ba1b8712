"""The broker's differential tests run each scenario four times: against the embedded broker set to behave as
RabbitMQ 3.10, against RabbitMQ 3.10, against the embedded broker as RabbitMQ 4.3, and against RabbitMQ 4.3.

`broker_url` (overriding the root conftest's for the tests in this folder) is the URL of the broker under test;
`rabbitmq_version` ("3.10" or "4.3") is the version that broker has or behaves as, for the expectations that
differ by version; `broker_kind` is "embedded" or "rabbitmq". The embedded brokers are one per version and
test module (they start in milliseconds, and every test cleans up what it declares, as it must on the shared
RabbitMQ nodes).
"""

from __future__ import annotations

import pytest

from brokers import require_rabbitmq
from spark_amqp_broker import Broker
from targets import TARGETS, targets_fixture


def _embedded(request, version: str):
    """A test module may set EMBEDDED_CONFIG, configuration keys (Broker keywords) for its embedded brokers."""
    config = getattr(request.module, "EMBEDDED_CONFIG", {})
    with Broker(port=0, rabbitmq_version=version, **config) as broker:
        yield broker


@pytest.fixture(scope="module")
def embedded_310(request):
    """An embedded broker behaving as RabbitMQ 3.10, for this module's tests."""
    yield from _embedded(request, "3.10")


@pytest.fixture(scope="module")
def embedded_43(request):
    """An embedded broker behaving as RabbitMQ 4.3, for this module's tests."""
    yield from _embedded(request, "4.3")


broker_target = targets_fixture(TARGETS)   # each test four times (a module may assign its own)


@pytest.fixture
def broker_url(request, broker_target) -> str:
    """Each test using this runs four times: embedded as 3.10, RabbitMQ 3.10, embedded as 4.3, RabbitMQ 4.3.
    Equal assertions on all four (or on the two of a version) is what makes a test differential."""
    if broker_target.kind == "rabbitmq":
        return require_rabbitmq(broker_target.version)
    fixture = "embedded_310" if broker_target.version == "3.10" else "embedded_43"
    return request.getfixturevalue(fixture).url


@pytest.fixture
def rabbitmq_version(broker_target) -> str:
    """The RabbitMQ version of the broker under test ("3.10" or "4.3"), for expectations that differ."""
    return broker_target.version


@pytest.fixture
def broker_kind(broker_target) -> str:
    return broker_target.kind
