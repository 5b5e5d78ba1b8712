"""Shared fixtures: where the brokers are, and names that do not collide.

Tests that need RabbitMQ (the reference brokers: 3.10 at 127.0.0.1:5672, 4.3 at 127.0.0.1:5682) skip with a clear reason when it is not
reachable, so the suite passes on a laptop without it; CI sets SPARK_AMQP_REQUIRE_RABBITMQ=1 and then an
unreachable RabbitMQ fails those tests instead. The embedded broker comes from our own pytest plugin
(`spark_amqp_broker.pytest_plugin`, fixture `amqp_broker`), registered through the `pytest11` entry point.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from brokers import (ALL_BROKERS, RABBITMQ4_URL, RABBITMQ_KINDS, RABBITMQ_URL, REQUIRE_RABBITMQ, require_rabbitmq,
                     url_of_broker)

# Every JVM the tests start (the session's SparkSession, the drivers of the kill tests, the notebooks' kernels,
# the demo, the Spark Connect server) compiles with C1 only. They live for seconds to minutes on small data,
# where C2's compiling is CPU spent and never paid back: a driver draining 2,000 messages in ten batches used
# 36.6 s of JVM CPU with C2 and 17.6 s without, and the suite is CPU-bound on two cores. Set in
# the environment, not in Spark's conf, so that it reaches the JVMs of child processes too; a
# JAVA_TOOL_OPTIONS of the user's own is left as it is.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1")


# Tests that must share one pytest-xdist worker: the ones that use the session's SparkSession (one per
# process, and two on two cores only slow each other down) or the session's second RabbitMQ node (one node
# name and port set per machine).
ONE_WORKER_FIXTURES = {"spark", "rabbitmq_tls", "rabbitmq_external"}


def pytest_itemcollected(item):
    """Group the tests above on one worker (`--dist loadgroup`), and the tests that start Spark drivers or
    servers of their own (mark `own_spark`: the kill tests, Spark Connect, the notebooks, the demo, a fresh
    process's discovery) on another, one at a time: beside the session's Spark, one more JVM at a time is
    what two cores take. The third worker (pyproject's `-n 3`) runs the rest, the broker's differential
    tests, which mostly wait on sockets and timers, and helps the second one once those are done.
    (xdist 3.8 reads the mark into the test id, which pytest 9.2 no longer lets it change: pyproject pins
    pytest below 9.2.)"""
    if ONE_WORKER_FIXTURES & set(item.fixturenames):
        item.add_marker(pytest.mark.xdist_group("spark"))
    elif item.get_closest_marker("own_spark") is not None:
        item.add_marker(pytest.mark.xdist_group("own-spark"))


@pytest.fixture
def rabbitmq_url() -> str:
    """The reference RabbitMQ broker's URL (skips, or fails under CI, when it is down)."""
    require_rabbitmq()
    return RABBITMQ_URL


@pytest.fixture(scope="session")
def rabbitmq_tls():
    """A second RabbitMQ node with a TLS listener (brokers.RabbitTLSNode), started once for the session and
    stopped after it; skips (fails under CI) when RabbitMQ cannot be started here."""
    yield from _rabbit_tls_node(external=False)


@pytest.fixture(scope="session")
def rabbitmq_external():
    """As rabbitmq_tls, a node that verifies client certificates and offers SASL EXTERNAL
    (rabbitmq_auth_mechanism_ssl)."""
    yield from _rabbit_tls_node(external=True)


def _rabbit_tls_node(external: bool):
    import shutil

    from brokers import RabbitTLSNode

    pytest.importorskip("trustme")
    reason = None
    if shutil.which("rabbitmq-server") is None:
        reason = "rabbitmq-server is not installed (needed for a second RabbitMQ node with TLS)"
    else:
        node = RabbitTLSNode(external=external)
        try:
            node.start()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = f"could not start a RabbitMQ node with TLS: {exc}"
    if reason:
        if REQUIRE_RABBITMQ:
            pytest.fail(reason + "; SPARK_AMQP_REQUIRE_RABBITMQ=1 forbids skipping")
        pytest.skip(reason)
    yield node
    node.stop()


@pytest.fixture(params=ALL_BROKERS)
def broker_url(request) -> str:
    """Each test using this runs three times: against our embedded broker (as RabbitMQ 4.3, its default),
    RabbitMQ 3.10 and RabbitMQ 4.3.

    Equal assertions on all is what makes a test differential. (The connector's tests narrow this to the
    embedded broker and RabbitMQ 4.3: tests/source/conftest.py, tests/sink/conftest.py.)
    """
    return url_of_broker(request)


@pytest.fixture
def broker_kind(broker_url) -> str:
    """"embedded", "rabbitmq" (3.10) or "rabbitmq4" (4.3)."""
    return {RABBITMQ_URL: "rabbitmq", RABBITMQ4_URL: "rabbitmq4"}.get(broker_url, "embedded")


@pytest.fixture
def node_version(broker_kind) -> str | None:
    """The RabbitMQ version of the node under test (for rabbitmqctl and version-dependent expectations);
    None for the embedded broker."""
    return RABBITMQ_KINDS.get(broker_kind)


@pytest.fixture
def unique_name(request):
    """A factory of names unique to this test, so runs against the shared RabbitMQ never collide."""
    base = request.node.name.split("[")[0][:40]

    def make(prefix: str = "") -> str:
        return f"{prefix or base}-{uuid.uuid4().hex[:10]}"

    return make


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole test session (a start costs about 8 s).

    Workers must run this interpreter (else "worker failed to connect back"), and the connector must be
    installed so workers can import it.
    """
    import sys

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from spark_amqp.pyspark_versions import ADMISSION_CONTROL

    builder = SparkSession.builder
    if not ADMISSION_CONTROL:
        # PySpark 4.0 / 4.1: availableNow for a Python source only through Spark's wrapper (docs/source.md).
        builder = builder.config("spark.sql.streaming.triggerAvailableNowWrapper.enabled", "true")
    session = (builder.master("local[2]").appName("spark-amqp-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.extraJavaOptions", "-Duser.timezone=UTC")
               .config("spark.executor.extraJavaOptions", "-Duser.timezone=UTC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
