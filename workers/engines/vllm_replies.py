"""vLLM's replies read strictly (``docs/reference/vllm-contract.md``): a ``/v1/completions`` choice's
``token_ids`` and ``finish_reason``, turned into the record's finish, the ``/metrics`` names the KV
controller reads, and error statuses turned into the project's errors. Pure functions over what
:class:`workers.engines.vllm.VllmClient` received."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import httpx

from datagen.errors import (
    ConfigError,
    DatagenError,
    GenerationAbortedError,
    ServerError,
)
from datagen.states import FinishType
from workers.engines.base import (
    CaptureReply,
    Finish,
    GenerateResult,
    KvSignals,
    classify_status,
    error_message,
    is_int,
)
from workers.engines.kv_metrics import KvMetricNames, read_kv_signals

__all__ = [
    "CAPTURE_LAUNCH_HINT",
    "KV_METRICS",
    "abort_error",
    "parse_capture_response",
    "parse_completion_response",
    "parse_kv_signals",
    "status_error",
]

# What a vLLM server needs to capture hidden states (vLLM 0.33.0, the flags speculators' launcher
# builds; docs/user/features.md has them whole).
CAPTURE_LAUNCH_HINT = (
    'start vLLM with --speculative-config \'{"method": "extract_hidden_states", "num_speculative_tokens": 1, '
    '"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [LAYERS]}}}\' and '
    '--kv-transfer-config \'{"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer", '
    '"kv_connector_extra_config": {"shared_storage_path": "DIR"}}\''
)

logger = logging.getLogger(__name__)

# The /metrics names (``vllm:`` or ``vllm_``, without ``_total``) the KV controller reads. vLLM's
# preemption is a retraction (the request loses its KV blocks and recomputes them later); requests
# served are summed over ``finished_reason``. vLLM has no KV capacity gauge.
KV_METRICS = KvMetricNames(
    prefixes=("vllm:", "vllm_"),
    fields={
        "kv_cache_usage_perc": "token_usage",
        "num_requests_waiting": "num_queue_reqs",
        "num_requests_running": "num_running_reqs",
        "num_preemptions": "retracted_total",
        "request_success": "requests_total",
    },
)


def _choice(body: object) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise ServerError(f"expected a JSON object, got {type(body).__name__}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        count = len(choices) if isinstance(choices, list) else choices
        raise ServerError(f"expected exactly one choice for one prompt and n=1, got {count!r:.200}")
    return choices[0]


def _token_ids(choice: Mapping[str, object]) -> list[int]:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise ServerError(
            "the choice has no token_ids: vLLM before 0.10.2 ignores return_token_ids. Upgrade vLLM"
        )
    if not isinstance(token_ids, list) or not all(is_int(t) for t in token_ids):
        raise ServerError(f"token_ids must be a list of integers, got {token_ids!r:.200}")
    return token_ids


def _finish(choice: Mapping[str, object], token_ids: list[int], max_tokens: int) -> Finish:
    reason, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "stop":
        if is_int(stop_reason) or isinstance(stop_reason, str):
            return Finish(type=FinishType.STOP, matched=stop_reason)
        if stop_reason is None and token_ids:
            # vLLM leaves stop_reason null for the tokenizer's EOS, which ends token_ids; it checks
            # the EOS before the length cap, so an EOS that is the max_tokens-th id lands here too,
            # where SGLang would say length.
            return Finish(type=FinishType.STOP, matched=token_ids[-1])
        raise ServerError(f"finish_reason stop with stop_reason {stop_reason!r} and no token ids")
    if reason == "length":
        if len(token_ids) != max_tokens:
            # vLLM lowers max_tokens to what its context leaves without saying so (0.32 and later);
            # the worker sizes max_tokens to fit the max_model_len the server reported, so a shorter
            # output means the server's real limit is not the one it reported.
            raise ServerError(
                f"finish_reason length after {len(token_ids)} tokens, but max_tokens was {max_tokens}: "
                "the server lowered it (its context is shorter than the max_model_len it reported?). "
                "Check the server's --max-model-len; the prompt is retried elsewhere"
            )
        return Finish(type=FinishType.LENGTH, length=max_tokens)
    if reason == "abort":
        return Finish(type=FinishType.ABORT, message="aborted by the server")
    raise ServerError(f"unexpected finish_reason {reason!r} (stop_reason {stop_reason!r})")


def parse_completion_response(body: object, *, rid: str, max_tokens: int) -> GenerateResult:
    """Validate a non-streaming one-prompt ``/v1/completions`` reply; raise ServerError if unusable.

    An ``abort`` finish is returned, not raised: the caller decides. ``max_tokens`` is what the
    request asked for, to catch vLLM's silent lowering.
    """
    choice = _choice(body)
    token_ids = _token_ids(choice)
    finish = _finish(choice, token_ids, max_tokens)
    assert isinstance(body, dict)  # _choice checked it
    usage = body.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return GenerateResult(
        rid=rid,
        output_ids=token_ids,
        finish=finish,
        prompt_tokens=prompt_tokens if is_int(prompt_tokens) else None,
        completion_tokens=len(token_ids),
        # Only with --enable-prompt-tokens-details; vLLM reports neither latency nor preemptions
        # per request (vllm:num_preemptions_total counts them for the KV controller).
        cached_tokens=cached if is_int(cached) else 0,
        e2e_latency_s=None,
        num_retractions=0,
        weight_version=None,
    )


def status_error(response: httpx.Response, *, server: str, what: str) -> DatagenError:
    """vLLM's statuses as the project's errors; the message is vLLM's ``error.message``."""
    status = response.status_code
    said = f"{what} on vLLM server {server} got HTTP {status}: {error_message(response)}"
    return classify_status(
        status, said, not_found="The URL is probably not a vLLM server, or it serves another model now"
    )


def abort_error(result: GenerateResult, *, server: str) -> DatagenError:
    return GenerationAbortedError(
        f"vLLM server {server} aborted request {result.rid!r} after {len(result.output_ids)} tokens "
        "(finish_reason abort). Retry, here or on another server"
    )


def parse_kv_signals(text: str) -> KvSignals:
    """The KV controller's inputs from vLLM's ``/metrics`` page (:data:`KV_METRICS`); ranks are
    told apart by its ``engine`` label."""
    return read_kv_signals(text, KV_METRICS)


def parse_capture_response(body: object, sent_ids: Sequence[int], *, rid: str, server: str) -> CaptureReply:
    """A capture's answer: the file it names, once the echoed prompt equals the ids sent (a server
    that tokenized or clipped them would store other positions' hidden states)."""
    choice = _choice(body)
    assert isinstance(body, dict)
    echo = choice.get("prompt_token_ids")
    if not isinstance(echo, list) or not all(is_int(t) for t in echo):
        raise ServerError(
            f"capture {rid!r} on {server}: the reply has no prompt_token_ids; vLLM before 0.10.2 ignores "
            "return_token_ids. Upgrade vLLM"
        )
    if echo != list(sent_ids):
        raise ServerError(
            f"capture {rid!r} on {server}: the server's prompt ({len(echo)} ids) is not the "
            f"{len(sent_ids)} ids sent"
        )
    params = body.get("kv_transfer_params")
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"vLLM server {server} answers without kv_transfer_params.hidden_states_path: "
            f"{CAPTURE_LAUNCH_HINT}"
        )
    return CaptureReply(rid=rid, hidden_states_path=path, prompt_tokens=len(echo))
