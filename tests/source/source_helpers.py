"""Helpers for the source tests: the broker under test with queue helpers, probes, a foreachBatch collector.

`env` wraps the broker under test (both brokers through `broker_url`): it declares queues (deleted after
the test), publishes with pika under publisher confirms (so a message is in its queue before Spark
starts), and reports a queue's `(ready, unacked)` as the broker sees it: RabbitMQ through `rabbitmqctl
list_queues` (about 0.3 s a call), the embedded broker by reading its core state on the broker's thread.
Every Spark query a test starts is stopped after it, so a failing test does not leave a query running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pika
import pika.exceptions
import psutil
import pytest

from spark_amqp.pyspark_versions import ADMISSION_CONTROL

from brokers import cut_connections, rabbitmq_list
from waiting import wait_until

# A password that matches none of Spark's own redaction patterns (secret|password|token|access key),
# so that if it shows up anywhere it is the connector's doing, and it is easy to search for.
SECRET = "hunter2q7Zx"

def _spark_descendants() -> list[psutil.Process]:
    """Processes started (indirectly) by this test process: the Spark JVM and its Python workers."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def local_ports_to(port: int) -> set[int]:
    """Local TCP ports of this process's descendants' connections to `port` (the source's consumer)."""
    ports = set()
    for proc in _spark_descendants():
        try:
            for c in proc.net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED:
                    ports.add(c.laddr.port)
        except psutil.Error:
            continue
    return ports


class Env:
    """The broker under test, as a test uses it."""

    def __init__(self, url: str, kind: str, broker, unique_name, version: str | None = None):
        self.url = url
        self.kind = kind
        self.broker = broker            # the embedded `Broker`, or None for RabbitMQ
        self.version = version or "3.10"    # which RabbitMQ node, when broker is None
        self._unique = unique_name
        self._declared: list[str] = []
        self._exchanges: list[str] = []
        self._conn = None
        self._ch = None

    # --- publishing ----------------------------------------------------------------------------

    def channel(self):
        if self._conn is None or not self._conn.is_open or self._ch is None or not self._ch.is_open:
            self.close_publisher()
            self._conn = pika.BlockingConnection(pika.URLParameters(self.url))
            self._ch = self._conn.channel()
            self._ch.confirm_delivery()
        return self._ch

    def close_publisher(self) -> None:
        if self._conn is not None:
            try:
                if self._conn.is_open:
                    self._conn.close()
            except Exception:
                pass
        self._conn = None
        self._ch = None

    def queue(self, prefix: str = "src", **arguments) -> str:
        """Declare a fresh non-durable queue (deleted after the test; x-expires as a safety net)."""
        name = self._unique(prefix)
        args = {"x-expires": 600_000, **arguments}
        self.channel().queue_declare(name, durable=False, arguments=args)
        self._declared.append(name)
        return name

    def quorum_queue(self, prefix: str = "quorum", **arguments) -> str:
        """Declare a fresh quorum queue (durable, as quorum queues must be; deleted after the test)."""
        name = self._unique(prefix)
        self.channel().queue_declare(name, durable=True, arguments={"x-queue-type": "quorum", **arguments})
        self._declared.append(name)
        return name

    def stream(self, prefix: str = "stream", **arguments) -> str:
        """Declare a fresh stream queue (durable, as streams must be; deleted after the test)."""
        name = self._unique(prefix)
        self.channel().queue_declare(name, durable=True, arguments={"x-queue-type": "stream", **arguments})
        self._declared.append(name)
        return name

    def super_stream(self, partitions: int = 3, binding_keys: list[str] | None = None) -> str:
        """A fresh super stream (deleted after the test): on RabbitMQ 4.3 made by `rabbitmq-streams
        add_super_stream`, on the embedded broker by `Broker.add_super_stream` (3.10 has none). Keys are
        "0".."N-1" unless `binding_keys` are given."""
        name = self._unique("super")
        keys = binding_keys or [str(i) for i in range(partitions)]
        self._exchanges.append(name)
        self._declared += [f"{name}-{k}" for k in keys]
        if self.kind == "rabbitmq4":
            from brokers import RABBITMQ4_CTL
            how = ["--binding-keys", ",".join(binding_keys)] if binding_keys else ["--partitions", str(partitions)]
            subprocess.run([RABBITMQ4_CTL, "rabbitmq-streams", "add_super_stream", name, *how], check=True,
                           capture_output=True, timeout=60)
            return name
        self.broker.add_super_stream(name, None if binding_keys else partitions, binding_keys)
        return name

    def add_partition(self, super_stream: str, key: str, order: int) -> str:
        """Stream `<super_stream>-<key>` bound to the super stream's exchange by `key` as partition `order`
        (as `add_super_stream` binds its partitions), as a partition added to a running super stream."""
        name = f"{super_stream}-{key}"
        ch = self.channel()
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
        ch.queue_bind(name, super_stream, key, arguments={"x-stream-partition-order": order})
        if name not in self._declared:
            self._declared.append(name)
        return name

    def publish_filtered(self, queue: str, rows: list[tuple[bytes, str | None]]) -> None:
        """Publish (body, filter value or None) rows to `queue` in one write (so that a broker may put
        them in one chunk), all confirmed; a row without a value gets another header instead."""
        from spark_amqp.client import Connection
        from spark_amqp.codec.properties import encode
        props = [encode({"headers": {"x-stream-filter-value": v} if v is not None else {"k": "v"}})
                 for _, v in rows]
        with Connection.open(self.url) as conn:
            ch = conn.channel()
            ch.confirm_select()
            ch.publish_many("", queue, [b for b, _ in rows], props)
            ch.wait_for_confirms(timeout=60)

    def publish(self, queue: str, bodies, properties=None, exchange: str = "") -> None:
        """Publish each body to `queue` (through `exchange`, routing key = queue), confirmed."""
        ch = self.channel()
        for i, body in enumerate(bodies):
            props = properties[i] if isinstance(properties, list) else properties
            if isinstance(body, str):
                body = body.encode()
            ch.basic_publish(exchange, queue, body, props)

    def publish_bulk(self, queue: str, bodies: list[bytes]) -> None:
        """Publish many bodies to `queue` fast (our client's pipelined publish_many), all confirmed."""
        from spark_amqp.client import Connection
        with Connection.open(self.url) as conn:
            ch = conn.channel()
            ch.confirm_select()
            ch.publish_many("", queue, bodies)
            ch.wait_for_confirms(timeout=60)

    # --- what the broker holds -----------------------------------------------------------------

    def state(self, queue: str) -> tuple[int, int]:
        """(messages ready, messages delivered and not acked) of `queue`, as the broker counts them."""
        if self.broker is None:
            for row in rabbitmq_list("queues", "name", "messages_ready", "messages_unacknowledged",
                                     version=self.version):
                if row["name"] == queue:
                    return int(row["messages_ready"]), int(row["messages_unacknowledged"])
            raise AssertionError(f"queue {queue!r} not found by rabbitmqctl list_queues")

        def inspect(core):
            q = core.vhosts["/"].queues[queue]
            unacked = sum(1 for conn in core.connections for ch in conn.channels.values()
                          for entry in ch.unacked.values() if entry[1] is q)
            return q.message_count(), unacked

        return self.broker.call(inspect, self.broker.core)

    def consumers(self, queue: str) -> int:
        """Consumers attached to `queue` now."""
        if self.broker is None:
            for row in rabbitmq_list("queues", "name", "consumers", version=self.version):
                if row["name"] == queue:
                    return int(row["consumers"])
            raise AssertionError(f"queue {queue!r} not found by rabbitmqctl list_queues")
        return self.broker.call(lambda core: len(core.vhosts["/"].queues[queue].consumers), self.broker.core)

    def wait_no_consumer(self, queue: str, timeout: float = 10.0) -> None:
        """A stopped query closes its consumer just after awaitTermination returns: wait for that."""
        wait_until(lambda: self.consumers(queue) == 0, timeout, interval=0.1,
                   message=f"the stopped query's consumer to leave {queue}")

    def in_broker(self, queue: str) -> int:
        ready, unacked = self.state(queue)
        return ready + unacked

    def wait_state(self, queue: str, expected: tuple[int, int], timeout: float = 15.0, query=None):
        """Wait until `queue` is (ready, unacked) == expected; with `query`, it must stay active meanwhile."""
        last = None

        def check():
            nonlocal last
            if query is not None:
                assert query.isActive, f"the query stopped: {query.exception()}"
            last = self.state(queue)
            return last == expected

        wait_until(check, timeout, interval=0.2,
                   message=lambda: f"queue {queue} to hold (ready, unacked) == {expected}, still {last}")

    # --- faults ----------------------------------------------------------------------------------

    def cut_source_connections(self) -> int:
        """Close, from the broker's side, the connections Spark's processes hold. Returns how many."""
        ports = local_ports_to(urlparse(self.url).port) if self.broker is None else set()
        return cut_connections(
            self.broker, reason="test: connection cut by the source tests", columns=["peer_port"],
            version=self.version,
            rabbitmq=lambda row: int(row["peer_port"]) in ports,
            embedded=lambda conn: conn.client_properties.get("product") in ("spark-amqp", b"spark-amqp"))

    def cleanup(self) -> None:
        """Delete what the test declared, each on its own, on a fresh connection if the one in hand fails
        (after a long test its unserviced heartbeats have let the broker drop it): whatever is left stays
        on the shared RabbitMQ, where streams have no x-expires to remove them."""
        for name in self._declared:
            for _attempt in range(2):
                try:
                    self.channel().queue_delete(name)
                    break
                except Exception:
                    self.close_publisher()
        for name in self._exchanges:
            try:
                self.channel().exchange_delete(name)
            except Exception:
                self.close_publisher()
        self.close_publisher()


class Collector:
    """A foreachBatch sink that keeps every batch's rows (the function runs in this driver process).

    `probe(batch_id, rows)` may be given to look at the broker while the batch runs; what it returns is
    kept in `probes[batch_id]`.
    """

    def __init__(self, probe=None):
        self.batches: dict[int, list] = {}
        self.probes: dict[int, object] = {}
        self.order: list[int] = []
        self._probe = probe

    def __call__(self, df, batch_id):
        rows = df.collect()
        self.batches[batch_id] = rows
        self.order.append(batch_id)
        if self._probe is not None:
            self.probes[batch_id] = self._probe(batch_id, rows)

    @property
    def rows(self) -> list:
        return [r for b in sorted(self.batches) for r in self.batches[b]]

    def bodies(self) -> list[bytes]:
        return [bytes(r.body) for r in self.rows]


class ConfirmedPublisher(threading.Thread):
    """Publishes ids p0.. persistent, each once, waiting for its confirm, `pause` s apart, until `total` or
    `stop()`; through a broker restart it reconnects and goes on with the next id (an id whose confirm never
    came may or may not be there)."""

    def __init__(self, url: str, queue: str, total: int, pause: float):
        super().__init__(daemon=True)
        self.url, self.queue, self.total, self.pause = url, queue, total, pause
        self.confirmed: list[int] = []
        self.unsure: list[int] = []
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(30)

    def run(self):
        i, ch = 0, None
        deadline = time.monotonic() + 120
        while i < self.total and time.monotonic() < deadline and not self._stopping.is_set():
            try:
                if ch is None:
                    ch = pika.BlockingConnection(pika.URLParameters(self.url)).channel()
                    ch.confirm_delivery()
                ch.basic_publish("", self.queue, f"p{i}".encode(), pika.BasicProperties(delivery_mode=2))
                self.confirmed.append(i)
                time.sleep(self.pause)
            except pika.exceptions.AMQPError:
                if ch is not None:
                    self.unsure.append(i)
                    ch = None
                    i += 1
                time.sleep(0.2)
                continue
            i += 1
        if ch is not None:
            with contextlib.suppress(Exception):
                ch.connection.close()


def stream(spark, url: str, queue: str, **options):
    """spark.readStream.format("amqp") over `queue` with extra options."""
    reader = spark.readStream.format("amqp").option("uri", url).option("queue", queue)
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load()


def checkpoint(tmp_path, name: str = "chk") -> str:
    return str(tmp_path / f"{name}-{uuid.uuid4().hex[:6]}")


# PySpark 4.0 / 4.1 run a Python source's availableNow as one batch per run and have no reportLatestOffset
# (docs/source.md, "PySpark versions"); tests of what 4.2's admission control gives are skipped there.
needs_admission_control = pytest.mark.skipif(
    not ADMISSION_CONTROL, reason="needs PySpark >= 4.2 (admission control: availableNow in batches, "
                                  "reportLatestOffset); 4.0/4.1 run availableNow as one batch per run")


def run_available_now(start_query, timeout: float = 60) -> int:
    """Drain the source with availableNow runs, as a user of this PySpark would: one run on PySpark >= 4.2;
    on 4.0 / 4.1, where a run reads one batch, runs until one reads nothing. `start_query()` starts one
    run and returns its StreamingQuery; each run must end without error. Returns the number of runs."""
    runs = 0
    while True:
        query = start_query()
        runs += 1
        assert query.awaitTermination(timeout), f"availableNow run {runs} did not end in {timeout} s"
        assert query.exception() is None, query.exception()
        rows = sum(p["numInputRows"] for p in query.recentProgress)
        if ADMISSION_CONTROL or rows == 0:
            return runs
        assert runs < 100, "100 availableNow runs did not drain the source"


# --- a streaming job in its own driver process (stream_job.py), for the tests that kill the driver ---------

JOB = Path(__file__).with_name("stream_job.py")


def job_spec(url: str, queue: str, chk: str, out: Path, **options) -> dict:
    """One query of a stream_job.py driver."""
    return {"url": url, "queue": queue, "checkpoint": chk, "out": str(out),
            "options": {k: str(v) for k, v in options.items()}}


def start_job(mode: str, per_trigger: int, *specs: dict) -> subprocess.Popen:
    """stream_job.py running `specs` side by side, in a new session (so that kill_group reaches its JVM
    and Python workers)."""
    child_env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    return subprocess.Popen([sys.executable, str(JOB), mode, str(per_trigger), json.dumps(list(specs))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill what is left of a job (its JVM and Python workers share its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)


def drop_killed_log_writes(checkpoint_dir: str) -> None:
    """After a driver was killed -9: remove the temp file of an offset or commit log write it was in the
    middle of (`offsets/.0.<uuid>.tmp`), as whoever restarts the job would. Spark ignores such files when it
    reads its logs except in one check: a query with no offset logged yet refuses to start while `offsets/`
    holds any file (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY), so a driver killed inside its first offset
    write leaves a checkpoint Spark will not restart from (seen in CI on a slow machine, where a query still
    starting was killed). Only Spark's unfinished writes go."""
    for log in ("offsets", "commits"):
        for path in Path(checkpoint_dir, log).glob(".*.tmp"):
            path.unlink()


def job_batches(out: Path) -> dict[int, list[list[tuple[bytes, bool]]]]:
    """Per batch id, the rows of each attempt that wrote it (files `<run>-<batch id>.txt`), as
    [(body, redelivered), ...]."""
    attempts: dict[int, list] = {}
    for f in sorted(out.glob("*.txt")):
        batch_id = int(f.stem.rsplit("-", 1)[1])
        rows = []
        for line in f.read_text().splitlines():
            body, redelivered = line.split("\t")
            rows.append((body.encode(), redelivered == "True"))
        attempts.setdefault(batch_id, []).append(rows)
    return attempts


def job_rows(out: Path) -> list[tuple[bytes, bool]]:
    """Every row every attempt wrote."""
    return [row for attempts in job_batches(out).values() for rows in attempts for row in rows]
