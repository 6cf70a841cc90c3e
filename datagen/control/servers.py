"""What workers publish about the SGLang servers they use, read by the coordinator and other workers.

Three records per server, all written by workers, each with one model here that encodes it as
stored and decodes it:

- :class:`ServerInfo` in ``servers_index`` (one hash, one JSON entry per server name): what the
  server said about itself when a worker last accepted or refused it. Entries are never deleted,
  so a server that no worker uses any more keeps its entry; what is shown is only the servers
  some worker still publishes a view of (:func:`published_names`).
- :class:`ServerView` in ``server_workers(name)`` (one hash per server, one JSON entry per worker):
  that worker's view of the server, refreshed every ``control_interval_s``; a view whose ``state``
  is ``refused`` says why in ``refused``. A view older than ``LIVE_WINDOW_S`` is stale
  (:func:`seen_recently`); one older than ``VIEWS_TTL_S`` is forgotten (:func:`remembered`): a
  worker that stops withdraws its views, one that dies leaves them to age out.
- :class:`ServerControl` in ``server_control(name)`` (a plain hash): the shared in-flight target
  that the worker holding the server's controller lease writes, with the KV signals behind it.

:func:`live_servers` is what the pre-flight checks and the context length use: the servers that
a live worker uses and has not refused, so a stale entry never refuses a job.

The models are pydantic rather than dataclasses because a field absent from what was stored must
stay absent when it is written or shown again: a server refused before it could be read is
published by name alone (``{"seen_at_ms": …}``), and a view from an older release shows what that
release wrote. So a model writes only the fields it was given (``exclude_unset``), ignores fields
it does not know (a newer release's) and defaults those it lacks (an older one's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Self, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis import Redis
from redis.typing import EncodableT, FieldT

from datagen.clock import now_ms
from datagen.control.keys import Keys
from datagen.control.redistext import as_text
from datagen.states import ServerState

__all__ = [
    "LIVE_WINDOW_S",
    "VIEWS_TTL_S",
    "ControllerPhase",
    "ServerControl",
    "ServerInfo",
    "ServerView",
    "decode_views",
    "fleet_context_len",
    "live_servers",
    "publish_server",
    "published_names",
    "read_control",
    "read_servers",
    "read_views",
    "remembered",
    "seen_recently",
    "shares_server",
]

# How long a worker's view of a server counts as live: five refreshes at the slowest interval a
# worker may use (``control_interval_s`` is at most 2 s). A reader cannot know the writer's interval,
# so the window is set by the slowest one: a late refresh or two (a busy event loop) never drops a
# live worker, and a dead worker's share of a server's slots goes to the others within 10 s. One
# rule for every reader: the workers sharing slots, the coordinator's ``GET /servers`` and the
# pre-flight checks' live servers.
LIVE_WINDOW_S = 10.0
# How long a worker's view of a server is remembered after its last refresh: the TTL of the views
# hash (each publish sets it again), and the age past which ``GET /servers`` drops a dead worker's
# view, and a server that no worker publishes any more, from its list.
VIEWS_TTL_S = 300

# ``model_path`` is a field of ours, not pydantic's ``model_`` namespace.
_STORED = ConfigDict(frozen=True, extra="ignore", protected_namespaces=())
_STATES = frozenset(state.value for state in ServerState)


class _JsonRecord(BaseModel):
    model_config = _STORED

    def to_json(self) -> dict[str, Any]:
        """The fields given, as JSON values, in the stored (sorted) order."""
        return dict(sorted(self.model_dump(mode="json", exclude_unset=True).items()))

    def encode(self) -> str:
        """The stored JSON, byte for byte what earlier releases wrote for the same fields."""
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Self:
        """From the stored JSON; pydantic's ValidationError (a ValueError) if it is not an object of
        the model's types."""
        return cls.model_validate_json(raw)


class ServerInfo(_JsonRecord):
    """What a server said about itself (``/server_info``, ``/v1/models``) when a worker read it."""

    context_len: int | None = None
    model_path: str | None = None
    weight_version: str | None = None
    seen_at_ms: int | None = None
    # ``capture`` for a capture server (jobs with features), with what its probe's file held:
    # ``{"layers", "hidden_size", "dtype"}``; None (older entries too) for a generation server.
    role: str | None = None
    capture: dict[str, Any] | None = None


class ServerView(_JsonRecord):
    """One worker's view of one server. ``in_flight`` and ``limits`` are keyed by prompt class
    (``PromptClass`` values): keys of classes a later release adds are kept, not refused."""

    state: ServerState = ServerState.UNKNOWN
    in_flight: dict[str, int] = Field(default_factory=dict)
    limits: dict[str, int] = Field(default_factory=dict)
    # The shared in-flight factor this worker applies (the KV controller's target / ceiling).
    factor: float | None = None
    context_len: int | None = None
    model_path: str | None = None
    weight_version: str | None = None
    # Why the worker keeps off the server (a failed pre-flight check); None while it uses it.
    refused: str | None = None
    # HOST:PORT of the worker's Prometheus metrics; None when it serves none.
    metrics: str | None = None
    seen_at_ms: int | None = None

    @field_validator("state", mode="before")
    @classmethod
    def _known_state(cls, value: object) -> object:
        # A state a newer release publishes is one this release cannot act on.
        return value if value in _STATES else ServerState.UNKNOWN


class ControllerPhase(StrEnum):
    """The KV controller's phase, stored beside the target so that a worker taking the lease over
    carries on where the previous holder was."""

    SLOW_START = "slow_start"
    STEADY = "steady"


class ServerControl(BaseModel):
    """The server's shared in-flight target. A hash rather than JSON so that workers can seed it
    field by field (HSETNX: the first worker wins) and a step can leave fields as they are (the
    reason of the last change)."""

    model_config = _STORED

    # In flight on the server, a total over both classes and every worker listing it.
    target: int | None = None
    # The configured maximum the target moves up to.
    ceiling: int | None = None
    # target / ceiling: what every worker scales its configured maximum by.
    factor: float | None = None
    phase: ControllerPhase | None = None
    # The KV signals the controller last read (``KvSignals.to_json``); ints stay ints.
    signals: dict[str, int | float | None] | None = None
    # The worker that last stepped the controller.
    controller: str | None = None
    # Why the target last changed, and when.
    reason: str | None = None
    changed_at_ms: int | None = None

    def encode(self) -> dict[FieldT, EncodableT]:
        """The hash fields to write (redis-py writes ints and floats as text, as before)."""
        fields: dict[FieldT, EncodableT] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue  # a hash has no null: a field that is None is not written, and stays as it was
            if name == "signals":
                fields[name] = json.dumps(value, sort_keys=True)
            elif isinstance(value, ControllerPhase):
                fields[name] = value.value
            else:
                fields[name] = value
        return fields

    @classmethod
    def decode(cls, raw: Mapping[Any, Any]) -> Self:
        """From an HGETALL reply. Signals that are not a JSON object of numbers, and a phase this
        release does not know, read as absent (the controller then starts from what it knows)."""
        fields: dict[str, Any] = {as_text(k): as_text(v) for k, v in raw.items()}
        if "signals" in fields:
            fields["signals"] = _signals(fields["signals"])
        if fields.get("phase") not in _PHASES:
            fields.pop("phase", None)
        return cls.model_validate({k: v for k, v in fields.items() if v is not None})


_PHASES = frozenset(phase.value for phase in ControllerPhase)


def _signals(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    numeric = all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in value.values()
    )
    return value if numeric else None


def seen_recently(view: ServerView, now_ms: int, *, max_age_s: float = LIVE_WINDOW_S) -> bool:
    """Whether a worker's view of a server was refreshed within ``max_age_s``."""
    return view.seen_at_ms is not None and view.seen_at_ms >= now_ms - int(max_age_s * 1000)


def remembered(view: ServerView, now_ms: int) -> bool:
    """Whether a worker's view of a server is recent enough to show (:data:`VIEWS_TTL_S`)."""
    return seen_recently(view, now_ms, max_age_s=VIEWS_TTL_S)


def shares_server(view: ServerView, now_ms: int, *, max_age_s: float = LIVE_WINDOW_S) -> bool:
    """Whether a worker's view says it uses the server: live, and not refused (a server that is down
    but still listed counts: it will be back)."""
    return seen_recently(view, now_ms, max_age_s=max_age_s) and view.state != ServerState.REFUSED


def publish_server(
    redis: Redis, keys: Keys, name: str, info: ServerInfo, *, only_if_new: bool = False
) -> None:
    """Write a server's entry; with ``only_if_new``, only if there is none yet (a name to show)."""
    value = info.encode()
    if only_if_new:
        redis.hsetnx(keys.servers_index(), name, value)
    else:
        redis.hset(keys.servers_index(), name, value)


def read_servers(redis: Redis, keys: Keys) -> dict[str, ServerInfo]:
    raw = cast(dict[bytes, bytes], redis.hgetall(keys.servers_index()))
    return {as_text(k): ServerInfo.decode(v) for k, v in raw.items()}


def decode_views(raw: Any) -> dict[str, ServerView]:
    """Worker name -> its view, from an HGETALL of ``server_workers`` (pipelined by the caller)."""
    return {
        as_text(worker): ServerView.decode(entry) for worker, entry in cast(dict[bytes, bytes], raw).items()
    }


def read_views(redis: Redis, keys: Keys, name: str) -> dict[str, ServerView]:
    return decode_views(redis.hgetall(keys.server_workers(name)))


def read_control(redis: Redis, keys: Keys, name: str) -> ServerControl:
    return ServerControl.decode(cast(dict[bytes, bytes], redis.hgetall(keys.server_control(name))))


def published_names(redis: Redis, keys: Keys, names: list[str]) -> set[str]:
    """Those of ``names`` that some worker has published a view of within :data:`VIEWS_TTL_S`
    (live or stale): a name a worker gave once, a server of a worker that exited or died long ago,
    is no longer one of the fleet's servers."""
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.server_workers(name))
        replies = pipe.execute()
    at_ms = now_ms()
    return {
        name
        for name, raw in zip(names, replies, strict=True)
        if any(remembered(view, at_ms) for view in decode_views(raw).values())
    }


def live_servers(redis: Redis, keys: Keys, *, max_age_s: float = LIVE_WINDOW_S) -> dict[str, dict[str, Any]]:
    """The entries of servers that some worker has listed in the last ``max_age_s`` without
    refusing them (a server that is down but still listed counts: it will be back).

    As JSON (:meth:`ServerInfo.to_json`): the shape the pre-flight checks, which never import the
    control plane, and a job's manifest take.
    """
    servers = read_servers(redis, keys)
    names = sorted(servers)
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.server_workers(name))
        replies = pipe.execute()
    at_ms = now_ms()
    live = {}
    for name, raw in zip(names, replies, strict=True):
        views = decode_views(raw).values()
        if any(shares_server(v, at_ms, max_age_s=max_age_s) for v in views):
            live[name] = servers[name].to_json()
    return live


def fleet_context_len(redis: Redis, keys: Keys) -> int | None:
    lengths = [info.context_len for info in read_servers(redis, keys).values() if info.context_len]
    return min(lengths) if lengths else None
