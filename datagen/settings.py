"""Process settings, read from ``DATAGEN_*`` environment variables at startup (never at import).

One model per process kind; CLI flags are passed as keyword arguments and override the
environment, which overrides a config file's values (``--config``, `FileValues`), which override the
defaults. Unknown ``DATAGEN_*`` variables are refused, because a typo such as
``DATAGEN_REDIS_ULR`` would otherwise silently fall back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from datagen.errors import ConfigError
from datagen.states import EngineChoice

__all__ = [
    "CommonSettings",
    "CoordinatorSettings",
    "FileValues",
    "WorkerSettings",
    "check_environment",
    "describe_invalid",
    "load",
]

ENV_PREFIX = "DATAGEN_"
# A field's json_schema_extra key marking a hook for the tests, left out of the docs.
TEST_HOOK = "test_hook"

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
# `datagen submit --wait` and `datagen wait` in a log (stderr not a terminal): a progress line this often.
DEFAULT_PROGRESS_INTERVAL_S = 30.0
MIN_PROGRESS_INTERVAL_S = 0.1
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

    redis_url: str | None = Field(
        default=None,
        description="redis:// or rediss:// URL of Redis; required (`datagen demo` starts its own)",
    )
    storage: str = Field(
        default=DEFAULT_STORAGE,
        description=(
            "where records and uploads live: a directory, or an fsspec URL such as `s3://bucket/prefix` "
            "(credentials and endpoint from `AWS_*`); several nodes need storage they all reach"
        ),
    )
    namespace: str = Field(
        default=DEFAULT_NAMESPACE,
        pattern=r"^[A-Za-z0-9_]{1,32}$",
        description=(
            "Redis key and queue-name prefix; a storage root belongs to one namespace (its "
            "`datagen-namespace.json`), so give each namespace its own `DATAGEN_STORAGE`"
        ),
    )
    log_level: str = Field(
        default=DEFAULT_LOG_LEVEL,
        description="DEBUG, INFO, WARNING, ERROR or CRITICAL; DEBUG also shows tracebacks (as `--debug`)",
    )
    startup_timeout_s: float = Field(
        default=DEFAULT_STARTUP_TIMEOUT_S,
        ge=0,
        description=(
            "how long the coordinator and workers wait for Redis and storage at startup, one log line per "
            "try (backoff 0.5 s doubling to 5 s); 0 = forever. A wrong password, URL or storage permission "
            "fails at once"
        ),
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
    host: str = Field(
        default=DEFAULT_COORDINATOR_HOST,
        description=(
            "the coordinator's bind address; beyond loopback it needs `DATAGEN_API_TOKEN` or "
            "`DATAGEN_ALLOW_INSECURE_BIND=1`"
        ),
    )
    port: int = Field(
        default=DEFAULT_COORDINATOR_PORT, ge=0, le=65535, description="the coordinator's HTTP port"
    )
    api_token: str | None = Field(
        default=None,
        description=(
            "bearer token for every route but `/healthz` and `/metrics` (the coordinator checks it, the CLI "
            "sends it)"
        ),
    )
    allow_insecure_bind: bool = Field(
        default=False, description="lets the coordinator listen beyond loopback without `DATAGEN_API_TOKEN`"
    )
    enqueue_chunk: int = Field(
        default=DEFAULT_ENQUEUE_CHUNK,
        ge=1,
        le=100_000,
        description="rows ingested and enqueued per chunk (one Redis transaction and one checkpoint each)",
    )
    ingest_processes: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "processes that parse and render uploaded rows, shared by every ingestion (0: in each "
            "ingestion's own thread); each loads the jobs' tokenizers, so count their memory. For "
            "datasets of a million rows or more give it the coordinator's cores less one: a "
            "chat-length row costs about 150 µs of CPU to render, the coordinator's own work about "
            "55 µs, which bounds one coordinator near 18,000 rows/s"
        ),
    )
    max_upload_bytes: int = Field(
        default=DEFAULT_MAX_UPLOAD_BYTES, ge=1, description="largest dataset upload the coordinator accepts"
    )
    result_ttl_s: int = Field(
        default=DEFAULT_RESULT_TTL_S, ge=1, description="how long RQ keeps a finished prompt's job hash"
    )
    failure_ttl_s: int = Field(
        default=DEFAULT_FAILURE_TTL_S,
        ge=1,
        description="how long RQ keeps a failed prompt's job in its failed registry",
    )
    max_worker_losses: int = Field(
        default=DEFAULT_MAX_WORKER_LOSSES,
        ge=1,
        le=100,
        description=(
            "RQ retries given to each prompt, spent only when its worker dies; one more loss fails it "
            "(`WorkerLost`)"
        ),
    )
    # Tokenizers and templates are loaded (and with trust_remote_code, executed) on the
    # coordinator: only these path prefixes and hub ids may be named in a job spec, besides the
    # bundled DeepSeek tokenizer and the shipped templates. "*" allows anything.
    tokenizer_allowlist: str = Field(
        default="",
        description=(
            "comma list of absolute path prefixes and hub ids a job spec may name as tokenizer, template or "
            "decontamination file (`*` = any); the bundled DeepSeek tokenizer and the shipped templates are "
            "always allowed"
        ),
    )
    # A dataset given by reference (`POST /jobs` ``dataset_url``) is read by the coordinator with its
    # own credentials: only URLs and paths under these prefixes may be named.
    dataset_allowlist: str = Field(
        default="",
        description=(
            "comma list of URL prefixes (`s3://bucket/datasets/`) and absolute local paths a job may name "
            "as `dataset_url` (read by the coordinator, nothing uploaded); empty refuses every reference"
        ),
    )
    allow_trust_remote_code: bool = Field(
        default=False,
        description=(
            "permits `trust_remote_code` in job specs (it runs the tokenizer repository's code on the "
            "coordinator)"
        ),
    )
    max_queued_per_class: int = Field(
        default=DEFAULT_MAX_QUEUED_PER_CLASS,
        ge=1,
        description=(
            "a job's ingestion waits (`waiting_for_room`) while its backlog of a class holds this many "
            "prompts, so Redis holds a bounded window of any dataset; size Redis's `maxmemory` for it (about"
            " 2.5 KB + 2.4 bytes per token per queued prompt)"
        ),
    )

    def allowlist(self) -> list[str]:
        return [entry.strip() for entry in self.tokenizer_allowlist.split(",") if entry.strip()]

    def dataset_prefixes(self) -> list[str]:
        return [entry.strip() for entry in self.dataset_allowlist.split(",") if entry.strip()]


# Capture (jobs with features): speculators waits 10 s for the lock; a 32k-token sample on a busy
# server takes longer to gather and write, so the bound is generous.
DEFAULT_CAPTURE_LOCK_TIMEOUT_S = 60.0
DEFAULT_CAPTURE_READ_TIMEOUT_S = 600.0
DEFAULT_CAPTURE_ORPHAN_AGE_S = 900.0
DEFAULT_CAPTURE_DIR_MAX_BYTES = 64 * 1024**3
DEFAULT_CAPTURE_CONCURRENCY = 64


class WorkerSettings(CommonSettings):
    servers: str = Field(
        default="",
        description=(
            "comma list of NAME=URL (a bare URL is named host-port); a URL with credentials, a query string "
            "or a fragment is refused (keys go in `DATAGEN_SERVER_API_KEYS`)"
        ),
    )
    engine: EngineChoice = Field(
        default=EngineChoice.AUTO,
        description="sglang, vllm, or auto (asked of each server); a vllm+http:// or sglang+http:// URL wins",
    )
    capture_servers: str = Field(
        default="",
        description=(
            "comma list of NAME=URL of vLLM capture servers (`extract_hidden_states`), for jobs with "
            "`features`; their files are read from `DATAGEN_CAPTURE_DIR`"
        ),
    )
    capture_dir: Path | None = Field(
        default=None,
        description=(
            "the capture servers' `shared_storage_path` as this node sees it (the worker reads and deletes "
            "their files there); needed with capture servers"
        ),
    )
    capture_lock_timeout_s: float = Field(
        default=DEFAULT_CAPTURE_LOCK_TIMEOUT_S,
        gt=0,
        description="how long a capture server may take to write its file after answering",
    )
    capture_read_timeout_s: float = Field(
        default=DEFAULT_CAPTURE_READ_TIMEOUT_S, gt=0, description="read timeout of one capture request"
    )
    capture_orphan_age_s: float = Field(
        default=DEFAULT_CAPTURE_ORPHAN_AGE_S,
        gt=0,
        description=(
            "files in the capture directory no request of this worker waits for are deleted at this age "
            "(aborted and timed-out requests leave them)"
        ),
    )
    capture_dir_max_bytes: int = Field(
        default=DEFAULT_CAPTURE_DIR_MAX_BYTES,
        ge=0,
        description="no new capture is sent while the capture directory holds more than this (0: no cap)",
    )
    capture_layers: str = Field(
        default="",
        description=(
            "comma list of the layer ids the capture servers were launched with "
            "(eagle_aux_hidden_state_layer_ids): vLLM does not report them, so without it only their count "
            "is checked; with it, a job with other layers is not sent to them"
        ),
    )
    capture_concurrency: int = Field(
        default=DEFAULT_CAPTURE_CONCURRENCY,
        ge=1,
        le=10_000,
        description="most capture requests in flight per capture server",
    )
    short_concurrency: int = Field(
        default=DEFAULT_SHORT_CONCURRENCY,
        ge=0,
        le=10_000,
        description="most `short` requests in flight per server (the KV controller moves below it)",
    )
    long_concurrency: int = Field(
        default=DEFAULT_LONG_CONCURRENCY,
        ge=0,
        le=10_000,
        description="most `long` requests in flight per server (the KV controller moves below it)",
    )
    metrics_port: int = Field(
        default=DEFAULT_METRICS_PORT,
        ge=0,
        le=65535,
        description=(
            "the worker's Prometheus port; unset, the first free of 9400-9463 (several workers on one host "
            "need no flag); set, that port or a one-line error; 0 = off"
        ),
    )
    heartbeat_interval_s: float = Field(
        default=DEFAULT_HEARTBEAT_INTERVAL_S,
        gt=0,
        le=30,
        description="how often a worker reports itself alive (at most 30 s)",
    )
    connect_timeout_s: float = Field(
        default=DEFAULT_CONNECT_TIMEOUT_S, gt=0, description="connect timeout to a server"
    )
    short_read_timeout_s: float = Field(
        default=DEFAULT_SHORT_READ_TIMEOUT_S, gt=0, description="read timeout of a `short` generation request"
    )
    long_read_timeout_s: float = Field(
        default=DEFAULT_LONG_READ_TIMEOUT_S, gt=0, description="read timeout of a `long` generation request"
    )
    max_attempts: int = Field(
        default=DEFAULT_MAX_ATTEMPTS,
        ge=1,
        le=100,
        description="attempts per prompt before it fails (server outages do not use them up)",
    )
    retry_base_s: float = Field(
        default=DEFAULT_RETRY_BASE_S,
        ge=0,
        description="first backoff between a prompt's attempts, doubling with jitter",
    )
    retry_max_s: float = Field(
        default=DEFAULT_RETRY_MAX_S, ge=0, description="longest backoff between a prompt's attempts"
    )
    commit_interval_s: float = Field(
        default=DEFAULT_COMMIT_INTERVAL_S,
        gt=0,
        description="group commit: how long finished records wait before their shard is written",
    )
    shard_max_records: int = Field(
        default=DEFAULT_SHARD_MAX_RECORDS, ge=1, description="group commit: most records in one Parquet shard"
    )
    max_uncommitted_records: int = Field(
        default=DEFAULT_MAX_UNCOMMITTED_RECORDS,
        ge=1,
        description=(
            "records waiting for their shard commit (storage that cannot be written) at which the worker "
            "stops claiming; a job with half of it waiting gets no more prompts from this worker"
        ),
    )
    poll_interval_s: float = Field(
        default=DEFAULT_POLL_INTERVAL_S,
        gt=0,
        description="how often an idle worker looks for prompts to claim",
    )
    # Fault tests only: how long a committed shard's acknowledgement waits (kill -9 in between).
    # Marked a test hook: the configuration reference leaves it out.
    test_ack_delay_s: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="fault tests only: how long a committed shard's acknowledgement waits",
        json_schema_extra={TEST_HOOK: True},
    )
    health_interval_s: float = Field(
        default=DEFAULT_HEALTH_INTERVAL_S, gt=0, description="how often each server's `/health` is probed"
    )
    health_timeout_s: float = Field(
        default=DEFAULT_HEALTH_TIMEOUT_S, gt=0, description="timeout of one `/health` probe"
    )
    health_timeouts_to_down: int = Field(
        default=DEFAULT_HEALTH_TIMEOUTS_TO_DOWN,
        ge=1,
        description="timed-out probes in a row after which a server is `down`",
    )
    control_interval_s: float = Field(
        default=DEFAULT_CONTROL_INTERVAL_S,
        gt=0,
        le=2,
        description="how often pauses and the shared in-flight targets are read (at most 2 s)",
    )
    kv_controller: bool = Field(
        default=True,
        description=(
            "the KV-pressure controller, which moves each server's in-flight target from its `/metrics` "
            "(off: fixed limits)"
        ),
    )
    controller_interval_s: float = Field(
        default=DEFAULT_CONTROLLER_INTERVAL_S,
        gt=0,
        description="how often the KV controller reads each server's `/metrics`",
    )
    controller_floor: float = Field(
        default=DEFAULT_CONTROLLER_FLOOR,
        gt=0,
        le=1,
        description="the KV controller's lowest target, as a fraction of the configured concurrency",
    )
    controller_initial_target: int = Field(
        default=DEFAULT_CONTROLLER_INITIAL_TARGET,
        ge=0,
        le=10_000,
        description=(
            "slow start: the KV controller's first in-flight target per server (0: start at the ceiling)"
        ),
    )
    controller_slow_start_interval_s: float = Field(
        default=DEFAULT_CONTROLLER_SLOW_START_INTERVAL_S,
        gt=0,
        description="the KV controller's sampling interval during slow start",
    )
    reaper_interval_s: float = Field(
        default=DEFAULT_REAPER_INTERVAL_S,
        gt=0,
        description="how often dead workers' prompts are looked for and handed back",
    )
    drain_timeout_s: float = Field(
        default=DEFAULT_DRAIN_TIMEOUT_S,
        ge=0,
        description="how long SIGTERM waits for in-flight requests before handing them back",
    )
    backup_requests: bool = Field(
        default=True, description="race stragglers on a faster idle server at the end of a run"
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="servers' `--api-key` (SGLang or vLLM), sent to those without a key of their own",
    )
    server_api_keys: SecretStr | None = Field(
        default=None,
        description=(
            "per-server keys, a comma list of NAME=KEY; a name that is not a `--server` is refused at "
            "startup; keys are never logged"
        ),
    )
    server_api_keys_file: Path | None = Field(
        default=None, description="a file of NAME=KEY lines (`#` comments), as `DATAGEN_SERVER_API_KEYS`"
    )

    def capture_layer_ids(self) -> tuple[int, ...] | None:
        """``capture_layers`` as vLLM orders them (ascending, once each); None when not declared."""
        if not self.capture_layers.strip():
            return None
        try:
            ids = {int(part) for part in self.capture_layers.split(",") if part.strip()}
        except ValueError as exc:
            raise ConfigError(
                f"DATAGEN_CAPTURE_LAYERS {self.capture_layers!r}: give comma-separated layer ids, "
                "e.g. 2,16,29,32"
            ) from exc
        return tuple(sorted(ids))

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
    coordinator_url: str = Field(
        default=DEFAULT_COORDINATOR_URL, description="where the CLI finds the coordinator"
    )
    api_token: str | None = Field(
        default=None,
        description=(
            "bearer token for every route but `/healthz` and `/metrics` (the coordinator checks it, the CLI "
            "sends it)"
        ),
    )
    wait_for_servers_s: float = Field(
        default=DEFAULT_WAIT_FOR_SERVERS_S,
        ge=0,
        description=(
            "how long `datagen submit` waits for the coordinator and for a worker's server report "
            "(`--wait-for-servers-s`); 0 = no wait"
        ),
    )
    progress_interval_s: float = Field(
        default=DEFAULT_PROGRESS_INTERVAL_S,
        ge=MIN_PROGRESS_INTERVAL_S,
        description=(
            "how often `datagen submit --wait` and `datagen wait` write the progress line when stderr is not "
            "a terminal (a log, nohup, CI) (`--progress-every-s`)"
        ),
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


@dataclass(frozen=True)
class FileValues:
    """Settings read from a config file (``--config FILE``), by field name, as the environment
    spells values (strings): below the environment, above the defaults."""

    path: str
    values: Mapping[str, str]

    def below(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The values that no ``DATAGEN_*`` variable sets (pydantic-settings reads names in any case)."""
        present = {name.upper() for name in environ}
        return {k: v for k, v in self.values.items() if ENV_PREFIX + k.upper() not in present}


def load(model: type[S], file: FileValues | None = None, **overrides: object) -> S:
    """Build a settings model from CLI overrides (``None`` means not given), the environment, and
    ``file`` (a config file's values), in that order of precedence."""
    check_environment()
    from_file = FileValues(file.path, file.below(os.environ)) if file else None
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    try:
        return model(**{**(from_file.values if from_file else {}), **given})
    except ValidationError as exc:
        raise ConfigError(f"invalid settings: {describe_invalid(exc, given, from_file)}") from exc


# Values of these fields are never repeated in a message (a URL may carry a password).
_SECRET_PARTS = ("key", "token", "url", "password")


def describe_invalid(
    exc: ValidationError, flags: Mapping[str, object] | None = None, file: FileValues | None = None
) -> str:
    """A validation error on one line: each field as its flag (when given as one), its key in the
    config file (when it came from there) or its variable, the value (unless it may be a secret) and
    what is wrong."""
    problems = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error.get("loc", ())) or "settings"
        where, suffix = ENV_PREFIX + name.upper(), ""
        if name in (flags or {}):
            where = f"--{name.replace('_', '-')}"
        elif file is not None and name in file.values:
            where, suffix = name, f" in {file.path}"
        value = error.get("input")
        secret = any(part in name for part in _SECRET_PARTS)
        shown = "" if secret or isinstance(value, dict) or value is None else f"={value!r}"
        problems.append(f"{where}{shown}{suffix}: {error.get('msg', 'invalid')}")
    return "; ".join(problems)
