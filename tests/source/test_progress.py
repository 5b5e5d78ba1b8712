"""The query's progress shows the source's backlog (reportLatestOffset, PySpark >= 4.2): per queue, the
messages ready in the broker, delivered to the query and not yet acked, and held (received, not yet in a
batch), next to the last batch planned."""

from __future__ import annotations

import json

from source_helpers import Collector, checkpoint, needs_admission_control, stream
from waiting import wait_until


def source_progress(query) -> list[dict]:
    """Each progress event's source latestOffset, parsed, with its batch id and rows."""
    out = []
    for p in query.recentProgress:
        latest = p["sources"][0]["latestOffset"]
        if latest:
            out.append({"batch": p["batchId"], "rows": p["numInputRows"], **json.loads(latest)})
    return out


@needs_admission_control
def test_progress_shows_the_backlog_per_queue(spark, env, tmp_path):
    total = 50
    q = env.queue("progress")
    env.publish(q, [f"m{i}" for i in range(total)])
    sink = Collector()
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=10, prefetch=20).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds")
             .start())
    wait_until(lambda: len(sink.rows) >= total or query.exception(), 60, interval=0.1, message="all rows")
    assert query.exception() is None

    def drained():
        events = source_progress(query)
        return events and events[-1]["queues"][q] == {"ready": 0, "unacked": 0, "held": 0}
    # the last batch is acked one trigger after its commit; an idle trigger then reports an empty backlog
    wait_until(drained, 30, interval=0.2, message="a progress event with an empty backlog")

    events = source_progress(query)
    first = next(e for e in events if e["rows"])
    backlog = first["queues"][q]
    # Nothing is acked before the first batch commits: everything is ready, held, in the batch, or on its
    # way (sent by the broker, so no longer ready there, and not yet received: at most the prefetch's rest).
    assert total - 20 <= backlog["ready"] + backlog["unacked"] <= total, backlog
    assert first["seq"] >= 0 and 0 <= backlog["held"] <= backlog["unacked"] <= 20, backlog   # prefetch 20
    for e in events:
        b = e["queues"][q]
        assert all(isinstance(v, int) and v >= 0 for v in b.values()), e
        assert b["ready"] + b["unacked"] <= total, e
    query.stop()
