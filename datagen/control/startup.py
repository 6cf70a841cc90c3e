"""Waiting for a long-running process's dependencies at startup: Redis and the storage root.

Compose and Kubernetes start services in any order, so a coordinator or worker whose Redis (or
object store) is not up yet waits for it: one log line per failed try, a backoff from
:data:`~datagen.settings.OUTAGE_RETRY_FIRST_S` doubling up to
:data:`~datagen.settings.OUTAGE_RETRY_MAX_S`, until ``DATAGEN_STARTUP_TIMEOUT_S``
(0 waits forever). A failure that retrying cannot fix (a wrong password or URL, a storage root
that belongs to another namespace or cannot be written) ends the wait at once with a
:class:`~datagen.errors.ConfigError` that names the setting to change.

The coordinator's command waits with :func:`wait_for`; the worker, inside its event loop, with
:func:`wait_for_async`, so that Ctrl-C stops the wait at once.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from datagen.backoff import Backoff
from datagen.errors import BackendUnavailableError, ConfigError, RetryableError, StorageError
from datagen.prompts.sources import redacted_url
from datagen.records.storage import Storage
from datagen.settings import OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S

__all__ = [
    "claim_storage",
    "claim_storage_async",
    "connect_redis",
    "connect_redis_async",
    "redacted_url",
    "wait_for",
    "wait_for_async",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

TIMEOUT_HINT = "DATAGEN_STARTUP_TIMEOUT_S=0 waits forever"
_REDIS_FIX = "check that Redis is running and that DATAGEN_REDIS_URL (--redis-url) points at it"
_STORAGE_FIX = "check DATAGEN_STORAGE (--storage) and that its file system or object store is reachable"
# Storage failures that need a person (permissions, a read-only or missing root, a missing bucket).
_PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR})


class _Backoff:
    """The deadline, the delays and the one log line per failed try of one wait."""

    def __init__(self, what: str, fix: str, timeout_s: float) -> None:
        self.what = what
        self.fix = fix
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s == 0 else time.monotonic() + timeout_s
        self.backoff = Backoff(OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S)

    def failed(self, exc: RetryableError) -> float:
        """Seconds to wait before the next try; `ConfigError` once the time is up."""
        delay_s = self.backoff.next_s()
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise ConfigError(
                f"{self.what} is still unavailable after {self.timeout_s:g} s ({exc}); {self.fix} "
                f"({TIMEOUT_HINT})"
            ) from exc
        if self.deadline is not None:
            delay_s = min(delay_s, self.deadline - now)
        log.warning(
            "waiting for %s: %s (try %d; next in %.1f s)", self.what, exc, self.backoff.failures, delay_s
        )
        return delay_s

    def succeeded(self) -> None:
        if self.backoff.failures:
            log.info("%s is available (after %d failed tries)", self.what, self.backoff.failures)


def wait_for(what: str, attempt: Callable[[], T], *, timeout_s: float, fix: str) -> T:
    """``attempt()`` until it returns, retrying on `RetryableError`; any other error ends the wait."""
    backoff = _Backoff(what, fix, timeout_s)
    while True:
        try:
            result = attempt()
        except RetryableError as exc:
            time.sleep(backoff.failed(exc))
            continue
        backoff.succeeded()
        return result


async def wait_for_async(what: str, attempt: Callable[[], T], *, timeout_s: float, fix: str) -> T:
    """As :func:`wait_for`, sleeping on the event loop (``attempt`` itself is a blocking call)."""
    backoff = _Backoff(what, fix, timeout_s)
    while True:
        try:
            result = attempt()
        except RetryableError as exc:
            await asyncio.sleep(backoff.failed(exc))
            continue
        backoff.succeeded()
        return result


def _redis_client(url: str, **options: object) -> redis.Redis:
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise ConfigError(f"DATAGEN_REDIS_URL is not a Redis URL ({exc}); e.g. redis://HOST:6379/0") from exc


def _ping(client: redis.Redis, shown: str) -> None:
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise ConfigError(
            f"Redis at {shown} refused the credentials ({exc}); fix the user and password in "
            "DATAGEN_REDIS_URL (redis://USER:PASSWORD@HOST:PORT/DB)"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise BackendUnavailableError(str(exc)) from exc
    except redis.ResponseError as exc:  # a database index the server does not have, ...
        raise ConfigError(f"Redis at {shown} refused the connection: {exc}; fix DATAGEN_REDIS_URL") from exc


def connect_redis(url: str, timeout_s: float, **options: object) -> redis.Redis:
    """A client of the Redis at ``url`` once it answers PING (blocking; see :func:`wait_for`)."""
    client = _redis_client(url, **options)
    shown = redacted_url(url)
    try:
        wait_for(f"Redis at {shown}", lambda: _ping(client, shown), timeout_s=timeout_s, fix=_REDIS_FIX)
    except BaseException:
        client.close()
        raise
    return client


async def connect_redis_async(url: str, timeout_s: float, **options: object) -> redis.Redis:
    """As :func:`connect_redis`, waiting on the event loop."""
    client = _redis_client(url, **options)
    shown = redacted_url(url)
    try:
        await wait_for_async(
            f"Redis at {shown}", lambda: _ping(client, shown), timeout_s=timeout_s, fix=_REDIS_FIX
        )
    except BaseException:
        client.close()
        raise
    return client


def _claim(storage: Storage, namespace: str) -> None:
    try:
        storage.claim_namespace(namespace)
    except StorageError as exc:
        cause = exc.__cause__
        permanent = isinstance(cause, FileNotFoundError) and not storage.is_local
        if permanent or (isinstance(cause, OSError) and cause.errno in _PERMANENT_ERRNOS):
            raise ConfigError(
                f"storage {storage.root} cannot be used: {exc}; fix its permissions, or point "
                "DATAGEN_STORAGE (--storage) at a directory or bucket this process can write"
            ) from exc
        raise


def claim_storage(storage: Storage, namespace: str, timeout_s: float) -> None:
    """:meth:`Storage.claim_namespace`, waiting while the storage is unavailable (blocking)."""
    wait_for(
        f"storage {storage.root}",
        lambda: _claim(storage, namespace),
        timeout_s=timeout_s,
        fix=_STORAGE_FIX,
    )


async def claim_storage_async(storage: Storage, namespace: str, timeout_s: float) -> None:
    """As :func:`claim_storage`, waiting on the event loop."""
    await wait_for_async(
        f"storage {storage.root}",
        lambda: _claim(storage, namespace),
        timeout_s=timeout_s,
        fix=_STORAGE_FIX,
    )
