"""Queue mode's batch journal (option `journalPath`): exactly-once replay of micro-batches.

Without it, a batch that Spark planned and did not commit before the driver died is taken again from what
the broker redelivers: the same messages, perhaps in other batches, and the batch that did run may have
written some of them already (at-least-once). With it:

- before `latestOffset` returns a batch, its rows are written durably under `journalPath`, one Arrow IPC
  file per batch, `batch-<seq>.arrow`; so every batch in Spark's offset log has its file;
- a batch re-planned after a restart is served from its file, row for row as the first attempt; so is
  a batch journaled by a run that died before Spark logged its offset: it becomes the next batch, for
  its messages' redelivered copies will be dropped;
- the broker redelivers what the dead connection held unacked (`redelivered=true`); a redelivered message
  whose key is one a journaled batch still waits for is acked with the batch that takes it and not
  emitted again. The key is the queue and `message_id` when the message has one, else a fingerprint of
  queue, exchange, routing key, property bytes and body; keys are counted (two equal messages are two);
- a file is removed once its batch is committed and every one of its messages was acked on a live
  channel: its own delivery, or the redelivered copy that was dropped. An ack counts once the broker has
  answered a round trip behind it on its channel (`QueueConsumer._acks_taken`): an ack written to a broker
  killed a moment later raises nothing, and its message comes back after the restart.

Where it runs: the driver, in the reader's `latestOffset` / `partitions` / `commit` (the Python process
that owns the consumer). Paths: a local path, or any URI pyarrow's filesystems reach (`file://`, `s3://`,
`hdfs://`, `gs://`). A local file is fsynced before its rename; elsewhere the filesystem's own write
(an object store's PUT) is what makes it durable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections import Counter

import pyarrow as pa
import pyarrow.fs as pafs

from ..codec import properties as amqp_properties
from . import arrow_rows

log = logging.getLogger("spark_amqp.source")

KEY_COLUMN = "_journal_key"
# `batch-<seq>.arrow` until its batch is committed; a file that outlives its commit (its messages' acks not
# yet known to have gone out) is renamed `committed-<seq>.arrow`: kept for matching, never served again.
_NAME = re.compile(r"^(batch|committed)-(\d{20})\.arrow$")


def delivery_key(queue: str, delivery, message_id: str | None) -> bytes:
    """The key a redelivered copy is matched by (see the module's docstring)."""
    if message_id:
        return b"m" + queue.encode() + b"\0" + message_id.encode()
    h = hashlib.blake2b(digest_size=16)
    for part in (queue.encode(), delivery.exchange.encode(), delivery.routing_key.encode(),
                 delivery.properties_raw):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(delivery.body)
    return b"f" + h.digest()


def redelivered_key(queue: str, delivery) -> bytes:
    """The key of a delivery whose message_id is not decoded yet (redeliveries only: they are few)."""
    return delivery_key(queue, delivery, amqp_properties.decode(delivery.properties_raw).get("message_id"))


def batch_keys(record_batch: pa.RecordBatch, deliveries_by_queue) -> list[bytes]:
    """The keys of a batch's rows, in row order (message_id read from the batch's own column)."""
    ids = record_batch.column("message_id").to_pylist()
    keys = []
    i = 0
    for queue, deliveries in deliveries_by_queue:
        for d in deliveries:
            keys.append(delivery_key(queue, d, ids[i]))
            i += 1
    return keys


class BatchJournal:
    """The journal's files and what it still waits for. Driver only."""

    def __init__(self, path: str):
        self.path = path
        self.fs, self.root, self.local = arrow_rows.filesystem(path)
        self.fs.create_dir(self.root, recursive=True)
        self.expected: Counter = Counter()            # keys whose redelivered copy is to be dropped
        self.outstanding: dict[int, Counter] = {}     # per journaled batch: keys not yet acked live
        self.generation: dict[int, int] = {}          # per journaled batch: the connection it came on
        self.committed = -1                           # the highest batch known committed
        self.committed_files: set[int] = set()        # batches whose file is named committed-<seq>

    # --- files -------------------------------------------------------------------------------------

    def _file(self, seq: int) -> str:
        kind = "committed" if seq in self.committed_files else "batch"
        return f"{self.root.rstrip('/')}/{kind}-{seq:020d}.arrow"

    def seqs(self) -> list[int]:
        """The batches with a file; those whose file says committed are noted in `committed_files`."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        found = [(m.group(1), int(m.group(2))) for i in infos if (m := _NAME.match(i.base_name))]
        self.committed_files.update(seq for kind, seq in found if kind == "committed")
        return sorted(seq for _, seq in found)

    def load(self) -> int:
        """At the start of a run: every file left by an earlier run waits for its messages' redelivered
        copies (its batch may be committed or not). Returns the number of files. A `.tmp` file is a batch
        whose writing a killed run never finished: its offset never reached Spark and its messages were
        never acked, so it is removed (they come again as deliveries, to be planned anew)."""
        for info in self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)):
            if info.base_name.endswith(".tmp") and _NAME.match(info.base_name[:-4]):
                try:
                    self.fs.delete_file(info.path)
                except OSError as exc:     # harmless where it is: never read
                    log.warning("AMQP source: journal %s: cannot remove %s, left unfinished by an earlier "
                                "run: %s", self.path, info.base_name, exc)
                else:
                    log.info("AMQP source: journal %s: removed %s, left unfinished by an earlier run",
                             self.path, info.base_name)
        seqs = self.seqs()
        for seq in seqs:
            keys = self._read(seq).column(KEY_COLUMN).to_pylist()
            self.outstanding[seq] = Counter(keys)
            self.generation[seq] = 0                   # before this process's first connection
            self.expected.update(keys)
        if seqs:
            log.info("AMQP source: journal %s holds %d batch(es) (%s..%s); their redelivered messages will "
                     "be dropped", self.path, len(seqs), seqs[0], seqs[-1])
        return len(seqs)

    def record(self, seq: int, record_batch: pa.RecordBatch, keys: list[bytes], generation: int) -> None:
        """Write batch `seq`, received on connection number `generation`, durably (before Spark records
        its offset)."""
        table = record_batch.append_column(KEY_COLUMN, pa.array(keys, pa.binary()))
        data = arrow_rows.serialize(table)
        final = self._file(seq)
        tmp = final + ".tmp"
        if self.local:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            dir_fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        else:
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.fs.move(tmp, final)
        self.outstanding[seq] = Counter(keys)
        self.generation[seq] = generation
        self.expected.update(keys)

    def _read(self, seq: int) -> pa.RecordBatch:
        with self.fs.open_input_stream(self._file(seq)) as fh:
            batches = arrow_rows.deserialize(fh.read())
        return batches[0]

    def rows(self, seq: int) -> pa.RecordBatch | None:
        """Batch `seq` as first planned, or None if it was never journaled, or is committed."""
        if seq not in self.outstanding or seq in self.committed_files:
            return None
        batch = self._read(seq)
        return batch.drop_columns([KEY_COLUMN])

    def uncommitted(self) -> list[int]:
        """The batches whose files are not known to be committed (planned, perhaps by an earlier run)."""
        return [seq for seq in self.outstanding if seq not in self.committed_files]

    # --- matching --------------------------------------------------------------------------------

    def claim(self, queue: str, delivery) -> bytes | None:
        """A redelivered message: its key if a journaled batch holds it (then counted as found: the caller
        acks it and leaves it out), else None."""
        key = redelivered_key(queue, delivery)
        if self.expected[key] > 0:
            self.expected[key] -= 1
            return key
        return None

    def release(self, key: bytes) -> None:
        """A claimed copy could not be acked: it will be redelivered again."""
        self.expected[key] += 1

    def acked(self, keys, seq: int | None = None) -> None:
        """These keys were acked on a live channel, and the broker answered behind the acks: batch `seq`'s
        own deliveries (they cannot come back, so no copy is expected any more), or with `seq` None
        redelivered copies dropped earlier."""
        if seq is not None:
            self.expected.subtract(keys)
            if seq in self.outstanding:
                self.outstanding[seq].subtract(keys)
            return
        for key in keys:
            for waiting in self.outstanding.values():
                if waiting[key] > 0:
                    waiting[key] -= 1
                    break

    def expire(self, generation: int) -> None:
        """Every queue has delivered a message that was not redelivered on connection `generation`: the
        copies released by earlier connections have all arrived, so batches from before it wait for
        nothing more (their acks reached the broker before the connection was lost)."""
        for seq, waiting in self.outstanding.items():
            if self.generation[seq] < generation and +waiting:
                log.info("AMQP source: journal batch %s: %d message(s) were not redelivered (acked before the "
                         "connection was lost)", seq, sum(waiting.values()))
                self.expected.subtract(waiting)
                self.expected = +self.expected
                waiting.clear()

    def settle(self, committed: int) -> list[int]:
        """Batches through `committed` are in Spark's commit log: remove the files of those whose messages
        were all acked live, and mark the others committed (a later run must not serve them as a batch).
        Returns the batches removed."""
        self.committed = max(self.committed, committed)
        self.expected = +self.expected      # drop the keys counted down to zero (or below)
        done = []
        for seq, waiting in list(self.outstanding.items()):
            if seq > self.committed:
                continue
            if not +waiting:
                try:
                    self.fs.delete_file(self._file(seq))
                except FileNotFoundError:
                    pass
                del self.outstanding[seq]
                del self.generation[seq]
                self.committed_files.discard(seq)
                done.append(seq)
            elif seq not in self.committed_files:
                before = self._file(seq)
                self.committed_files.add(seq)
                self.fs.move(before, self._file(seq))
        return done
