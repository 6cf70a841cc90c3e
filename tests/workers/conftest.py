from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.workers import close_left_open


@pytest.fixture(autouse=True)
async def _close_workers_left_open() -> AsyncIterator[None]:
    """A test that fails before it stops its worker leaves nothing running into the next test."""
    yield
    await close_left_open()
