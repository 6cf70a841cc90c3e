"""The worker's client for one vLLM server: prompt token ids in, generated token ids out.

It speaks vLLM's OpenAI-compatible ``POST /v1/completions`` (``docs/reference/vllm-contract.md``,
vLLM 0.33.0), non-streaming, one prompt per call: ``prompt`` as a list of ids (taken as is: no
BOS, no chat template), ``return_token_ids`` so the choice carries the generated ids, and every
sampling field sent explicitly, since vLLM fills the missing ones from the model's
``generation_config.json``. It reads ``/health``, ``/v1/models`` (``max_model_len``, the model) and
``/metrics``. It parses no tool calls, having no route for it, so it is no
:class:`workers.engines.base.ToolCallParsing`. Errors, as :mod:`workers.engines.vllm_replies`
translates them::

    httpx.TimeoutException                  RequestTimeoutError
    httpx.TransportError                    ServerUnavailableError
    HTTP 503, 429                           ServerUnavailableError
    HTTP 408                                RequestTimeoutError
    HTTP 5xx, 404, unusable 200 body        ServerError (a length finish short of max_tokens too)
    HTTP 400 and other 4xx                  BadRequestError (vLLM's error.message verbatim)
    HTTP 401, 403                           ConfigError (the API key is a setting)
    200 with finish_reason abort            GenerationAbortedError

A request given up is aborted by closing its connection: vLLM cancels it at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import httpx

from datagen.errors import BadRequestError, DatagenError, ServerError
from datagen.states import EngineChoice, FinishType
from workers.engines.base import CaptureReply, GenerateResult, KvSignals, ServerFacts, is_int
from workers.engines.http import DEFAULT_CONTROL_TIMEOUT_S, PooledClient
from workers.engines.vllm_replies import (
    abort_error,
    parse_capture_response,
    parse_completion_response,
    parse_kv_signals,
    status_error,
)

__all__ = ["VllmClient", "vllm_request"]

logger = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
METRICS_PATH = "/metrics"
VERSION_PATH = "/version"

# The project's sampling names (SGLang's, :class:`datagen.spec.SamplingParams`) that vLLM's
# CompletionRequest spells the same; the others are translated in :func:`vllm_request`.
_SAME_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_RENAMED = {"sampling_seed": "seed", "max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids"}


def vllm_request(
    input_ids: Sequence[int], sampling_params: Mapping[str, object], *, rid: str, model: str | None
) -> dict[str, object]:
    """The ``/v1/completions`` body for one prompt. A sampling field vLLM has no name for is a
    BadRequestError: sent under SGLang's name, vLLM would ignore it without a word."""
    unknown = sorted(set(sampling_params) - set(_SAME_NAMES) - set(_RENAMED))
    if unknown:
        raise BadRequestError(
            f"sampling params {', '.join(unknown)} have no vLLM equivalent here; drop them from the job "
            "spec or run the job on SGLang servers"
        )
    if "max_new_tokens" not in sampling_params:
        raise BadRequestError("max_new_tokens must be set: vLLM's default is 16 tokens")
    body: dict[str, object] = {"prompt": list(input_ids)}
    if model is not None:
        body["model"] = model
    # Explicit even where the value is vLLM's default, so that neither the server's defaults nor
    # the model's generation config decide them.
    body.update({name: sampling_params.get(name) for name in _SAME_NAMES if name in sampling_params})
    body["seed"] = sampling_params.get("sampling_seed")
    body["max_tokens"] = sampling_params["max_new_tokens"]
    body["stop_token_ids"] = sampling_params.get("stop_token_ids") or []
    body.update(
        {
            "n": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": False,
            "stream": False,
            "request_id": rid,
        }
    )
    return body


class VllmClient(PooledClient):
    """One vLLM server (the large pools take ``/v1/completions``): the vLLM side of
    :class:`workers.engines.base.Engine`."""

    engine = EngineChoice.VLLM
    kind = "vLLM"
    generate_path = COMPLETIONS_PATH
    # The served model's name from /v1/models, sent as ``model`` (None: the server's only one).
    served_model: str | None = None

    def _status_error(self, response: httpx.Response, *, what: str) -> DatagenError:
        return status_error(response, server=self._label, what=what)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, object],
        *,
        rid: str,
        read_timeout_s: float | None = None,
    ) -> GenerateResult:
        """Generate from exactly these prompt tokens; ``sampling_params`` under SGLang's names."""
        what = f"POST {COMPLETIONS_PATH} request {rid!r}"
        body = vllm_request(input_ids, sampling_params, rid=rid, model=self.served_model)
        max_tokens = body["max_tokens"]
        assert isinstance(max_tokens, int)
        timeout = self.timeouts.to_httpx(read_s=read_timeout_s)
        response = await self._send("POST", COMPLETIONS_PATH, what=what, phase_timeouts=timeout, body=body)
        if response.status_code != 200:
            raise self._status_error(response, what=what)
        try:
            result = parse_completion_response(
                self._json(response, what=what), rid=rid, max_tokens=max_tokens
            )
        except ServerError as exc:
            raise ServerError(f"{what} on vLLM server {self._label}: unusable reply: {exc}") from exc
        if result.finish.type is FinishType.ABORT:
            raise abort_error(result, server=self._label)
        logger.debug(
            "%s: request %r %s, %s prompt + %d output tokens",
            self.name,
            rid,
            result.finish.type,
            result.prompt_tokens,
            result.completion_tokens,
        )
        return result

    async def capture(
        self, input_ids: Sequence[int], *, rid: str, read_timeout_s: float | None = None
    ) -> CaptureReply:
        """One prefill of exactly ``input_ids`` on a server launched with ``extract_hidden_states``:
        ``max_tokens: 1`` (the sampled token is never an input, so nothing past the ids is
        captured), greedy, the echo asked for and checked (`parse_capture_response`)."""
        what = f"POST {COMPLETIONS_PATH} capture {rid!r}"
        body: dict[str, object] = {"prompt": list(input_ids)}
        if self.served_model is not None:
            body["model"] = self.served_model
        body.update(
            {
                "max_tokens": 1,
                "temperature": 0.0,
                "n": 1,
                "return_token_ids": True,
                "stream": False,
                "request_id": rid,
            }
        )
        timeout = self.timeouts.to_httpx(read_s=read_timeout_s)
        response = await self._send("POST", COMPLETIONS_PATH, what=what, phase_timeouts=timeout, body=body)
        if response.status_code != 200:
            raise self._status_error(response, what=what)
        return parse_capture_response(self._json(response, what=what), input_ids, rid=rid, server=self._label)

    async def engine_version(self) -> str | None:
        """``GET /version``'s ``version``; None when it does not say."""
        body = await self._get_object(VERSION_PATH, timeout_s=DEFAULT_CONTROL_TIMEOUT_S)
        version = body.get("version")
        return version if isinstance(version, str) else None

    async def facts(self) -> ServerFacts:
        """``/v1/models``' first card: ``max_model_len`` (always the length in use) and ``root``,
        the model path. vLLM reports no weight version."""
        models = await self._get_object(MODELS_PATH, timeout_s=DEFAULT_CONTROL_TIMEOUT_S)
        data = models.get("data")
        card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        max_model_len = card.get("max_model_len")
        served, root = card.get("id"), card.get("root")
        self.served_model = served if isinstance(served, str) else None
        return ServerFacts(
            context_len=int(max_model_len) if is_int(max_model_len) and max_model_len > 0 else None,
            model_path=None if root is None else str(root),
            weight_version=None,
        )

    async def kv_signals(self, *, timeout_s: float) -> KvSignals:
        what = f"GET {METRICS_PATH}"
        timeout = self._control_timeout(timeout_s)
        response = await self._send("GET", METRICS_PATH, what=what, phase_timeouts=timeout)
        if response.status_code != 200:
            raise self._status_error(response, what=what)
        return parse_kv_signals(response.text)
