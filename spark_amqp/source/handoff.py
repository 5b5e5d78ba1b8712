"""Queue mode's file handoff (option `handoffPath`): a micro-batch reaches the executors as Arrow files.

Without it, each partition's rows travel inside the partition object: pickled by the driver's source
process, copied into the driver's JVM, serialized into the task, deserialized on the executor and written
to the executor's Python worker, which reads them back. With it, the driver writes each partition to an
Arrow IPC file under `handoffPath` and the partition holds only its path; the executor's Python worker
reads the file (memory-mapped when local). Spark's JVM then spends less CPU per message, and the driver's
JVM never holds a batch's bytes (bench/read_throughput.py, source against inline, JVM CPU per message:
3.2 against 3.9 us at 100 B, 13.9 against 35.9 us at 4 KB; docs/performance.md).

The directory must be one every executor can read: any local path in local mode, else a shared filesystem
(`hdfs://`, `s3://`, ... as pyarrow's filesystems reach them). Each run of a query writes under its own
`run-<uuid>` subdirectory; a batch's files are removed once it is committed (in the source's own directory
a few are kept instead, renamed, for later batches to be written over: `HandoffDir.committed`), the run's
directory when the query stops, and directories left by earlier runs (a driver killed -9) when the next
run starts: so, as with journalPath, one directory per query.

Without `handoffPath` (option `handoff=auto`, the default), the source hands off through files only once
the executors are shown to run inside the driver's JVM (Spark's local mode: notebooks, tests, single-machine
jobs), in a directory of its own under Spark's local directory (`LocalModeProbe`); a cluster gets the rows
inside its tasks as before.

Where it runs: `HandoffDir` and `LocalModeProbe` on the driver (the source's `partitions` and `commit`),
`read_file` and `answer_probe` on the executors.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.sql.datasource import InputPartition

from . import arrow_rows

log = logging.getLogger("spark_amqp.source")

# Under Spark's local directory (handoff=auto): LocalModeProbe's directory and probe file, then "<pid>-<uuid>".
DIR_PREFIX = "spark-amqp-handoff-"
PROBE_PREFIX = "spark-amqp-probe-"
# Committed batches' files kept in the source's own directory for later batches to be written over, at
# most: enough for the slices of two default batches, and at most 8 x PARTITION_BYTES (256 MiB) of disk.
SPARE_FILES = 8


class FilePartition(InputPartition):
    """One slice of a micro-batch as a file under `handoffPath` (written on the driver, read on an
    executor): the directory's URI as the user gave it, and the file's path below it."""

    def __init__(self, base: str, path: str):
        super().__init__(None)
        self.base = base
        self.path = path


class HandoffDir:
    """The driver's side: writes a batch's slices, removes them once the batch is committed."""

    def __init__(self, base: str, owned: bool = False):
        """`owned`: `base` is this reader's own directory (handoff=auto), removed with the run's."""
        self.base = base
        self.owned = owned
        self.fs, root, self.local = arrow_rows.filesystem(base)
        self.root = f"{root.rstrip('/')}/run-{uuid.uuid4().hex}"
        self.fs.create_dir(self.root, recursive=True)
        # One directory per query, and a query runs once at a time: other runs' directories are left over
        # from runs that stopped before removing theirs (a driver killed, or Spark ending the process).
        for info in self.fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
            if info.base_name.startswith("run-") and info.path.rstrip("/") != self.root:
                try:
                    self.fs.delete_dir(info.path)
                except OSError as exc:
                    log.warning("AMQP source: cannot remove an earlier run's handoff directory %s: %s",
                                info.path, exc)
        self.files: dict[int, list[FilePartition]] = {}    # per batch handed off: its partitions
        self.spares: list[str] = []     # committed batches' files (`spare-<batch>-<index>`), to be written over

    def partitions(self, seq: int, record_batch: pa.RecordBatch, rows: int) -> list[FilePartition]:
        """Batch `seq` in slices of `rows` rows, one file each (written once: Spark may ask again)."""
        return self.write(seq, (record_batch.slice(offset, rows)
                                for offset in range(0, record_batch.num_rows, rows)))

    def write(self, seq: int, slices) -> list[FilePartition]:
        """Batch `seq`, one file per record batch of the iterable `slices`, each built only when the one
        before is written (so that one slice at a time is in memory twice: as deliveries and as Arrow);
        written once, as Spark may ask again. A batch already written is not asked for its slices."""
        if seq not in self.files:
            parts = []
            for index, record_batch in enumerate(slices):
                path = self.file_path(seq, index)
                with self._output(path) as out:
                    arrow_rows.write(out, record_batch)
                parts.append(FilePartition(self.base, path))
            self.files[seq] = parts
        return self.files[seq]

    def _output(self, path: str):
        """A new file at `path`: a spare one renamed and written over (see `committed`), else (none left, or
        the spare cannot be reused) a new one."""
        if self.spares:
            try:
                os.replace(self.spares.pop(), path)
                return _WrittenOver(path)
            except OSError as exc:
                log.warning("AMQP source: cannot write handoff file %s over a spare one (%s); writing it anew",
                            path, exc)
        return self.fs.open_output_stream(path)

    def bodies(self, seq: int, count: int):
        """The bodies of batch `seq`'s first `count` files, a list per file (a write that failed part way
        puts back the bodies it let go)."""
        for index in range(count):
            with self.fs.open_input_stream(self.file_path(seq, index)) as source:
                yield pa.ipc.open_stream(source).read_all().column("body").to_pylist()

    def file_path(self, seq: int, index: int) -> str:
        return f"{self.root}/batch-{seq:020d}-{index:04d}.arrow"

    def committed(self, seq: int) -> None:
        """Batches through `seq` are committed: their files go. In the source's own directory (`owned`: a
        local disk, handoff=auto) up to SPARE_FILES of them stay, renamed `spare-<batch>-<index>`, for later
        batches to be written over: the page cache keeps their pages, which new files would take afresh (and
        on a virtual machine whose freed memory goes back to its host, fault in anew). Measured alternating,
        four rounds each, embedded broker, 250,000 x 4 KB: 140.8-148.6 MB/s written over, 132.8-140.8 MB/s
        new (1.08x); at 1,000,000 x 100 B within noise (1.02x). Not under a user's `handoffPath`, which may be a mount (NFS, a FUSE
        object store) where writing over a file is slow, unsupported or seen late by other machines."""
        for done in [s for s in self.files if s <= seq]:
            for index, part in enumerate(self.files.pop(done)):
                try:
                    if self.owned and len(self.spares) < SPARE_FILES:
                        spare = f"{self.root}/spare-{done:020d}-{index:04d}"
                        os.replace(part.path, spare)
                        self.spares.append(spare)
                    else:
                        self.fs.delete_file(part.path)
                except OSError as exc:
                    log.warning("AMQP source: cannot remove handoff file %s: %s", part.path, exc)

    def close(self) -> None:
        """The query stops: the run's directory goes (what Spark has not committed is re-planned anew)."""
        self.files.clear()
        self.spares.clear()
        directory = self.base if self.owned else self.root
        try:
            self.fs.delete_dir(directory)
        except OSError as exc:
            log.warning("AMQP source: cannot remove handoff directory %s: %s", directory, exc)


class _WrittenOver(io.BufferedRandom):
    """A file opened for writing without truncation (its pages stay in the page cache as they are written
    over), cut at the last byte written when closed. Buffered, so that a short write of the OS is written on
    and the IPC writer's small pieces go out together; a body buffer larger than the buffer goes straight."""

    def __init__(self, path: str):
        super().__init__(io.FileIO(path, "r+"))

    def close(self) -> None:
        if not self.closed:
            self.truncate(self.tell())
        super().close()


class LocalModeProbe:
    """Driver (the source's process): whether this query's executors run inside the driver's JVM, so that
    a batch can reach them as files in a directory of the driver's machine without `handoffPath`.

    Spark gives each Python process it starts its block manager's directories in SPARK_LOCAL_DIRS: this
    process, and the executors' Python workers. Those are the same only within one JVM, which is local mode,
    where the driver's JVM is the only executor (PySpark 4.3, measured: local[2] the same directory;
    local-cluster, whose executors are JVMs of their own on the same machine, different ones). The driver
    cannot ask the executors before a task runs, so its first partitions carry a ticket (its directories
    and a path): an executor whose directories are the same creates the file at that path (`answer_probe`),
    and the next batch's planning finds it there. Anything else (no SPARK_LOCAL_DIRS, other directories, a
    failed write) leaves the rows inside the tasks."""

    ENV = "SPARK_LOCAL_DIRS"

    def __init__(self):
        dirs = os.environ.get(self.ENV, "")
        self.local_dirs = dirs
        self.first_dir = dirs.split(",")[0] if dirs else ""
        # Named after this process: Spark may end it before stop() has removed them, and another query of
        # the same application (its own process, the same local directory) removes them once it is gone.
        self.token = f"{os.getpid()}-{uuid.uuid4().hex}"
        self.path = os.path.join(self.first_dir, f"{PROBE_PREFIX}{self.token}") if self.first_dir else ""

    def ticket(self) -> tuple[str, str] | None:
        """What an inline partition carries for `answer_probe` (None: nothing to ask)."""
        return (self.local_dirs, self.path) if self.path else None

    def answered(self) -> bool:
        """Whether an executor in this JVM has read a partition that carried the ticket."""
        return bool(self.path) and os.path.exists(self.path)

    def handoff_dir(self) -> HandoffDir | None:
        """The directory for this reader's files, under Spark's local directory (Spark removes it at its
        shutdown if the source could not); None, with a warning, if it cannot be made."""
        _remove_dead_processes_files(self.first_dir)
        try:
            return HandoffDir(os.path.join(self.first_dir, f"{DIR_PREFIX}{self.token}"), owned=True)
        except OSError as exc:
            log.warning("AMQP source: cannot make a handoff directory under %s (%s); the rows stay inside "
                        "Spark's tasks", self.first_dir, exc)
            return None

    def close(self) -> None:
        if self.path:
            try:
                os.remove(self.path)
            except OSError:
                pass


def _remove_dead_processes_files(local_dir: str) -> None:
    """Driver: the probe files and handoff directories that LocalModeProbe made for source processes no
    longer running (Spark ended them before their stop() finished)."""
    try:
        names = os.listdir(local_dir)
    except OSError:
        return
    for name in names:
        prefix = next((p for p in (DIR_PREFIX, PROBE_PREFIX) if name.startswith(p)), None)
        pid = name[len(prefix):].split("-")[0] if prefix else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _running(int(pid)):
            continue
        path = os.path.join(local_dir, name)
        try:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        except OSError as exc:
            log.warning("AMQP source: cannot remove %s, left by an earlier run: %s", path, exc)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True      # there, and not ours to signal
    return True


def answer_probe(ticket: tuple[str, str] | None) -> None:
    """Executor: tell the driver this worker runs in its JVM (see LocalModeProbe) by creating the ticket's
    file, if its SPARK_LOCAL_DIRS are the driver's. Never fails the read."""
    if not ticket or os.environ.get(LocalModeProbe.ENV) != ticket[0]:
        return
    try:
        with open(ticket[1], "x"):
            pass
    except OSError:
        pass     # already there (another partition), or not writable: then the rows stay inline


def read_file(partition: FilePartition):
    """Executor: the partition's record batches, from its file, in batches for the JVM
    (`arrow_rows.in_jvm_batches`)."""
    fs, _, local = arrow_rows.filesystem(partition.base)
    try:
        source = pa.memory_map(partition.path) if local else fs.open_input_file(partition.path)
    except OSError as exc:
        raise RuntimeError(
            f"option handoffPath={partition.base!r}: this executor cannot read {partition.path} ({exc}); "
            "handoffPath must be a directory every executor reads (local mode, or a shared filesystem)"
        ) from None
    with source:
        yield from arrow_rows.in_jvm_batches(pa.ipc.open_stream(source))
