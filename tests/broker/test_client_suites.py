"""Real clients' own integration suites, run unmodified against our embedded broker.

* kombu 5.7.0: ``t/integration/test_py_amqp.py`` (the py-amqp transport: exchange types, TTL, priority
  queues, requeue, failover, connection pools, consumer revival ...).
* py-amqp 5.4.2: ``t/integration/test_rmq.py -k plain`` (publish/consume/get, confirms, ``immediate``
  refused with 540, short and short-short integer header values).

Both suites ship only inside the projects' source distributions. Each test here fetches the sdist once
into ``.ci-cache/client-suites/`` (git-ignored) with ``pip download``, extracts it into a temporary
directory, starts a fresh ``Broker(port=0)`` in this process and runs the suite with
``python -m pytest`` in a subprocess, pointing it at the broker through the variables the suites read:
``RABBITMQ_HOST`` and ``RABBITMQ_5672_TCP``. The outcome is read from the subprocess's JUnit XML: every
selected test must pass, and the number that passed must be the number the suite is known to contain, so
a suite that silently collects nothing (or skips) fails here too.

A fresh broker per suite matters: kombu's suite declares fixed, non-auto-delete queue names and leaves
unacknowledged messages in them, so a second run against the same broker starts from dirty queues (that,
and not priority handling, is why ``test_PyAMQPPriority::test_publish_requeue_consume`` fails when the
suite is re-run against a long-lived RabbitMQ).

The suites mark tests ``@pytest.mark.flaky(reruns=5)``; pytest-rerunfailures is deliberately *not*
installed, and is disabled for the subprocess if present, so an intermittent broker bug fails CI instead
of being retried away.

Offline: when the sdist is not cached and cannot be downloaded for lack of network, the test skips with
the reason, unless ``CI=true`` (then it fails). To prefetch, run this module once with network, or
``pip download --no-deps --no-binary :all: kombu==5.7.0 amqp==5.4.2 -d .ci-cache/client-suites``.

Manual baseline against another broker (e.g. RabbitMQ): set
``SPARK_AMQP_CLIENT_SUITES_BROKER=127.0.0.1:5672``; the suites then run against that address instead of
an embedded broker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".ci-cache" / "client-suites"
IN_CI = os.environ.get("CI", "").lower() == "true"
EXTERNAL_BROKER = os.environ.get("SPARK_AMQP_CLIENT_SUITES_BROKER", "")

pytestmark = pytest.mark.client_suite


@dataclass(frozen=True)
class Suite:
    project: str          # distribution name on the package index
    version: str
    paths: tuple[str, ...]  # test files inside the sdist, relative to its top directory
    extra_args: tuple[str, ...]
    expected_passed: int  # tests the selection contains (all must pass)
    timeout: float        # seconds for the whole subprocess

    @property
    def sdist_name(self) -> str:
        return f"{self.project}-{self.version}.tar.gz"


KOMBU = Suite("kombu", "5.7.0", ("t/integration/test_py_amqp.py",), (), expected_passed=51, timeout=300)
PY_AMQP = Suite("amqp", "5.4.2", ("t/integration/test_rmq.py",), ("-k", "plain"), expected_passed=12,
                timeout=120)

# pip's messages when the package index cannot be reached (as opposed to, say, a wrong version).
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|No route to host|Connection refused|"
    r"ConnectTimeoutError|ReadTimeoutError|ProxyError|Max retries exceeded|"
    r"Could not fetch URL|connection broken|SSLError",
    re.IGNORECASE,
)


def _offline(reason: str) -> None:
    if IN_CI:
        pytest.fail(reason + " (CI=true forbids skipping)")
    pytest.skip(reason)


def fetch_sdist(suite: Suite) -> Path:
    """The sdist from the cache, downloading it with pip first if it is not there."""
    target = CACHE_DIR / suite.sdist_name
    if target.is_file() and tarfile.is_tarfile(target):
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--retries", "2", "--timeout", "20",
           "-d", str(CACHE_DIR), f"{suite.project}=={suite.version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        _offline(f"`pip download {suite.project}=={suite.version}` timed out (no network?)")
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 or not target.is_file():
        if _NETWORK_ERRORS.search(output):
            _offline(f"cannot download the {suite.sdist_name} sdist (no network?): "
                     + _tail(output, 5))
        pytest.fail(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{_tail(output, 40)}")
    return target


def extract(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(dest)
    tops = [p for p in dest.iterdir() if p.is_dir()]
    assert len(tops) == 1, f"unexpected sdist layout: {tops}"
    return tops[0]


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class SuiteResult:
    passed: list[str]
    failed: list[str]
    skipped: list[str]


def parse_junit(path: Path) -> SuiteResult:
    result = SuiteResult([], [], [])
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed.append(name)
        elif case.find("skipped") is not None:
            result.skipped.append(name)
        else:
            result.passed.append(name)
    return result


def run_suite(suite: Suite, host: str, port: int, workdir: Path) -> None:
    src = extract(fetch_sdist(suite), workdir / "src")
    for rel in suite.paths:
        assert (src / rel).is_file(), f"{rel} is missing from {suite.sdist_name}"
    junit = workdir / "junit.xml"
    log = workdir / "output.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONPATH")}
    env.update(RABBITMQ_HOST=host, RABBITMQ_5672_TCP=str(port), PYTHONDONTWRITEBYTECODE="1")
    cmd = [
        sys.executable, "-m", "pytest", *suite.paths, *suite.extra_args,
        "-c", str(src / "setup.cfg"), "--rootdir", str(src),
        "-p", "no:cacheprovider",
        "-p", "no:rerunfailures",   # no retries: a flaky broker must fail, not be re-run to green
        "-p", "no:amqp_broker",     # our own plugin has no business inside the client's suite
        "-p", "no:randomly",
        "-W", "ignore::pytest.PytestUnknownMarkWarning",
        "--timeout", "60",          # per test (pytest-timeout), so one hang is named in the output
        "-o", "junit_family=xunit2", "--junitxml", str(junit),
        "-rfEs", "-v", "--tb=short", "--color=no",
    ]
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=suite.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            rc = None
    output = log.read_text(errors="replace")
    elapsed = time.monotonic() - started
    header = f"{suite.project} {suite.version} suite against {host}:{port}"
    if rc is None:
        pytest.fail(f"{header}: did not finish within {suite.timeout:.0f}s; output tail:\n{_tail(output)}")
    if not junit.is_file():
        pytest.fail(f"{header}: pytest exited {rc} without a report; output tail:\n{_tail(output)}")
    res = parse_junit(junit)
    problems = []
    if res.failed:
        problems.append(f"failed: {res.failed}")
    if res.skipped:
        problems.append(f"skipped: {res.skipped}")
    if len(res.passed) != suite.expected_passed:
        problems.append(f"{len(res.passed)} passed, expected {suite.expected_passed}")
    if rc != 0:
        problems.append(f"pytest exit code {rc}")
    if problems:
        pytest.fail(f"{header} ({elapsed:.1f}s): " + "; ".join(problems)
                    + f"\n--- output tail ---\n{_tail(output, 120)}", pytrace=False)


def _run_against_target(suite: Suite, tmp_path: Path) -> None:
    if EXTERNAL_BROKER:
        host, _, port = EXTERNAL_BROKER.rpartition(":")
        run_suite(suite, host, int(port), tmp_path)
        return
    from spark_amqp_broker import Broker

    with Broker(port=0) as b:
        run_suite(suite, b.host, b.port, tmp_path)


@pytest.mark.timeout(KOMBU.timeout + 360)
def test_kombu_py_amqp_integration_suite(tmp_path):
    _run_against_target(KOMBU, tmp_path)


@pytest.mark.timeout(PY_AMQP.timeout + 360)
def test_py_amqp_rmq_integration_suite(tmp_path):
    _run_against_target(PY_AMQP, tmp_path)
