"""Fixtures of the sink tests (helpers live in sink_helpers.py)."""

from __future__ import annotations

import pytest

from sink_helpers import Admin


@pytest.fixture
def admin(broker_url):
    a = Admin(broker_url)
    yield a
    a.close()
