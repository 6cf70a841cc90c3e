from __future__ import annotations

import pytest

from datagen.errors import ConfigError
from datagen.settings import ClientSettings, CoordinatorSettings, WorkerSettings, check_environment, load


def test_env_is_read_at_load_and_cli_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_REDIS_URL", "redis://example:6379/1")
    monkeypatch.setenv("DATAGEN_SHORT_CONCURRENCY", "7")
    settings = load(WorkerSettings, short_concurrency=9, long_concurrency=None)
    assert settings.redis_url == "redis://example:6379/1"
    assert settings.short_concurrency == 9  # the flag wins over the environment
    assert settings.long_concurrency == 16  # None means "flag not given"


def test_unknown_datagen_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_REDIS_ULR", "redis://typo")
    with pytest.raises(ConfigError, match="DATAGEN_REDIS_ULR"):
        load(CoordinatorSettings)


def test_check_environment_accepts_every_declared_variable() -> None:
    # Every field of every process's settings, named here rather than through known_variables().
    declared = {
        "DATAGEN_" + name.upper()
        for model in (CoordinatorSettings, WorkerSettings, ClientSettings)
        for name in model.model_fields
    }
    assert {"DATAGEN_SERVERS", "DATAGEN_API_TOKEN", "DATAGEN_COORDINATOR_URL", "DATAGEN_PORT"} <= declared
    environ = dict.fromkeys(declared, "1") | {"OTHER": "1"}
    check_environment(environ)  # raises ConfigError for any it does not know
    with pytest.raises(ConfigError, match=r"unknown environment variable\(s\) DATAGEN_TYPO;"):
        check_environment(environ | {"DATAGEN_TYPO": "1"})


def test_invalid_value_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_PORT", "not-a-port")
    with pytest.raises(ConfigError, match="port"):
        load(CoordinatorSettings)


def test_missing_redis_url_says_what_to_set() -> None:
    with pytest.raises(ConfigError, match="DATAGEN_REDIS_URL"):
        load(CoordinatorSettings).require_redis_url()
