"""Waiting for Redis and storage at startup (datagen/control/startup.py), against a real Redis and real
directories: retried failures log one line per try and end in one `ConfigError`; failures that
retrying cannot fix end the wait at once."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from datagen.control.startup import claim_storage, connect_redis, redacted_url
from datagen.errors import ConfigError
from datagen.records.storage import Storage
from datagen_cli.local.redis_server import free_port


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("rediss://user:pw@h:1/2", "rediss://user:***@h:1/2"),
    ],
)
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


def test_a_redis_that_answers_is_connected_without_a_log_line(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="datagen.control.startup"):
        client = connect_redis(redis_url, timeout_s=5)
    try:
        assert client.ping()
    finally:
        client.close()
    assert not caplog.records


def test_a_redis_that_never_comes_is_one_line_per_try_then_one_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://user:secret@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with (
        caplog.at_level(logging.INFO, logger="datagen.control.startup"),
        pytest.raises(ConfigError) as refused,
    ):
        connect_redis(url, timeout_s=1.2)
    assert time.monotonic() - started < 5
    message = str(refused.value)
    assert "is still unavailable after 1.2 s" in message and "DATAGEN_REDIS_URL" in message
    assert "secret" not in message and "DATAGEN_STARTUP_TIMEOUT_S=0" in message
    tries = [r.getMessage() for r in caplog.records]
    assert len(tries) >= 2 and all("waiting for Redis at redis://user:***@" in t for t in tries)
    assert all("secret" not in t for t in tries)


def test_a_url_that_is_not_redis_fails_at_once() -> None:
    with pytest.raises(ConfigError, match="DATAGEN_REDIS_URL is not a Redis URL"):
        connect_redis("http://127.0.0.1:1", timeout_s=0)


def test_a_storage_root_under_a_file_fails_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot be used: .*DATAGEN_STORAGE"):
        claim_storage(Storage(blocker / "data"), "ns", timeout_s=0)  # 0 = would wait forever
    assert time.monotonic() - started < 2


def test_a_storage_of_another_namespace_fails_at_once(tmp_path: Path) -> None:
    claim_storage(Storage(tmp_path), "first", timeout_s=1)
    with pytest.raises(ConfigError, match="belongs to Redis namespace 'first'"):
        claim_storage(Storage(tmp_path), "second", timeout_s=0)
