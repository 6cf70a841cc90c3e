"""The seam between the worker and an inference server: :class:`Engine`, the replies every engine
gives in one shape, and how an HTTP error status reads as the project's errors.

Everything above it (generation, routing, health, the KV controller, pause and drain) talks to a
server through these methods and types only, and never asks which engine answered. The engines
implement it in their own modules beside this one, which imports none of them;
:mod:`workers.engines.detect` picks one per server.

What only some engines can do is a protocol of its own, checked on the engine that answers now
(:meth:`Engine.current`): ``isinstance(engine.current(), ToolCallParsing)``. An engine without
the capability simply lacks the method; the caller says what to do instead.

Pause and drain need no hook of their own: a paused or draining worker sends nothing new, and a
request it gives up is aborted by closing its connection, which every engine honours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

import httpx

from datagen.errors import (
    BadRequestError,
    ConfigError,
    DatagenError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from datagen.states import EngineChoice, FinishType

__all__ = [
    "ERROR_TEXT_MAX_CHARS",
    "CaptureReply",
    "Engine",
    "EngineChoice",
    "Finish",
    "GenerateResult",
    "HiddenStateCapture",
    "KvSignals",
    "ParsedCalls",
    "ServerFacts",
    "ToolCall",
    "ToolCallParsing",
    "classify_status",
    "error_message",
    "is_int",
]

# How much of a server's error body or unusable reply a message quotes.
ERROR_TEXT_MAX_CHARS = 1000


def is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; JSON true is never a token id or a count.
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------------
# What a server says
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFacts:
    """What a server says about itself when it comes up: read once, checked, then published.

    ``context_len`` is None when the server does not say (the worker then keeps off it).
    """

    context_len: int | None
    model_path: str | None
    weight_version: str | None


@dataclass(frozen=True)
class Finish:
    """How a generation ended, as the record keeps it.

    ``matched`` is set for ``stop`` (a token id, or the stop string or regex), ``length`` for ``length``
    (the max_new_tokens reached), ``message``/``status_code``/``err_type`` for ``abort``.
    """

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    def to_json(self) -> dict[str, object]:
        """One object whose ``type`` says which other fields it has, for storing or logging as-is."""
        if self.type is FinishType.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.type is FinishType.LENGTH:
            return {"type": "length", "length": self.length}
        return {
            "type": "abort",
            "message": self.message,
            "status_code": self.status_code,
            "err_type": self.err_type,
        }


@dataclass(frozen=True)
class GenerateResult:
    """One finished generation. ``output_ids`` are the generated tokens only, never the prompt,
    and end with the EOS or stop token when ``finish.type`` is stop. What an engine does not
    report is None, or 0 for the counts."""

    rid: str
    output_ids: list[int]
    finish: Finish
    prompt_tokens: int | None  # absent when the request was aborted in the waiting queue
    completion_tokens: int
    cached_tokens: int
    e2e_latency_s: float | None
    num_retractions: int
    weight_version: str | None


@dataclass(frozen=True)
class CaptureReply:
    """A capture server's answer: the file its connector will write the hidden states of exactly
    the ids sent into (the echo was checked), as the server names it. The file does not exist yet
    when the answer arrives; its lock does (`datagen.features.locks`)."""

    rid: str
    hidden_states_path: str
    prompt_tokens: int


@dataclass(frozen=True)
class KvSignals:
    """The KV controller's inputs, read from a server's Prometheus metrics by its engine
    (:mod:`workers.engines.kv_metrics`): absent signals stay None/0."""

    token_usage: float | None = None
    num_queue_reqs: float = 0.0
    num_running_reqs: float = 0.0
    retracted_total: float | None = None
    max_total_num_tokens: float | None = None
    requests_total: float | None = None  # requests the server has served since it started

    def to_json(self) -> dict[str, float | None]:
        return {
            "token_usage": self.token_usage,
            "num_queue_reqs": self.num_queue_reqs,
            "num_running_reqs": self.num_running_reqs,
            "retracted_total": self.retracted_total,
            "max_total_num_tokens": self.max_total_num_tokens,
            "requests_total": self.requests_total,
        }

    @classmethod
    def from_json(cls, values: dict[str, float | None]) -> KvSignals:
        """The inverse of :meth:`to_json`; unknown keys (an older or newer worker) are ignored."""
        return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})  # type: ignore[arg-type]


@dataclass(frozen=True)
class ToolCall:
    """One call a server's tool-call parser found: the function's name and its arguments (the JSON
    object the model wrote; its text when that is not an object)."""

    name: str
    arguments: dict[str, object] | str


@dataclass(frozen=True)
class ParsedCalls:
    """What a server's tool-call parser made of a generated text: the text around the calls, and the
    calls in order."""

    normal_text: str
    calls: tuple[ToolCall, ...]


# --------------------------------------------------------------------------------------------------
# The engine and its optional capabilities
# --------------------------------------------------------------------------------------------------


class Engine(Protocol):
    """One server behind one engine's HTTP API, with long-lived connection pools.

    Errors are the project's (:mod:`datagen.errors`), translated inside the implementation:
    a request that cannot succeed is a ``FatalError`` carrying the server's own message,
    anything worth retrying a ``RetryableError``.
    """

    name: str
    base_url: str

    @property
    def engine(self) -> EngineChoice:
        """What the client speaks (``auto`` only while :mod:`workers.engines.detect` has not asked)."""
        ...

    def current(self) -> Engine:
        """The engine that answers for this server now, whose optional capabilities a caller checks
        with ``isinstance``: the client itself, or the one a detecting engine delegates to
        (``ServerUnavailableError`` while the server has not said which)."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, object],
        *,
        rid: str,
        read_timeout_s: float | None = None,
    ) -> GenerateResult:
        """Exactly these prompt ids in, the generated ids out (ending with the EOS or stop id when
        the finish is ``stop``). ``sampling_params`` use the project's names
        (:class:`datagen.spec.SamplingParams`), with ``max_new_tokens`` always set."""
        ...

    async def health(self, *, timeout_s: float) -> bool:
        """True only when the server says it is ready; timeouts and refused connections raise."""
        ...

    async def facts(self) -> ServerFacts:
        """Context length and model, read when the server comes up (again)."""
        ...

    async def kv_signals(self, *, timeout_s: float) -> KvSignals:
        """The KV controller's inputs from the server's Prometheus metrics."""
        ...


@runtime_checkable
class ToolCallParsing(Protocol):
    """An engine whose server parses tool calls out of generated text with its own parser (the
    names its ``--tool-call-parser`` takes)."""

    async def parse_function_call(
        self, text: str, parser: str, tools: Sequence[Mapping[str, object]], *, timeout_s: float
    ) -> ParsedCalls: ...


@runtime_checkable
class HiddenStateCapture(Protocol):
    """An engine whose server can capture a sequence's hidden states into a file (vLLM's
    ``extract_hidden_states`` with a file connector): one prefill of exactly these ids, no
    generation kept. ``ConfigError`` when the server answers without a file (not launched for it)."""

    async def capture(
        self, input_ids: Sequence[int], *, rid: str, read_timeout_s: float | None = None
    ) -> CaptureReply: ...

    async def engine_version(self) -> str | None:
        """The server's engine release (pinned in a job's manifest with what it captures)."""
        ...


# --------------------------------------------------------------------------------------------------
# HTTP error statuses (pure)
# --------------------------------------------------------------------------------------------------


def error_message(response: httpx.Response) -> str:
    """The server's own message from the error bodies the engines send, else the body text."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])  # {"error": {"message": ...}} from a ValueError
        if isinstance(body.get("message"), str):
            return str(body["message"])  # {"object": "error", "message": ...}
        if "detail" in body:
            return str(body["detail"])  # FastAPI's own errors: {"detail": "Not Found"}
        if isinstance(error, str):
            return error  # {"error": "Unauthorized"} from the API-key middleware
    text = response.text.strip()
    if not text:
        return "(empty body)"
    return text if len(text) <= ERROR_TEXT_MAX_CHARS else text[:ERROR_TEXT_MAX_CHARS] + "…"


def classify_status(status: int, said: str, *, not_found: str) -> DatagenError:
    """An HTTP error status as the project's error, the same for every engine: ``said`` names the
    request, the server and its message; ``not_found`` is what a 404 most likely means there."""
    if status in (401, 403):
        return ConfigError(f"{said}. The server wants an API key: set the one it was started with --api-key")
    if status == 404:
        return ServerError(f"{said}. {not_found}; check the server's base URL")
    if status == 408:
        return RequestTimeoutError(f"{said}. Retry")
    if status in (429, 503):
        return ServerUnavailableError(f"{said}. The server is busy, starting or shutting down; retry later")
    if status >= 500:
        return ServerError(f"{said}. Retry; if it repeats, read the server's log")
    if 400 <= status < 500:
        return BadRequestError(f"{said}. The request must change; retrying it cannot succeed")
    return ServerError(f"{said}. Unexpected status for this endpoint")
