"""The counted fault suite: after each fault, every message id is counted, lost and duplicated.

- the driver killed (-9) twice at random moments, each time restarted from its checkpoints, then
  drained with availableNow: queue mode with `journalPath` and stream mode, on both brokers, in one
  driver: 0 lost, 0 duplicated, and every attempt of a batch id wrote the same rows (the kill without a
  journal, at least once, is in test_restart.py);
- the driver killed (-9) while an availableNow batch fills part by part with the journal, then restarted:
  the journaled parts are that batch, 0 lost, 0 duplicated;
- the source's connection cut three times while the query runs, with the journal: 0 lost, 0 duplicated
  (without it the batch planned before a cut comes back as redelivered copies);
- the journal's files are removed once their batches are committed and acked;
- the embedded broker killed (-9) and restarted on its data directory under a running query while a
  publisher publishes with confirms: every confirmed message is read, none twice (with the journal);
- the same broker stopped while the source acks a committed batch and then killed: acks it never read
  are not counted done, so their messages' redelivered copies are dropped (with the journal).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import pika
import psutil
import pyarrow as pa
import pytest

from brokers import RABBITMQ_URL, DataDirBroker, require_rabbitmq
from source_helpers import (Collector, ConfirmedPublisher, Env, checkpoint, drop_killed_log_writes, job_batches, job_spec, kill_group,
                            start_job, stream)
from spark_amqp.options import parse
from spark_amqp.pyspark_versions import ADMISSION_CONTROL
from spark_amqp.source.queue_mode import LegacyQueueStreamReader
from waiting import wait_until


def _count(bodies, total: int, prefix: str) -> tuple[list, dict]:
    """(lost ids, {duplicated id: times})."""
    seen = Counter(bodies)
    lost = [i for i in range(total) if seen[f"{prefix}{i}".encode()] == 0]
    duplicated = {b.decode(): n for b, n in seen.items() if n > 1}
    return lost, duplicated


@pytest.mark.own_spark
@pytest.mark.timeout(600)      # three driver starts
def test_driver_killed_twice_loses_and_duplicates_nothing(amqp_broker, unique_name, tmp_path):
    """One driver runs, side by side, a queue-mode query with `journalPath` on each broker and (PySpark
    4.2+) a stream-mode query on each broker; it is killed (-9) twice at random moments and
    restarted from the checkpoints, then every query drains with availableNow. Every id is counted per
    query: 0 lost, 0 duplicated, and every attempt of a batch id wrote the same rows."""
    require_rabbitmq()
    total = 500
    envs = [Env(amqp_broker.url, "embedded", amqp_broker, unique_name),
            Env(RABBITMQ_URL, "rabbitmq", None, unique_name)]
    cases = []   # (env, queue, spec, id prefix)
    for env in envs:
        q = env.queue("faults")
        env.publish(q, [f"f{i}" for i in range(total)])
        cases.append((env, q, job_spec(env.url, q, checkpoint(tmp_path, f"chk-{env.kind}-queue"),
                                       tmp_path / f"out-{env.kind}-queue",
                                       journalPath=tmp_path / f"journal-{env.kind}"), "f"))
        if ADMISSION_CONTROL:
            s = env.stream("faults")
            env.publish(s, [f"s{i}" for i in range(total)])
            cases.append((env, s, job_spec(env.url, s, checkpoint(tmp_path, f"chk-{env.kind}-stream"),
                                           tmp_path / f"out-{env.kind}-stream",
                                           queueType="stream", startingOffsets="earliest"), "s"))
    specs = [spec for _, _, spec, _ in cases]
    for spec in specs:
        Path(spec["out"]).mkdir()
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)

    def files(spec) -> int:
        return len(list(Path(spec["out"]).glob("*.txt")))

    def progressed(before: dict, more: int) -> bool:
        """Every query wrote `more` batches since `before`, or has read all its messages."""
        return all(files(spec) >= before[spec["out"]] + more or
                   sum(len(rows) for attempts in job_batches(Path(spec["out"])).values() for rows in attempts)
                   >= total for spec in specs)

    try:
        for kill in range(2):
            job = start_job("stream", 10, *specs)
            started = time.monotonic()
            try:
                before, more = {spec["out"]: files(spec) for spec in specs}, rnd.randint(1, 2)
                # Until every query has written a batch or two, or 60 s: a query slow to start in this
                # driver is killed where it stands (the drain and the counts below judge every query).
                wait_until(lambda: progressed(before, more) or job.poll() is not None or
                           time.monotonic() - started > 60, 120, interval=0.05,
                           message=f"batches of every query from driver {kill + 1}")
                time.sleep(rnd.uniform(0.0, 0.5))         # anywhere in a batch: planning, running, committing
                assert job.poll() is None, f"driver {kill + 1} ended on its own:\n{job.stdout.read()}"
                os.kill(job.pid, signal.SIGKILL)
                job.wait(timeout=30)
                for env, q, spec, _ in cases:
                    if "queueType" not in spec["options"]:   # a stream holds nothing for its consumers
                        wait_until(lambda: env.state(q)[1] == 0, 30, interval=0.2,
                                   message=f"the killed driver's unacked deliveries on {env.kind}")
                        env.wait_no_consumer(q, timeout=30)
            finally:
                kill_group(job)
            for spec in specs:      # the job's JVM is gone too: no log write of its is still under way
                drop_killed_log_writes(spec["checkpoint"])

        # One batch may take everything left: PySpark 4.0/4.1 drain in runs of one batch each, a query start
        # apiece. With 50 a batch, the test took 215 s in CI's PySpark 4.0.5 stage on a slow machine; with
        # this, 136 s there. What this test asks of the drain is only that it ends with nothing lost or
        # duplicated.
        job = start_job("availableNow", total, *specs)
        try:
            log, _ = job.communicate(timeout=480)
        finally:
            kill_group(job)
        causes = [line for line in log.splitlines() if "Caused by" in line or "Error:" in line][:12]
        assert job.returncode == 0, "the last run failed:\n" + "\n".join(causes) + f"\n...\n{log[-1500:]}"

        problems = []
        for env, q, spec, prefix in cases:
            what = f"{env.kind} {spec['options'].get('queueType', 'queue')} mode"
            batches = job_batches(Path(spec["out"]))
            for batch_id, attempts in batches.items():
                if not all(a == attempts[0] for a in attempts):
                    problems.append(f"{what}: batch {batch_id} wrote different rows in its {len(attempts)} "
                                    "attempts")
            lost, duplicated = _count([body for attempts in batches.values() for body, _ in attempts[0]],
                                      total, prefix)
            if lost or duplicated:
                problems.append(f"{what}: lost {lost}, duplicated {duplicated}")
            if "journalPath" in spec["options"]:
                try:
                    env.wait_state(q, (0, 0), timeout=10)
                except AssertionError as exc:      # reported with the seed and the counts
                    problems.append(f"{what}: {exc}")
                left = sorted(p.name for p in Path(spec["options"]["journalPath"]).iterdir())
                # A killed driver may leave the file of a batch whose acks went out just before it died; a
                # run removes such files once its queue delivers messages that are not redelivered.
                if len(left) > 3:
                    problems.append(f"{what}: journal files left after the drain: {left}")
        assert not problems, f"seed {seed}: " + "; ".join(problems)
    finally:
        for env in envs:
            env.cleanup()


@pytest.mark.own_spark
@pytest.mark.timeout(300)      # two driver starts
@pytest.mark.skipif(not ADMISSION_CONTROL, reason="needs PySpark >= 4.2: batches that fill part by part "
                                                  "(availableNow in batches, acks at the journal write)")
@pytest.mark.parametrize("seq, kill_at_part", [(1, 3), (2, 0)], ids=["first-batch", "next-batch"])
def test_driver_killed_while_a_batch_fills_in_parts_loses_and_duplicates_nothing(amqp_broker, unique_name,
                                                                                 tmp_path, seq, kill_at_part):
    """availableNow with `journalPath`: a batch fills part by part, each part journaled and acked as it comes.
    The driver is killed (-9) once batch `seq` has part `kill_at_part` journaled: the first batch's fourth
    part, before Spark ran it; or the next batch's first, which the prefill takes while Spark runs the
    first. The next run serves the parts as that batch, drops the redelivered copies of what was journaled
    and not acked, and reads the rest: every id once, and nothing left in the queue."""
    total = 40_000
    per_trigger = total if seq == 1 else 10_000     # batches of 10,000: a next batch to prefill
    env = Env(amqp_broker.url, "embedded", amqp_broker, unique_name)
    try:
        q = env.queue("fill")
        env.publish_bulk(q, [f"p{i}".encode() for i in range(total)])
        journal = tmp_path / "journal"
        spec = job_spec(env.url, q, checkpoint(tmp_path), tmp_path / "out", journalPath=journal, prefetch=2000)
        Path(spec["out"]).mkdir()
        job = start_job("availableNow", per_trigger, spec)
        kill_part = f"batch-{seq:020d}-{kill_at_part:06d}.arrow"
        try:
            wait_until(lambda: (journal / kill_part).exists() or job.poll() is not None, 120, interval=0.01,
                       message=f"batch {seq}'s part {kill_at_part} journaled")
            os.kill(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
        finally:
            kill_group(job)
        assert seq - 1 not in job_batches(Path(spec["out"])), f"batch {seq} ran before the kill: nothing to test"
        parts = sorted(p for p in journal.iterdir()
                       if p.name.startswith(f"batch-{seq:020d}-") and p.suffix == ".arrow")
        assert len(parts) > kill_at_part, parts
        journaled = [b for p in parts for b in pa.ipc.open_stream(p.read_bytes()).read_all().column("body").to_pylist()]
        drop_killed_log_writes(spec["checkpoint"])
        wait_until(lambda: env.state(q)[1] == 0, 30, interval=0.2, message="the killed driver's unacked deliveries")

        job = start_job("availableNow", per_trigger, spec)
        try:
            log, _ = job.communicate(timeout=240)
        finally:
            kill_group(job)
        assert job.returncode == 0, f"the second run failed:\n{log[-3000:]}"
        batches = job_batches(Path(spec["out"]))
        assert [body for body, _ in batches[seq - 1][0]] == journaled, \
            f"batch {seq - 1} is not the parts journaled before the kill"
        lost, duplicated = _count([body for attempts in batches.values() for body, _ in attempts[0]], total, "p")
        assert not lost and not duplicated, f"lost {len(lost)}, duplicated {len(duplicated)}"
        assert env.state(q) == (0, 0)
    finally:
        env.cleanup()


def test_connection_cut_three_times_with_a_journal_loses_and_duplicates_nothing(spark, env, tmp_path):
    """The broker closes the source's connections three times while a query reads with a journal; every
    message is read once. Batches of 10 every 200 ms make the read last at least 16 s, longer than three
    cuts take even on a busy machine (each is two rabbitmqctl runs on RabbitMQ)."""
    total = 800
    q = env.queue("resets")
    env.publish(q, [f"r{i}" for i in range(total)])
    sink = Collector()
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=10, journalPath=str(tmp_path / "journal"))
             .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
             .trigger(processingTime="200 milliseconds").start())
    for cut in range(3):
        wanted = 10 * (cut + 1)
        wait_until(lambda: len(sink.rows) >= wanted or query.exception(), 60, interval=0.05,
                   message=f"{wanted} rows before cut {cut + 1}")
        assert query.exception() is None, query.exception()
        assert len(sink.rows) < total, "the query read everything before the cuts: nothing to test"
        # (The source may be between two connections: the one cut before and the next.)
        wait_until(lambda: env.cut_source_connections() >= 1, 30, interval=0.2,
                   message=f"a connection of the source to cut ({cut + 1})")
    wait_until(lambda: len(set(sink.bodies())) >= total or query.exception(), 90, interval=0.1,
               message="every message after the cuts")
    assert query.exception() is None, f"the query failed after the cuts: {query.exception()}"
    env.wait_state(q, (0, 0), timeout=20, query=query)
    lost, duplicated = _count(sink.bodies(), total, "r")
    assert not lost and not duplicated, f"lost {lost}, duplicated {duplicated}"
    query.stop()


def test_broker_killed_under_a_running_query_with_a_journal(spark, tmp_path):
    """The embedded broker, on a data directory, is killed (-9) while a query reads and a publisher
    publishes with confirms, and restarted on the same port: every confirmed message is read, none twice."""
    total = 2000
    broker = DataDirBroker(tmp_path / "data")
    url = broker.url
    q = "faults-durable"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare(q, durable=True)
    conn.close()
    sink = Collector()
    query = (stream(spark, url, q, maxMessagesPerTrigger=100, journalPath=str(tmp_path / "journal"))
             .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path))
             .trigger(processingTime="200 milliseconds").start())
    publisher = ConfirmedPublisher(url, q, total, pause=0.003)   # about 10 s of publishing
    try:
        wait_until(lambda: query.lastProgress is not None or query.exception(), 60, interval=0.05,
                   message="the query's first trigger")
        publisher.start()
        wait_until(lambda: len(sink.rows) >= 200 or query.exception(), 60, interval=0.05,
                   message="rows before the broker is killed")
        assert publisher.is_alive(), "the publisher finished before the broker was killed: nothing to test"
        broker.stop("kill")
        broker = DataDirBroker(tmp_path / "data", "--port", str(urlparse(url).port))
        publisher.join(timeout=120)
        assert not publisher.is_alive(), "the publisher did not finish after the restart"
        confirmed = {f"p{i}".encode() for i in publisher.confirmed}
        wait_until(lambda: set(sink.bodies()) >= confirmed or query.exception(), 90, interval=0.1,
                   message="every confirmed message after the restart")
        assert query.exception() is None, f"the query failed: {query.exception()}"
        seen = Counter(sink.bodies())
        lost = sorted(confirmed - set(seen))
        duplicated = {b.decode(): n for b, n in seen.items() if n > 1}
        assert not lost and not duplicated, (f"lost {lost}, duplicated {duplicated} "
                                             f"(unconfirmed ids: {publisher.unsure})")
    finally:
        query.stop()
        broker.stop("kill")


def test_acks_a_killed_broker_never_read_are_not_counted_done(tmp_path):
    """The driver's side alone, called as Spark calls it (no Spark here): the embedded broker, on a data
    directory, is stopped (SIGSTOP) while the source commits a journaled batch, so its acks go into a
    socket the broker never reads; then it is killed (-9) and restarted. Writing the acks raised nothing,
    and the broker never answered behind them: the batch's five messages stay expected, their redelivered
    copies are dropped, the next batch holds the other five, and once it commits the journal is empty."""
    broker = DataDirBroker(tmp_path / "data")
    url, q = broker.url, "faults-unread-acks"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    for i in range(10):
        ch.basic_publish("", q, f"u{i}".encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    journal = tmp_path / "journal"
    # Acks at the commit, as this reader's PySpark (4.0/4.1) has them by default: at the journal write (the
    # default on 4.2+) they would go out before the broker stops, and whether it answers them first is a race.
    reader = LegacyQueueStreamReader(parse({"uri": url, "queue": q, "maxMessagesPerTrigger": "5",
                                            "journalPath": str(journal), "ackAt": "commit"}, "source"))

    def bodies(start, end):
        return [b for p in reader.partitions(start, end) for rb in reader.read(p)
                for b in rb.column("body").to_pylist()]

    try:
        start = reader.initialOffset()
        first = reader.latestOffset()
        assert bodies(start, first) == [f"u{i}".encode() for i in range(5)]
        broker.proc.send_signal(signal.SIGSTOP)
        stopped = psutil.Process(broker.proc.pid)
        wait_until(lambda: stopped.status() == psutil.STATUS_STOPPED, 10, message="the broker stopped")
        committing = threading.Thread(target=reader.commit, args=(first,), daemon=True)
        committing.start()
        wait_until(lambda: first["seq"] not in reader._consumer.batches, 10, message="the acks written")
        time.sleep(0.3)
        broker.stop("kill")
        committing.join(timeout=60)
        assert not committing.is_alive(), "the commit still waits after the broker was killed"
        broker = DataDirBroker(tmp_path / "data", "--port", str(urlparse(url).port))
        second = wait_until(lambda: (end := reader.latestOffset()) != first and end, 30, interval=0.1,
                            message="a batch after the restart")
        assert bodies(first, second) == [f"u{i}".encode() for i in range(5, 10)]
        reader.commit(second)
        # PySpark 4.0/4.1's reader waits at each commit for the broker's answer behind its acks (a restart
        # may serve a file still named uncommitted), so the file is gone already.
        assert sorted(p.name for p in journal.iterdir()) == []
    finally:
        reader.stop()
        broker.stop("kill")
