"""`df.writeStream.format("amqp")`: a file stream of rows, transformed and published to two queues (routed by
a `routing_key` column), every row arriving exactly once across two availableNow runs of one query; and
the deterministic message ids carry the query id, the micro-batch id, the partition and the row."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest


def write_json(path, start: int, count: int) -> None:
    with open(path, "w") as f:
        for n in range(start, start + count):
            f.write(json.dumps({"n": n, "kind": "even" if n % 2 == 0 else "odd"}) + "\n")


def start_query(spark, src, chk, url, even_queue, odd_queue):
    events = spark.readStream.schema("n long, kind string").json(str(src))
    out = events.selectExpr(
        "CAST(n AS STRING) AS body",
        f"CASE kind WHEN 'even' THEN '{even_queue}' ELSE '{odd_queue}' END AS routing_key",
        "map('n', CAST(n AS STRING), 'kind', kind) AS headers",
        "map('n', 'long') AS header_types",   # 'kind' has no type: a string
        "'application/json' AS content_type",
    )
    return (out.writeStream.format("amqp").option("uri", url).option("messageId", "deterministic")
            .option("checkpointLocation", str(chk)).trigger(availableNow=True).start())


def test_stream_publishes_every_row_exactly_once(spark, broker_url, admin, unique_name, tmp_path):
    even, odd = admin.queue(unique_name("even")), admin.queue(unique_name("odd"))
    src, chk = tmp_path / "in", tmp_path / "chk"
    src.mkdir()
    write_json(src / "a.json", 0, 400)
    write_json(src / "b.json", 400, 400)

    q1 = start_query(spark, src, chk, broker_url, even, odd)
    assert q1.awaitTermination(90), "first availableNow run did not finish"
    assert q1.exception() is None
    write_json(src / "c.json", 800, 300)        # new data for a second run of the same query
    q2 = start_query(spark, src, chk, broker_url, even, odd)
    assert q2.awaitTermination(90), "second availableNow run did not finish"
    assert q2.exception() is None
    assert q2.id == q1.id

    got = {name: admin.drain(name) for name in (even, odd)}
    for name, parity in ((even, 0), (odd, 1)):
        numbers = [int(body) for _, _, body in got[name]]
        assert Counter(numbers) == Counter(n for n in range(1100) if n % 2 == parity), \
            f"{name}: missing or duplicated rows"
        for method, props, body in got[name]:
            assert method.routing_key == name
            assert props.headers == {"n": int(body), "kind": "even" if parity == 0 else "odd"}
            assert props.content_type == "application/json"

    ids = [props.message_id for name in got for _, props, _ in got[name]]
    assert len(set(ids)) == 1100
    pattern = re.compile(rf"{re.escape(q1.id)}:(\d+):(\d+):(\d+)")
    parsed = [pattern.fullmatch(i) for i in ids]
    assert all(parsed), [i for i, m in zip(ids, parsed) if not m][:3]
    batches = Counter(int(m.group(1)) for m in parsed)
    assert sorted(batches) == [0, 1] and batches[0] == 800 and batches[1] == 300
    # within a task, row indexes are 0..n-1
    per_task = Counter((int(m.group(1)), int(m.group(2))) for m in parsed)
    for (batch, part), count in per_task.items():
        rows = sorted(int(m.group(3)) for m in parsed if (int(m.group(1)), int(m.group(2))) == (batch, part))
        assert rows == list(range(count))


def test_stream_with_a_bad_schema_fails_at_start(spark, broker_url, admin, unique_name, tmp_path):
    queue = admin.queue(unique_name("bad"))
    src = tmp_path / "in"
    src.mkdir()
    write_json(src / "a.json", 0, 10)
    events = spark.readStream.schema("n long, kind string").json(str(src))
    bad = events.selectExpr("CAST(n AS STRING) AS body", "kind", "CAST(n AS STRING) AS priority")
    with pytest.raises(Exception) as err:
        q = (bad.writeStream.format("amqp").option("uri", broker_url).option("routingKey", queue)
             .option("checkpointLocation", str(tmp_path / "chk")).trigger(availableNow=True).start())
        q.awaitTermination(60)
        raise AssertionError("the query ran") if q.exception() is None else q.exception()
    msg = str(err.value)
    assert "unknown column(s) for the amqp sink: 'kind'" in msg
    assert admin.depth(queue) == 0


def test_the_routing_options_override_the_rows_columns(spark, broker_url, admin, unique_name, tmp_path):
    """A row read from queue `q` carries routing_key 'q' and exchange ''. Written with the option
    `routingKey` it goes where the option says, not back into `q` (the option overrides the column, as the
    `topic` option of Spark's Kafka sink does); the same for `exchange`."""
    source, out = admin.queue(unique_name("in")), admin.queue(unique_name("out"))
    fanout = admin.exchange(unique_name("fan"), "fanout")
    fanned = admin.queue(unique_name("fanned"))
    admin.ch.queue_bind(fanned, fanout)
    for n in range(50):
        admin.ch.basic_publish("", source, str(n).encode())

    def run(options: dict, name: str):
        writer = (spark.readStream.format("amqp").option("uri", broker_url).option("queue", source).load()
                  .writeStream.format("amqp").option("uri", broker_url)
                  .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True))
        for key, value in options.items():
            writer = writer.option(key, value)
        query = writer.start()
        assert query.awaitTermination(90), "the availableNow run did not finish"
        assert query.exception() is None

    run({"routingKey": out}, "by-key")
    got = admin.drain(out)
    assert sorted(int(body) for _, _, body in got) == list(range(50))
    assert {method.routing_key for method, _, _ in got} == {out}
    assert admin.depth(source) == 0          # read once, acked, and nothing published back into it

    for n in range(50, 60):
        admin.ch.basic_publish("", source, str(n).encode())
    run({"exchange": fanout}, "by-exchange")     # the rows' exchange '' is overridden; their key kept
    got = admin.drain(fanned)
    assert sorted(int(body) for _, _, body in got) == list(range(50, 60))
    assert {(method.exchange, method.routing_key) for method, _, _ in got} == {(fanout, source)}
    assert admin.depth(source) == 0
