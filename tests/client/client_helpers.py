"""Helpers for the client tests (module name distinct from tests/broker/helpers.py: rootdir-less imports).

The relay that freezes or kills the link to the broker is ``proxies.Proxy``, polling is
``waiting.wait_until``, and ``free_port`` is in ``brokers`` (modules shared by every suite, in tests/).

- ``field_table(items)``: an AMQP field table with explicit type tags, so the tests can put every field
  type on the wire (pamqp picks tags from Python types and never emits some of them).
- ``raw_properties(...)``: content-header property bytes built by hand (flags word + values).
- ``Blocked``: run a blocking call in a thread and report what it raised and when.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any, Callable

import pytest

# ----------------------------------------------------------------------------------- blocking calls


class Blocked:
    """Runs ``fn`` in a daemon thread; ``.join(timeout)`` returns (exception or None, seconds taken)."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed: float | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()
        self._started.wait(5)

    def _run(self, fn):
        self._started.set()
        t0 = time.monotonic()
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        self.elapsed = time.monotonic() - t0

    def join(self, timeout: float) -> tuple[BaseException | None, float | None]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"the blocked call did not return within {timeout} s")
        return self.error, self.elapsed


# ------------------------------------------------------------------------------- wire encodings


def _shortstr(text: str) -> bytes:
    raw = text.encode()
    return bytes([len(raw)]) + raw


def _longstr(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


def field_value(tag: str, value: Any) -> bytes:
    """One tagged field value, per RabbitMQ's errata table (the tags RabbitMQ and Qpid use)."""
    t = tag.encode()
    fixed = {"t": ">B", "b": ">b", "B": ">B", "s": ">h", "u": ">H", "I": ">i", "i": ">I", "l": ">q",
             "f": ">f", "d": ">d", "T": ">Q"}
    if tag in fixed:
        return t + struct.pack(fixed[tag], value)
    if tag == "D":
        scale, unscaled = value
        return t + struct.pack(">Bi", scale, unscaled)
    if tag == "S":
        return t + _longstr(value.encode() if isinstance(value, str) else value)
    if tag == "x":
        return t + _longstr(value)
    if tag == "F":
        return t + field_table(value)
    if tag == "A":
        inner = b"".join(field_value(it, iv) for it, iv in value)
        return t + _longstr(inner)
    if tag == "V":
        return t
    raise ValueError(tag)


def field_table(items: list[tuple[str, str, Any]]) -> bytes:
    return _longstr(b"".join(_shortstr(k) + field_value(tag, v) for k, tag, v in items))


# Basic.Properties in wire order with their flag bits (spec 1.8, class basic).
_PROPERTY_ORDER = [
    ("content_type", 15, "shortstr"), ("content_encoding", 14, "shortstr"), ("headers", 13, "table"),
    ("delivery_mode", 12, "octet"), ("priority", 11, "octet"), ("correlation_id", 10, "shortstr"),
    ("reply_to", 9, "shortstr"), ("expiration", 8, "shortstr"), ("message_id", 7, "shortstr"),
    ("timestamp", 6, "timestamp"), ("type", 5, "shortstr"), ("user_id", 4, "shortstr"),
    ("app_id", 3, "shortstr"),
]


def raw_properties(**props: Any) -> bytes:
    """Content-header property bytes; `headers` must already be an encoded field table."""
    flags, values = 0, []
    for name, bit, kind in _PROPERTY_ORDER:
        if name not in props:
            continue
        flags |= 1 << bit
        v = props.pop(name)
        if kind == "shortstr":
            values.append(_shortstr(v))
        elif kind == "octet":
            values.append(bytes([v]))
        elif kind == "timestamp":
            values.append(struct.pack(">Q", v))
        else:
            values.append(v)
    if props:
        raise ValueError(f"unknown properties {sorted(props)}")
    return struct.pack(">H", flags) + b"".join(values)
