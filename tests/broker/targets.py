"""The brokers a differential test runs against (tests/broker/conftest.py), in a module of its own so that test
modules can import them: the embedded broker set to each RabbitMQ version and the RabbitMQ node of that version.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from brokers import require_rabbitmq

VERSIONS = ("3.10", "4.3")


@dataclass(frozen=True)
class Target:
    kind: str         # "embedded" or "rabbitmq"
    version: str      # the RabbitMQ version it is, or behaves as

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.version}"


TARGETS = [Target(kind, version) for version in VERSIONS for kind in ("embedded", "rabbitmq")]
TARGETS_43 = [t for t in TARGETS if t.version == "4.3"]     # for what RabbitMQ 3.10 does not have


def targets_fixture(targets, marks: dict | None = None):
    """A `broker_target` fixture over `targets`: which broker a test runs against; skips (fails under CI,
    SPARK_AMQP_REQUIRE_RABBITMQ=1) when that RabbitMQ node is down. conftest.py makes the one over TARGETS;
    a module whose feature only 4.3 has assigns its own: `broker_target = targets_fixture(TARGETS_43)`.
    `marks`: pytest marks for the tests of some targets ({Target: mark})."""
    marks = marks or {}

    @pytest.fixture(params=[pytest.param(t, id=t.id, marks=marks.get(t, ())) for t in targets])
    def broker_target(request) -> Target:
        if request.param.kind == "rabbitmq":
            require_rabbitmq(request.param.version)
        return request.param

    return broker_target
