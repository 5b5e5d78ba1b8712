"""Stream filtering (RabbitMQ 3.13+), the client's half: which rows a stream-mode read with `streamFilter`
keeps, and the consumer arguments that let the broker skip chunks.

The broker keeps a Bloom filter of each chunk's filter values (header `x-stream-filter-value`) and sends a
chunk that may hold a wanted value whole, so the rows of a chunk sent are filtered again here. Runs on the
executors (stream_mode.read_range).
"""

from __future__ import annotations

from ..codec.fields import FieldError
from ..codec.properties import header_item
from ..super_stream import FILTER_VALUE_HEADER

# The filter value header as publishers send it: shortstr name, then type 'S' (long string).
FILTER_HEADER = bytes([len(FILTER_VALUE_HEADER)]) + FILTER_VALUE_HEADER.encode() + b"S"


class RowFilter:
    """Executor. Which rows a read with `streamFilter` keeps: those whose header `x-stream-filter-value` (a
    long string, as RabbitMQ reads it) is one of the values, and, with `streamMatchUnfiltered`, those
    without one. The broker filters by chunk (a Bloom filter per chunk) and sends a matching chunk whole,
    so this runs on every row it sends.

    Cheap on raw property bytes: a row whose bytes lack the header's name has no filter value; otherwise
    the headers table is split into raw items (no value decoded), once per distinct property bytes
    (`split_offsets`' bytes without the offset, which a producer's messages with one value share)."""

    def __init__(self, values, match_unfiltered: bool):
        self.values = frozenset(v.encode("utf-8") for v in values)
        self.match_unfiltered = bool(match_unfiltered)
        self._decided: dict[bytes, bool] = {}

    @classmethod
    def of(cls, options) -> "RowFilter | None":
        values = options.get("streamFilter")
        return cls(values, options.get("streamMatchUnfiltered")) if values else None

    def consumer_arguments(self, also: bytes | None = None, also_unfiltered: bool = False) -> dict:
        """The consumer arguments that let RabbitMQ 3.13+ skip chunks (an older broker ignores them), with
        the filter value `also`, or match-unfiltered, added to what was asked (see `_read_filtered`)."""
        values = self.values | ({also} if also else set())
        return {"x-stream-filter": sorted(v.decode("utf-8", "replace") for v in values),
                "x-stream-match-unfiltered": self.match_unfiltered or also_unfiltered}

    def keeps(self, props: bytes) -> bool:
        """`props`: a row's property bytes (with or without its x-stream-offset entry)."""
        decided = self._decided.get(props)
        if decided is None:
            value = filter_value(props) if FILTER_HEADER in props else None
            decided = self.match_unfiltered if value is None else value in self.values
            if len(self._decided) < 10_000:
                self._decided[props] = decided
        return decided


def filter_value(props: bytes) -> bytes | None:
    """The raw x-stream-filter-value of property bytes whose headers hold it as a long string, else None:
    without the header, with the empty string (RabbitMQ's "unfiltered"), or with the name's bytes only
    inside some other value. (RabbitMQ refuses a message whose value is not a string.)"""
    try:
        raw = header_item(props, FILTER_VALUE_HEADER)
    except FieldError:
        return None
    return (raw[5:] or None) if raw is not None and raw[:1] == b"S" else None
