"""Stream filtering, differential: the embedded broker as RabbitMQ 4.3 and a RabbitMQ 4.3 node.

A publisher sets the header `x-stream-filter-value`; a consumer asks with `x-stream-filter` (a string or an
array of strings) and `x-stream-match-unfiltered`. Both brokers decide per chunk: a chunk that holds a wanted
value is delivered whole (its other messages too: false positives the client filters out), any other chunk is
skipped, and no match is ever missed.

Chunk layouts. Each test builds the chunks it needs the same way on both brokers:

- one message per confirm round trip: every message is a chunk of its own on both, so filtering is exact;
- a run published at once and confirmed before the next run starts: a chunk never holds two runs on either
  broker (RabbitMQ confirms a message once osiris wrote its chunk; the embedded broker writes a chunk per
  socket read), so runs of one value are delivered exactly;
- values published back to back without waiting: the chunks differ. osiris' writer makes a chunk of what it
  took from its mailbox (measured on 4.3.6: a filter for one of 4 interleaved values delivered about 9,300 of
  10,000, and for runs of 1,000 about 3,400), while the embedded broker makes one chunk per socket read, which
  holds more messages: it delivers more false positives (all 10,000, and about 8,800). Only bounds hold on
  both: every match, nothing beyond what was published.

RabbitMQ keeps a Bloom filter per chunk and the embedded broker the exact set of values, so where a Bloom
filter's hash collision would deliver a chunk without a match, only RabbitMQ does; no test here depends on one.
RabbitMQ 3.10 has no filtering: the last test checks both 3.10 brokers deliver everything.
"""

from __future__ import annotations

import time
import uuid

import pika
import pytest

from brokers import require_rabbitmq
from targets import TARGETS_43, Target, targets_fixture
from spark_amqp.client import Connection
from spark_amqp.codec import properties
from spark_amqp_broker import Broker

from helpers import pika_connect, refusal, safe_close

pytestmark = pytest.mark.timeout(180)

STREAM = {"x-queue-type": "stream"}
VALUES = "abcd"


broker_target = targets_fixture(TARGETS_43)    # this module's brokers: the embedded broker as 4.3 and the 4.3 node


class Streams:
    """Streams of one test on one broker, deleted at teardown; publishes in chosen chunk layouts with the
    package's client (confirm window, pre-encoded properties) and reads with pika consumers."""

    def __init__(self, url: str):
        self.url = url
        self.names: list[str] = []
        self.conn = Connection.open(url)

    def declare(self, arguments=None) -> str:
        name = f"sf-{uuid.uuid4().hex[:10]}"
        self.names.append(name)
        with self.conn.channel() as ch:
            ch.queue_declare(name, durable=True, arguments={**STREAM, **(arguments or {})})
        return name

    def publish(self, stream: str, runs, *, confirm_each_run: bool = True) -> None:
        """`runs`: (value or None, count) pairs. With confirm_each_run a run goes out at once and the next one
        waits for its confirms (no chunk spans two runs); without, all runs go out back to back, as few
        writes as the client makes of them (PUBLISH_GROUP messages a write)."""
        ch = self.conn.channel()
        ch.confirm_select(window=1_000_000)
        batches = [[run] for run in runs] if confirm_each_run else [list(runs)]
        for batch in batches:
            bodies, props = [], []
            for value, n in batch:
                encoded = properties.encode({"headers": {"x-stream-filter-value": value}} if value is not None
                                            else None)
                bodies += [(value or "-").encode()] * n
                props += [encoded] * n
            ch.publish_many("", stream, bodies, props)
            ch.wait_for_confirms(60)
        ch.close()

    def publish_each(self, stream: str, values) -> None:
        """One message per confirm round trip: each is a chunk of its own on both brokers."""
        self.publish(stream, [(v, 1) for v in values])

    def read(self, stream: str, arguments: dict, quiet: float = 1.0):
        """[(offset, filter value)] a consumer from the first offset gets with these consumer arguments,
        once nothing more arrives for `quiet` seconds."""
        conn = pika_connect(self.url)
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=2000)
            got = []

            def on_message(c, m, p, _body):
                got.append((p.headers["x-stream-offset"], p.headers.get("x-stream-filter-value")))
                c.basic_ack(m.delivery_tag)

            ch.basic_consume(stream, on_message, arguments={"x-stream-offset": "first", **arguments})
            seen, since = -1, time.monotonic()
            while len(got) != seen or time.monotonic() - since < quiet:
                if len(got) != seen:
                    seen, since = len(got), time.monotonic()
                conn.process_data_events(0.1)
            return got
        finally:
            safe_close(conn)

    def close(self) -> None:
        try:
            with self.conn.channel() as ch:
                for name in self.names:
                    ch.queue_delete(name)
        finally:
            self.conn.close()


@pytest.fixture
def streams(broker_url):
    s = Streams(broker_url)
    yield s
    s.close()


# ------------------------------------------------------------------------------ declare: x-stream-filter-size-bytes


@pytest.mark.parametrize("value, text", [
    (16, None), (255, None), (15, "Invalid value for x-stream-filter-size-bytes"),
    (256, "Invalid value for x-stream-filter-size-bytes"), (2 ** 40, "Invalid value for x-stream-filter-size-bytes"),
    (-1, "invalid arg 'x-stream-filter-size-bytes' for queue '{q}' in vhost '/': {{value_negative,-1}}"),
    ("20", "invalid arg 'x-stream-filter-size-bytes' for queue '{q}' in vhost '/': \"expected integer, got longstr\""),
    (True, "invalid arg 'x-stream-filter-size-bytes' for queue '{q}' in vhost '/': \"expected integer, got bool\""),
])
def test_filter_size_bytes_is_16_to_255(streams, broker_url, value, text):
    name = f"sf-size-{uuid.uuid4().hex[:8]}"
    conn = pika_connect(broker_url)
    try:
        declare = lambda: conn.channel().queue_declare(name, durable=True, arguments={  # noqa: E731
            **STREAM, "x-stream-filter-size-bytes": value})
        if text is None:
            declare()
            conn.channel().queue_delete(name)
        else:
            assert refusal(declare) == ("channel", 406, "PRECONDITION_FAILED - " + text.format(q=name))
    finally:
        safe_close(conn)


# ------------------------------------------------------------------------------ one message per chunk: exact


# offsets 0..3 hold values "a", none, "b", "" (the empty string counts as unfiltered)
EXACT = [
    ({}, [0, 1, 2, 3]),
    ({"x-stream-filter": "a"}, [0]),
    ({"x-stream-filter": ["a"]}, [0]),
    ({"x-stream-filter": ["b", "a"]}, [0, 2]),
    ({"x-stream-filter": "b", "x-stream-match-unfiltered": True}, [1, 2, 3]),
    ({"x-stream-filter": "zz"}, []),
    ({"x-stream-filter": "zz", "x-stream-match-unfiltered": True}, [1, 3]),
    ({"x-stream-filter": "zz", "x-stream-match-unfiltered": "yes"}, []),     # not a bool: false
    ({"x-stream-filter": ""}, [1, 3]),                                       # the empty string wants unfiltered
    # a chunk of unfiltered messages only has an empty Bloom filter: osiris asks the matcher's first hash, and
    # rabbit_stream_queue folds the array, so that is the last string's
    ({"x-stream-filter": ["a", ""]}, [0, 1, 3]),
    ({"x-stream-filter": ["", "a"]}, [0]),
    ({"x-stream-match-unfiltered": True}, [0, 1, 2, 3]),                     # without a filter: nothing filtered
    ({"x-stream-filter": 5}, [0, 1, 2, 3]),                                  # not a string: no filter
    ({"x-stream-filter": [5, "a"]}, [0]),                                    # only the array's strings count
    ({"x-stream-filter": b"a"}, [0, 1, 2, 3]),                               # pika sends bytes as a byte array
    ({"x-stream-filter": {"a": 1}}, [0, 1, 2, 3]),
]


@pytest.mark.parametrize("arguments, offsets", EXACT, ids=[str(a) for a, _ in EXACT])
def test_one_message_per_chunk_filters_exactly(streams, arguments, offsets):
    s = streams.declare()
    streams.publish_each(s, ["a", None, "b", ""])
    got = streams.read(s, arguments, quiet=0.6)
    assert [o for o, _v in got] == offsets


@pytest.mark.parametrize("value", [5, b"\xff\xfe"], ids=["int", "byte-array"])
def test_a_filter_value_that_is_not_a_string_closes_the_connection(streams, broker_url, value):
    s = streams.declare()
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", s, b"fine", pika.BasicProperties(headers={"x-stream-filter-value": "a"}))
        assert refusal(lambda: ch.basic_publish("", s, b"bad", pika.BasicProperties(
            headers={"x-stream-filter-value": value}))) == ("connection", 541, "INTERNAL_ERROR")
    finally:
        safe_close(conn)
    assert streams.read(s, {}, quiet=0.6) == [(0, "a")]


@pytest.mark.parametrize("spec", [[], [5]], ids=["empty", "no-string"])
def test_a_filter_list_without_a_string_closes_the_connection(streams, broker_url, spec):
    s = streams.declare()
    conn = pika_connect(broker_url)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        outcome = refusal(lambda: (ch.basic_consume(s, lambda *a: None, arguments={"x-stream-filter": spec}),
                                   conn.process_data_events(1.0), conn.channel().queue_declare(s, passive=True)))
        assert outcome == ("connection", 541, "INTERNAL_ERROR")
    finally:
        safe_close(conn)


# ------------------------------------------------------------------------------ chunk layouts


def cycle(run: int, total: int, unfiltered_every: int = 0):
    """Runs of `run` messages cycling through VALUES; with unfiltered_every=k every k-th run has no value."""
    out = []
    for i in range(total // run):
        value = None if unfiltered_every and i % unfiltered_every == unfiltered_every - 1 else VALUES[i % len(VALUES)]
        out.append((value, run))
    return out


def test_runs_of_1000_of_4_values_deliver_exactly_the_matching_1000s(streams):
    s = streams.declare()
    runs = cycle(1000, 10_000)
    streams.publish(s, runs)
    got = streams.read(s, {"x-stream-filter": "a"})
    assert len(got) == 3000 and {v for _o, v in got} == {"a"}
    assert [o for o, _v in got] == [*range(0, 1000), *range(4000, 5000), *range(8000, 9000)]


def test_runs_of_250_confirmed_between_runs_deliver_exactly_the_matches(streams):
    s = streams.declare()
    streams.publish(s, cycle(250, 4000))
    got = streams.read(s, {"x-stream-filter": ["b", "c"]})
    assert len(got) == 2000 and {v for _o, v in got} == {"b", "c"}


@pytest.mark.parametrize("match_unfiltered", [False, True])
def test_unfiltered_runs_go_only_to_match_unfiltered_consumers(streams, match_unfiltered):
    s = streams.declare()
    runs = cycle(500, 4000, unfiltered_every=2)      # a, none, c, none, a, none, c, none
    assert [v for v, _n in runs] == ["a", None, "c", None, "a", None, "c", None]
    streams.publish(s, runs)
    got = streams.read(s, {"x-stream-filter": "a", "x-stream-match-unfiltered": match_unfiltered})
    counts = {v: sum(1 for _o, x in got if x == v) for v in ("a", None, "c")}
    assert counts == {"a": 1000, None: 2000 if match_unfiltered else 0, "c": 0}


@pytest.mark.parametrize("layout", ["interleaved", "runs-of-1000"])
def test_back_to_back_publishes_never_miss_a_match(streams, layout):
    """Chunks formed from what arrived together: false positives differ between the brokers (see the
    module's docstring), a missed match never happens on either."""
    s = streams.declare()
    runs = [(VALUES[i % 4], 1) for i in range(10_000)] if layout == "interleaved" else cycle(1000, 10_000)
    streams.publish(s, runs, confirm_each_run=False)
    got = streams.read(s, {"x-stream-filter": "a"})
    wanted = 2500 if layout == "interleaved" else 3000
    assert sum(1 for _o, v in got if v == "a") == wanted
    assert wanted <= len(got) <= 10_000
    offsets = [o for o, _v in got]
    assert offsets == sorted(set(offsets))


# ------------------------------------------------------------------------------ the embedded broker only


def test_a_chunk_with_a_match_goes_out_whole_on_the_embedded_broker(amqp_broker):
    """One write of three publishes is one socket read, so one chunk: a filter for one of its values gets all
    three (false positives), a filter for none of them gets nothing."""
    s = Streams(amqp_broker.url)
    try:
        name = s.declare()
        s.publish(name, [("a", 1), ("b", 1), (None, 1)], confirm_each_run=False)
        assert s.read(name, {"x-stream-filter": "b"}, quiet=0.4) == [(0, "a"), (1, "b"), (2, None)]
        assert s.read(name, {"x-stream-filter": "z"}, quiet=0.4) == []
        assert len(s.read(name, {"x-stream-filter": "z", "x-stream-match-unfiltered": True}, quiet=0.4)) == 3
    finally:
        s.close()


def test_filters_survive_a_restart(tmp_path):
    """The filter values are read back from the stored messages' headers: the log's format has no field of its
    own for them, so logs written before filtering existed get their filters too."""
    with Broker(data_dir=str(tmp_path)) as broker:
        s = Streams(broker.url)
        name = s.declare()
        s.names.clear()          # kept for the restart
        s.publish(name, cycle(100, 800, unfiltered_every=4))     # a, b, c, none, a, b, c, none
        before = [s.read(name, args, quiet=0.4) for args in
                  ({"x-stream-filter": "b"}, {"x-stream-filter": "zz", "x-stream-match-unfiltered": True})]
        s.close()
    assert [len(r) for r in before] == [200, 200]
    with Broker(data_dir=str(tmp_path)) as broker:
        s = Streams(broker.url)
        s.names.append(name)
        after = [s.read(name, args, quiet=0.4) for args in
                 ({"x-stream-filter": "b"}, {"x-stream-filter": "zz", "x-stream-match-unfiltered": True})]
        s.close()
    assert after == before


@pytest.mark.parametrize("kind", ["embedded", "rabbitmq"])
def test_rabbitmq_3_10_has_no_filtering(kind):
    """3.10 takes none of the filtering names: every message goes to a consumer asking for a filter, and a
    filter size outside 16..255 is an unknown argument."""
    if kind == "rabbitmq":
        url, broker = require_rabbitmq("3.10"), None
    else:
        broker = Broker(rabbitmq_version="3.10").start()
        url = broker.url
    try:
        s = Streams(url)
        try:
            name = s.declare({"x-stream-filter-size-bytes": 4})
            s.publish_each(name, ["a", "b", None])
            assert [v for _o, v in s.read(name, {"x-stream-filter": "a"}, quiet=0.6)] == ["a", "b", None]
        finally:
            s.close()
    finally:
        if broker is not None:
            broker.stop()
