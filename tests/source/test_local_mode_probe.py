"""handoff=auto's question to the executors (LocalModeProbe): do they run in the driver's JVM? Real files in
a directory standing for Spark's local directory; the executor's side is `answer_probe`, as read() calls it.
The whole round trip on local[2] is in test_large_batches.py."""

from __future__ import annotations

import subprocess
import sys

from spark_amqp.source.handoff import (DIR_PREFIX, PROBE_PREFIX, LocalModeProbe, _remove_dead_processes_files,
                                       answer_probe)


def test_an_executor_with_the_drivers_local_dirs_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_LOCAL_DIRS", f"{tmp_path},/elsewhere")
    probe = LocalModeProbe()
    assert not probe.answered()
    ticket = probe.ticket()
    answer_probe(ticket)
    answer_probe(ticket)     # a second partition of the same batch: no error
    assert probe.answered()
    handoff = probe.handoff_dir()
    assert handoff.owned and handoff.base.startswith(str(tmp_path / DIR_PREFIX))
    probe.close()
    handoff.close()
    assert list(tmp_path.iterdir()) == [], "the probe file and the handoff directory are removed"


def test_an_executor_in_another_jvm_does_not_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    probe = LocalModeProbe()
    ticket = probe.ticket()
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path / "executor-1" / "blockmgr-x"))
    answer_probe(ticket)
    monkeypatch.delenv("SPARK_LOCAL_DIRS")
    answer_probe(ticket)
    assert not probe.answered()
    assert list(tmp_path.iterdir()) == []


def test_without_spark_local_dirs_nothing_is_asked(monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    probe = LocalModeProbe()
    assert probe.ticket() is None and not probe.answered()
    answer_probe(probe.ticket())


def test_files_of_ended_source_processes_are_removed_and_no_others(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead = int(ended.stdout)
    (tmp_path / f"{DIR_PREFIX}{dead}-abc" / "run-1").mkdir(parents=True)
    (tmp_path / f"{DIR_PREFIX}{dead}-abc" / "run-1" / "batch.arrow").write_bytes(b"x")
    (tmp_path / f"{PROBE_PREFIX}{dead}-abc").write_bytes(b"")
    (tmp_path / f"{DIR_PREFIX}1-live").mkdir()            # pid 1 runs: another query's
    (tmp_path / "blockmgr-data").mkdir()                   # not ours
    _remove_dead_processes_files(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blockmgr-data", f"{DIR_PREFIX}1-live"]
