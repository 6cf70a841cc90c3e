"""Riding out a Redis outage: a restart of Redis must not lose a prompt's work, so the worker's
Redis steps wait for it (with backoff) instead of failing the prompt."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar, cast

import redis

from datagen.backoff import Backoff
from datagen.settings import OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S

__all__ = ["while_redis_down"]

log = logging.getLogger(__name__)

T = TypeVar("T")


async def while_redis_down(step: Callable[[], T], *, already_done: Callable[[], bool] | None = None) -> T:
    """Run a Redis step, retrying while Redis is unreachable (a restart must not lose work).

    ``already_done`` tells whether an earlier try went through although its reply was lost.
    """
    backoff = Backoff(OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S)
    tried = False
    while True:
        try:
            if tried and already_done is not None and already_done():
                return cast(T, None)
            tried = True
            return step()
        except redis.RedisError as exc:
            delay_s = backoff.next_s()
            log.warning("Redis unreachable, retrying in %.1f s: %s", delay_s, exc)
            await asyncio.sleep(delay_s)
