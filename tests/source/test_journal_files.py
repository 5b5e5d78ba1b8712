"""The journal's files across runs (journalPath), on a real directory, without a broker: what an earlier
run left is read back, and what it left half-written goes; and how redelivered copies are matched and
counted before a batch's file goes (the end-to-end faults are in test_faults.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from spark_amqp.client.events import Delivery
from spark_amqp.codec import properties
from spark_amqp.schema import ARROW_SCHEMA
from spark_amqp.source.journal import BatchJournal, delivery_key


def _rows(n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([b"m%d" % i for i in range(n)], pa.binary()) if f.name == "body" else pa.nulls(n, f.type)
         for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)


def test_a_batch_file_a_killed_run_left_unfinished_is_removed_at_load(tmp_path):
    first = BatchJournal(str(tmp_path))
    first.load()
    first.record(7, _rows(3), [b"k0", b"k1", b"k2"], generation=1)
    # A run killed while writing batch 8: its .tmp never became batch 8's file.
    (tmp_path / f"batch-{8:020d}.arrow.tmp").write_bytes(b"half a batch")
    (tmp_path / "notes.tmp").write_bytes(b"not the journal's")

    second = BatchJournal(str(tmp_path))
    assert second.load() == 1
    assert second.uncommitted() == [7]
    assert second.rows(7).column("body").to_pylist() == [b"m0", b"m1", b"m2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"batch-{7:020d}-000000.arrow", "notes.tmp"]


@pytest.fixture
def journal(tmp_path) -> BatchJournal:
    """A new run's journal on an empty directory."""
    journal = BatchJournal(str(tmp_path))
    journal.load()
    return journal


def _copy(message_id: str) -> Delivery:
    """A redelivered message with this message_id, as the client hands it over."""
    d = Delivery(None, "ctag", 1, True, "", "q")
    d.properties_raw = properties.encode({"message_id": message_id})
    return d


def _key(message_id: str) -> bytes:
    return delivery_key("q", _copy(message_id), message_id)


def _files(path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in path.iterdir())


def test_redelivered_copies_are_counted_per_key_and_a_file_goes_once_every_message_is_acked(journal, tmp_path):
    a, b, d = _key("a"), _key("b"), _key("d")
    # Batch 0 came on connection 1, which was lost before its acks: its messages come back redelivered.
    journal.record(0, _rows(3), [a, a, b], generation=1)
    assert journal.claim("q", _copy("a")) == a
    assert journal.claim("q", _copy("b")) == b
    assert journal.claim("q", _copy("c")) is None           # never journaled: a row of the batch taking it
    journal.acked_copies([a, b])
    # Batch 0 is committed (served from its file) and still waits for a's second copy: the file stays,
    # marked committed so that no later run serves it again.
    assert journal.settle(0) == []
    assert _files(tmp_path) == ["committed"]
    assert journal.uncommitted() == []
    # The second copy's ack fails: it is released, comes again and is matched again; a third is not.
    assert journal.claim("q", _copy("a")) == a
    journal.release(a)
    assert journal.claim("q", _copy("a")) == a
    assert journal.claim("q", _copy("a")) is None
    journal.acked_copies([a])
    assert journal.settle(0) == [0]
    assert _files(tmp_path) == []

    # Batch 1 on connection 2, whose acks are in doubt; a queue's first delivery on connection 3 that is not
    # redelivered shows that every copy released earlier has come: batch 1 waits for nothing more.
    journal.record(1, _rows(1), [d], generation=2)
    journal.expire(3)
    assert journal.claim("q", _copy("d")) is None
    assert journal.settle(1) == [1]

    # Batch 2 on the live connection 3, acked whole at its commit: no copy of it is expected any more.
    journal.record(2, _rows(2), [a, d], generation=3)
    journal.acked_batch(2, [[a], [d]], whole=True)
    assert journal.claim("q", _copy("a")) is None
    assert journal.settle(2) == [2]
    assert _files(tmp_path) == []


def test_a_batch_acked_in_part_keeps_its_file_for_the_copies_of_the_rest(journal, tmp_path):
    a, b = _key("a"), _key("b")
    # Two channels: the part on the channel that failed at the ack is redelivered.
    journal.record(0, _rows(2), [a, b], generation=1)
    journal.acked_batch(0, [[a]], whole=False)
    assert journal.settle(0) == []
    assert journal.claim("q", _copy("a")) is None
    assert journal.claim("q", _copy("b")) == b
    journal.acked_copies([b])
    assert journal.settle(0) == [0]
    assert _files(tmp_path) == []


def test_copies_of_a_message_in_two_batches_count_for_each_batch_in_turn(journal, tmp_path):
    a = _key("a")
    # Batches 0 and 1 each hold a message `a` (two equal messages are two) and came on the lost connection 1.
    journal.record(0, _rows(1), [a], generation=1)
    journal.record(1, _rows(1), [a], generation=1)
    assert journal.claim("q", _copy("a")) == a
    assert journal.claim("q", _copy("a")) == a
    journal.acked_copies([a])                  # the first copy's ack counts for batch 0, whose file goes
    assert journal.settle(1) == [0]
    journal.release(a)                         # the second copy's ack failed: it comes again, still matched
    assert journal.claim("q", _copy("a")) == a
    journal.acked_copies([a])
    assert journal.settle(1) == [1]
    assert _files(tmp_path) == []


def test_copies_acked_together_count_for_each_batch_that_holds_their_key(journal):
    a = _key("a")
    journal.record(0, _rows(1), [a], generation=1)
    journal.record(1, _rows(1), [a], generation=1)
    assert [journal.claim("q", _copy("a")) for _ in range(3)] == [a, a, None]
    journal.acked_copies([a, a])
    assert journal.settle(1) == [0, 1]


def _rows_from(start: int, n: int) -> pa.RecordBatch:
    rows = _rows(start + n)
    return rows.slice(start, n)


def test_a_batch_written_in_parts_is_served_whole_and_its_files_go_together(tmp_path):
    """An availableNow batch fills part by part, each part journaled as it arrives: a later run serves the
    parts in order as one batch, matches the copies of any part, and removes every part at once."""
    a, b, c = _key("a"), _key("b"), _key("c")
    first = BatchJournal(str(tmp_path))
    first.load()
    first.record(4, _rows_from(0, 2), [a, b], generation=1, part=0)
    first.record(4, _rows_from(2, 1), [c], generation=1, part=1)
    # Killed while writing the third part: its deliveries were never acked, so they come again as new ones.
    (tmp_path / f"batch-{4:020d}-{2:06d}.arrow.tmp").write_bytes(b"half a part")

    second = BatchJournal(str(tmp_path))
    assert second.load() == 1
    assert second.uncommitted() == [4]
    assert second.rows(4).column("body").to_pylist() == [b"m0", b"m1", b"m2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"batch-{4:020d}-{0:06d}.arrow",
                                                         f"batch-{4:020d}-{1:06d}.arrow"]
    # The first part's acks reached the broker; the second part's copy comes back and is dropped.
    second.acked_batch(4, [[a, b]], whole=False)
    assert second.claim("q", _copy("c")) == c
    assert second.settle(4) == []             # its copy's ack is not answered yet: both parts stay
    assert _files(tmp_path) == ["committed", "committed"]
    assert second.rows(4) is None
    second.acked_copies([c])
    assert second.settle(4) == [4]
    assert _files(tmp_path) == []


def test_a_file_named_without_a_part_is_read_as_the_whole_batch(tmp_path):
    """A journal written before batches had parts: `batch-<seq>.arrow` is the batch's one file."""
    first = BatchJournal(str(tmp_path))
    first.load()
    first.record(9, _rows(2), [_key("a"), _key("b")], generation=1)
    (tmp_path / f"batch-{9:020d}-{0:06d}.arrow").rename(tmp_path / f"batch-{9:020d}.arrow")

    second = BatchJournal(str(tmp_path))
    assert second.load() == 1
    assert second.rows(9).column("body").to_pylist() == [b"m0", b"m1"]
    assert second.claim("q", _copy("b")) == _key("b")


def test_a_batch_whose_files_were_half_renamed_committed_is_never_served(tmp_path):
    """A run killed while it renamed a committed batch's parts: one part says committed, so the batch is."""
    first = BatchJournal(str(tmp_path))
    first.load()
    first.record(3, _rows(1), [_key("a")], generation=1, part=0)
    first.record(3, _rows(1), [_key("b")], generation=1, part=1)
    (tmp_path / f"batch-{3:020d}-{0:06d}.arrow").rename(tmp_path / f"committed-{3:020d}-{0:06d}.arrow")

    second = BatchJournal(str(tmp_path))
    assert second.load() == 1
    assert second.uncommitted() == [] and second.rows(3) is None
    assert second.settle(3) == []             # still waiting for both copies: every part now says committed
    assert _files(tmp_path) == ["committed", "committed"]
