"""Stream filtering as RabbitMQ 4.x serves it to AMQP 0-9-1 clients: a chunk's filter and a consumer's matcher.

Why chunks and not messages: osiris keeps one Bloom filter per chunk (osiris_bloom, `x-stream-filter-size-bytes`
bytes, 16 by default) of the `x-stream-filter-value` of every message in it, and a reader skips a chunk whose
filter cannot hold a value the consumer wants; a chunk that may hold one is delivered whole
(rabbit_stream_queue delivers every message of it to an AMQP 0-9-1 consumer). So a consumer never misses a
match, gets the other messages of a matching chunk too, and filters again itself.

Here a chunk keeps the exact set of its values instead of a Bloom filter: the decision is the same except that
a Bloom filter's hash collisions (more chunks delivered than needed) never happen. What is kept of osiris'
rules, measured on RabbitMQ 4.3.6:

- A message without the header, or with the empty string, is *unfiltered*: the empty string in the set (osiris
  inserts `<<>>`, bit 0 of the filter). A chunk holding only unfiltered messages has an empty filter.
- `x-stream-match-unfiltered = true` also wants unfiltered messages. A chunk with an empty filter is delivered
  only when the first hash of the matcher is bit 0: match-unfiltered, or the first value of the consumer's
  list is the empty string (rabbit_stream_queue:filter_spec folds the array, so the first is its last
  string).
- `x-stream-filter` is a longstr or an array; only the array's longstr elements count. Any other type means
  no filtering. An array without a longstr crashes osiris' matcher: 541 INTERNAL_ERROR. A non-boolean
  `x-stream-match-unfiltered` is false; without `x-stream-filter` it means nothing.
- The publisher's value must be a longstr that is UTF-8 without NUL, of at most 4,096 bytes (mc_util); any
  other value crashes the publishing channel (rabbit_stream_queue:stream_message's case clause): 541.
"""

from __future__ import annotations

from spark_amqp.codec import properties

from .arguments import Crash, is_int, text

FILTER_VALUE = "x-stream-filter-value"
_KEY = b"\x15" + FILTER_VALUE.encode()      # the key as it appears in a field table (shortstr)
UNFILTERED = ""
UTF8_SCAN_LIMIT = 4096                      # mc_util: a longer longstr is taken as binary
DEFAULT_FILTER_SIZE = 16                    # osiris_bloom ?DEFAULT_FILTER_SIZE, bytes
MIN_FILTER_SIZE, MAX_FILTER_SIZE = 16, 255  # osiris_bloom:filter_size() and rabbit_stream_queue:check_filter_size


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


INVALID = _Invalid()   # a filter value RabbitMQ crashes on


def filter_value(header: bytes):
    """The message's `x-stream-filter-value` from its content header: the text, None without one, or INVALID
    for a value that is not a UTF-8 longstr without NUL of at most 4,096 bytes. Headers that cannot hold
    the key are not decoded."""
    if _KEY not in header:
        return None
    value = properties.header_item(header[12:], FILTER_VALUE)
    if value is None:
        return None
    if value[:1] != b"S":
        return INVALID
    data = bytes(value[5:])
    if len(data) > UTF8_SCAN_LIMIT or b"\x00" in data:
        return INVALID
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return INVALID


def chunk_values(values) -> frozenset:
    """A chunk's filter: the set of its messages' values, UNFILTERED for a message without one."""
    return frozenset(UNFILTERED if v is None or v is INVALID else v for v in values)


def filter_bytes(values: frozenset, size: int) -> int:
    """The bytes osiris writes for a chunk's filter: none when the chunk has only unfiltered messages."""
    return 0 if values <= {UNFILTERED} else size


def check_size(value) -> str | None:
    """rabbit_stream_queue:check_filter_size (after the argument's integer check): the 406 text, or None."""
    if value is not None and is_int(value) and not MIN_FILTER_SIZE <= value <= MAX_FILTER_SIZE:
        return "Invalid value for x-stream-filter-size-bytes"
    return None


class Matcher:
    """What a consumer wants (osiris_bloom's matcher): `wanted` values, UNFILTERED among them with
    match-unfiltered, and whether the first hash is bit 0 (what decides on a chunk with an empty filter)."""

    __slots__ = ("wanted", "first_is_unfiltered")

    def __init__(self, values: list, match_unfiltered: bool):
        self.wanted = frozenset(values) | ({UNFILTERED} if match_unfiltered else frozenset())
        self.first_is_unfiltered = match_unfiltered or values[0] == UNFILTERED

    def matches(self, values: frozenset) -> bool:
        """Whether a chunk with these values goes to the consumer (osiris_bloom:is_match)."""
        if values <= {UNFILTERED}:
            return self.first_is_unfiltered
        return not self.wanted.isdisjoint(values)


def matcher(args: dict):
    """The consumer's Matcher from its basic.consume arguments, or None (no filtering), as
    rabbit_stream_queue:filter_spec reads them; Crash for a filter list without a string (osiris'
    init_matcher has no clause for an empty list)."""
    spec = args.get("x-stream-filter")
    if isinstance(spec, str):
        values = [spec]
    elif isinstance(spec, (list, tuple)):
        values = [text(v) for v in reversed(spec) if isinstance(v, str)]
        if not values:
            raise Crash()
    else:
        return None
    return Matcher(values, args.get("x-stream-match-unfiltered") is True)
