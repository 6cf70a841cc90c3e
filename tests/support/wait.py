"""Polling until a condition holds: :func:`wait_until` in sync code, :func:`wait_until_async` on an
event loop. Both check the predicate first, then the deadline, then sleep ``interval_s``."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["ASYNC_POLL_INTERVAL_S", "POLL_INTERVAL_S", "wait_until", "wait_until_async"]

POLL_INTERVAL_S = 0.1
ASYNC_POLL_INTERVAL_S = 0.05

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T | None],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = POLL_INTERVAL_S,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that. After ``timeout_s``
    the test fails naming ``what``, followed by ``on_timeout()`` (process logs, say) if given."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            detail = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
        time.sleep(interval_s)
    return value


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T | None] | None],
    timeout_s: float,
    message: str,
    *,
    interval_s: float = ASYNC_POLL_INTERVAL_S,
) -> T:
    """Poll ``predicate`` (a plain function or a coroutine function) without blocking the loop until
    it returns something truthy, and return that. After ``timeout_s`` the test fails with
    ``message``, the whole text of the AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message)
        await asyncio.sleep(interval_s)
