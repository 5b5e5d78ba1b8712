"""Broker helpers shared by the test suites (``from brokers import ...``): a port nothing listens on, the
two reference RabbitMQ nodes (3.10 and 4.3) and their ``rabbitmqctl``, and cutting a broker's connections
from the broker's side.

Cutting on RabbitMQ closes the chosen connections one at a time (``rabbitmqctl close_connection``: the
client gets 320 CONNECTION_FORCED with the given reason), never ``close_all_connections``: the server is
shared. On the embedded broker the chosen connections' transports are aborted on the broker's thread (a
dropped TCP connection, as a network cut).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

import pytest

RABBITMQCTL_TIMEOUT = 30

# Where the reference RabbitMQ nodes are. Tests that need one call require_rabbitmq() (3.10) or
# require_rabbitmq4() (4.3): a skip with the reason when it is not reachable, a failure under CI
# (SPARK_AMQP_REQUIRE_RABBITMQ=1).
RABBITMQ_HOST = os.environ.get("SPARK_AMQP_RABBITMQ_HOST", "127.0.0.1")
RABBITMQ_PORT = int(os.environ.get("SPARK_AMQP_RABBITMQ_PORT", "5672"))
RABBITMQ_URL = f"amqp://guest:guest@{RABBITMQ_HOST}:{RABBITMQ_PORT}/%2F"
REQUIRE_RABBITMQ = os.environ.get("SPARK_AMQP_REQUIRE_RABBITMQ") == "1"

# The RabbitMQ 4.3 node started by ../shared/rabbitmq4/start.sh, its rabbitmqctl in the same folder (the host's
# rabbitmqctl, 3.10's, cannot reach it).
RABBITMQ4_HOST = os.environ.get("SPARK_AMQP_RABBITMQ4_HOST", "127.0.0.1")
RABBITMQ4_PORT = int(os.environ.get("SPARK_AMQP_RABBITMQ4_PORT", "5682"))
RABBITMQ4_URL = f"amqp://guest:guest@{RABBITMQ4_HOST}:{RABBITMQ4_PORT}/%2F"
RABBITMQ4_CTL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "shared", "rabbitmq4", "ctl.sh")

# The two reference nodes by the version they run: (host, port, URL).
NODES = {"3.10": (RABBITMQ_HOST, RABBITMQ_PORT, RABBITMQ_URL),
         "4.3": (RABBITMQ4_HOST, RABBITMQ4_PORT, RABBITMQ4_URL)}
# The RabbitMQ nodes a connector test runs against, by the name of the `broker_url` param (tests/conftest.py).
RABBITMQ_KINDS = {"rabbitmq": "3.10", "rabbitmq4": "4.3"}
# The brokers the connector's tests (tests/source, tests/sink) run against: the embedded broker and the
# RabbitMQ users run today. What the connector does is the same on 3.10; the modules where a version shows
# (quorum queues' delivery counts, consumer timeouts, header order) add 3.10 themselves.
CONNECTOR_BROKERS = ["embedded", "rabbitmq4"]
ALL_BROKERS = ["embedded", *RABBITMQ_KINDS]
# The smallest frame_max a client may negotiate with each version (rabbit_framing FRAME_MIN_SIZE).
MIN_FRAME_MAX = {"3.10": 4096, "4.3": 8192}
_STARTED_BY = {"3.10": "`rabbitmq-server -detached`", "4.3": "../shared/rabbitmq4/start.sh"}

_reachable: dict[str, bool] = {}


def rabbitmq_reachable(version: str = "3.10") -> bool:
    if version not in _reachable:
        host, port, _url = NODES[version]
        try:
            with socket.create_connection((host, port), timeout=2):
                _reachable[version] = True
        except OSError:
            _reachable[version] = False
    return _reachable[version]


def require_rabbitmq(version: str = "3.10") -> str:
    """The URL of the reference node running RabbitMQ `version`; skips (fails under CI) when it is down."""
    host, port, url = NODES[version]
    if rabbitmq_reachable(version):
        return url
    reason = (f"RabbitMQ {version} is not reachable at {host}:{port} "
              f"(start it with {_STARTED_BY[version]})")
    if REQUIRE_RABBITMQ:
        pytest.fail(reason + "; SPARK_AMQP_REQUIRE_RABBITMQ=1 forbids skipping")
    pytest.skip(reason)


def url_of_broker(request) -> str:
    """For a `broker_url` fixture: the URL of the broker `request.param` names, "embedded" (the test's own
    embedded broker, fixture `amqp_broker`) or a RABBITMQ_KINDS key (skips, or fails under CI, when that
    node is down)."""
    if request.param in RABBITMQ_KINDS:
        return require_rabbitmq(RABBITMQ_KINDS[request.param])
    return request.getfixturevalue("amqp_broker").url


def require_rabbitmq4() -> str:
    """The RabbitMQ 4.3 node's URL; skips (fails under CI) when 5682 is closed."""
    return require_rabbitmq("4.3")


def free_port() -> int:
    """A loopback port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- RabbitMQ


def rabbitmqctl(*args: str, version: str = "3.10") -> str:
    """``rabbitmqctl -q <args>``'s output on the node running RabbitMQ `version` (3.10: the host's
    rabbitmqctl; 4.3: ../shared/rabbitmq4/ctl.sh); RuntimeError (with its stderr) when it fails."""
    ctl = "rabbitmqctl" if version == "3.10" else RABBITMQ4_CTL
    out = subprocess.run([ctl, "-q", *args], capture_output=True, text=True, timeout=RABBITMQCTL_TIMEOUT)
    if out.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} ({version}) failed: {out.stderr.strip()}")
    return out.stdout


def rabbitmq_list(what: str, *columns: str, version: str = "3.10") -> list[dict[str, str]]:
    """``rabbitmqctl list_<what> <columns>`` as one dict a row (column name -> text); the last column
    keeps any tabs of its own (``client_properties`` does). 4.3's CLI writes ``client_properties`` in
    Elixir's syntax: with that column its JSON is read and every value given as text, as 3.10's are."""
    import json

    if version != "3.10" and "client_properties" in columns:
        asked = [*columns, "name"] if "pid" in columns and "name" not in columns else list(columns)
        rows = json.loads(rabbitmqctl(f"list_{what}", *asked, "--formatter", "json", version=version) or "[]")
        out = [{c: row.get(c) if isinstance(row.get(c), str) else json.dumps(row.get(c)) for c in asked}
               for row in rows]
        if "pid" in columns:
            # The JSON gives a pid as Pid(#PID<...>), which close_connection does not take: the table's
            # form (<node.creation.id.serial>) by the row's name.
            lines = rabbitmqctl(f"list_{what}", "name", "pid", version=version).splitlines()[1:]
            pids = dict(line.rsplit("\t", 1) for line in lines if "\t" in line)
            for row in out:
                row["pid"] = pids.get(row["name"], row["pid"])
        return [{c: row[c] for c in columns} for row in out]
    rows = []
    for line in rabbitmqctl(f"list_{what}", *columns, "--no-table-headers", version=version).splitlines():
        parts = line.split("\t", len(columns) - 1)
        if len(parts) == len(columns):
            rows.append(dict(zip(columns, parts)))
    return rows


# ------------------------------------------------------------------------------ cutting connections


def cut_connections(broker: Any, *, embedded: Callable[[Any], bool],
                    rabbitmq: Callable[[dict[str, str]], bool], columns: Sequence[str],
                    reason: str, version: str = "3.10") -> int:
    """Close, from the broker's side, the connections a test picks; returns how many were closed.

    ``broker`` is the embedded ``Broker``, or None for RabbitMQ. On the embedded broker ``embedded(conn)``
    picks among the core's connections (read on the broker's thread); on RabbitMQ ``rabbitmq(row)`` picks
    among the rows of ``rabbitmq_list("connections", "pid", *columns)``, and ``reason`` is the close text;
    ``version`` picks the RabbitMQ node.
    """
    if broker is None:
        pids = [row["pid"] for row in rabbitmq_list("connections", "pid", *columns, version=version)
                if rabbitmq(row)]
        # At once: each rabbitmqctl takes a second or more, and a test cutting two publishers one after the
        # other saw the second finish its work before its cut.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(pids))) as pool:
            list(pool.map(lambda pid: rabbitmqctl("close_connection", pid, reason, version=version), pids))
        return len(pids)

    def abort(core) -> int:
        victims = [c for c in list(core.connections)
                   if c.io is not None and c.io.transport is not None and embedded(c)]
        for c in victims:
            c.io.transport.abort()
        return len(victims)

    return broker.call(abort, broker.core)


# ------------------------------------------------------------------------- a RabbitMQ node with TLS


class RabbitTLSNode:
    """A second RabbitMQ node with a TLS listener, for the TLS tests against the reference broker.

    The machine's default node (rabbit@localhost, port 5672) is left alone: this one has its own node name,
    ports, config, data and log directories under `workdir`, a certificate for localhost/127.0.0.1 from a
    throw-away CA (trustme), and no plugins. Starting it takes a few seconds; `stop()` stops it.

    `external=True`: client certificates signed by `ca` are verified (verify_peer, not required) and the
    rabbitmq_auth_mechanism_ssl plugin offers SASL EXTERNAL (auth_mechanisms PLAIN, AMQPLAIN, EXTERNAL;
    ssl_cert_login_from left at its default, distinguished_name); `ctl(...)` runs rabbitmqctl on the node.
    """

    def __init__(self, external: bool = False):
        import os
        import shutil
        import tempfile

        from spark_amqp_broker.pytest_plugin import write_tls_files

        # Not under pytest's tmp_path: its parents are private to this user, and rabbitmq-server started as
        # root runs as the rabbitmq user.
        self.dir = tempfile.mkdtemp(prefix="spark-amqp-rabbitmq-tls-")
        os.chmod(self.dir, 0o755)
        self.node = f"sparkamqp-{'external' if external else 'tls'}-{os.getpid()}@localhost"
        self.tls_port, self.tcp_port, self.dist_port = free_port(), free_port(), free_port()
        self.ca, files = write_tls_files(self.dir)             # ca.pem, server.pem, server.key
        self.ca_file = files.ca_file
        with open(f"{self.dir}/rabbitmq.conf", "w") as fh:
            fh.write(f"listeners.tcp.default = 127.0.0.1:{self.tcp_port}\n"
                     f"listeners.ssl.default = 127.0.0.1:{self.tls_port}\n"
                     f"ssl_options.cacertfile = {self.dir}/ca.pem\n"
                     f"ssl_options.certfile = {self.dir}/server.pem\n"
                     f"ssl_options.keyfile = {self.dir}/server.key\n"
                     f"ssl_options.verify = {'verify_peer' if external else 'verify_none'}\n"
                     "ssl_options.fail_if_no_peer_cert = false\n")
            if external:
                fh.write("auth_mechanisms.1 = PLAIN\nauth_mechanisms.2 = AMQPLAIN\n"
                         "auth_mechanisms.3 = EXTERNAL\n")
        with open(f"{self.dir}/enabled_plugins", "w") as fh:
            fh.write("[rabbitmq_auth_mechanism_ssl].\n" if external else "[].\n")
        for sub in ("mnesia", "log"):
            os.makedirs(f"{self.dir}/{sub}", exist_ok=True)
        if os.geteuid() == 0 and shutil.which("chown"):
            # rabbitmq-server drops to the rabbitmq user when started as root: let it read and write here
            subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", self.dir], check=False, timeout=30)
        self.env = {**os.environ, "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_PORT": str(self.tcp_port),
                    "RABBITMQ_DIST_PORT": str(self.dist_port),
                    "RABBITMQ_CONFIG_FILE": f"{self.dir}/rabbitmq",
                    "RABBITMQ_MNESIA_BASE": f"{self.dir}/mnesia", "RABBITMQ_LOG_BASE": f"{self.dir}/log",
                    "RABBITMQ_ENABLED_PLUGINS_FILE": f"{self.dir}/enabled_plugins",
                    "RABBITMQ_PID_FILE": f"{self.dir}/pid"}

    @property
    def url(self) -> str:
        return f"amqps://guest:guest@localhost:{self.tls_port}/%2F"

    @property
    def tcp_url(self) -> str:
        """The node's plain listener, for a test that needs a 3.10 node with settings of its own."""
        return f"amqp://guest:guest@127.0.0.1:{self.tcp_port}/%2F"

    def start(self, timeout: float = 90.0) -> "RabbitTLSNode":
        import time

        subprocess.run(["rabbitmq-server", "-detached"], env=self.env, capture_output=True, timeout=60,
                       check=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.tls_port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the RabbitMQ TLS node {self.node} did not listen on {self.tls_port} within "
                           f"{timeout:.0f} s (logs in {self.dir}/log)")

    def ctl(self, *args: str) -> str:
        """rabbitmqctl on this node; RuntimeError with its output when it fails."""
        done = subprocess.run(["rabbitmqctl", "-n", self.node, *args], env=self.env, capture_output=True,
                              text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def stop(self) -> None:
        import shutil

        subprocess.run(["rabbitmqctl", "-n", self.node, "stop"], env=self.env, capture_output=True,
                       timeout=60, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------ RabbitMQ definitions


def rabbitmq_definitions(vhosts, users, version: str = "3.10") -> dict:
    """RabbitMQ's ``export_definitions`` cut down to some vhosts and users (the shared RabbitMQ holds other
    tests' too). Exported to standard output: the node cannot write into pytest's private directories."""
    import json

    doc = json.loads(rabbitmqctl("export_definitions", "-", "--format", "json", version=version))
    out = {}
    for key, items in doc.items():
        if not isinstance(items, list):
            out[key] = items
        elif key == "users":
            out[key] = [u for u in items if u["name"] in users]
        elif key == "vhosts":
            out[key] = [v for v in items if v["name"] in vhosts]
        elif key in ("permissions", "topic_permissions"):
            out[key] = [p for p in items if p["vhost"] in vhosts and p["user"] in users]
        else:
            out[key] = [i for i in items if i.get("vhost") in vhosts]
    return out


@contextlib.contextmanager
def rabbitmq_setup(vhost: str, users: Sequence[str], setup: Callable[[str], None], fallback: dict,
                   version: str = "3.10"):
    """The definitions a differential test starts the embedded broker with: when the RabbitMQ `version` node
    is reachable, add `vhost` there, run `setup(version)` (rabbitmqctl users, permissions, AMQP declares...),
    and yield that node's own export cut down to `vhost` and `users`, with True; the vhost and users are
    deleted afterwards. Without that node, yield `fallback` (the same setup written in the export's format)
    and False."""
    if not rabbitmq_reachable(version):
        yield fallback, False
        return
    try:
        rabbitmqctl("add_vhost", vhost, version=version)
        setup(version)
        yield rabbitmq_definitions({vhost}, set(users), version), True
    finally:
        for args in (("delete_vhost", vhost), *(("delete_user", u) for u in users if u != "guest")):
            try:
                rabbitmqctl(*args, version=version)
            except RuntimeError:
                pass    # never created (setup failed first)


class BrokerProcess:
    """`python -m spark_amqp_broker ARGS` in a process of its own, its log (stderr) read by a thread and kept."""

    def __init__(self, args: Sequence[str], cwd=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "spark_amqp_broker", *args], cwd=cwd,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 20.0) -> re.Match:
        """The first log line from now on that matches `pattern` (the test fails if none comes)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no log line matching {pattern!r} within {timeout}s; got {self.lines}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(f"the broker exited ({self.proc.poll()}) before logging {pattern!r}: {self.lines}")
            m = re.search(pattern, line)
            if m:
                return m

    def stop(self, how: str = "term") -> None:
        """SIGTERM (the broker must exit 0) or kill -9."""
        if how == "kill":
            self.proc.kill()
        else:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=20) == (-signal.SIGKILL if how == "kill" else 0)
        self._reader.join(timeout=10)       # it ends at the pipe's EOF, once the process is gone
        self.proc.stderr.close()

    def log(self) -> str:
        return "".join(self.lines)


class DataDirBroker(BrokerProcess):
    """`python -m spark_amqp_broker --port 0 --data-dir D [extra]`, its port read from its log (`extra` may
    name the port: `--port N` to restart a killed broker where its clients reconnect)."""

    def __init__(self, data_dir, *extra: str):
        super().__init__(["--port", "0", "--data-dir", str(data_dir), *extra])
        self.port = int(self.wait_for(r"broker listening on 127\.0\.0\.1:(\d+)").group(1))
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
