"""Queue mode's batch journal (option `journalPath`): exactly-once replay of micro-batches.

Without it, a batch that Spark planned and did not commit before the driver died is taken again from what
the broker redelivers: the same messages, perhaps in other batches, and the batch that did run may have
written some of them already (at-least-once). With it:

- before `latestOffset` returns a batch, its rows are written durably under `journalPath` as Arrow IPC
  files, `batch-<seq>-<part>.arrow`: one part for a batch taken at once, several for an availableNow batch
  that fills part by part (each part written as it arrives); so every batch in Spark's offset log has its
  files. (A file named `batch-<seq>.arrow`, without a part, is read as the batch's only part.)
- a batch re-planned after a restart is served from its file, row for row as the first attempt; so is
  a batch journaled by a run that died before Spark logged its offset: it becomes the next batch, for
  its messages' redelivered copies will be dropped;
- the broker redelivers what the dead connection held unacked (`redelivered=true`); a redelivered message
  whose key is one a journaled batch still waits for is acked with the batch that takes it and not
  emitted again. The key is the queue and `message_id` when the message has one, else a fingerprint of
  queue, exchange, routing key, property bytes (without the delivery counts a quorum queue adds, which
  differ between a message's deliveries) and body; keys are counted (two equal messages are two);
- a batch's files are removed once it is committed and every one of its messages was acked on a live
  channel: its own delivery, or the redelivered copy that was dropped. An ack counts once the broker has
  answered a round trip behind it on its channel (`QueueConsumer._acks_taken`): an ack written to a broker
  killed a moment later raises nothing, and its message comes back after the restart. The answer behind a
  commit's acks is taken at the next commit (`QueueConsumer.confirm_acks`), or when the query stops, so a
  committed batch's file goes then (on PySpark 4.0/4.1 each commit waits for it instead).

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
import struct
from collections import Counter

import pyarrow as pa
import pyarrow.fs as pafs

from ..codec import properties as amqp_properties
from . import arrow_rows

log = logging.getLogger("spark_amqp.source")

KEY_COLUMN = "_journal_key"
# `batch-<seq>-<part>.arrow` until its batch is committed; a file that outlives its commit (its messages'
# acks not yet known to have gone out) is renamed `committed-<seq>-<part>.arrow`: kept for matching, never
# served again. Files without `-<part>` are a whole batch's single file.
_NAME = re.compile(r"^(batch|committed)-(\d{20})(-\d{6})?\.arrow$")


def _fingerprint_head(queue: str, exchange: str, routing_key: str, properties_raw: bytes) -> bytes:
    """What a fingerprint hashes before the body: each part after its length (4 bytes, big-endian). The
    property bytes without the delivery counts a quorum queue adds to each delivery
    (`properties.without_delivery_counts`): a redelivered copy's count differs from its first delivery's."""
    try:
        properties_raw = amqp_properties.without_delivery_counts(properties_raw)
    except (ValueError, IndexError, struct.error):
        pass     # a malformed table: the bytes as they came, for the original and its copies alike
    return b"".join(len(part).to_bytes(4, "big") + part
                    for part in (queue.encode(), exchange.encode(), routing_key.encode(), properties_raw))


def _fingerprint(head: bytes, body: bytes) -> bytes:
    return b"f" + hashlib.blake2b(head + body, digest_size=16).digest()


def delivery_key(queue: str, delivery, message_id: str | None) -> bytes:
    """The key a redelivered copy is matched by (see the module's docstring)."""
    if message_id:
        return b"m" + queue.encode() + b"\0" + message_id.encode()
    head = _fingerprint_head(queue, delivery.exchange, delivery.routing_key, delivery.properties_raw)
    return _fingerprint(head, delivery.body)


def redelivered_key(queue: str, delivery) -> bytes:
    """The key of a delivery whose message_id is not decoded yet (redeliveries only: they are few)."""
    return delivery_key(queue, delivery, amqp_properties.decode(delivery.properties_raw).get("message_id"))


def batch_keys(record_batch: pa.RecordBatch, deliveries_by_queue) -> list[bytes]:
    """The keys of a batch's rows, in row order (message_id read from the batch's own column), as
    `delivery_key` gives them. Driver, in latestOffset: a batch's messages mostly share their exchange,
    routing key and properties, so each distinct head is built once and each body hashed in one call
    (100,000 x 100 B without message_id, alternating: 1.6-3.0 -> 1.0-1.8 us a key against a blake2b update
    per part; the hash itself takes 1.0 us of that on this machine)."""
    ids = record_batch.column("message_id").to_pylist()
    keys = []
    i = 0
    for queue, deliveries in deliveries_by_queue:
        heads: dict[tuple, bytes] = {}
        for d in deliveries:
            message_id = ids[i]
            i += 1
            if message_id:
                keys.append(delivery_key(queue, d, message_id))
                continue
            at = (d.exchange, d.routing_key, d.properties_raw)
            head = heads.get(at)
            if head is None:
                head = _fingerprint_head(queue, *at)
                if len(heads) < 4096:
                    heads[at] = head
            keys.append(_fingerprint(head, d.body))
    return keys


class BatchJournal:
    """The journal's files and what it still waits for. Driver only."""

    def __init__(self, path: str):
        self.path = path
        self.fs, self.root, self.local = arrow_rows.filesystem(path)
        self.fs.create_dir(self.root, recursive=True)
        # What a redelivered copy is matched against, kept per batch so that the common case (a batch's own
        # deliveries all acked live) drops a whole Counter instead of counting 100,000 keys down one by one:
        # a key's copies still expected = its count in `own` over all batches + `adjusted`; a batch waits
        # (for acks) for its `own` keys minus its `found` ones.
        self.own: dict[int, Counter] = {}             # per journaled batch: keys whose own delivery is not
                                                      # known acked live
        self.found: dict[int, Counter] = {}           # per journaled batch: keys acked live as a dropped copy
        self.adjusted: Counter = Counter()            # claims, releases and expiries
        self.generation: dict[int, int] = {}          # per journaled batch: the connection it came on
        self.committed = -1                           # the highest batch known committed
        self.committed_files: set[int] = set()        # batches whose files are named committed-<seq>-...
        self.names: dict[int, list[str]] = {}         # per batch with files: their names, in part order

    # --- files -------------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def seqs(self) -> list[int]:
        """The batches with files (their names in `names`, in part order); those with a file that says
        committed are noted in `committed_files`."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        found = sorted((int(m.group(2)), m.group(3) or "", m.group(1), i.base_name)
                       for i in infos if (m := _NAME.match(i.base_name)))
        self.names = {}
        for seq, _part, kind, name in found:
            self.names.setdefault(seq, []).append(name)
            if kind == "committed":
                self.committed_files.add(seq)
        return sorted(self.names)

    def load(self) -> int:
        """At the start of a run: every file left by an earlier run waits for its messages' redelivered
        copies (its batch may be committed or not). Returns the number of batches. A `.tmp` file is a part
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
            for name in self.names[seq]:
                self._journaled(seq, self._read(name).column(KEY_COLUMN).to_pylist(), generation=0)
        if seqs:
            log.info("AMQP source: journal %s holds %d batch(es) (%s..%s); their redelivered messages will "
                     "be dropped", self.path, len(seqs), seqs[0], seqs[-1])
        return len(seqs)

    def record(self, seq: int, record_batch: pa.RecordBatch, keys: list[bytes], generation: int,
               part: int = 0) -> None:
        """Write part `part` of batch `seq` (the whole batch when it is taken at once), received on
        connection number `generation`, durably (before Spark records the batch's offset; a part of a batch
        filling part by part, before its deliveries are acked)."""
        table = record_batch.append_column(KEY_COLUMN, pa.array(keys, pa.binary()))
        name = f"batch-{seq:020d}-{part:06d}.arrow"
        final = self._path(name)
        tmp = final + ".tmp"
        if self.local:
            with open(tmp, "wb") as fh:
                arrow_rows.write(fh, table)
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
                arrow_rows.write(out, table)
            self.fs.move(tmp, final)
        self.names.setdefault(seq, []).append(name)
        self._journaled(seq, keys, generation)

    def _journaled(self, seq: int, keys: list[bytes], generation: int) -> None:
        """Keys of batch `seq` (one more part of it), from connection `generation` (0: an earlier run's), now
        wait: for their own deliveries' acks, or for their redelivered copies."""
        self.own.setdefault(seq, Counter()).update(keys)
        self.found.setdefault(seq, Counter())
        self.generation[seq] = generation

    def _read(self, name: str) -> pa.RecordBatch:
        with self.fs.open_input_stream(self._path(name)) as fh:
            batches = arrow_rows.deserialize(fh.read())
        return batches[0]

    def rows(self, seq: int) -> pa.RecordBatch | None:
        """Batch `seq` as first planned (its parts in order), or None if it was never journaled, or is
        committed."""
        if seq not in self.own or seq in self.committed_files:
            return None
        batch = arrow_rows.concat([self._read(name) for name in self.names[seq]])
        return batch.drop_columns([KEY_COLUMN])

    def uncommitted(self) -> list[int]:
        """The batches whose files are not known to be committed (planned, perhaps by an earlier run)."""
        return [seq for seq in self.own if seq not in self.committed_files]

    # --- matching --------------------------------------------------------------------------------

    def _waiting(self, seq: int) -> Counter:
        """Batch `seq`'s keys not yet acked live (neither their own delivery nor a dropped copy)."""
        own, found = self.own[seq], self.found[seq]
        return own - found if found else +own

    def _expected(self, key: bytes) -> int:
        """How many more redelivered copies of `key` are to be dropped (zero or less: none)."""
        return sum(own[key] for own in self.own.values() if key in own) + self.adjusted[key]

    def _clamp(self) -> None:
        """No key is expected fewer than zero times (a count taken below zero is forgotten)."""
        for key, adjusted in list(self.adjusted.items()):
            total = self._expected(key)
            if total < 0:
                adjusted -= total
            if adjusted:
                self.adjusted[key] = adjusted
            else:
                del self.adjusted[key]

    def claim(self, queue: str, delivery) -> bytes | None:
        """A redelivered message: its key if a journaled batch holds it (then counted as found: the caller
        acks it and leaves it out), else None."""
        key = redelivered_key(queue, delivery)
        if self._expected(key) > 0:
            self.adjusted[key] -= 1
            return key
        return None

    def release(self, key: bytes) -> None:
        """A claimed copy could not be acked: it will be redelivered again."""
        self.adjusted[key] += 1

    def acked_batch(self, seq: int, keys_by_part: list[list[bytes]], whole: bool) -> None:
        """Batch `seq`'s own deliveries with these keys (per part of the batch) were acked on a live channel,
        and the broker answered behind the acks; `whole`: all of its deliveries were. They cannot come back,
        so no copy is expected for them."""
        own = self.own.get(seq)
        if own is not None and whole:
            own.clear()
            return
        for keys in keys_by_part:
            (own if own is not None else self.adjusted).subtract(keys)

    def acked_copies(self, keys) -> None:
        """Redelivered copies dropped earlier (claimed) were acked live, and the broker answered behind the
        acks: each counts for the first batch still waiting for its key."""
        for key in keys:
            for seq, own in self.own.items():
                if own[key] - self.found[seq][key] > 0:
                    self.found[seq][key] += 1
                    break

    def _forget(self, seq: int) -> None:
        """Batch `seq` waits for nothing more; what it still counted as expected stays expected."""
        self.adjusted.update(self.own.pop(seq))
        del self.found[seq]

    def expire(self, generation: int) -> None:
        """Every queue has delivered a message that was not redelivered on connection `generation`: the
        copies released by earlier connections have all arrived, so batches from before it wait for
        nothing more (their acks reached the broker before the connection was lost)."""
        for seq in self.own:
            if self.generation[seq] >= generation:
                continue
            waiting = self._waiting(seq)
            if waiting:
                log.info("AMQP source: journal batch %s: %d message(s) were not redelivered (acked before the "
                         "connection was lost)", seq, sum(waiting.values()))
                # No copy is expected for what the batch still counted, its copies found aside.
                self.adjusted.update(self.found[seq])
                self.own[seq], self.found[seq] = Counter(), Counter()
                self._clamp()

    def settle(self, committed: int) -> list[int]:
        """Batches through `committed` are in Spark's commit log: remove the files of those whose messages
        were all acked live, and mark the others' files committed (a later run must not serve them as a batch).
        Returns the batches removed."""
        self.committed = max(self.committed, committed)
        self._clamp()
        done = []
        for seq in list(self.own):
            if seq > self.committed:
                continue
            if not self._waiting(seq):
                for name in self.names.pop(seq, []):
                    try:
                        self.fs.delete_file(self._path(name))
                    except FileNotFoundError:
                        pass
                self._forget(seq)
                del self.generation[seq]
                self.committed_files.discard(seq)
                done.append(seq)
            elif seq not in self.committed_files or any(n.startswith("batch-") for n in self.names.get(seq, [])):
                committed = []
                for name in self.names.get(seq, []):
                    if name.startswith("batch-"):
                        renamed = "committed-" + name[len("batch-"):]
                        self.fs.move(self._path(name), self._path(renamed))
                        name = renamed
                    committed.append(name)
                self.names[seq] = committed
                self.committed_files.add(seq)
        return done
