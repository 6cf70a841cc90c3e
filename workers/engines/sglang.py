"""The worker's client for one SGLang server: prompt token ids in, generated token ids out.

It speaks SGLang's native ``POST /generate`` (never the OpenAI routes, which apply a chat template and
return text), non-streaming, one prompt per call: ``input_ids``, ``sampling_params`` and ``rid`` in;
``output_ids`` and ``meta_info`` (``finish_reason``, token counts, ``e2e_latency``) out. It also
reads ``/health``, ``/model_info``, ``/server_info`` (or ``/v1/models``) and ``/metrics``, as SGLang's
``http_server.py`` serves them; the project's simulator (:mod:`simulator`) answers the same routes in
the same shapes.

The connection pools and the translation of transport errors are :mod:`workers.engines.http`
(shared with the vLLM client). These two modules are the boundary where httpx errors and HTTP
statuses become the project's errors
(:mod:`datagen.errors`)::

    httpx.TimeoutException (connect/read/write/pool)    RequestTimeoutError
    httpx.TransportError (refused, reset, protocol)     ServerUnavailableError
    HTTP 503, 429                                       ServerUnavailableError
    HTTP 408                                            RequestTimeoutError
    HTTP 500 and other 5xx, 404, unusable 200 body      ServerError
    HTTP 400 "Duplicate request ID"                     DuplicateRequestError
    HTTP 400 and other 4xx                              BadRequestError (server message verbatim)
    HTTP 401, 403                                       ConfigError (the API key is a setting)
    200 with finish_reason abort, status_code 400       BadRequestError (scheduler-side validation)
    200 with any other finish_reason abort              GenerationAbortedError
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from datagen.errors import DatagenError, ServerError
from datagen.states import EngineChoice, FinishType
from workers.engines.base import GenerateResult, KvSignals, ParsedCalls, ServerFacts, is_int
from workers.engines.http import DEFAULT_CONTROL_TIMEOUT_S, PooledClient
from workers.engines.sglang_replies import (
    abort_error,
    parse_function_call_response,
    parse_generate_response,
    parse_kv_signals,
    status_error,
)

__all__ = ["SGLangClient"]

logger = logging.getLogger(__name__)

GENERATE_PATH = "/generate"
MODEL_INFO_PATH = "/model_info"
LEGACY_MODEL_INFO_PATH = "/get_model_info"  # the only name before v0.5.6, a deprecated alias since
SERVER_INFO_PATH = "/server_info"
LEGACY_SERVER_INFO_PATH = "/get_server_info"
MODELS_PATH = "/v1/models"
METRICS_PATH = "/metrics"
PARSE_FUNCTION_CALL_PATH = "/parse_function_call"


class SGLangClient(PooledClient):
    """One SGLang server (:class:`workers.engines.http.PooledClient`'s pools, ``/generate`` taking the
    large ones): the SGLang side of :class:`workers.engines.base.Engine`, and a
    :class:`workers.engines.base.ToolCallParsing` (``/parse_function_call``)."""

    engine = EngineChoice.SGLANG
    kind = "SGLang"
    generate_path = GENERATE_PATH

    def _status_error(self, response: httpx.Response, *, what: str) -> DatagenError:
        return status_error(response, server=self._label, what=what)

    # -- API ---------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, object],
        *,
        rid: str,
        read_timeout_s: float | None = None,
    ) -> GenerateResult:
        """Generate from exactly these prompt tokens (no chat template is applied on ``/generate``).

        After a client-side timeout the server may still run ``rid``; a retry with the same rid can then
        get DuplicateRequestError until it finishes.
        """
        what = f"POST {GENERATE_PATH} rid {rid!r}"
        # Only the fields we need: every SGLang version knows these four, and sending text as well would
        # let it set the batch shape.
        payload = {
            "rid": rid,
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "stream": False,
        }
        timeout = self.timeouts.to_httpx(read_s=read_timeout_s)
        response = await self._send("POST", GENERATE_PATH, what=what, phase_timeouts=timeout, body=payload)
        if response.status_code != 200:
            raise status_error(response, server=self._label, what=what)
        body = self._json(response, what=what)
        try:
            result = parse_generate_response(body, rid=rid)
        except ServerError as exc:
            raise ServerError(f"{what} on SGLang server {self._label}: unusable reply: {exc}") from exc
        if result.finish.type is FinishType.ABORT:
            raise abort_error(result, server=self._label)
        logger.debug(
            "%s: rid %r %s, %s prompt + %d output tokens, %d cached, %s s",
            self.name,
            rid,
            result.finish.type,
            result.prompt_tokens,
            result.completion_tokens,
            result.cached_tokens,
            result.e2e_latency_s,
        )
        return result

    async def model_info(self, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> dict[str, Any]:
        return await self._get_object(
            MODEL_INFO_PATH, timeout_s=timeout_s, legacy_path=LEGACY_MODEL_INFO_PATH
        )

    async def server_info(self, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> dict[str, Any]:
        return await self._get_object(
            SERVER_INFO_PATH, timeout_s=timeout_s, legacy_path=LEGACY_SERVER_INFO_PATH
        )

    async def context_len(self, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> int | None:
        """The model's context length, None if the server does not say.

        ``/server_info`` has ``context_length`` only when the server was started with ``--context-length``
        (it is null otherwise); ``/v1/models`` ``max_model_len`` always has the length in use.
        """
        configured = (await self.server_info(timeout_s=timeout_s)).get("context_length")
        if is_int(configured) and configured > 0:
            return int(configured)
        models = await self._get_object(MODELS_PATH, timeout_s=timeout_s)
        data = models.get("data")
        if isinstance(data, list) and data and isinstance(data[0], dict):
            max_model_len = data[0].get("max_model_len")
            if is_int(max_model_len) and max_model_len > 0:
                return int(max_model_len)
        return None

    async def facts(self) -> ServerFacts:
        """Context length first, then ``/model_info``: the order and routes the worker always used."""
        context_len = await self.context_len()
        info = await self.model_info()
        return ServerFacts(
            context_len=context_len,
            model_path=_text(info.get("model_path")),
            weight_version=_text(info.get("weight_version")),
        )

    async def kv_signals(self, *, timeout_s: float) -> KvSignals:
        return parse_kv_signals(await self.metrics_text(timeout_s=timeout_s))

    async def parse_function_call(
        self, text: str, parser: str, tools: Sequence[Mapping[str, object]], *, timeout_s: float
    ) -> ParsedCalls:
        """The server's own tool-call parser (``--tool-call-parser`` names) applied to ``text``."""
        what = f"POST {PARSE_FUNCTION_CALL_PATH} ({parser})"
        body = {"text": text, "tool_call_parser": parser, "tools": [dict(t) for t in tools]}
        response = await self._send(
            "POST",
            PARSE_FUNCTION_CALL_PATH,
            what=what,
            phase_timeouts=self._control_timeout(timeout_s),
            body=body,
        )
        if response.status_code != 200:
            raise status_error(response, server=self._label, what=what)
        try:
            return parse_function_call_response(self._json(response, what=what))
        except ServerError as exc:
            raise ServerError(f"{what} on SGLang server {self._label}: unusable reply: {exc}") from exc

    async def metrics_text(self, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> str:
        """The Prometheus text of ``/metrics`` (exists only with ``--enable-metrics``)."""
        what = f"GET {METRICS_PATH}"
        timeout = self._control_timeout(timeout_s)
        response = await self._send("GET", METRICS_PATH, what=what, phase_timeouts=timeout)
        if response.status_code == 404:
            raise ServerError(
                f"{what} on SGLang server {self._label} got HTTP 404: start SGLang with --enable-metrics"
            )
        if response.status_code != 200:
            raise status_error(response, server=self._label, what=what)
        return response.text


def _text(value: object) -> str | None:
    """A field of SGLang's reply as text: SGLang sends strings, but a reply is not ours to trust,
    and what is published must decode (:class:`datagen.control.servers.ServerInfo`)."""
    return None if value is None else str(value)
