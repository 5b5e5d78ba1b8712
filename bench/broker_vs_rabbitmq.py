"""Throughput and memory of the embedded broker, measured side by side with RabbitMQ.

What it measures:

* publish: with pika, publish ``--messages`` (100,000) messages of ``--size`` (100) bytes to a fresh queue
  through the default exchange, with publisher confirms and at most ``--window`` (1,000) unconfirmed
  messages in flight (pika ``SelectConnection``, pipelined; ``multiple=true`` acks are honoured). Timed from
  the first publish to the last confirm.
* consume: consume them all from that queue (``basic.qos`` prefetch ``--prefetch`` = 1,000, manual acks,
  ``basic.ack(multiple=True)`` every ``--ack-every`` = 100 deliveries). Timed from ``basic.consume`` to the
  last delivery.
* both against our embedded broker (started as a subprocess, ``python -m spark_amqp_broker --port <free port>``, so
  that it does not share a process or a GIL with the client) and against RabbitMQ (``--rabbitmq-url``,
  default ``amqp://guest:guest@127.0.0.1:5672/%2F``) in the same run. Each phase is repeated ``--rounds``
  (3) times, alternating which broker goes first, and the median is reported, together with the ratios
  ours/RabbitMQ (targets: publish >= 1.2, consume >= 1.5; with quorum queues >= 1.0 each). Ratios are only meaningful against the peer
  measured in the same run: the machine is shared and noisy.
* CPU per message, of the client (this process) and of the server process (the broker subprocess; for
  RabbitMQ the process listening on its port, when it can be found), to show where the time goes.
* diagnostics: messages per confirm frame the publisher received, and the server's wakeups (voluntary
  context switches) per message. With pika the publisher's CPU is the publish bottleneck, and its cost per
  message falls as confirms are coalesced (more messages per ``basic.ack multiple``): this column explains
  most of the run-to-run spread of the publish rate.
* memory (``--memory``, on by default): the embedded broker's resident set size (psutil) with 1,000,000
  (``--memory-messages``) queued messages of ``--size`` bytes; target under 500 MB. The queue is deleted
  afterwards. ``--memory-rabbitmq`` measures RabbitMQ's RSS growth the same way, for comparison.

Queues are named ``bench-<uuid>``, carry ``x-expires`` (10 min) so that an interrupted run does not leave them
on the shared RabbitMQ, and are deleted at the end of each round. ``--queue-type classic`` (the default) makes
them non-durable classic queues; ``--queue-type quorum`` durable quorum queues (every message is written to
disk: RabbitMQ's Raft log, the embedded broker's journal when it runs with ``--data-dir``, which
``--data-dir`` gives it; without it the embedded broker keeps them in memory).

``--rabbitmq-url`` may be given more than once (each node is named by the version it reports, e.g.
``rabbitmq-4.3.6``), and each gets its own ratios.

Run (from the repository root, RabbitMQ running at 127.0.0.1:5672)::

    python bench/broker_vs_rabbitmq.py                      # full run: 3 rounds + memory
    python bench/broker_vs_rabbitmq.py --rounds 5 --no-memory
    python bench/broker_vs_rabbitmq.py --queue-type quorum --size 1024 --no-memory \
        --rabbitmq-url amqp://guest:guest@127.0.0.1:5672/%2F --rabbitmq-url amqp://guest:guest@127.0.0.1:5682/%2F
    python bench/broker_vs_rabbitmq.py --queue-type quorum --data-dir --size 1024 --no-memory
    python bench/broker_vs_rabbitmq.py --skip-rabbitmq      # embedded broker only (no ratios)
    python bench/broker_vs_rabbitmq.py --skip-embedded      # RabbitMQ only (checks the client code)
    python bench/broker_vs_rabbitmq.py --skip-rabbitmq --no-memory --py-spy /tmp/prof.svg   # profile ours

It prints a table, the two ratios, and a final summary line for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pika
import pika.exceptions
import pika.spec
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
QUEUE_EXPIRES_MS = 600_000


class BenchError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------
# The two phases, each on its own pika SelectConnection (asynchronous, so confirms are pipelined)
# ---------------------------------------------------------------------------------------------------------


class _AsyncClient:
    """Runs one SelectConnection until ``finish()`` or an error; bounded by a timeout."""

    def __init__(self, url: str, timeout: float):
        self.url = url
        self.timeout = timeout
        self.error: str | None = None
        self.done = False
        self.conn: pika.SelectConnection | None = None
        self.channel = None
        self._timer = None

    def run(self) -> None:
        params = pika.URLParameters(self.url)
        self.conn = pika.SelectConnection(
            params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_close,
        )
        self._timer = self.conn.ioloop.call_later(self.timeout, self._on_timeout)
        self.conn.ioloop.start()
        if self.error:
            raise BenchError(self.error)
        if not self.done:
            raise BenchError("connection closed before the phase finished")

    # -- plumbing
    def _on_open(self, conn):
        conn.channel(on_open_callback=self._on_channel_open_base)

    def _on_open_error(self, conn, exc):
        self.error = f"cannot connect to {self.url}: {exc!r}"
        conn.ioloop.stop()

    def _on_close(self, conn, reason):
        if not self.done and self.error is None:
            self.error = f"connection closed: {reason!r}"
        if self._timer is not None:
            conn.ioloop.remove_timeout(self._timer)
            self._timer = None
        conn.ioloop.stop()

    def _on_timeout(self):
        self._timer = None
        self.fail(f"timed out after {self.timeout:.0f} s")

    def _on_channel_open_base(self, channel):
        self.channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        self.on_channel_open(channel)

    def _on_channel_closed(self, channel, reason):
        if not self.done and self.error is None:
            self.error = f"channel closed: {reason!r}"
            if self.conn.is_open:
                self.conn.close()

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        if self.conn.is_open:
            self.conn.close()
        else:
            self.conn.ioloop.stop()

    def finish(self) -> None:
        self.done = True
        if self.conn.is_open:
            self.conn.close()

    def on_channel_open(self, channel):  # pragma: no cover - overridden
        raise NotImplementedError


class Publisher(_AsyncClient):
    """Publishes ``n`` messages with confirms, at most ``window`` unconfirmed at any time."""

    def __init__(self, url: str, queue: str, n: int, size: int, window: int, timeout: float):
        super().__init__(url, timeout)
        self.queue = queue
        self.n = n
        self.body = os.urandom(size // 2 + 1).hex()[:size].encode() if size else b""
        self.window = window
        self.published = 0
        self.confirmed = 0  # highest delivery tag acked (one queue: the broker confirms in order)
        self.confirm_frames = 0
        self.t0 = self.t1 = 0.0

    def on_channel_open(self, channel):
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_select_ok)

    def _on_select_ok(self, _frame):
        self.t0 = time.perf_counter()
        self._pump()

    def _pump(self):
        publish = self.channel.basic_publish
        queue = self.queue
        body = self.body
        stop = min(self.n, self.confirmed + self.window)
        while self.published < stop:
            publish("", queue, body)
            self.published += 1

    def _on_confirm(self, frame):
        self.confirm_frames += 1
        method = frame.method
        if not isinstance(method, pika.spec.Basic.Ack):
            self.fail(f"publish nacked (delivery tag {method.delivery_tag}, multiple={method.multiple})")
            return
        if method.delivery_tag > self.confirmed:  # a multiple ack confirms every tag up to its own
            self.confirmed = method.delivery_tag
        if self.confirmed >= self.n:
            self.t1 = time.perf_counter()
            self.finish()
            return
        self._pump()


class Consumer(_AsyncClient):
    """Consumes ``n`` messages, prefetch ``prefetch``, ``basic.ack(multiple)`` every ``ack_every``."""

    def __init__(self, url: str, queue: str, n: int, size: int, prefetch: int, ack_every: int,
                 timeout: float):
        super().__init__(url, timeout)
        self.queue = queue
        self.n = n
        self.size = size
        self.prefetch = prefetch
        self.ack_every = ack_every
        self.received = 0
        self.bad_bodies = 0
        self.t0 = self.t1 = 0.0

    def on_channel_open(self, channel):
        channel.basic_qos(prefetch_count=self.prefetch, callback=self._on_qos_ok)

    def _on_qos_ok(self, _frame):
        self.t0 = time.perf_counter()
        self.channel.basic_consume(self.queue, self._on_message, auto_ack=False)

    def _on_message(self, channel, method, _properties, body):
        self.received += 1
        if len(body) != self.size:
            self.bad_bodies += 1
        if self.received % self.ack_every == 0 or self.received == self.n:
            channel.basic_ack(method.delivery_tag, multiple=True)
        if self.received == self.n:
            self.t1 = time.perf_counter()
            if self.bad_bodies:
                self.fail(f"{self.bad_bodies} deliveries had a body of the wrong size")
            else:
                self.finish()


# ---------------------------------------------------------------------------------------------------------
# Brokers
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    process: psutil.Process | None = None  # server process, for CPU time and RSS

    def server_cpu(self) -> float | None:
        if self.process is None:
            return None
        try:
            procs = [self.process] + self.process.children(recursive=True)
            return sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        except psutil.Error:
            return None

    def server_wakeups(self) -> int | None:
        """Voluntary context switches so far, summed over the server's threads (Linux): how often it slept
        waiting for input, i.e. roughly how many separate batches it handled."""
        if self.process is None:
            return None
        total = 0
        try:
            for proc in [self.process] + self.process.children(recursive=True):
                for task in Path(f"/proc/{proc.pid}/task").iterdir():
                    for line in (task / "status").read_text().splitlines():
                        if line.startswith("voluntary_ctxt_switches:"):
                            total += int(line.split()[1])
        except (OSError, ValueError, psutil.Error):
            return None
        return total

    def server_rss(self) -> int | None:
        if self.process is None:
            return None
        try:
            procs = [self.process] + self.process.children(recursive=True)
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, deadline: float, proc: subprocess.Popen | None = None) -> None:
    while True:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"broker exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"nothing accepts connections on {host}:{port}")
            time.sleep(0.05)


def start_embedded(log_path: Path, data_dir: str | None = None) -> tuple[subprocess.Popen, Target]:
    port = free_port()
    log = open(log_path, "wb")
    persist = ["--data-dir", data_dir] if data_dir else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_amqp_broker", "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
         *persist],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port("127.0.0.1", port, time.monotonic() + 30, proc)
    except BenchError:
        stop_embedded(proc)
        tail = log_path.read_text(errors="replace")[-3000:]
        raise BenchError(f"the embedded broker did not start; its log ({log_path}):\n{tail}")
    return proc, Target("embedded", f"amqp://guest:guest@127.0.0.1:{port}/%2F", psutil.Process(proc.pid))


def stop_embedded(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def find_listener(url: str) -> psutil.Process | None:
    """The process listening on the URL's port (RabbitMQ's beam.smp), when it can be seen."""
    port = urlparse(url).port or 5672
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
    except (psutil.Error, OSError):
        pass
    return None


# ---------------------------------------------------------------------------------------------------------
# Queue management (blocking, outside the timed phases)
# ---------------------------------------------------------------------------------------------------------


# The queue each round declares, by --queue-type: (durable, arguments).
QUEUE_TYPES = {"classic": (False, {"x-expires": QUEUE_EXPIRES_MS}),
               "quorum": (True, {"x-expires": QUEUE_EXPIRES_MS, "x-queue-type": "quorum"})}


# Targets of the ratios ours/RabbitMQ (publish, consume) by queue type.
TARGETS = {"classic": (1.2, 1.5), "quorum": (1.0, 1.0)}


def declare_queue(url: str, queue_type: str = "classic") -> str:
    name = f"bench-{uuid.uuid4().hex[:12]}"
    durable, arguments = QUEUE_TYPES[queue_type]
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_declare(name, durable=durable, arguments=arguments)
    finally:
        conn.close()
    return name


def server_version(url: str) -> str:
    """The version a broker reports at connection.start (e.g. "4.3.6")."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        version = conn._impl.server_properties.get("version", b"?")
        return version.decode() if isinstance(version, bytes) else str(version)
    finally:
        conn.close()


def queue_depth(url: str, name: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return conn.channel().queue_declare(name, passive=True).method.message_count
    finally:
        conn.close()


def delete_queue(url: str, name: str) -> None:
    try:
        conn = pika.BlockingConnection(pika.URLParameters(url))
    except Exception as exc:  # noqa: BLE001 - best effort cleanup; x-expires is the safety net
        print(f"  (could not delete {name}: {exc!r})", file=sys.stderr)
        return
    try:
        conn.channel().queue_delete(name)
    except Exception as exc:  # noqa: BLE001
        print(f"  (could not delete {name}: {exc!r})", file=sys.stderr)
    finally:
        if conn.is_open:
            conn.close()


# ---------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    rate: float           # msg/s
    client_us: float      # client CPU µs per message
    server_us: float | None
    server_wakeups: float | None = None  # server voluntary context switches per message
    per_confirm: float | None = None     # messages per confirm frame the publisher received


def _sample(n: int, seconds: float, c0, c1, s0, s1, io0, io1, **extra) -> Sample:
    return Sample(n / seconds, (c1 - c0) / n * 1e6,
                  None if s0 is None or s1 is None else (s1 - s0) / n * 1e6,
                  None if io0 is None or io1 is None else (io1 - io0) / n, **extra)


@dataclass
class Results:
    publish: dict[str, list[Sample]] = field(default_factory=dict)
    consume: dict[str, list[Sample]] = field(default_factory=dict)


def publish_phase(target: Target, queue: str, args, n: int | None = None) -> Sample:
    n = args.messages if n is None else n
    pub = Publisher(target.url, queue, n, args.size, args.window, args.timeout)
    c0, s0, io0 = time.process_time(), target.server_cpu(), target.server_wakeups()
    pub.run()
    c1, s1, io1 = time.process_time(), target.server_cpu(), target.server_wakeups()
    return _sample(n, pub.t1 - pub.t0, c0, c1, s0, s1, io0, io1,
                   per_confirm=n / max(pub.confirm_frames, 1))


def consume_phase(target: Target, queue: str, args, n: int | None = None) -> Sample:
    n = args.messages if n is None else n
    con = Consumer(target.url, queue, n, args.size, args.prefetch, args.ack_every, args.timeout)
    c0, s0, io0 = time.process_time(), target.server_cpu(), target.server_wakeups()
    con.run()
    c1, s1, io1 = time.process_time(), target.server_cpu(), target.server_wakeups()
    return _sample(n, con.t1 - con.t0, c0, c1, s0, s1, io0, io1)


def one_round(target: Target, args, n: int | None = None) -> tuple[Sample, Sample]:
    n = args.messages if n is None else n
    queue = declare_queue(target.url, args.queue_type)
    try:
        pub = publish_phase(target, queue, args, n)
        depth = queue_depth(target.url, queue)
        if depth != n:
            raise BenchError(f"{target.name}: {depth} messages in {queue} after publishing {n}")
        con = consume_phase(target, queue, args, n)
        depth = queue_depth(target.url, queue)
        if depth != 0:
            raise BenchError(f"{target.name}: {depth} messages left in {queue} after consuming all")
    finally:
        delete_queue(target.url, queue)
    return pub, con


def median_sample(samples: list[Sample]) -> Sample:
    def med(attr):
        values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return statistics.median(values) if values else None
    return Sample(*(med(f) for f in Sample.__dataclass_fields__))


def measure_memory(target: Target, args) -> dict:
    """RSS of the target's server process before, with ``memory_messages`` queued, and after deleting."""
    n = args.memory_messages
    before = target.server_rss()
    queue = declare_queue(target.url, args.queue_type)
    try:
        t0 = time.perf_counter()
        # several chunks on fresh connections keep each Publisher's counters small; same pipelining
        chunk = 250_000
        done = 0
        while done < n:
            k = min(chunk, n - done)
            Publisher(target.url, queue, k, args.size, args.window, max(args.timeout, 600)).run()
            done += k
        seconds = time.perf_counter() - t0
        depth = queue_depth(target.url, queue)
        time.sleep(1.0)
        loaded = max(target.server_rss() or 0, 0)
    finally:
        delete_queue(target.url, queue)
    time.sleep(1.0)
    after = target.server_rss()
    return {"messages": n, "depth": depth, "publish_seconds": seconds, "rss_before": before,
            "rss_loaded": loaded, "rss_after_delete": after}


def mb(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e6:,.0f} MB"


def fmt_us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:6.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=100_000, help="messages per phase (default 100000)")
    p.add_argument("--size", type=int, default=100, help="body size in bytes (default 100)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per broker; the median is reported")
    p.add_argument("--window", type=int, default=1000, help="max unconfirmed publishes (default 1000)")
    p.add_argument("--prefetch", type=int, default=1000, help="consumer prefetch (default 1000)")
    p.add_argument("--ack-every", type=int, default=100, help="ack(multiple) every N deliveries")
    p.add_argument("--warmup", type=int, default=10_000,
                   help="messages published and consumed once per broker before timing (0: none)")
    p.add_argument("--rabbitmq-url", action="append",
                   help="a RabbitMQ node to compare with; repeat for several (default "
                        f"{DEFAULT_RABBITMQ_URL.replace('%', '%%')})")
    p.add_argument("--queue-type", choices=sorted(QUEUE_TYPES), default="classic",
                   help="classic (non-durable, the default) or quorum (durable) queues")
    p.add_argument("--data-dir", action="store_true",
                   help="run the embedded broker with --data-dir (a temporary directory): durable state on disk")
    p.add_argument("--skip-rabbitmq", action="store_true", help="measure the embedded broker only")
    p.add_argument("--skip-embedded", action="store_true", help="measure RabbitMQ only")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the embedded broker's RSS with --memory-messages queued (default on)")
    p.add_argument("--memory-messages", type=int, default=1_000_000)
    p.add_argument("--memory-rabbitmq", action="store_true",
                   help="also measure RabbitMQ's RSS growth with --memory-messages queued")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one phase")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--py-spy", type=Path, metavar="FILE",
                   help="profile the embedded broker with py-spy during the timed rounds (`pip install "
                        "py-spy`); FILE.svg: flame graph, FILE.txt: collapsed stacks, FILE.json: speedscope. "
                        "The profiler takes CPU: do not quote throughput from a profiled run")
    args = p.parse_args(argv)
    args.rabbitmq_url = args.rabbitmq_url or [DEFAULT_RABBITMQ_URL]
    if args.skip_embedded and args.skip_rabbitmq:
        p.error("nothing to measure")

    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}, "
          f"{psutil.cpu_count()} CPUs, pika {pika.__version__}, Python {sys.version.split()[0]}")
    print(f"{args.messages:,} messages x {args.size} B, {args.queue_type} queues"
          f"{' (embedded broker with --data-dir)' if args.data_dir else ''}; publish window {args.window}, "
          f"prefetch {args.prefetch}, ack multiple every {args.ack_every}; {args.rounds} rounds")

    proc = None
    data_dir = tempfile.TemporaryDirectory(prefix="bench-broker-") if args.data_dir else None
    targets: list[Target] = []
    log_path = Path(tempfile.gettempdir()) / f"bench-broker-{os.getpid()}.log"
    try:
        if not args.skip_embedded:
            proc, embedded = start_embedded(log_path, data_dir.name if data_dir else None)
            print(f"embedded broker: pid {proc.pid}, {embedded.url} (log {log_path})")
            targets.append(embedded)
        for url in ([] if args.skip_rabbitmq else args.rabbitmq_url):
            u = urlparse(url)
            try:
                wait_for_port(u.hostname or "127.0.0.1", u.port or 5672, time.monotonic() + 3)
            except BenchError as exc:
                raise BenchError(f"RabbitMQ is not reachable at {url} ({exc}); start it, or pass "
                                 "--skip-rabbitmq") from None
            rabbit = Target(f"rabbitmq-{server_version(url)}", url, find_listener(url))
            where = f"pid {rabbit.process.pid}" if rabbit.process else "server process not found"
            print(f"{rabbit.name}: {url} ({where})")
            targets.append(rabbit)

        if args.warmup:
            for t in targets:
                one_round(t, args, args.warmup)

        spy = None
        if args.py_spy and proc is not None:
            fmt = {".svg": "flamegraph", ".txt": "raw", ".json": "speedscope"}.get(args.py_spy.suffix, "flamegraph")
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--rate", "200", "--format", fmt,
                                    "-o", str(args.py_spy)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # let it attach

        res = Results({t.name: [] for t in targets}, {t.name: [] for t in targets})
        for r in range(args.rounds):
            order = targets if r % 2 == 0 else list(reversed(targets))
            for t in order:
                pub, con = one_round(t, args)
                res.publish[t.name].append(pub)
                res.consume[t.name].append(con)
                print(f"  round {r + 1} {t.name:9s} publish {pub.rate:9,.0f} msg/s   "
                      f"consume {con.rate:9,.0f} msg/s")

        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
            print(f"py-spy profile written to {args.py_spy}" if args.py_spy.exists()
                  else f"py-spy failed: {err.decode(errors='replace')[-500:]}")

        print()
        print(f"median of {args.rounds}    publish msg/s  consume msg/s   CPU µs/msg "
              "(client pub/con, server pub/con)")
        med = {t.name: (median_sample(res.publish[t.name]), median_sample(res.consume[t.name]))
               for t in targets}
        for name, (pub, con) in med.items():
            print(f"  {name:14s} {pub.rate:14,.0f} {con.rate:14,.0f}   "
                  f"{fmt_us(pub.client_us)} {fmt_us(con.client_us)}   "
                  f"{fmt_us(pub.server_us)} {fmt_us(con.server_us)}")
        print("  diagnostics: messages per confirm frame the publisher received; server wakeups "
              "(voluntary context switches) per 100 messages, publish/consume")
        for name, (pub, con) in med.items():
            def per100(v):
                return "n/a" if v is None else f"{v * 100:.1f}"
            print(f"  {name:14s} {pub.per_confirm:5.1f} msg/confirm; wakeups/100 msg "
                  f"{per100(pub.server_wakeups)}/{per100(con.server_wakeups)}")

        out: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "loadavg": os.getloadavg(),
                     "median": {n: {"publish": vars(a), "consume": vars(b)} for n, (a, b) in med.items()},
                     "rounds": {n: {"publish": [vars(s) for s in res.publish[n]],
                                    "consume": [vars(s) for s in res.consume[n]]} for n in res.publish}}
        ratio_text = ""
        out["ratios"] = {}
        for name in [n for n in med if n.startswith("rabbitmq") and "embedded" in med]:
            pr = med["embedded"][0].rate / med[name][0].rate
            cr = med["embedded"][1].rate / med[name][1].rate
            out["ratios"][name] = {"publish": pr, "consume": cr}
            pt, ct = TARGETS[args.queue_type]
            print()
            print(f"ratio ours/{name}: publish {pr:.2f} (target >= {pt}, "
                  f"{'met' if pr >= pt else 'NOT met'}), consume {cr:.2f} (target >= {ct}, "
                  f"{'met' if cr >= ct else 'NOT met'})")
            ratio_text += f"; ratio ours/{name}: publish {pr:.2f}, consume {cr:.2f}"

        mem_text = ""
        if args.memory and not args.skip_embedded:
            print()
            print(f"memory: publishing {args.memory_messages:,} x {args.size} B to the embedded broker ...")
            m = measure_memory(targets[0], args)
            out["memory"] = m
            print(f"  embedded broker RSS: {mb(m['rss_before'])} idle, {mb(m['rss_loaded'])} with "
                  f"{m['depth']:,} queued (target < 500 MB: "
                  f"{'met' if m['rss_loaded'] < 500e6 else 'NOT met'}), {mb(m['rss_after_delete'])} after "
                  f"deleting the queue; filled at {m['messages'] / m['publish_seconds']:,.0f} msg/s")
            mem_text = (f"; RSS with {m['depth']:,} queued {args.size}-byte messages: "
                        f"{m['rss_loaded'] / 1e6:,.0f} MB")
        if args.memory_rabbitmq and not args.skip_rabbitmq:
            rabbit = next(t for t in targets if t.name.startswith("rabbitmq"))
            if rabbit.process is None:
                print("  RabbitMQ RSS: server process not found")
            else:
                m = measure_memory(rabbit, args)
                out["memory_rabbitmq"] = m
                print(f"  RabbitMQ RSS: {mb(m['rss_before'])} idle, {mb(m['rss_loaded'])} with "
                      f"{m['depth']:,} queued (+{mb(m['rss_loaded'] - m['rss_before'])})")

        if args.json:
            args.json.write_text(json.dumps(out, indent=2))

        print()
        parts = [f"{n}: publish {a.rate:,.0f} msg/s, consume {b.rate:,.0f} msg/s" for n, (a, b) in med.items()]
        print(f"Summary (docs/performance.md): {args.messages:,} x {args.size} B messages, {args.queue_type} queues"
              f"{' (embedded: --data-dir)' if args.data_dir else ''}, with pika (confirms, window "
              f"{args.window}; prefetch {args.prefetch}, ack every {args.ack_every}), median of "
              f"{args.rounds}: " + "; ".join(parts) + ratio_text + mem_text + ".")
        return 0
    except (BenchError, pika.exceptions.AMQPError) as exc:
        print(f"benchmark failed: {exc!r}" if not isinstance(exc, BenchError) else f"benchmark failed: {exc}",
              file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_embedded(proc)
        if data_dir is not None:
            data_dir.cleanup()
            if log_path.exists() and log_path.stat().st_size == 0:
                log_path.unlink()


if __name__ == "__main__":
    sys.exit(main())
