"""`spark.readStream.format("amqp")`, queue mode: a micro-batch is what the driver's consumers received,
acked once Spark has committed it.

Where things run (measured on PySpark 4.3.0, docs/design.md): `initialOffset`, `latestOffset`, `partitions`,
`commit` and `stop` run on the driver, in one long-lived Python process per query, so that process owns the
AMQP connection; `read` runs on executors with a copy of this object pickled at planning time, so it uses
only its partition (the batch's rows as Arrow IPC bytes, or with `handoffPath` the path of a file holding
them) and never a socket.

Offsets are `{"seq": N}`: batch N's end; every batch covers exactly one planned `seq`. When to ack: on
PySpark >= 4.2 (`QueueStreamReader`), `latestOffset(start, limit)` is called on every trigger and only once
the batch ending at `start` is in Spark's commit log, so everything up to `start` is acked there;
`commit(end)` is the same signal arriving again. Under `availableNow` the run ends with one empty batch (an
"ack barrier") after the last data batch, so that the last data batch is acked within the run.

PySpark 4.0 and 4.1 (`LegacyQueueStreamReader`) call `latestOffset()` with no start and no limit, and know
no availableNow support or read limits (`pyspark.sql.streaming.datasource` arrived in 4.2). Under Spark's
synchronous progress tracking (the default) the next `latestOffset()` comes only after the previous batch
is in the commit log, so it acks every batch already handed to `partitions()`. Not knowing its start, that
reader numbers batches by the wall clock in milliseconds (always above the last number it returned or
saw), so that a batch number is never reused across restarts of the query.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from .. import gc_tuning
from ..pyspark_versions import ADMISSION_CONTROL, SupportsTriggerAvailableNow, default_read_limit, max_rows
from . import arrow_rows
from .consumer import (Batch, ConsumerTimeout, QueueConsumer, SourceError, deliveries_by_queue, let_go_bodies,
                       put_back_bodies)
from .handoff import FilePartition, HandoffDir, LocalModeProbe, answer_probe, read_file
from .journal import BatchJournal, batch_keys

log = logging.getLogger("spark_amqp.source")

# Seconds a batch re-planned after a restart waits for the broker to redeliver what the previous run held.
REPLAY_WAIT = 2.0
# Seconds an availableNow run waits for messages it counted at the start before it stops without them.
AVAILABLE_NOW_WAIT = 5.0
# Seconds to wait for deliveries already sent by the broker once it reports the queues empty (RabbitMQ can
# hold tens of thousands in its channel processes while the machine is busy).
IN_FLIGHT_WAIT = 2.0
# Rows per partition: a batch of the default size (100,000) is split in two, one for each core of a small
# cluster; smaller slices cost more in Spark's per-task and per-row overhead than they gain (measured with
# bench/read_throughput.py: 20,000 gave 0.75x the throughput).
ROWS_PER_PARTITION = 50000
# Bodies per partition, at most about: a partition is one task's input (inside the task without handoffPath),
# and each task costs Spark ~0.1 s on local[2] however few its rows. A default batch of 4 KB messages (64 MiB)
# is split in two like one of 100 B messages: with 16 MiB (four tasks, two waves) bench/read_throughput.py
# read 132-138 MB/s with handoffPath, with 32 MiB 152-168 MB/s; with 64 MiB (one task) 158-162 MB/s.
PARTITION_BYTES = 32 * 2**20
# Seconds between the broker round trips behind the backlog's `ready` figure in the query's progress while
# batches keep coming (an idle trigger always asks): see QueueConsumer.backlog.
BACKLOG_REFRESH = 5.0
# Seconds a batch that must fill (PySpark 4.0/4.1's first batch; each availableNow batch) waits for its first
# deliveries: a backlog is read in full batches rather than in whatever had arrived when Spark asked (each
# batch costs Spark ~0.3 s).
FILL_WAIT = 1.0
# An availableNow batch, once its first deliveries are here, waits up to AVAILABLE_NOW_FILL seconds for the
# rest while they keep arriving, up to AVAILABLE_NOW_IDLE seconds apart. RabbitMQ pauses its deliveries for
# 0.1-1.8 s while the source holds a batch (its queue process collecting garbage: docs/performance.md), and
# a gap of 0.1 s ended the batch: 1,000,000 x 100 B went in 56-58 batches of 25-100,000 rows. With a 4 s
# bound and this gap, 15 batches, the JVM's CPU per message fell from 12.2-13.5 to 4.6-5.2 µs, and the
# source read 23,828-24,200 msg/s against 20,772-20,851 (alternating, one Spark session, a slow machine:
# ceiling 29,386); with 5 s, 16 batches in the read benchmark. The run's last batch fills as soon as its
# count is in, so the wait costs a drain nothing.
AVAILABLE_NOW_FILL = 5.0
AVAILABLE_NOW_IDLE = 0.5
# With journalPath and acks at the journal write, an availableNow batch fills part by part: every
# JOURNAL_PART deliveries are journaled and acked as they arrive, and the batch grows to bounds.PARTS_BATCH
# rows rather than half the prefetch. RabbitMQ's queue process works harder for a consumer that stops with
# its window full than for one that keeps acking (bench/ack_patterns.py, docs/performance.md: acks every
# 2,000 as it reads 1.43x pika on 4.3, batches of 20,000 acked whole 1.06x).
JOURNAL_PART = 5000
# Seconds the prefill (`QueueStreamReader._prefill`) waits at most for a part's deliveries before it looks
# whether it must stop: how long the next latestOffset may wait for it.
PREFILL_POLL = 0.2
# Seconds between two triggers from which the source stops its consumers after planning a batch and
# starts them again at the next trigger (each batch then waits to fill, as an availableNow batch does):
# deliveries that arrive between triggers far apart would otherwise wait unacked here for a whole interval
# before their batch, and one more before its commit's ack, nearer the broker's consumer timeout.
PAUSE_BETWEEN_TRIGGERS = 10.0


class ConsumerTimeoutError(SourceError):
    """The broker timed out this query's consumer, and without a journal the messages it took back would be
    read again (onConsumerTimeout=fail, the default)."""


def consumer_timeout_report(events: list[ConsumerTimeout], journal: bool) -> str:
    """What the query says when the broker timed out its consumers: the cause, what came back, the fixes."""
    queues = ", ".join(sorted({e.queue for e in events}))
    returned = sum(e.returned for e in events)
    head = (f"AMQP source: the broker timed out this query's consumer on {queues} ({events[-1].cause}): a "
            f"delivery stayed unacked longer than the broker's consumer timeout allows, and {returned} "
            "message(s) this query had received went back to the queue. ")
    if journal:
        return head + ("Those of batches already journaled are dropped when they come back (journalPath); "
                       "the rest are read once.")
    return head + (
        "Those in batches Spark has already run will be read again. The source acks a batch at the first "
        "trigger after its commit, so a trigger interval plus a batch's run time longer than the timeout "
        "causes this. Fixes: set journalPath (each batch is acked as soon as its journal file is written, "
        "and redelivered copies are dropped); or a trigger interval well under the timeout; or a longer "
        "timeout: consumer_timeout in rabbitmq.conf, or on RabbitMQ 4.x quorum queues the option "
        "consumerTimeout (or the queue argument x-consumer-timeout, or a policy's consumer-timeout). "
        "onConsumerTimeout=continue keeps the query running and reads those messages again.")


def journal_part(consumer: QueueConsumer) -> int:
    """Driver: the deliveries of one part of a batch that fills part by part: JOURNAL_PART, and no more than
    half the prefetch (a full window sends nothing until its acks)."""
    return max(1, min(JOURNAL_PART, consumer.prefetch // 2))


def wait_to_fill(consumer: QueueConsumer, cap: int) -> None:
    """Driver: wait, as an availableNow batch does, until `cap` deliveries are pending (FILL_WAIT for the
    first, then AVAILABLE_NOW_FILL while they keep arriving up to AVAILABLE_NOW_IDLE apart)."""
    if consumer.wait_pending(1, FILL_WAIT):
        consumer.wait_pending(cap, AVAILABLE_NOW_FILL, idle=AVAILABLE_NOW_IDLE)


class ArrowPartition(InputPartition):
    """One slice of a micro-batch: its rows as Arrow IPC bytes (made on the driver, read on an executor),
    and while the driver does not know whether its executors share its JVM, LocalModeProbe's ticket."""

    def __init__(self, data: bytes, probe: tuple[str, str] | None = None):
        super().__init__(None)
        self.data = data
        self.probe = probe


# How long a SIGTERM waits for the reader's stop() before the process ends anyway.
STOP_ON_SIGTERM_TIMEOUT = 5.0


def _stop_on_sigterm(reader) -> None:
    """Driver (Spark's Python source runner, in its main thread). Spark ends the runner with SIGTERM when a
    query stops or fails, without the reader's stop() (measured: stop() never ran after a failed batch);
    here SIGTERM first stops the reader, then ends the process as SIGTERM does. The stop runs in a thread
    of its own, for at most STOP_ON_SIGTERM_TIMEOUT: the signal may have interrupted the main thread
    holding a lock the stop needs (a socket write in progress), and the process must end regardless.

    When the query stops normally, Spark closes the runner's socket and the runner calls stop() itself (in
    its `finally`) while the SIGTERM comes: a stop already running (`reader.stopping`) is left to finish,
    and the runner then exits on its own. (A second stop beside it waited on the first one's locks until
    the timeout, and the kill closed the connection with the batch's deliveries still unacked.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    stopping = []

    def on_sigterm(signum, frame):
        if stopping or reader.stopping:     # Spark may send it twice; the runner may be stopping already
            return
        stopping.append(True)
        stopper = threading.Thread(target=reader.stop, name="spark-amqp stop on SIGTERM", daemon=True)
        stopper.start()
        stopper.join(STOP_ON_SIGTERM_TIMEOUT)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


class _QueueStreamReaderBase(DataSourceStreamReader):
    """What both API generations share: the driver's consumer, the backlog, partitions, commit and stop."""

    SIZED_START = True      # QueueConsumer's sized_start: a small first prefetch until sizes are known
    ACKS_ANSWERED_LATER = True  # journal: the answer behind a commit's acks is taken at the next commit

    def __init__(self, options):
        self.options = options
        self._consumer: QueueConsumer | None = None
        self._latest = 0       # the last batch planned
        self._idle = True      # the last latestOffset planned nothing new
        self._backlog_asked = 0.0
        self._journal: BatchJournal | None = None
        self._acks_sent_through = -1     # journal: the batches acked by the last _ack_through (answer due)
        self._built: dict = {}  # journalPath: record batches built (and journaled) by latestOffset
        self._parts_built: dict = {}  # journalPath: per batch filling part by part, its parts' record batches
        self._handoff: HandoffDir | None = None   # handoffPath (or handoff=auto in local mode): files here
        self._probe: LocalModeProbe | None = None  # handoff=auto: asking whether the executors share our JVM
        # journalPath: ack each batch when its file is durable (ackAt=journal), not at its commit. The default
        # on PySpark 4.2+; on 4.0/4.1, whose runs end without telling the source their last batch committed,
        # the driver-kill fault test left one more journal file per run with it: there only when asked for.
        ack_at = options.get("ackAt") or ("journal" if ADMISSION_CONTROL else "commit")
        self._acks_at_journal = bool(options.get("journalPath")) and ack_at == "journal"
        self._asked_at: float | None = None   # when latestOffset was last called (time.monotonic)
        self._triggers_far_apart = False       # pause the consumers between triggers (see _trigger_starts)
        self._broker_timed_out = False         # the broker has timed out a consumer of this query
        self._timeouts_reported = 0            # consumer timeouts logged so far (the first in full)
        self._timeouts_returned = 0            # messages those timeouts sent back to the queues
        self.stopping = False                  # stop() has started (see _stop_on_sigterm)

    def __getstate__(self):
        """Executors get the options only: the consumer (a socket) stays on the driver."""
        return dict(type(self)(self.options).__dict__)

    # --- driver ------------------------------------------------------------------------------------

    def _session(self) -> QueueConsumer:
        """The driver's consumer, connected on first use (errors here fail the query with a clear text).
        Its consumers start with the first batch taken, so that an availableNow count is exact."""
        if self._consumer is None:
            _stop_on_sigterm(self)
            if self.options.get("journalPath") and self._journal is None:
                self._journal = BatchJournal(self.options["journalPath"])
                self._journal.load()
            if self.options.get("handoffPath") and self._handoff is None:
                self._handoff = HandoffDir(self.options["handoffPath"])
            elif self.options.get("handoff") == "auto" and self._handoff is None and self._probe is None:
                self._probe = LocalModeProbe()
            gc_tuning.for_message_holding_process()   # this process runs only the source (Spark's runner)
            consumer = QueueConsumer(self.options, journal=self._journal, sized_start=self.SIZED_START)
            consumer.connect(consume=False)
            self._consumer = consumer
        return self._consumer

    def _planned(self, batch: Batch) -> None:
        """Driver, in latestOffset, for a batch with rows, before its offset is returned to Spark: with
        journalPath, its rows are written durably now (the file every later attempt is served from), unless
        it filled part by part (`_fill_in_parts`: its parts are written and acked already)."""
        if self._journal is None:
            return
        parts = self._parts_built.pop(batch.seq, None)
        if parts is not None:     # filled part by part: every part is journaled and acked already
            self._built[batch.seq] = arrow_rows.concat(parts)
            self._consumer.ack_through(batch.seq)
            return
        record_batch, keys = self._keyed_rows(batch.parts)
        self._journal.record(batch.seq, record_batch, keys, self._consumer.generation)
        self._built[batch.seq] = record_batch
        if self._acks_at_journal:
            # The file is durable: every later attempt of this batch is served from it, so the broker need
            # hold its deliveries no longer. Batches are planned in order, so this acks every batch so far;
            # the journal lets go of the file once the batch is committed and the broker answered the acks.
            self._consumer.ack_through(batch.seq)

    def _trigger_starts(self) -> None:
        """Driver, as latestOffset starts, before any ack: report the broker's consumer timeouts since the
        last trigger (`_report_timeouts`: the query may fail here), and decide whether the consumers pause
        after this trigger: when triggers come PAUSE_BETWEEN_TRIGGERS or more apart, and from the broker's
        first consumer timeout on (the interval is then too long for it, whatever its length: consumers
        that went on between triggers would be timed out again at every one, and each trigger, starting on
        a fresh consumer, would take almost nothing while the backlog grew)."""
        consumer = self._session()
        consumer.check_timeouts()
        if consumer.timeouts:
            self._broker_timed_out = True
            consumer.consuming = False      # the channels are gone: _resume starts and fills anew
        self._report_timeouts(consumer)
        now = time.monotonic()
        far_apart = self._asked_at is not None and now - self._asked_at >= PAUSE_BETWEEN_TRIGGERS
        self._triggers_far_apart = far_apart or self._broker_timed_out
        self._asked_at = now

    def _resume(self, consumer: QueueConsumer, cap: int) -> None:
        """Driver: consumers paused between triggers start again, and the batch waits for what the queues
        held ready as they start (at most `cap`), not for messages still being published: a batch that
        waited for a steady trickle would hold its first deliveries for the whole fill wait."""
        if self._triggers_far_apart and not consumer.consuming:
            ready = consumer.ready_count()
            consumer.start_consuming()
            if ready:
                wait_to_fill(consumer, min(cap, ready))

    def _trigger_ends(self, available_now: bool = False) -> None:
        """Driver, as latestOffset returns: report the broker's consumer timeouts (`_report_timeouts`), and
        between triggers far apart stop the consumers until the next one (`QueueConsumer.pause`)."""
        consumer = self._consumer
        if consumer is None:
            return
        self._report_timeouts(consumer)
        if self._triggers_far_apart and consumer.consuming and not available_now:
            released = consumer.pause()
            log.info("AMQP source: triggers come %.0f s or more apart: consumers paused until the next one "
                     "(%d delivery(ies) handed back)", PAUSE_BETWEEN_TRIGGERS, released)

    def _report_timeouts(self, consumer: QueueConsumer) -> None:
        """Driver: the broker timed out a consumer (RabbitMQ's consumer timeout). Without a journal and with
        onConsumerTimeout=fail (the default) the query fails, saying why and what fixes it: going on would
        read again, silently, messages already read, and again at every trigger while the interval stays
        too long. Otherwise the report is logged (in full the first time) and the query goes on."""
        events, consumer.timeouts = consumer.timeouts, []
        if not events:
            return
        report = consumer_timeout_report(events, journal=self._journal is not None)
        if self._journal is None and self.options.get("onConsumerTimeout", "fail") == "fail":
            raise ConsumerTimeoutError(report)
        if self._timeouts_reported:
            log.warning("AMQP source: the broker timed out this query's consumer again (%d time(s) so far): "
                        "%d message(s) went back to the queue", self._timeouts_reported + len(events),
                        sum(e.returned for e in events))
        else:
            log.warning("%s", report)
        self._timeouts_reported += len(events)
        self._timeouts_returned += sum(e.returned for e in events)

    def _ack_through(self, seq: int) -> None:
        """Driver: batches through `seq` are committed; ack them. With the journal, the broker's answer behind
        the acks is taken at the next call (`QueueConsumer.confirm_acks`; at once if not
        ACKS_ANSWERED_LATER), and the journal lets go of the files of the batches whose acks it answered."""
        consumer = self._consumer
        if self._journal is not None:
            consumer.confirm_acks()
        consumer.ack_through(seq)
        if self._journal is not None:
            answered_through = self._acks_sent_through     # the batches whose acks the broker has answered
            if not self.ACKS_ANSWERED_LATER:
                consumer.confirm_acks()
                answered_through = seq
            for done in [s for s in self._built if s <= seq]:
                del self._built[done]
            if len(consumer.fresh_in) == len(consumer.queues):
                self._journal.expire(min(consumer.fresh_in.values()))
            self._journal.settle(answered_through)
            self._acks_sent_through = seq
        if self._handoff is not None:
            self._handoff.committed(seq)

    def initialOffset(self) -> dict:
        """Driver. A new query starts at batch 0; connecting here reports bad options at once."""
        self._session()
        return {"seq": 0}

    def _batch_cap(self, max_rows: int | None, in_parts: bool = False) -> int:
        """Driver: how many deliveries the next batch takes, at most `max_rows` (bounds.bounds; `in_parts`:
        a batch that fills part by part)."""
        return self._session().batch_size(max_rows, in_parts)

    def _keyed_rows(self, parts: list):
        """Driver, journalPath: the rows of `parts` (taken from the broker) as a record batch, and their
        journal keys (also set on each part, for the journal's accounting of their acks). The build is
        Python work on deliveries already taken, so the reader thread pauses (as in `_building`); the
        journal's write and its fsync after it do not. In the read benchmark with --journal (1,000,000 x
        100 B, embedded broker, alternating) `latestOffset` went from 5.5-5.6 to 4.8-4.9 s and the rate
        from 112,835-114,638 to 118,454-122,194 msg/s."""
        deliveries = deliveries_by_queue(parts)
        with self._consumer.reading_paused():
            record_batch = arrow_rows.to_record_batch(deliveries)
            keys = batch_keys(record_batch, deliveries)
            at = 0
            for part in parts:
                part.keys = keys[at:at + len(part.deliveries)]
                at += len(part.deliveries)
        return record_batch, keys

    def _journal_part(self, seq: int, parts: list) -> None:
        """Driver, journalPath with acks at the journal write: `parts`, just added to batch `seq` as it
        fills, are journaled as the batch's next file and acked at once; their bodies are let go (their rows
        are in the file and in the record batch kept for the batch)."""
        record_batch, keys = self._keyed_rows(parts)
        built = self._parts_built.setdefault(seq, [])
        self._journal.record(seq, record_batch, keys, self._consumer.generation, part=len(built))
        built.append(record_batch)
        self._consumer.ack_taken(seq)
        let_go_bodies(deliveries_by_queue(parts))

    def reportLatestOffset(self) -> dict | None:
        """Driver, every trigger (PySpark >= 4.2): what the query's progress shows as this source's
        `latestOffset`: the last batch planned and, per queue, the backlog (`ready` in the broker,
        `unacked`: delivered to this query and not yet acked, `held`: received, not yet in a batch), and
        once the broker has timed out a consumer, `consumerTimeouts`: how many times and how many messages
        went back to the queues with them."""
        if self._consumer is None:
            return None
        now = time.monotonic()
        ask = self._idle or now - self._backlog_asked >= BACKLOG_REFRESH
        if ask:
            self._backlog_asked = now
        report = {"seq": self._latest, "queues": self._consumer.backlog(ask_broker=ask)}
        if self._timeouts_reported:
            report["consumerTimeouts"] = {"count": self._timeouts_reported, "returned": self._timeouts_returned}
        return report

    def _batch_partitions(self, seq: int) -> list:
        """Driver. Batch `seq` as Arrow partitions. A batch this process never planned was planned by a run
        that stopped before its commit: it is taken again from what the broker redelivers."""
        consumer = self._session()
        batch = consumer.batches.get(seq)
        record_batch = self._built.get(seq)
        if batch is None and record_batch is None and self._journal is not None:
            record_batch = self._from_journal(seq)
        if batch is None and record_batch is None:
            batch = consumer.take(seq, self._batch_cap(self.options.get("maxMessagesPerTrigger")), REPLAY_WAIT)
            self._replayed(batch.count)
        if self._handoff is None and self._probe is not None and self._probe.answered():
            self._local_mode_found()
        if record_batch is None and not batch.count:
            return []
        with self._building():
            return self._partitions_of(seq, batch, record_batch)

    def _building(self):
        """Driver: the block in which `partitions()` builds a batch already taken: the consumer's reader
        thread pauses (`QueueConsumer.reading_paused`), so that the build has the GIL to itself while Spark
        waits for it. The next deliveries wait in the socket meanwhile, and the reader catches up while
        Spark runs the batch's tasks. In the read benchmark (1,000,000 x 100 B, embedded broker, queries
        alternating in one Spark session) `addBatch` went from 3.0-3.2 to 2.5-2.9 s and the rate from
        167,168-183,102 to 176,702-190,801 msg/s. Not with files on a remote filesystem (`handoffPath`
        s3://, hdfs://, ...): there the build waits on the network, and the reader should read meanwhile."""
        if self._consumer is None or (self._handoff is not None and not self._handoff.local):
            return contextlib.nullcontext()
        return self._consumer.reading_paused()

    def _partitions_of(self, seq: int, batch: Batch | None, record_batch) -> list:
        """Driver: batch `seq` (taken from the broker, or its `record_batch` from the journal) as Arrow
        partitions: handoff files, or the rows inside the partitions."""
        if record_batch is None:
            if batch.handed_off and (self._handoff is None or seq not in self._handoff.files):
                raise RuntimeError(f"AMQP source: batch {seq} was handed off as files, and they are gone; "
                                   "restart the query (its deliveries go back to the queue)")
            if self._handoff is not None:
                files = self._to_files(seq, lambda: self._handoff_deliveries(seq, batch))
                if files is not None:
                    return files
            record_batch = arrow_rows.to_record_batch(batch.deliveries)
        if not record_batch.num_rows:
            return []
        rows = arrow_rows.rows_per_slice(record_batch, ROWS_PER_PARTITION, PARTITION_BYTES)
        if self._handoff is not None:
            files = self._to_files(seq, lambda: self._handoff.partitions(seq, record_batch, rows))
            if files is not None:
                return files
        ticket = self._probe.ticket() if self._probe is not None else None
        return [ArrowPartition(arrow_rows.serialize(record_batch.slice(offset, rows)), ticket)
                for offset in range(0, record_batch.num_rows, rows)]

    def _handoff_deliveries(self, seq: int, batch: Batch) -> list:
        """Driver: batch `seq`, taken from the broker, as handoff files built slice by slice, each slice's
        bodies let go once its file is written (the batch stays held for its acks). While it is written this
        process holds what is not yet in files and one slice of it as Arrow, beside the next batch's
        deliveries arriving; while Spark runs it, only those. That peak is what bounds the batch size
        (`maxBytesPerTrigger`) the source process's memory allows, and larger batches cost Spark less per
        message. A write that fails part way puts the bodies back from the files written, for the inline
        fallback (`_to_files`)."""
        if seq not in self._handoff.files:
            rows = arrow_rows.slice_rows(batch.count, batch.body_bytes(), ROWS_PER_PARTITION, PARTITION_BYTES)
            written = []        # the slices in files so far, their bodies let go

            def slices():
                for run in arrow_rows.in_slices(batch.deliveries, rows):
                    yield arrow_rows.to_record_batch(run)
                    written.append(run)         # resumed by write() once the slice is in its file
                    let_go_bodies(run)

            try:
                self._handoff.write(seq, slices())
            except OSError:
                self._put_back(seq, written)
                raise
            batch.handed_off = True
        return self._handoff.files[seq]

    def _put_back(self, seq: int, written: list) -> None:
        """Driver: the bodies of batch `seq`'s slices in `written`, read back from their files."""
        try:
            for run, bodies in zip(written, self._handoff.bodies(seq, len(written)), strict=True):
                put_back_bodies(run, bodies)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"AMQP source: batch {seq}'s handoff files under {self._handoff.base} could be "
                               f"neither completed nor read back ({exc}); restart the query (its deliveries "
                               "go back to the queue)") from None

    def _to_files(self, seq: int, write) -> list | None:
        """Driver: `write()` batch `seq`'s handoff files and return them; if the directory is our own
        (handoff=auto) and a write fails, None, with a warning, and no more handoff (the user's handoffPath
        fails the query: they must know)."""
        try:
            return write()
        except OSError as exc:
            if not self._handoff.owned:
                raise
            log.warning("AMQP source: cannot write batch %s under %s (%s); batches go inside Spark's "
                        "tasks from now on", seq, self._handoff.base, exc)
            self._handoff.close()
            self._handoff = None
            return None

    def _local_mode_found(self) -> None:
        """Driver (handoff=auto): an executor answered the probe, so every executor is this JVM; later
        batches go through files under Spark's local directory, as with handoffPath."""
        probe, self._probe = self._probe, None
        probe.close()
        self._handoff = probe.handoff_dir()
        if self._handoff is not None:
            log.info("AMQP source: the executors run in the driver's JVM (local mode); batches go to them as "
                     "files under %s (option handoff=inline keeps them inside the tasks)", self._handoff.base)

    def _from_journal(self, seq: int):
        """Driver: batch `seq` as an earlier run journaled it (None if it did not), kept until its commit
        (Spark may ask for a batch's partitions more than once)."""
        record_batch = self._journal.rows(seq)
        if record_batch is not None:
            log.info("AMQP source: batch %s re-planned: %d row(s) from the journal", seq, record_batch.num_rows)
            self._built[seq] = record_batch
        return record_batch

    def _replayed(self, count: int) -> None:
        """Driver: a batch of `count` deliveries was taken from the broker's redeliveries for a batch
        planned by an earlier run. (A batch served from the journal takes nothing from the broker: its
        messages' redelivered copies, if any come, are counted as `QueueConsumer.copies_dropped`.)"""

    def commit(self, end: dict) -> None:
        """Driver. Spark finished the batch ending at `end`: the same signal latestOffset acted on."""
        if self._consumer is not None:
            self._ack_through(int(end["seq"]))

    def stop(self) -> None:
        """Driver, when the query stops. Unacked deliveries go back to the queue (redelivered=true): first
        those in no batch (uncounted by a quorum queue's delivery limit on RabbitMQ 4.x), then, as the
        connection closes, those of batches planned and not committed (counted)."""
        self.stopping = True
        if self._handoff is not None:        # first: Spark may end this process soon after calling stop
            self._handoff.close()
            self._handoff = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._consumer is not None:
            try:
                self._consumer.release_held()
                if self._journal is not None:   # the last commit's acks: their files go if the broker took them
                    self._consumer.confirm_acks()
                    self._journal.settle(self._acks_sent_through)
            finally:
                self._consumer.close()
                self._consumer = None

    # --- executors -----------------------------------------------------------------------------------

    def read(self, partition: ArrowPartition):
        """Executor. Yields the partition's rows as Arrow record batches (no broker access here)."""
        if isinstance(partition, FilePartition):
            yield from read_file(partition)
            return
        answer_probe(partition.probe)
        yield from arrow_rows.in_jvm_batches(arrow_rows.deserialize(partition.data))


class LegacyQueueStreamReader(_QueueStreamReaderBase):
    """The source on PySpark 4.0 and 4.1, whose `latestOffset()` takes no start and no read limit.

    Acks: every batch handed to `partitions()` is committed by the time Spark calls `latestOffset()` again
    (synchronous progress tracking; asynchronous progress tracking is not supported by Python sources).
    Batch size: `maxMessagesPerTrigger` is applied here, as 4.2's read limits would. availableNow: 4.0 and
    4.1 run it as a single batch unless `spark.sql.streaming.triggerAvailableNowWrapper.enabled` is true,
    and either way the source cannot see the trigger; a batch that ends the run is acked only if Spark
    calls `latestOffset()` once more (the wrapper does), else it is redelivered to the next run."""

    SIZED_START = False     # under availableNow the first batch is the whole run: it must be full-sized
    # A restart on these versions may serve a committed batch's file that still has its uncommitted name
    # (docs/source.md, journalPath's limits), so each commit waits for the broker's answer behind its acks
    # and the journal renames or removes the batch's file at once.
    ACKS_ANSWERED_LATER = False

    def __init__(self, options):
        super().__init__(options)
        self._known = None     # the highest batch number returned, planned by Spark, or run (None: unknown)
        self._handed = -1      # the highest batch handed to partitions(): committed at the next latestOffset

    def initialOffset(self) -> dict:
        """Driver. A new query starts at batch 0."""
        offset = super().initialOffset()
        self._known = max(self._known or 0, 0)
        return offset

    def latestOffset(self) -> dict:
        """Driver, every trigger. Acks what earlier triggers ran, then plans the next batch from what has
        arrived; returns the last batch's offset when there is nothing new."""
        consumer = self._session()
        self._trigger_starts()
        self._ack_through(self._handed)
        planned = [s for s in consumer.batches if s > self._handed]
        if self._journal is not None:
            # Journaled by a run that died before Spark logged the offset: that batch comes next.
            planned += [s for s in self._journal.uncommitted() if s > (self._known or -1) and s > self._handed]
        if planned:
            # Asked again before the planned batch ran: the same batch, not a second one.
            end = max(planned)
        else:
            seq = max(int(time.time() * 1000), (self._known or 0) + 1)
            cap = self._batch_cap(self.options.get("maxMessagesPerTrigger"))
            if not consumer.consuming:
                # The first batch of a run (or after a pause between triggers far apart): let the
                # deliveries the consumers start now fill it, for an availableNow run (one batch on these
                # versions) reads this batch and no other.
                consumer.start_consuming()
                consumer.wait_pending(cap, FILL_WAIT)
            batch = consumer.take(seq, cap)
            if batch.count:
                self._planned(batch)
                end = seq
            else:
                consumer.batches.pop(seq, None)
                end = self._known if self._known is not None else 0
        self._idle = end == self._latest
        self._known = max(self._known or 0, end)
        self._latest = max(self._latest, end)
        self._trigger_ends()
        return {"seq": end}

    def partitions(self, start: dict, end: dict):
        """Driver. The batch ending at `end` (batch numbers are not consecutive here: see the module's
        docstring). Spark also calls this with start == end for the last committed batch when a query
        restarts from its checkpoint: that names the number to continue above."""
        seq = int(end["seq"])
        self._known = max(self._known or 0, seq)
        if int(start["seq"]) == seq:
            return []
        self._handed = max(self._handed, seq)
        return self._batch_partitions(seq)

    def stop(self) -> None:
        """Driver, when the query stops. A batch that ran and was never followed by a latestOffset() may
        or may not be committed; its deliveries are released and the broker redelivers them."""
        if self._consumer is not None:
            unsure = sum(b.count for s, b in self._consumer.batches.items() if s <= self._handed)
            if unsure:
                log.warning("AMQP source: %d message(s) of the last batch are released unacked (PySpark < 4.2 "
                            "does not tell a source that its last batch committed); the broker redelivers "
                            "them to the next run. Under availableNow set "
                            "spark.sql.streaming.triggerAvailableNowWrapper.enabled=true", unsure)
        super().stop()


if ADMISSION_CONTROL:
    class QueueStreamReader(_QueueStreamReaderBase, SupportsTriggerAvailableNow):
        """The source on PySpark >= 4.2: `latestOffset(start, limit)`, read limits and availableNow."""

        def __init__(self, options):
            super().__init__(options)
            self._available_now_left: int | None = None
            self._copies_counted = 0       # consumer.copies_dropped already taken off _available_now_left
            self._barrier_done = False
            # The prefill: while Spark runs a batch, a thread fills the next one (`_prefill`).
            self._prefill_thread: threading.Thread | None = None   # (and no Event here: the reader is pickled)
            self._prefill_stop: threading.Event | None = None
            self._prefill_error: BaseException | None = None
            self._prefilled: int | None = None     # the batch the prefill took parts into, not yet planned

        def getDefaultReadLimit(self):
            """Driver. `maxMessagesPerTrigger` bounds each batch."""
            return default_read_limit(self.options)

        def prepareForTriggerAvailableNow(self) -> None:
            """Driver, once at the start of an availableNow run (before any batch is taken): count what is
            there to drain. Counted before the consumers start, the count is exact: a count taken while the
            broker is pushing deliveries misses those on the wire, and the run would end that many short."""
            consumer = self._session()
            self._available_now_left = consumer.ready_count()
            self._copies_counted = consumer.copies_dropped
            self._barrier_done = False
            log.info("AMQP source: availableNow run will read %s messages", self._available_now_left)

        def latestOffset(self, start: dict, limit) -> dict:
            """Driver, every trigger. Acks through `start` (committed), then plans the next batch from what
            has arrived; returns `start` when there is nothing new."""
            self._stop_prefill()
            self._trigger_starts()
            end = self._latest_offset(start, limit)
            self._idle = end == start
            self._latest = max(self._latest, int(end["seq"]))
            self._trigger_ends(available_now=self._available_now_left is not None)
            return end

        def _latest_offset(self, start: dict, limit) -> dict:
            consumer = self._session()
            seq = int(start["seq"])
            self._ack_through(seq)
            if self._prefilled != seq + 1:      # (the prefill's parts of batch seq + 1: it goes on filling)
                if seq + 1 in consumer.batches or seq + 1 in self._built:
                    # Asked again from the same start before that batch ran: the same batch, not a second one
                    # (a second would strand the first one's deliveries unacked until the connection closes).
                    return {"seq": seq + 1}
                if self._journal is not None and self._from_journal(seq + 1) is not None:
                    # Journaled by a run that died before Spark logged its offset: that batch is this one.
                    return {"seq": seq + 1}
            cap = self._batch_cap(max_rows(limit))
            if self._available_now_left is not None:
                if self._available_now_left <= 0:
                    if not self._barrier_done:
                        self._barrier_done = True
                        consumer.take(seq + 1, 0)            # the empty "ack barrier" batch
                        return {"seq": seq + 1}
                    return start
                cap = min(cap, self._available_now_left)
                batch = self._take_available_now(consumer, seq + 1, cap, max_rows(limit))
                self._count_copies(consumer)
            else:
                self._resume(consumer, cap)
                batch = consumer.take(seq + 1, cap)
            if not batch.count:
                consumer.batches.pop(seq + 1, None)
                if self._available_now_left is not None:   # drained: end with the barrier
                    self._available_now_left = 0
                    return self._latest_offset(start, limit)
                return start
            if self._available_now_left is not None:
                self._available_now_left -= batch.count
            self._planned(batch)
            return {"seq": seq + 1}

        def _take_available_now(self, consumer: QueueConsumer, seq: int, cap: int, limit_rows: int | None):
            """Under availableNow the count taken at the start is a ceiling, not a promise (it can count a
            message twice while it moves from the queue to our buffer): the run is drained once nothing
            arrives and the broker reports the queues empty, or nothing arrived for AVAILABLE_NOW_WAIT. The
            run's first batch is sized by its first deliveries (`QueueConsumer.fit_prefetch_to_pending`).
            With journalPath and acks at the journal write the batch fills part by part (`_fill_in_parts`)."""
            if self._prefilled == seq:     # its first parts are journaled and acked already
                self._prefilled = None
                batch = consumer.batches[seq]
                cap = min(self._batch_cap(limit_rows, True), self._available_now_left)
                self._fill_in_parts(consumer, batch, cap, first_journaled=True)
                return batch
            consumer.start_consuming()
            in_parts = self._acks_at_journal
            fitted = consumer.wait_pending(1, FILL_WAIT) and consumer.fit_prefetch_to_pending()
            if fitted or in_parts:
                cap = min(self._batch_cap(limit_rows, in_parts), self._available_now_left)
            first = min(cap, journal_part(consumer)) if in_parts else cap
            wait_to_fill(consumer, first)
            deadline = time.monotonic() + AVAILABLE_NOW_WAIT
            while True:
                batch = consumer.take(seq, first, wait=0.2)
                if batch.count or time.monotonic() > deadline:
                    break
                if consumer.ready_count() == 0:
                    # Empty queues; what the broker already sent is on its way: one last look.
                    batch = consumer.take(seq, first, wait=IN_FLIGHT_WAIT)
                    break
            if in_parts and batch.count:
                self._fill_in_parts(consumer, batch, cap)
            return batch

        def _fill_in_parts(self, consumer: QueueConsumer, batch, cap: int, first_journaled: bool = False) -> None:
            """Driver, availableNow with journalPath and acks at the journal write: batch `batch` (its first
            part taken) goes on filling JOURNAL_PART deliveries at a time, each part journaled and acked as
            it comes (`_journal_part`), until it holds `cap`, or for AVAILABLE_NOW_FILL seconds while
            deliveries keep arriving up to AVAILABLE_NOW_IDLE apart. The consumers never stop with their
            window full, which is what slows RabbitMQ's queue process, and the batch is not bounded by the
            prefetch. A run killed part way leaves the parts journaled so far: the next run serves them as
            this batch, and drops their messages' redelivered copies. (`first_journaled`: the prefill took
            and journaled its first parts.)"""
            if not first_journaled:
                self._journal_part(batch.seq, batch.parts)
            deadline = time.monotonic() + AVAILABLE_NOW_FILL
            part = journal_part(consumer)
            while batch.count < cap and time.monotonic() < deadline:
                want = min(part, cap - batch.count)
                if not consumer.pending() and not consumer.wait_pending(1, AVAILABLE_NOW_IDLE):
                    break
                consumer.wait_pending(want, max(0.0, deadline - time.monotonic()), idle=AVAILABLE_NOW_IDLE)
                parts = consumer.take_more(batch.seq, want)
                if not parts:
                    break
                self._journal_part(batch.seq, parts)

        def partitions(self, start: dict, end: dict):
            """Driver. The batch in (start, end] (one per planned offset) as Arrow partitions; then, while
            Spark runs it, the next batch starts filling (`_start_prefill`)."""
            self._stop_prefill()
            parts = [part for seq in range(int(start["seq"]) + 1, int(end["seq"]) + 1)
                     for part in self._batch_partitions(seq)]
            self._start_prefill(int(end["seq"]) + 1)
            return parts

        def commit(self, end: dict) -> None:
            """Driver. As the base's, once the prefill has stopped (`_stop_prefill`)."""
            self._stop_prefill()
            super().commit(end)

        def reportLatestOffset(self) -> dict | None:
            """Driver. As the base's, once the prefill has stopped (`_stop_prefill`)."""
            self._stop_prefill()
            return super().reportLatestOffset()

        def stop(self) -> None:
            """Driver. As the base's, once the prefill has stopped; the query is stopping, so an error the
            prefill had is not raised here (the parts it journaled are served by the next run)."""
            with contextlib.suppress(Exception):
                self._stop_prefill()
            super().stop()

        def _start_prefill(self, seq: int) -> None:
            """Driver, as `partitions()` hands Spark a batch of an availableNow run with journalPath and acks
            at the journal write: a thread fills batch `seq`, the next one, part by part (each part journaled
            and acked, as `_fill_in_parts` does) while Spark runs this one, so that the consumers keep
            flowing and the broker never waits on a full window between batches. It stops at the next call
            Spark makes (`_stop_prefill`); latestOffset then goes on filling that batch."""
            left = self._available_now_left
            if (not self._acks_at_journal or not left or left <= 0 or self._consumer is None
                    or self._prefilled is not None or seq in self._consumer.batches or seq in self._built
                    or seq in self._journal.names):
                return
            cap = min(self._batch_cap(self.options.get("maxMessagesPerTrigger"), True), left)
            self._prefill_stop = threading.Event()
            self._prefill_thread = threading.Thread(target=self._prefill, args=(seq, cap), daemon=True,
                                                    name="spark-amqp prefill")
            self._prefill_thread.start()

        def _prefill(self, seq: int, cap: int) -> None:
            """Driver, the prefill's thread (`_start_prefill`): takes parts into batch `seq` until it holds
            `cap` or `_stop_prefill` asks it to stop; an error is raised again by `_stop_prefill`."""
            consumer = self._consumer
            part = journal_part(consumer)
            try:
                while not self._prefill_stop.is_set():
                    batch = consumer.batches.get(seq)
                    have = batch.count if batch is not None else 0
                    if have >= cap:
                        return
                    want = min(part, cap - have)
                    if not consumer.wait_pending(want, PREFILL_POLL, idle=AVAILABLE_NOW_IDLE):
                        continue
                    if self._prefill_stop.is_set():
                        return
                    if batch is None:
                        batch = consumer.take(seq, want)
                        if not batch.count:
                            consumer.batches.pop(seq, None)
                            continue
                        self._prefilled = seq
                        self._journal_part(seq, batch.parts)
                    else:
                        parts = consumer.take_more(seq, want)
                        if parts:
                            self._journal_part(seq, parts)
            except BaseException as exc:     # raised again in the thread Spark calls (_stop_prefill)
                self._prefill_error = exc

        def _stop_prefill(self) -> None:
            """Driver, first in every call from Spark: the prefill's thread stops after the part it is on, so
            that only one thread uses the consumer; its error, if it had one, is raised here."""
            thread = self._prefill_thread
            if thread is None:
                return
            self._prefill_stop.set()
            thread.join()
            self._prefill_thread = None
            error, self._prefill_error = self._prefill_error, None
            if error is not None:
                raise error

        def _replayed(self, count: int) -> None:
            if self._available_now_left is not None:
                self._available_now_left -= count   # counted at the start of the run

        def _count_copies(self, consumer: QueueConsumer) -> None:
            """Driver (journalPath, availableNow): the redelivered copies of journaled messages dropped since
            the run's count were in that count and will never be in a batch: the run has that many fewer to
            wait for. (Whether a journaled batch's messages come back depends on whether the broker took its
            acks before the crash: with acks at the journal write, usually not.)"""
            if self._available_now_left is not None:
                self._available_now_left -= consumer.copies_dropped - self._copies_counted
                self._copies_counted = consumer.copies_dropped
else:
    QueueStreamReader = LegacyQueueStreamReader
