"""The broker drops the source's connection mid-query: the query reconnects and keeps running, loses
nothing (at least once), and the queue drains."""

from __future__ import annotations

from source_helpers import Collector, checkpoint, stream
from waiting import wait_until


def test_query_survives_a_connection_cut_and_loses_nothing(spark, env, tmp_path):
    q = env.queue("cut")
    env.publish(q, [f"c{i}" for i in range(20)])
    sink = Collector()
    query = (stream(spark, env.url, q, maxMessagesPerTrigger=5).writeStream.foreachBatch(sink)
             .option("checkpointLocation", checkpoint(tmp_path)).trigger(processingTime="200 milliseconds")
             .start())
    wait_until(lambda: len(sink.rows) >= 5 or query.exception(), 60, interval=0.1, message="a first batch")
    assert query.exception() is None

    cut = env.cut_source_connections()
    assert cut >= 1, "found no connection of the source to cut"
    env.close_publisher()                 # the embedded broker may have cut it too; reopen on next use
    env.publish(q, [f"d{i}" for i in range(10)])

    expected = {f"c{i}".encode() for i in range(20)} | {f"d{i}".encode() for i in range(10)}
    wait_until(lambda: set(sink.bodies()) >= expected or query.exception(), 60, interval=0.1,
               message="every message after the cut")
    assert query.exception() is None, f"the query failed after the connection cut: {query.exception()}"
    assert query.isActive
    assert set(sink.bodies()) == expected
    # The reconnected consumer acks what it took; nothing stays ready or unacked while the query runs.
    env.wait_state(q, (0, 0), timeout=20, query=query)
    query.stop()
