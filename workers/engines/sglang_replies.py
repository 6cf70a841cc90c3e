"""SGLang's replies read strictly: ``/generate``'s ``output_ids`` and ``meta_info`` (finish reasons in
every shape SGLang sends), ``/parse_function_call``'s calls, the ``/metrics`` names the KV controller
reads, and error statuses and bodies turned into the project's errors, as the table in
:mod:`workers.engines.sglang` draws them. Pure functions over what the client received."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import httpx

from datagen.errors import (
    BadRequestError,
    DatagenError,
    DuplicateRequestError,
    GenerationAbortedError,
    ServerError,
)
from datagen.states import FinishType
from workers.engines.base import (
    ERROR_TEXT_MAX_CHARS,
    Finish,
    GenerateResult,
    KvSignals,
    ParsedCalls,
    ToolCall,
    classify_status,
    error_message,
    is_int,
)
from workers.engines.kv_metrics import KvMetricNames, read_kv_signals

__all__ = [
    "KV_METRICS",
    "abort_error",
    "parse_finish",
    "parse_function_call_response",
    "parse_generate_response",
    "parse_kv_signals",
    "status_error",
]

logger = logging.getLogger(__name__)

DUPLICATE_RID_MARKER = "Duplicate request ID"

# The /metrics names (``sglang:`` or ``sglang_``, without ``_total``) the KV controller reads.
KV_METRICS = KvMetricNames(
    prefixes=("sglang:", "sglang_"),
    fields={
        "token_usage": "token_usage",
        "num_queue_reqs": "num_queue_reqs",
        "num_running_reqs": "num_running_reqs",
        "num_retracted_requests": "retracted_total",
        "max_total_num_tokens": "max_total_num_tokens",
        "num_requests": "requests_total",
    },
)


def _optional_int(mapping: Mapping[str, object], key: str) -> int | None:
    value = mapping.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise ServerError(f"{key} must be an integer, got {value!r}")
    return value


def _optional_str(mapping: Mapping[str, object], key: str) -> str | None:
    value = mapping.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ServerError(f"{key} must be a string, got {value!r}")


def _optional_float(mapping: Mapping[str, object], key: str) -> float | None:
    value = mapping.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ServerError(f"{key} must be a number, got {value!r}")
    return float(value)


def _parse_matched(raw: Mapping[str, object]) -> int | str:
    matched = raw.get("matched")
    if is_int(matched) or isinstance(matched, str):
        return matched
    # SGLang's type hint allows List[int], but nothing on main emits one; should a server send it, the
    # first id is kept so that Finish stays one scalar per record.
    if isinstance(matched, list) and matched and all(is_int(token) for token in matched):
        first: int = matched[0]
        return first
    raise ServerError(f"finish_reason stop needs an int, list[int] or str 'matched', got {dict(raw)!r}")


def parse_finish(raw: object) -> Finish:
    """``meta_info.finish_reason`` of a finished request, in every shape SGLang emits; ServerError on
    anything else, ``null`` included. :meth:`Finish.to_json` gives the same shape back."""
    if raw is None:
        # Only streamed chunks before the last one carry null, and this client never streams.
        raise ServerError("finish_reason is null: the reply is an unfinished streaming chunk")
    if not isinstance(raw, dict):
        raise ServerError(f"finish_reason must be an object, got {raw!r}")
    kind = raw.get("type")
    if kind == FinishType.STOP:
        return Finish(type=FinishType.STOP, matched=_parse_matched(raw))
    if kind == FinishType.LENGTH:
        length = _optional_int(raw, "length")
        if length is None:
            raise ServerError(f"finish_reason length needs an integer 'length', got {raw!r}")
        return Finish(type=FinishType.LENGTH, length=length)
    if kind == FinishType.ABORT:
        # A waiting-queue abort carries only type and message.
        return Finish(
            type=FinishType.ABORT,
            message=_optional_str(raw, "message"),
            status_code=_optional_int(raw, "status_code"),
            err_type=_optional_str(raw, "err_type"),
        )
    raise ServerError(f"unknown finish_reason type {kind!r} in {raw!r}; expected stop, length or abort")


def _parse_output_ids(body: Mapping[str, object]) -> list[int]:
    if "output_ids" not in body:
        if "error" in body:
            raise ServerError(f"the reply is an error, not a generation: {body['error']!r}")
        raise ServerError(
            "the reply has no output_ids: SGLang before 0.5.0 returns only text. "
            "Upgrade SGLang to 0.5 or later, or start it with --skip-tokenizer-init"
        )
    output_ids = body["output_ids"]
    if not isinstance(output_ids, list) or not all(is_int(token) for token in output_ids):
        raise ServerError(f"output_ids must be a list of integers, got {output_ids!r:.200}")
    return output_ids


def _parse_meta(body: Mapping[str, object]) -> Mapping[str, object]:
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ServerError(f"meta_info must be an object, got {meta!r:.200}")
    return meta


def parse_generate_response(body: object, *, rid: str) -> GenerateResult:
    """Validate a non-streaming single-prompt ``/generate`` reply; raise ServerError if unusable.

    An ``abort`` finish is returned, not raised: the caller decides (see ``SGLangClient.generate``).
    """
    if isinstance(body, list):
        raise ServerError(
            f"expected one JSON object for one prompt, got a JSON list of {len(body)}: "
            "sampling_params.n > 1 and batched input_ids are not supported"
        )
    if not isinstance(body, dict):
        raise ServerError(f"expected a JSON object, got {type(body).__name__}")
    output_ids = _parse_output_ids(body)
    meta = _parse_meta(body)
    finish = parse_finish(meta.get("finish_reason"))
    completion_tokens = _optional_int(meta, "completion_tokens")
    if completion_tokens is None:
        raise ServerError("meta_info.completion_tokens is missing")

    reply_rid = meta.get("id")
    if reply_rid != rid:
        logger.warning("SGLang answered rid %r with meta_info.id %r; keeping the rid sent", rid, reply_rid)
    if completion_tokens != len(output_ids):
        # SGLang counts completion_tokens as the output_ids it sends, so this should not happen; the tokens
        # are what we store, so a miscount is worth a trace, not a failed generation.
        logger.debug(
            "rid %r: completion_tokens %d != len(output_ids) %d", rid, completion_tokens, len(output_ids)
        )
    retractions = _optional_int(meta, "num_retractions")
    if retractions is None:
        retractions = _optional_int(meta, "total_retractions")  # its name before 2026-05
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        finish=finish,
        prompt_tokens=_optional_int(meta, "prompt_tokens"),
        completion_tokens=completion_tokens,
        cached_tokens=_optional_int(meta, "cached_tokens") or 0,
        e2e_latency_s=_optional_float(meta, "e2e_latency"),
        num_retractions=retractions or 0,
        weight_version=_optional_str(meta, "weight_version"),
    )


# --------------------------------------------------------------------------------------------------
# HTTP error translation (pure)
# --------------------------------------------------------------------------------------------------


def status_error(response: httpx.Response, *, server: str, what: str) -> DatagenError:
    status = response.status_code
    message = error_message(response)
    said = f"{what} on SGLang server {server} got HTTP {status}: {message}"
    if status == 400 and DUPLICATE_RID_MARKER in message:
        return DuplicateRequestError(
            f"{said}. An earlier attempt with this rid is still running; retry later"
        )
    return classify_status(status, said, not_found="The URL is probably not an SGLang server")


def abort_error(result: GenerateResult, *, server: str) -> DatagenError:
    finish = result.finish
    said = (
        f"SGLang server {server} aborted rid {result.rid!r} after {len(result.output_ids)} tokens: "
        f"{finish.message!r} (status_code {finish.status_code}, err_type {finish.err_type})"
    )
    if finish.status_code == 400:
        return BadRequestError(f"{said}. The scheduler refused the request; it must change to succeed")
    return GenerationAbortedError(f"{said}. Retry, here or on another server")


# --------------------------------------------------------------------------------------------------
# Tool calls and metrics
# --------------------------------------------------------------------------------------------------


def _arguments(parameters: object) -> dict[str, object] | str:
    """SGLang sends a call's arguments as JSON text; an object comes back as a dict (what chat
    templates take), anything else as its JSON text."""
    decoded = parameters
    if isinstance(parameters, str):
        try:
            decoded = json.loads(parameters)
        except json.JSONDecodeError:
            return parameters
    return decoded if isinstance(decoded, dict) else json.dumps(decoded)


def parse_function_call_response(body: object) -> ParsedCalls:
    """``{"normal_text": str, "calls": [{"tool_index", "name", "parameters": JSON text}]}``."""
    if not isinstance(body, dict) or not isinstance(body.get("normal_text"), str):
        raise ServerError(
            f"/parse_function_call reply has no normal_text: {str(body)[:ERROR_TEXT_MAX_CHARS]!r}"
        )
    raw_calls = body.get("calls")
    if not isinstance(raw_calls, list):
        raise ServerError(
            f"/parse_function_call reply has no calls list: {str(body)[:ERROR_TEXT_MAX_CHARS]!r}"
        )
    calls = []
    for raw in raw_calls:
        name = raw.get("name") if isinstance(raw, dict) else None
        if not isinstance(name, str):
            raise ServerError(f"/parse_function_call reply has a call without a name: {raw!r}")
        calls.append(ToolCall(name=name, arguments=_arguments(raw.get("parameters", "{}"))))
    return ParsedCalls(normal_text=body["normal_text"], calls=tuple(calls))


def parse_kv_signals(text: str) -> KvSignals:
    """The KV controller's inputs from SGLang's ``/metrics`` page (:data:`KV_METRICS`)."""
    return read_kv_signals(text, KV_METRICS)
