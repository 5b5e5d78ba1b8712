"""A long fuzz run of the embedded broker: 100,000 malformed frames (by default), every kind that
tests/broker/test_fuzz.py makes, against a broker in its own process.

The cases come from the test's seeded generator (`a_case`, imported, not copied): mutated publishes,
mutated property lists (headers with nested tables and arrays, routed through a headers exchange and a
dead-lettering queue, in and out of a transaction), mutated methods with field-table arguments, random
class and method ids, random frames, and well-formed sequences ending in a mutated frame. Each case gets
its own connection, as in the test: handshake, topology, the case, a sync, then our half of the socket is
shut so the broker reads everything and closes. `--workers` connections run at once.

The broker runs as `python -m spark_amqp_broker` (its own process and GIL, so its peak RSS is its own),
logging to a file. Printed at the end: cases, crashes (tracebacks or ERROR lines in the broker's log), 541s
(connection.close or channel.close with INTERNAL_ERROR: must be 0), connections the broker left open,
a histogram of the replies, the broker's peak RSS (VmHWM) and whether it still serves a client. Exits
non-zero on a crash, a 541, a connection left open or a broker that stopped serving.

Run from the repository root (about 2.5 minutes on 2 cores for 100,000 cases)::

    python bench/fuzz_broker.py                          # 100,000 cases, seed of the test
    python bench/fuzz_broker.py --cases 5000 --seed 7    # a quick one with another seed
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "broker"))

import pytest  # noqa: E402  (RawConnection.wait_closed fails with pytest.fail on a socket left open)
from pamqp import commands  # noqa: E402

import test_fuzz  # noqa: E402
from helpers import pika_connect, safe_close  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "spark_amqp_broker", "--port", str(port),
                             "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the broker exited at start; see {log_path}")
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the broker did not listen within 20 s")


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM), bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def still_serves(port: int) -> bool:
    url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    try:
        conn = pika_connect(url)
    except Exception:
        return False
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"after the fuzz")
        return ch.basic_get(q, auto_ack=True)[2] == b"after the fuzz"
    except Exception:
        return False
    finally:
        safe_close(conn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=100_000, help="malformed cases to send (default 100,000)")
    p.add_argument("--seed", type=lambda s: int(s, 0), default=test_fuzz.SEED,
                   help=f"generator seed (default the test's, {test_fuzz.SEED:#x})")
    p.add_argument("--workers", type=int, default=4, help="connections at once (default 4)")
    p.add_argument("--log", default=None, help="the broker's log file (default: a temporary file)")
    args = p.parse_args(argv)

    log_path = args.log or os.path.join(tempfile.mkdtemp(prefix="fuzz-broker-"), "broker.log")
    port = free_port()
    proc = start_broker(port, log_path)
    prefix = test_fuzz.handshake_bytes() + test_fuzz.setup_bytes()
    sync = test_fuzz.frame(3, commands.Tx.Commit()) + test_fuzz.frame(2, commands.Channel.Open())

    rng = random.Random(args.seed)
    lock = threading.Lock()
    replies: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    internal_errors: list[tuple[int, str, str]] = []
    left_open: list[tuple[int, str]] = []
    next_case = [0]

    def take() -> tuple[int, str, bytes] | None:
        with lock:                          # one generator, so the run is the seed's whatever the workers
            n = next_case[0]
            if n >= args.cases:
                return None
            next_case[0] += 1
            kind, case = test_fuzz.a_case(rng)
            return n, kind, case

    def worker() -> None:
        while (item := take()) is not None:
            n, kind, case = item
            try:
                frames = test_fuzz.run_case(port, prefix, case, sync)
            except pytest.fail.Exception:
                with lock:
                    left_open.append((n, kind))
                continue
            except OSError as exc:          # e.g. reset by the broker: counted, not a failure
                with lock:
                    replies[f"socket error ({type(exc).__name__})"] += 1
                    kinds[kind] += 1
                continue
            closes = [f for f in frames if isinstance(f, (commands.Connection.Close, commands.Channel.Close))]
            with lock:
                kinds[kind] += 1
                for close in closes:
                    what = "connection.close" if isinstance(close, commands.Connection.Close) else "channel.close"
                    replies[f"{what} {close.reply_code}"] += 1
                    if close.reply_code == 541:
                        internal_errors.append((n, kind, close.reply_text))
                if not closes:
                    replies["no close frame (socket closed)"] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    for t in threads:
        t.start()
    last = started
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=1)
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            print(f"  {next_case[0]:,} cases, {time.monotonic() - started:.0f} s", flush=True)
    elapsed = time.monotonic() - started

    serves = still_serves(port)
    rss = peak_rss(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        log_lines = fh.read().splitlines()
    crashes = [line for line in log_lines if "Traceback" in line or " ERROR " in line]

    print(f"cases: {args.cases:,} (seed {args.seed:#x}) in {elapsed:.0f} s, {args.cases / elapsed:.0f}/s, "
          f"{args.workers} workers")
    print("by kind: " + ", ".join(f"{k} {v:,}" for k, v in sorted(kinds.items())))
    print(f"crashes (tracebacks or ERROR lines in the broker's log): {len(crashes)}")
    print(f"541 INTERNAL_ERROR replies: {len(internal_errors)}")
    print(f"connections left open by the broker: {len(left_open)}")
    print("replies:")
    for what, count in sorted(replies.items(), key=lambda kv: -kv[1]):
        print(f"  {what:<40} {count:>8,}")
    print(f"broker peak RSS: {rss / 2**20:.1f} MiB")
    print(f"broker still serves a client afterwards: {'yes' if serves else 'NO'}")
    print(f"broker log: {log_path} ({len(log_lines):,} lines)")
    for line in crashes[:20]:
        print("  " + line)
    for n, kind, text in internal_errors[:10]:
        print(f"  541 on case {n} ({kind}): {text}")
    failed = bool(crashes or internal_errors or left_open or not serves)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
