"""Process settings, read from ``DATAGEN_*`` environment variables at startup (never at import).

One model per process kind; CLI flags are passed as keyword arguments and override the
environment. Unknown ``DATAGEN_*`` variables are refused, because a typo such as
``DATAGEN_REDIS_ULR`` would otherwise silently fall back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from datagen.errors import ConfigError
from datagen.states import EngineChoice

__all__ = [
    "CommonSettings",
    "CoordinatorSettings",
    "WorkerSettings",
    "check_environment",
    "describe_invalid",
    "load",
]

ENV_PREFIX = "DATAGEN_"

S = TypeVar("S", bound=BaseSettings)

DEFAULT_STORAGE = "./datagen-data"
DEFAULT_NAMESPACE = "datagen"
DEFAULT_COORDINATOR_HOST = "127.0.0.1"
DEFAULT_COORDINATOR_PORT = 8000
DEFAULT_COORDINATOR_URL = "http://127.0.0.1:8000"
DEFAULT_METRICS_PORT = 9400
# Long-running processes wait this long for Redis and storage at startup (0 = forever).
DEFAULT_STARTUP_TIMEOUT_S = 300.0
# `datagen submit` waits this long for a worker to report a server (0 = not at all).
DEFAULT_WAIT_FOR_SERVERS_S = 60.0
DEFAULT_LOG_LEVEL = "INFO"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_SHORT_MAX_NEW_TOKENS = 2048
DEFAULT_LONG_MAX_NEW_TOKENS = 16384
DEFAULT_LONG_THRESHOLD_TOKENS = 4096
DEFAULT_ENQUEUE_CHUNK = 1000
DEFAULT_MAX_UPLOAD_BYTES = 20 * 1024**3
DEFAULT_SHORT_CONCURRENCY = 64
DEFAULT_LONG_CONCURRENCY = 16
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
# A worker's connect timeout to its SGLang servers (`workers.engines.sglang.ClientTimeouts`).
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_SHORT_READ_TIMEOUT_S = 600.0
DEFAULT_LONG_READ_TIMEOUT_S = 3600.0
DEFAULT_MAX_ATTEMPTS = 4
# A generation request's retries (`workers.run.generate`): backoff from the base, doubling up to the max.
DEFAULT_RETRY_BASE_S = 1.0
DEFAULT_RETRY_MAX_S = 30.0
# A long-running process waiting for an unreachable Redis (or storage root): the backoff starts
# here and doubles up to the max, at startup (`datagen.control.startup`) and through an outage
# (`workers.run.redisretry`), so the service is back within seconds of Redis.
OUTAGE_RETRY_FIRST_S = 0.5
OUTAGE_RETRY_MAX_S = 5.0
DEFAULT_COMMIT_INTERVAL_S = 2.0
DEFAULT_SHARD_MAX_RECORDS = 1000
# A worker claims nothing while this many of its records wait for their shard commit (storage that
# cannot be written): memory and the claim stay bounded. Far above what a commit interval gathers.
DEFAULT_MAX_UNCOMMITTED_RECORDS = 2048
DEFAULT_POLL_INTERVAL_S = 0.2
DEFAULT_HEALTH_INTERVAL_S = 5.0
DEFAULT_HEALTH_TIMEOUT_S = 20.0
DEFAULT_HEALTH_TIMEOUTS_TO_DOWN = 3
DEFAULT_CONTROL_INTERVAL_S = 1.0
DEFAULT_CONTROLLER_INTERVAL_S = 2.0
DEFAULT_CONTROLLER_FLOOR = 0.05
# Slow start: the KV controller's first in-flight target per server and its pace until it finds
# the server's limit (0: start at the ceiling).
DEFAULT_CONTROLLER_INITIAL_TARGET = 16
DEFAULT_CONTROLLER_SLOW_START_INTERVAL_S = 0.5
DEFAULT_REAPER_INTERVAL_S = 10.0
DEFAULT_MAX_WORKER_LOSSES = 3
DEFAULT_DRAIN_TIMEOUT_S = 120.0
DEFAULT_MAX_QUEUED_PER_CLASS = 200_000
DEFAULT_RESULT_TTL_S = 600
DEFAULT_FAILURE_TTL_S = 7 * 24 * 3600


class CommonSettings(BaseSettings):
    """What every process needs: where Redis and storage are, and the key namespace."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    redis_url: str | None = Field(default=None, description="redis:// or rediss:// URL")
    storage: str = DEFAULT_STORAGE
    namespace: str = Field(default=DEFAULT_NAMESPACE, pattern=r"^[A-Za-z0-9_]{1,32}$")
    log_level: str = DEFAULT_LOG_LEVEL
    startup_timeout_s: float = Field(
        default=DEFAULT_STARTUP_TIMEOUT_S, ge=0, description="wait for Redis and storage; 0 = forever"
    )

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return level

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ConfigError(
                "DATAGEN_REDIS_URL is not set: point it at Redis, e.g. redis://127.0.0.1:6379/0"
            )
        return self.redis_url


class CoordinatorSettings(CommonSettings):
    host: str = DEFAULT_COORDINATOR_HOST
    port: int = Field(default=DEFAULT_COORDINATOR_PORT, ge=0, le=65535)
    api_token: str | None = None
    allow_insecure_bind: bool = False
    enqueue_chunk: int = Field(default=DEFAULT_ENQUEUE_CHUNK, ge=1, le=100_000)
    max_upload_bytes: int = Field(default=DEFAULT_MAX_UPLOAD_BYTES, ge=1)
    result_ttl_s: int = Field(default=DEFAULT_RESULT_TTL_S, ge=1)
    failure_ttl_s: int = Field(default=DEFAULT_FAILURE_TTL_S, ge=1)
    max_worker_losses: int = Field(default=DEFAULT_MAX_WORKER_LOSSES, ge=1, le=100)
    # Tokenizers and templates are loaded (and with trust_remote_code, executed) on the
    # coordinator: only these path prefixes and hub ids may be named in a job spec, besides the
    # bundled DeepSeek tokenizer and the shipped templates. "*" allows anything.
    tokenizer_allowlist: str = Field(default="", description="comma list of path prefixes or hub ids")
    allow_trust_remote_code: bool = False
    max_queued_per_class: int = Field(default=DEFAULT_MAX_QUEUED_PER_CLASS, ge=1)

    def allowlist(self) -> list[str]:
        return [entry.strip() for entry in self.tokenizer_allowlist.split(",") if entry.strip()]


class WorkerSettings(CommonSettings):
    servers: str = Field(default="", description="comma list of NAME=URL or URL")
    engine: EngineChoice = Field(
        default=EngineChoice.AUTO,
        description="sglang, vllm, or auto (asked of each server); a vllm+http:// or sglang+http:// URL wins",
    )
    short_concurrency: int = Field(default=DEFAULT_SHORT_CONCURRENCY, ge=0, le=10_000)
    long_concurrency: int = Field(default=DEFAULT_LONG_CONCURRENCY, ge=0, le=10_000)
    metrics_port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    heartbeat_interval_s: float = Field(default=DEFAULT_HEARTBEAT_INTERVAL_S, gt=0, le=30)
    connect_timeout_s: float = Field(default=DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    short_read_timeout_s: float = Field(default=DEFAULT_SHORT_READ_TIMEOUT_S, gt=0)
    long_read_timeout_s: float = Field(default=DEFAULT_LONG_READ_TIMEOUT_S, gt=0)
    max_attempts: int = Field(default=DEFAULT_MAX_ATTEMPTS, ge=1, le=100)
    retry_base_s: float = Field(default=DEFAULT_RETRY_BASE_S, ge=0)
    retry_max_s: float = Field(default=DEFAULT_RETRY_MAX_S, ge=0)
    commit_interval_s: float = Field(default=DEFAULT_COMMIT_INTERVAL_S, gt=0)
    shard_max_records: int = Field(default=DEFAULT_SHARD_MAX_RECORDS, ge=1)
    max_uncommitted_records: int = Field(
        default=DEFAULT_MAX_UNCOMMITTED_RECORDS,
        ge=1,
        description="records waiting for their shard commit at which the worker stops claiming",
    )
    poll_interval_s: float = Field(default=DEFAULT_POLL_INTERVAL_S, gt=0)
    # Fault tests only: how long a committed shard's acknowledgement waits (kill -9 in between).
    test_ack_delay_s: float = Field(default=0.0, ge=0, le=60)
    health_interval_s: float = Field(default=DEFAULT_HEALTH_INTERVAL_S, gt=0)
    health_timeout_s: float = Field(default=DEFAULT_HEALTH_TIMEOUT_S, gt=0)
    health_timeouts_to_down: int = Field(default=DEFAULT_HEALTH_TIMEOUTS_TO_DOWN, ge=1)
    control_interval_s: float = Field(default=DEFAULT_CONTROL_INTERVAL_S, gt=0, le=2)
    kv_controller: bool = True
    controller_interval_s: float = Field(default=DEFAULT_CONTROLLER_INTERVAL_S, gt=0)
    controller_floor: float = Field(default=DEFAULT_CONTROLLER_FLOOR, gt=0, le=1)
    controller_initial_target: int = Field(default=DEFAULT_CONTROLLER_INITIAL_TARGET, ge=0, le=10_000)
    controller_slow_start_interval_s: float = Field(default=DEFAULT_CONTROLLER_SLOW_START_INTERVAL_S, gt=0)
    reaper_interval_s: float = Field(default=DEFAULT_REAPER_INTERVAL_S, gt=0)
    drain_timeout_s: float = Field(default=DEFAULT_DRAIN_TIMEOUT_S, ge=0)
    backup_requests: bool = Field(
        default=True, description="race stragglers on a faster idle server at the end of a run"
    )
    api_key: SecretStr | None = Field(
        default=None, description="servers' --api-key (SGLang or vLLM), sent to those without their own"
    )
    server_api_keys: SecretStr | None = Field(default=None, description="comma list of NAME=KEY")
    server_api_keys_file: Path | None = Field(default=None, description="file of NAME=KEY lines")

    def server_keys(self) -> dict[str, SecretStr]:
        """Per-server API keys from DATAGEN_SERVER_API_KEYS and the lines of DATAGEN_SERVER_API_KEYS_FILE.

        Messages name the variable and the entry's position, never a key.
        """
        keys: dict[str, SecretStr] = {}
        if self.server_api_keys is not None:
            entries = self.server_api_keys.get_secret_value().split(",")
            _add_keys(keys, entries, "DATAGEN_SERVER_API_KEYS entry")
        if self.server_api_keys_file is not None:
            try:
                lines = self.server_api_keys_file.read_text("utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"cannot read DATAGEN_SERVER_API_KEYS_FILE {self.server_api_keys_file}: {exc}"
                ) from exc
            entries = [line for line in lines if not line.lstrip().startswith("#")]
            _add_keys(keys, entries, f"line of {self.server_api_keys_file}")
        return keys


def _add_keys(keys: dict[str, SecretStr], entries: list[str], where: str) -> None:
    for position, entry in enumerate(entries, 1):
        if not entry.strip():
            continue
        name, sep, key = (part.strip() for part in entry.partition("="))
        if not sep or not name or not key:
            raise ConfigError(f"{where} {position} is not NAME=KEY; write one server name and its key")
        if name in keys:
            raise ConfigError(f"{where} {position}: server {name} already has an API key; give it one")
        keys[name] = SecretStr(key)


class ClientSettings(CommonSettings):
    coordinator_url: str = DEFAULT_COORDINATOR_URL
    api_token: str | None = None
    wait_for_servers_s: float = Field(
        default=DEFAULT_WAIT_FOR_SERVERS_S, ge=0, description="submit: wait for a worker; 0 = no wait"
    )


_ALL_MODELS: tuple[type[BaseSettings], ...] = (CoordinatorSettings, WorkerSettings, ClientSettings)


def known_variables() -> set[str]:
    return {ENV_PREFIX + name.upper() for model in _ALL_MODELS for name in model.model_fields}


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known_variables())
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}; "
            f"known DATAGEN_* variables are: {', '.join(sorted(known_variables()))}"
        )


def load(model: type[S], **overrides: object) -> S:
    """Build a settings model from the environment plus CLI overrides (``None`` means not given)."""
    check_environment()
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    try:
        return model(**given)
    except ValidationError as exc:
        raise ConfigError(f"invalid settings: {describe_invalid(exc, given)}") from exc


# Values of these fields are never repeated in a message (a URL may carry a password).
_SECRET_PARTS = ("key", "token", "url", "password")


def describe_invalid(exc: ValidationError, flags: Mapping[str, object] | None = None) -> str:
    """A validation error on one line: each field as its flag (when given as one) or its variable,
    the value (unless it may be a secret) and what is wrong."""
    problems = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error.get("loc", ())) or "settings"
        where = f"--{name.replace('_', '-')}" if name in (flags or {}) else ENV_PREFIX + name.upper()
        value = error.get("input")
        secret = any(part in name for part in _SECRET_PARTS)
        shown = "" if secret or isinstance(value, dict) or value is None else f"={value!r}"
        problems.append(f"{where}{shown}: {error.get('msg', 'invalid')}")
    return "; ".join(problems)
