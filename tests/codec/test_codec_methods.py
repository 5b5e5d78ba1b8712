"""Every AMQP 0-9-1 method pamqp knows, through the codec's pamqp side (`methods.unchecked`,
`frames.method_frame`, `frames.FrameReader`, `methods.unmarshal_method`).

The expected bytes are built here from the spec's argument layout (spec 4.2.3 frame, 4.2.5 data types; bits
packed LSB first into octets), independently of pamqp's `Frame.marshal`, and also compared with
`pamqp.frame.marshal` of pamqp's own (validated) objects where pamqp accepts the values.

pamqp encodes and decodes `longlong` as *signed* (range up to 2**63 - 1), so the method-wide values stay
inside that range here; the unsigned 2**64 - 1 delivery tags of the hand-written paths are covered in
test_codec_message_methods.py.
"""

from __future__ import annotations

import struct

import pytest
from pamqp import commands
from pamqp import encode as pamqp_encode
from pamqp import frame as pamqp_frame

from spark_amqp.codec import frames, methods, replies

# basic.recover-async is deprecated in 0-9-1; pamqp warns when it is built, and it is still a method pamqp knows.
pytestmark = pytest.mark.filterwarnings("ignore:This command is deprecated:DeprecationWarning")

ALL_METHODS = sorted(commands.INDEX_MAPPING.items())
IDS = [cls.name for _, cls in ALL_METHODS]

# Representative argument values per AMQP domain type, in three variants:
#   "unicode": non-ASCII names (what RabbitMQ accepts but pamqp's name check refuses), large numbers,
#              a nested table; bits alternate True/False
#   "zero":    zeros, empty strings, an empty table; every bit False
#   "max":     largest values pamqp can encode, 255-byte shortstrs; every bit True
VARIANTS = {
    "unicode": {
        "octet": 7, "short": 0xBEEF, "long": 0xDEADBEEF, "longlong": 2**40 + 3,
        "shortstr": "événements.ü-队列", "longstr": "PLAIN AMQPLAIN — ünïcødé",
        "table": {"product": "spark-amqp", "n": 5, "flag": True,
                  "capabilities": {"publisher_confirms": True, "list": [1, "x", {"k": "é"}]}},
    },
    "zero": {
        "octet": 0, "short": 0, "long": 0, "longlong": 0, "shortstr": "", "longstr": "", "table": {},
    },
    "max": {
        "octet": 255, "short": 65535, "long": 2**32 - 1, "longlong": 2**63 - 1,
        "shortstr": "é" * 127 + "x", "longstr": "y" * 70000,
        "table": {"big": 2**62, "neg": -(2**62), "s": "z" * 300},
    },
}
BIT_PATTERN = {"unicode": lambda i: i % 2 == 0, "zero": lambda i: False, "max": lambda i: True}


def arguments(cls, variant: str) -> dict:
    values = VARIANTS[variant]
    out, bit_index = {}, 0
    for name in cls.__slots__:
        kind = cls.amqp_type(name)
        if kind == "bit":
            out[name] = BIT_PATTERN[variant](bit_index)
            bit_index += 1
        else:
            out[name] = values[kind]
    return out


# --- an encoder written from the spec, to check pamqp-side bytes independently ------------------------

def _shortstr(text: str) -> bytes:
    raw = text.encode("utf-8")
    assert len(raw) <= 255
    return bytes((len(raw),)) + raw


def _longstr(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


SPEC_ENCODERS = {
    "octet": lambda v: struct.pack(">B", v),
    "short": lambda v: struct.pack(">H", v),
    "long": lambda v: struct.pack(">I", v),
    "longlong": lambda v: struct.pack(">Q", v),
    "shortstr": _shortstr,
    "longstr": _longstr,
    "table": pamqp_encode.field_table,   # tables themselves are covered in test_codec_fields.py
}


def spec_arguments(cls, args: dict) -> bytes:
    out = []
    bits, nbits = 0, 0
    for name in cls.__slots__:
        kind = cls.amqp_type(name)
        if kind == "bit":
            bits |= (1 if args[name] else 0) << nbits
            nbits += 1
            if nbits == 8:
                out.append(bytes((bits,)))
                bits, nbits = 0, 0
            continue
        if nbits:
            out.append(bytes((bits,)))
            bits, nbits = 0, 0
        out.append(SPEC_ENCODERS[kind](args[name]))
    if nbits:
        out.append(bytes((bits,)))
    return b"".join(out)


def spec_method_frame(channel: int, cls, args: dict) -> bytes:
    payload = struct.pack(">HH", cls.index >> 16, cls.index & 0xFFFF) + spec_arguments(cls, args)
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


# Values pamqp's own constructors require (deprecated fields that must be empty/zero/False).
PAMQP_REQUIRED = {"ticket": 0, "capabilities": "", "insist": False, "known_hosts": "",
                  "out_of_band": "0", "channel_id": "0", "cluster_id": ""}
ASCII_VALUES = {"octet": 9, "short": 4242, "long": 123456789, "longlong": 2**50, "shortstr": "amq.gen-Q_1:@#,/+ x",
                "longstr": "PLAIN AMQPLAIN", "table": {"x-max-length": 10, "x-queue-type": "classic"}, "bit": True}


# ------------------------------------------------------------------------------------------------- tests

def test_pamqp_knows_all_of_amqp_0_9_1():
    """The iteration below covers the whole protocol: 64 methods of the 7 classes (plus RabbitMQ's
    extensions pamqp includes: basic.nack, confirm.*, connection.blocked/unblocked/update-secret)."""
    assert len(ALL_METHODS) == 64
    assert {index >> 16 for index, _ in ALL_METHODS} == methods.KNOWN_CLASSES
    for index, cls in ALL_METHODS:
        assert cls.index == index


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("index,cls", ALL_METHODS, ids=IDS)
def test_method_round_trip(index, cls, variant):
    args = arguments(cls, variant)
    channel = {"unicode": 1, "zero": 0, "max": 65535}[variant]
    method = methods.unchecked(cls, **args)
    data = frames.method_frame(channel, method)

    # bytes: as the spec lays them out, and as pamqp itself writes them
    assert data == spec_method_frame(channel, cls, args)
    assert data == pamqp_frame.marshal(method, channel)

    # split by the frame reader: exactly one method frame, with the whole payload
    reader = frames.FrameReader(0)
    reader.feed(data)
    got = list(reader.frames())
    assert got == [(frames.FRAME_METHOD, channel, data[7:-1])]
    assert reader.buffer == b""
    payload = got[0][2]
    assert methods.method_index(payload) == index

    # decoded: the same class and every argument value equal
    decoded = methods.unmarshal_method(payload)
    assert isinstance(decoded, cls)
    assert decoded.name == cls.name
    assert dict(decoded) == args

    # and pamqp's own decoder reads the codec's bytes the same way
    consumed, pch, theirs = pamqp_frame.unmarshal(data)
    assert (consumed, pch) == (len(data), channel)
    assert dict(theirs) == args


@pytest.mark.parametrize("index,cls", ALL_METHODS, ids=IDS)
def test_unchecked_matches_pamqp_constructor(index, cls):
    """For values pamqp's own constructor accepts, `unchecked` builds the same object and the same bytes."""
    args = {name: PAMQP_REQUIRED.get(name, ASCII_VALUES[cls.amqp_type(name)]) for name in cls.__slots__}
    theirs = cls(**args)
    ours = methods.unchecked(cls, **args)
    assert dict(ours) == dict(theirs) == args
    assert frames.method_frame(7, ours) == pamqp_frame.marshal(theirs, 7) == spec_method_frame(7, cls, args)
    # defaults: every argument left out takes the default of pamqp's signature. pamqp's constructor turns
    # a table's None into {} (`arguments or {}`); both marshal to the same empty table (4 zero bytes).
    defaults, constructed = dict(methods.unchecked(cls)), dict(cls())
    for name in cls.__slots__:
        if cls.amqp_type(name) == "table" and defaults[name] is None:
            assert constructed[name] in (None, {}), name
            assert pamqp_encode.field_table(None) == pamqp_encode.field_table({}) == b"\0\0\0\0"
        else:
            assert defaults[name] == constructed[name], name


def test_unchecked_accepts_names_pamqp_refuses():
    with pytest.raises(ValueError):
        commands.Queue.Declare(queue="événements")
    method = methods.unchecked(commands.Queue.Declare, queue="événements", durable=True)
    data = frames.method_frame(1, method)
    assert b"\x0c" + "événements".encode() in data  # 12 UTF-8 bytes
    decoded = methods.unmarshal_method(data[7:-1])
    assert decoded.queue == "événements" and decoded.durable is True
    # the override is per subclass, pamqp's class keeps its check
    with pytest.raises(ValueError):
        commands.Queue.Declare(queue="événements")


def test_unchecked_rejects_unknown_arguments():
    with pytest.raises(TypeError, match="no_such_argument"):
        methods.unchecked(commands.Queue.Declare, queue="q", no_such_argument=1)


def test_unchecked_still_limits_shortstr_to_255_bytes():
    frames.method_frame(1, methods.unchecked(commands.Basic.ConsumeOk, consumer_tag="é" * 127 + "x"))  # 255
    with pytest.raises(TypeError, match="255"):
        frames.method_frame(1, methods.unchecked(commands.Basic.ConsumeOk, consumer_tag="é" * 128))  # 256


# --- unmarshal_method errors --------------------------------------------------------------------------

def test_unmarshal_method_too_short_is_frame_error():
    for payload in (b"", b"\x00", b"\x00\x3c\x00"):
        with pytest.raises(replies.AMQPError) as info:
            methods.unmarshal_method(payload)
        assert info.value.code == replies.FRAME_ERROR == 501
        assert info.value.hard


def test_unmarshal_unknown_method_of_known_class_is_command_invalid():
    with pytest.raises(replies.AMQPError) as info:
        methods.unmarshal_method(struct.pack(">HH", 60, 999))
    assert info.value.code == replies.COMMAND_INVALID == 503
    assert info.value.hard
    assert info.value.text.startswith("COMMAND_INVALID - ")


def test_unmarshal_unknown_class_is_not_implemented():
    with pytest.raises(replies.AMQPError) as info:
        methods.unmarshal_method(struct.pack(">HH", 99, 10))
    assert info.value.code == replies.NOT_IMPLEMENTED == 540
    assert info.value.hard


def test_unmarshal_truncated_arguments_is_syntax_error():
    """Queue.Declare cut anywhere before its last argument: SYNTAX_ERROR naming the method."""
    args = arguments(commands.Queue.Declare, "unicode")
    payload = frames.method_frame(1, methods.unchecked(commands.Queue.Declare, **args))[7:-1]
    # every cut before the complete table (the table's length word says how much must follow)
    for cut in range(4, len(payload)):
        with pytest.raises(replies.AMQPError) as info:
            methods.unmarshal_method(payload[:cut])
        assert info.value.code == replies.SYNTAX_ERROR == 502, cut
        assert info.value.hard
        assert (info.value.class_id, info.value.method_id) == (50, 10)
        assert "Queue.Declare" in info.value.text


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception, reason=(
    "codec bug: unmarshal_method accepts a method whose LAST argument is a shortstr/longstr cut short "
    "(pamqp slices past the end without checking), returning a shorter string instead of SYNTAX_ERROR 502"))
def test_unmarshal_truncated_final_string_is_syntax_error():
    # channel.open, out-of-band shortstr declared 5 bytes long, 2 present
    with pytest.raises(replies.AMQPError) as info:
        methods.unmarshal_method(b"\x00\x14\x00\x0a\x05ab")
    assert info.value.code == replies.SYNTAX_ERROR
