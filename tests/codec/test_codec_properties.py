"""Basic-class content properties (`spark_amqp.codec.properties`) against pamqp's `Basic.Properties`.

Names: the codec uses the spec's property names; pamqp calls `type` `message_type`.
Differences from pamqp that are by design, and how the tests treat them:
- headers given as a dict are encoded with RabbitMQ's field types (`fields.encode_value`: every int is a
  signed 64-bit long 'l', floats are doubles 'd'), where pamqp picks the smallest integer type ('b', 's',
  'I', ...) and single floats 'f'. Where the types legitimately differ the tests compare the decoded values
  (and check the 'l' type letter); where both libraries pick the same types (strings, bools, decimals,
  timestamps, void, arrays and nested tables with keys in sorted order, as pamqp sorts them) the bytes
  must be equal.
- an empty string is a present property for the codec (None means "not set"); pamqp drops ''.
- pamqp refuses a non-empty cluster_id in its constructor; its marshal still encodes one, so the reference
  object gets it set after construction.
"""

from __future__ import annotations

import datetime
import decimal
import itertools
import random
import struct

import pytest
from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from spark_amqp.codec import fields, frames, properties
from spark_amqp.codec.properties import PropertyError

UTC = datetime.UTC
NAMES = [name for name, _ in properties.PROPERTIES]
SHORTSTR_NAMES = [name for name, kind in properties.PROPERTIES if kind == "s"]
PAMQP_NAME = {"type": "message_type"}

# Headers both libraries encode to the same bytes (keys sorted as pamqp sorts them).
SAME_TYPED_HEADERS = {
    "a-string": "vålue",
    "b-true": True,
    "c-false": False,
    "d-void": None,
    "e-decimal": decimal.Decimal("3.14"),
    "f-timestamp": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
    "g-array": ["x", True, None, ["nested"]],
    "h-table": {"a": "b", "z": {"deep": "er"}},
}

# One representative value per property (the codec's input form).
VALUES = {
    "content_type": "application/json",
    "content_encoding": "gzip",
    "headers": SAME_TYPED_HEADERS,
    "delivery_mode": 2,
    "priority": 9,
    "correlation_id": "corr-42",
    "reply_to": "amq.rabbitmq.reply-to",
    "expiration": "60000",
    "message_id": "msg-ü-1",
    "timestamp": 1700000000,
    "type": "order.created",
    "user_id": "guest",
    "app_id": "spark-amqp",
    "cluster_id": "cluster-1",
}
assert set(VALUES) == set(NAMES)


def pamqp_properties(values: dict) -> commands.Basic.Properties:
    kwargs = {PAMQP_NAME.get(k, k): v for k, v in values.items() if k != "cluster_id"}
    if isinstance(kwargs.get("timestamp"), int):
        kwargs["timestamp"] = datetime.datetime.fromtimestamp(kwargs["timestamp"], UTC)
    props = commands.Basic.Properties(**kwargs)
    if "cluster_id" in values:
        props.cluster_id = values["cluster_id"]   # pamqp's validate refuses it, its marshal encodes it
    return props


def pamqp_unmarshal(raw: bytes) -> commands.Basic.Properties:
    """pamqp's own reading of property bytes, through a whole content-header frame."""
    payload = struct.pack(">HHQ", 60, 0, 0) + raw
    data = struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"
    _, _, content_header = pamqp_frame.unmarshal(data)
    assert isinstance(content_header, pamqp_header.ContentHeader)
    return content_header.properties


def expected_decoded(values: dict) -> dict:
    """What `decode` gives back: timestamps as int seconds, headers as raw table bytes."""
    out = dict(values)
    if "headers" in out:
        out["headers"] = fields.encode_table(out["headers"])
    return out


# --- the property table ---------------------------------------------------------------------------

def test_property_table_matches_pamqp():
    pamqp_slots = commands.Basic.Properties.__slots__
    assert len(properties.PROPERTIES) == 14
    assert [PAMQP_NAME.get(n, n) for n in NAMES] == pamqp_slots
    kinds = {"shortstr": "s", "table": "F", "octet": "o", "timestamp": "T"}
    for name, kind in properties.PROPERTIES:
        pname = PAMQP_NAME.get(name, name)
        assert properties.FLAG[name] == commands.Basic.Properties.flags[pname], name
        assert kind == kinds[commands.Basic.Properties.amqp_type(pname)], name
    # bit 15 down to bit 2, one each; bit 0 (continuation) and bit 1 unused
    assert sorted(properties.FLAG.values()) == [1 << b for b in range(2, 16)]


# --- every property alone --------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_each_property_alone(name):
    values = {name: VALUES[name]}
    raw = properties.encode(values)
    assert raw == pamqp_properties(values).marshal()
    assert properties.flags_of(raw) == properties.FLAG[name]
    assert properties.decode(raw) == expected_decoded(values)
    assert properties.to_pamqp(raw) == pamqp_unmarshal(raw)
    parts = properties.split(raw)
    assert list(parts) == [name]
    assert properties.join(parts) == raw
    assert raw == struct.pack(">H", properties.FLAG[name]) + parts[name]


@pytest.mark.parametrize("name", NAMES)
def test_each_property_alone_to_pamqp_values(name):
    raw = properties.encode({name: VALUES[name]})
    theirs = properties.to_pamqp(raw)
    value = getattr(theirs, PAMQP_NAME.get(name, name))
    if name == "timestamp":
        assert value == datetime.datetime.fromtimestamp(VALUES[name], UTC)
    else:
        assert value == VALUES[name]
    for other in NAMES:
        if other not in (name, "cluster_id"):
            assert getattr(theirs, PAMQP_NAME.get(other, other)) is None, other


# --- every combination ------------------------------------------------------------------------------

def combinations_sample():
    """Every subset of at most 3 or at least 11 of the 14 properties (940), and 600 more drawn with a
    fixed seed: each property pair appears present/absent in every combination many times over. (All
    2**14 subsets take about 4 s; this keeps the folder fast.)"""
    subsets = [s for r in (*range(4), *range(11, 15)) for s in itertools.combinations(NAMES, r)]
    rng = random.Random(91)
    for _ in range(600):
        mask = rng.getrandbits(14)
        subsets.append(tuple(n for i, n in enumerate(NAMES) if mask >> i & 1))
    return subsets


def test_combinations_of_properties():
    """Property subsets: pamqp's bytes, the round trip, split/join, to_pamqp."""
    subsets = combinations_sample()
    assert len(subsets) == 940 + 600
    for subset in subsets:
        values = {name: VALUES[name] for name in subset}
        raw = properties.encode(values)
        assert raw == pamqp_properties(values).marshal(), subset
        assert properties.decode(raw) == expected_decoded(values), subset
        parts = properties.split(raw)
        assert list(parts) == list(subset)
        assert properties.join(parts) == raw
        assert properties.to_pamqp(raw) == pamqp_unmarshal(raw), subset


def test_all_properties_layout():
    raw = properties.encode(VALUES)
    assert raw[:2] == b"\xff\xfc"
    parts = properties.split(raw)
    assert parts["content_type"] == b"\x10application/json"
    assert parts["delivery_mode"] == b"\x02"
    assert parts["priority"] == b"\x09"
    assert parts["timestamp"] == struct.pack(">Q", 1700000000)
    assert parts["message_id"] == b"\x08msg-\xc3\xbc-1"
    assert parts["headers"] == fields.encode_table(SAME_TYPED_HEADERS)
    assert raw == b"\xff\xfc" + b"".join(parts[n] for n in NAMES)


def test_join_rewrites_one_property_and_keeps_the_others_byte_exact():
    raw = properties.encode(VALUES)
    parts = properties.split(raw)
    parts["headers"] = fields.table_from_items(fields.table_items(parts["headers"])
                                               + [("x-death", fields.encode_value([{"count": 1}]))])
    del parts["expiration"]
    rewritten = properties.join(parts)
    again = properties.split(rewritten)
    assert "expiration" not in again
    assert {k: v for k, v in again.items() if k != "headers"} == \
        {k: v for k, v in properties.split(raw).items() if k not in ("headers", "expiration")}
    assert fields.decode_table(again["headers"])["x-death"] == [{"count": 1}]
    assert properties.flags_of(rewritten) == properties.flags_of(raw) & ~properties.FLAG["expiration"]


# --- headers -------------------------------------------------------------------------------------------

def test_headers_with_ints_and_floats_decode_to_the_same_values_as_pamqp():
    """Field types differ by design: the codec writes every int as 'l' (RabbitMQ's choice), pamqp the
    smallest type that fits; floats are doubles 'd' here and singles 'f' in pamqp. The values agree."""
    headers = {"n": 1, "neg": -5, "big": 2**40, "min": -(2**63), "max": 2**63 - 1, "half": 0.5,
               "nested": {"k": 300}, "arr": [1, 70000]}
    raw = properties.encode({"headers": headers})
    theirs = pamqp_properties({"headers": headers}).marshal()
    assert raw != theirs                                          # the types differ...
    assert properties.to_pamqp(raw).headers == pamqp_unmarshal(theirs).headers == headers   # ...not the values
    table = properties.decode(raw)["headers"]
    assert fields.decode_table(table) == headers
    letters = {name: value[:1] for name, value in fields.table_items(table)}
    assert letters == {"n": b"l", "neg": b"l", "big": b"l", "min": b"l", "max": b"l", "half": b"d",
                       "nested": b"F", "arr": b"A"}


def test_headers_as_raw_table_bytes_pass_through_untouched():
    # a table pamqp wrote (small int types, 'f' float), kept exactly as given
    raw_table = commands.Basic.Properties(headers={"x": 1, "f": 0.5}).marshal()[2:]
    raw = properties.encode({"headers": raw_table, "priority": 1})
    assert properties.split(raw)["headers"] == raw_table
    assert properties.decode(raw)["headers"] == raw_table
    assert properties.encode({"headers": bytearray(raw_table)}) == properties.encode({"headers": raw_table})
    assert properties.encode({"headers": memoryview(raw_table)}) == properties.encode({"headers": raw_table})


def test_empty_headers_table():
    raw = properties.encode({"headers": {}})
    assert raw == struct.pack(">H", properties.FLAG["headers"]) + b"\0\0\0\0"
    assert properties.decode(raw) == {"headers": b"\0\0\0\0"}


# --- value forms -------------------------------------------------------------------------------------

def test_timestamp_forms():
    aware = datetime.datetime(2023, 11, 14, 22, 13, 20, 999999, tzinfo=UTC)
    naive = datetime.datetime(2023, 11, 14, 22, 13, 20)
    plus2 = datetime.datetime(2023, 11, 15, 0, 13, 20, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    for value in (1700000000, 1700000000.9, aware, naive, plus2):
        raw = properties.encode({"timestamp": value})
        assert properties.decode(raw) == {"timestamp": 1700000000}, value
    for value in (aware, naive, plus2):
        assert properties.encode({"timestamp": value}) == \
            commands.Basic.Properties(timestamp=value).marshal(), value
    assert properties.encode({"timestamp": 0}) == struct.pack(">HQ", properties.FLAG["timestamp"], 0)
    assert properties.decode(properties.encode({"timestamp": 2**64 - 1})) == {"timestamp": 2**64 - 1}


def test_epoch_seconds_floors():
    assert properties.epoch_seconds(datetime.datetime(1970, 1, 1, 0, 0, 1, 500000)) == 1
    assert properties.epoch_seconds(datetime.datetime(1969, 12, 31, 23, 59, 59, 500000, tzinfo=UTC)) == -1


def test_octet_edges():
    for value in (0, 1, 255):
        raw = properties.encode({"priority": value, "delivery_mode": value})
        assert properties.decode(raw) == {"priority": value, "delivery_mode": value}
    assert properties.encode({"priority": 255}) == commands.Basic.Properties(priority=255).marshal()


def test_empty_string_is_a_present_property():
    raw = properties.encode({"content_type": ""})
    assert raw == struct.pack(">H", properties.FLAG["content_type"]) + b"\x00"
    assert properties.decode(raw) == {"content_type": ""}
    assert properties.to_pamqp(raw).content_type == ""
    assert commands.Basic.Properties(content_type="").marshal() == properties.EMPTY   # pamqp drops it


def test_none_means_not_set():
    assert properties.encode({name: None for name in NAMES}) == properties.EMPTY
    assert properties.encode({"app_id": "a", "headers": None}) == properties.encode({"app_id": "a"})


def test_255_byte_strings():
    for name in SHORTSTR_NAMES:
        value = "é" * 127 + "x"
        raw = properties.encode({name: value})
        assert properties.decode(raw) == {name: value}
        assert raw == pamqp_properties({name: value}).marshal()


def test_encode_other_input_forms():
    assert properties.encode(None) == properties.EMPTY == b"\0\0"
    raw = properties.encode(VALUES)
    assert properties.encode(raw) == raw
    assert properties.encode(bytearray(raw)) == raw
    theirs = pamqp_properties({"content_type": "a/b", "priority": 3})
    assert properties.encode(theirs) == theirs.marshal()
    with pytest.raises(TypeError):
        properties.encode(["content_type"])


def test_decode_empty():
    assert properties.decode(properties.EMPTY) == {}
    assert properties.split(properties.EMPTY) == {}
    assert properties.join({}) == properties.EMPTY
    assert properties.to_pamqp(properties.EMPTY) == commands.Basic.Properties()


def test_flags_of_in_a_content_header():
    raw = properties.encode({"content_type": "t", "timestamp": 5})
    payload = frames.content_header(10, raw)
    assert properties.flags_of(payload, 12) == properties.FLAG["content_type"] | properties.FLAG["timestamp"]


# --- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHORTSTR_NAMES)
def test_shortstr_over_255_bytes(name):
    with pytest.raises(PropertyError, match=rf"'{name}'.*255"):
        properties.encode({name: "é" * 128})
    with pytest.raises(PropertyError, match=rf"'{name}'.*255"):
        properties.encode({name: "x" * 256})


@pytest.mark.parametrize("name", ["delivery_mode", "priority"])
@pytest.mark.parametrize("value", [256, -1, 1000])
def test_octet_out_of_range(name, value):
    with pytest.raises(PropertyError, match=rf"'{name}'.*0\.\.255"):
        properties.encode({name: value})


@pytest.mark.parametrize("unknown", ["message_type", "content-type", "Headers"])
def test_unknown_property_name(unknown):
    with pytest.raises(PropertyError, match=unknown):
        properties.encode({"content_type": "a", unknown: "x"})


def test_bad_timestamps():
    with pytest.raises(PropertyError, match="'timestamp'.*1970"):
        properties.encode({"timestamp": -1})
    with pytest.raises(PropertyError, match="'timestamp'.*1970"):
        properties.encode({"timestamp": datetime.datetime(1969, 12, 31, tzinfo=UTC)})
    with pytest.raises(PropertyError, match="'timestamp'.*str"):
        properties.encode({"timestamp": "2024-01-01"})


def test_unencodable_header_value_names_the_property():
    with pytest.raises(PropertyError, match="'headers'.*object"):
        properties.encode({"headers": {"x": object()}})


def test_header_int_out_of_range_names_the_property():
    with pytest.raises(PropertyError, match="'headers'"):
        properties.encode({"headers": {"n": 2**64}})


def truncations(raw: bytes):
    return [raw[:n] for n in range(len(raw))]


def test_truncated_property_bytes_split_and_decode():
    raw = properties.encode(VALUES)
    for cut in truncations(raw):
        with pytest.raises(PropertyError, match="truncated"):
            properties.split(cut)
        with pytest.raises(PropertyError, match="truncated"):
            properties.decode(cut)


def test_truncated_property_bytes_to_pamqp():
    """Cut anywhere, when the last present property is not a string (pamqp reads a cut string short)."""
    raw = properties.encode({k: v for k, v in VALUES.items() if k in
                             ("content_type", "headers", "delivery_mode", "message_id", "timestamp")})
    for cut in truncations(raw):
        with pytest.raises(PropertyError):
            properties.to_pamqp(cut)


def test_truncated_final_shortstr_to_pamqp():
    raw = properties.encode({"content_type": "abcde"})
    with pytest.raises(PropertyError):
        properties.to_pamqp(raw[:-3])          # b"\x80\x00\x05ab"


def test_flags_continuation_is_refused():
    with pytest.raises(PropertyError, match="continuation"):
        properties.split(b"\x80\x01\x00\x00\x01a")


def test_to_pamqp_bad_utf8_is_property_error():
    with pytest.raises(PropertyError):
        properties.to_pamqp(b"\x80\x00\x02\xc3\x28")


@pytest.mark.parametrize("columns", [
    {"headers": {"a": "1"}},
    {"content_type": "text/plain", "headers": {"a": "1"}},
    {"content_encoding": "gzip", "headers": {}},
    {"content_type": "application/json", "content_encoding": "utf-8", "headers": {"x": "y"}, "priority": 3},
    {"content_type": "text/plain"},
])
def test_headers_at_finds_the_headers_table_after_the_strings_before_it(columns):
    raw = properties.encode(columns)
    at = properties.headers_at(raw)
    if "headers" not in columns:
        assert at is None
        return
    assert raw[at:at + 4 + int.from_bytes(raw[at:at + 4], "big")] == properties.split(raw)["headers"]


def test_with_sorted_headers_is_the_table_as_rabbitmq_4_delivers_it():
    """Sorted by the names' bytes, each name once with its first value; untouched without headers or when
    already in order (the same object back: the broker's fast path)."""
    from spark_amqp import properties as columns

    raw = columns.from_columns({"content_type": "t", "headers": {"z": "1", "a": "2", "B": "3"},
                                   "header_types": None, "priority": 4})
    out = properties.with_sorted_headers(raw)
    assert list(columns.to_columns(out)["headers"]) == ["B", "a", "z"]
    assert columns.to_columns(out)["content_type"] == "t" and columns.to_columns(out)["priority"] == 4
    assert properties.with_sorted_headers(out) is out
    plain = columns.from_columns({"priority": 1})
    assert properties.with_sorted_headers(plain) is plain
    assert fields.sorted_items([("b", b"t\x01"), ("a", b"t\x00"), ("b", b"t\x00")]) == [("a", b"t\x00"),
                                                                                         ("b", b"t\x01")]


def test_without_delivery_counts_reads_only_the_headers_table():
    """The delivery counts go from the headers table (an emptied table reads as none); a property that only
    holds their names, or a table without them, is left as it is."""
    encode, without_delivery_counts = properties.encode, properties.without_delivery_counts
    first = encode({"headers": {"a": 1}, "delivery_mode": 2})
    copy = encode({"headers": {"a": 1, "x-delivery-count": 1, "x-acquired-count": 1}, "delivery_mode": 2})
    assert without_delivery_counts(copy) == without_delivery_counts(first) == first
    assert without_delivery_counts(encode({"headers": {"x-delivery-count": 0}, "delivery_mode": 2})) == \
        without_delivery_counts(encode({"headers": {}, "delivery_mode": 2})) == encode({"delivery_mode": 2})
    named = encode({"content_type": "x-delivery-count", "correlation_id": "x-acquired-count"})
    assert without_delivery_counts(named) == named
