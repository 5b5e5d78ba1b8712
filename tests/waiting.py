"""Polling with a deadline, for every test suite (``from waiting import wait_until``).

tests/ is on ``sys.path`` (pytest's default "prepend" import mode puts the directory of tests/conftest.py
there), so the suites under tests/ import this module by its bare name.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, *, interval: float = 0.02,
               message: str | Callable[[], str] | None = None) -> Any:
    """Call ``predicate`` every ``interval`` seconds until it returns a truthy value, and return that value.

    After ``timeout`` seconds without one, raise ``AssertionError`` naming what was awaited: ``message``
    (phrase it as what is awaited, e.g. ``"a first batch"``; a callable is called then, so it can tell the
    last state seen) or, without one, the predicate and where it was written. The predicate is called at
    least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            what = message() if callable(message) else message or _describe(predicate)
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last value {value!r})")
        time.sleep(min(interval, remaining))


def _describe(predicate: Callable[[], Any]) -> str:
    code = getattr(predicate, "__code__", None)
    name = getattr(predicate, "__qualname__", None) or repr(predicate)
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
