"""Invalid settings are one line naming the flag or the variable to fix, never a secret."""

from __future__ import annotations

import pytest

from datagen.errors import ConfigError
from datagen.settings import ClientSettings, CoordinatorSettings, WorkerSettings, load


def test_a_bad_flag_is_named_as_the_flag() -> None:
    with pytest.raises(ConfigError) as refused:
        load(WorkerSettings, metrics_port=70000)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("invalid settings: --metrics-port=70000: ")


def test_a_bad_variable_is_named_as_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STARTUP_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match=r"DATAGEN_STARTUP_TIMEOUT_S='-1': "):
        load(CoordinatorSettings)


def test_log_levels_are_checked_and_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_LOG_LEVEL", "debug")
    assert load(ClientSettings).log_level == "DEBUG"
    monkeypatch.setenv("DATAGEN_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match=r"DATAGEN_LOG_LEVEL='loud': .*one of DEBUG, INFO"):
        load(ClientSettings)


def test_values_that_may_hold_a_secret_are_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_API_TOKEN", "hunter2")
    with pytest.raises(ConfigError) as refused:
        load(ClientSettings, coordinator_url=["not", "a", "string", "hunter2"])
    assert "hunter2" not in str(refused.value) and "--coordinator-url" in str(refused.value)


def test_waits_default_to_named_constants() -> None:
    settings = load(ClientSettings)
    assert settings.wait_for_servers_s == 60 and settings.startup_timeout_s == 300
