"""The journal's files across runs (journalPath), on a real directory, without a broker: what an earlier
run left is read back, and what it left half-written goes."""

from __future__ import annotations

import pyarrow as pa

from spark_amqp.schema import ARROW_SCHEMA
from spark_amqp.source.journal import BatchJournal


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
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"batch-{7:020d}.arrow", "notes.tmp"]
