"""vLLM's ``/v1/completions`` request, its checks and its finish rule, as vLLM 0.33.0 has them.

Sources (``docs/reference/vllm-contract.md`` has the details): ``CompletionRequest`` in
``vllm/entrypoints/openai/completion/protocol.py``; the length checks in ``TokenizeParams``
(``vllm/renderers/params.py``) and ``get_max_tokens`` (``vllm/entrypoints/serve/utils/api_utils.py``);
``SamplingParams._verify_args`` (``vllm/sampling_params.py``); ``check_stop``
(``vllm/v1/core/sched/utils.py``). Messages are kept word for word. Every check raises
``VllmError``, which the app turns into vLLM's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from http import HTTPStatus
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from simulator.model import SpecialIds, expected_output

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "SAMPLING_FIELDS",
    "CompletionRequest",
    "VllmError",
    "VllmFinish",
    "VllmOutput",
    "check_prompt",
    "check_sampling",
    "check_token_ids",
    "effective_max_tokens",
    "vllm_expected_output",
    "vllm_finish",
]

DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens; null means this too
_SAMPLING_EPS = 1e-5  # below it, temperature means greedy
_MAX_TEMPERATURE = 2.0
_MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2]
# The request's fields that ``to_sampling_params`` puts in vLLM's ``SamplingParams``.
SAMPLING_FIELDS = frozenset(
    {
        "max_tokens",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    }
)


class VllmFinish(StrEnum):
    """``finish_reason`` of a choice (vLLM's ``FinishReason`` strings the simulator can produce)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class VllmError(Exception):
    """A request vLLM answers with an ``ErrorResponse``; ``create_error_response`` picks the type."""

    def __init__(
        self,
        message: str,
        *,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": int(self.status),
            }
        }


_TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(BaseModel):
    """The fields of vLLM's ``CompletionRequest`` the simulator reads or refuses.

    vLLM allows (and logs) unknown keys; here they are ignored.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[_TokenId] | list[list[_TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    n: int = 1
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = []
    stream: bool | None = False
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    # Accepted and checked as vLLM checks them; the simulated tokens do not depend on them.
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    # Read by the hidden-states connector: include_output_tokens, hidden_states_path (ignored).
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data: Any) -> Any:
        # normalize_null_max_tokens: an explicit null is the default (16), not "until the context is
        # full". A missing one is left missing, so that the request log says what was sent.
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": DEFAULT_MAX_TOKENS}
        return data

    @model_validator(mode="before")
    @classmethod
    def _prompt_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            prompt = data.get("prompt")
            if prompt is None or prompt == "":
                raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return data

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields the request carried, under their names (``SAMPLING_FIELDS``)."""
        return self.model_dump(include=set(SAMPLING_FIELDS & self.model_fields_set))

    def refuse_unsimulated(self) -> None:
        """Refusing loudly beats answering without the fields a client asked for."""
        asked = {
            "stream": bool(self.stream),
            "echo": bool(self.echo),
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "use_beam_search": self.use_beam_search,
            "suffix": self.suffix is not None,
            "min_tokens": self.min_tokens != 0,
        }
        refused = [name for name, on in asked.items() if on]
        if refused:
            raise VllmError(
                f"{refused[0]} is not simulated; the simulator answers in one body with token ids and text.",
                param=refused[0],
            )


def check_prompt(prompt_len: int, *, max_tokens: int, max_model_len: int) -> None:
    """The renderer's checks (``TokenizeParams``): output budget first, then the prompt itself."""
    if max_tokens > max_model_len:
        raise VllmError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )
    if prompt_len > max_model_len:
        raise VllmError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {prompt_len} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )


def effective_max_tokens(prompt_len: int, *, max_tokens: int, max_model_len: int) -> int:
    """``get_max_tokens``: what the client asked for, silently lowered to what the context leaves."""
    return min(max_model_len - prompt_len, max_tokens)


def check_sampling(req: CompletionRequest, *, max_tokens: int) -> None:
    """``SamplingParams._verify_args`` (the checks for the fields the simulator reads), in its order."""
    n = req.n
    if n < 1:
        raise VllmError(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise VllmError(
            f"n must be at most {_MAX_N}, got {n}. "
            "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
        )
    _check_penalties(req)
    temperature = 1.0 if req.temperature is None else req.temperature
    _check_temperature(temperature)
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise VllmError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    top_k = 0 if req.top_k is None else req.top_k
    if top_k < -1:
        raise VllmError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0.0 <= min_p <= 1.0:
        raise VllmError(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise VllmError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if temperature < _SAMPLING_EPS and n > 1:
        raise VllmError(f"n must be 1 when using greedy sampling, got {n}.")


def _check_penalties(req: CompletionRequest) -> None:
    presence = 0.0 if req.presence_penalty is None else req.presence_penalty
    if not -_MAX_PENALTY <= presence <= _MAX_PENALTY:
        raise VllmError(f"presence_penalty must be in [-2, 2], got {presence}.", param="presence_penalty")
    frequency = 0.0 if req.frequency_penalty is None else req.frequency_penalty
    if not -_MAX_PENALTY <= frequency <= _MAX_PENALTY:
        raise VllmError(f"frequency_penalty must be in [-2, 2], got {frequency}.", param="frequency_penalty")
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not math.isfinite(repetition) or repetition <= 0.0:
        raise VllmError(
            f"repetition_penalty must be greater than zero, got {repetition}.", param="repetition_penalty"
        )


def _check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature):
        raise VllmError(f"temperature must be a finite number, got {temperature}.", param="temperature")
    if temperature < 0.0:
        raise VllmError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    if temperature > _MAX_TEMPERATURE:
        raise VllmError(f"temperature must be in [0, 2], got {temperature}.", param="temperature")


def check_token_ids(ids: Sequence[int], *, vocab_size: int) -> None:
    """``InputProcessor``: an empty prompt, then ids outside the vocabulary (``validate_token_ids``)."""
    if not ids:
        raise VllmError("The decoder prompt cannot be empty")
    if max(ids) > vocab_size - 1:
        raise VllmError(f"Token id {max(ids)} is out of vocabulary")


@dataclass(frozen=True)
class VllmOutput:
    """One choice's generated ids with vLLM's ``finish_reason`` and ``stop_reason`` for them."""

    token_ids: list[int]
    finish_reason: VllmFinish
    stop_reason: int | None


def vllm_finish(
    token_ids: Sequence[int], *, eos_id: int | None, stop_token_ids: Collection[int] = ()
) -> VllmOutput:
    """Cut ``token_ids`` where vLLM's ``check_stop`` would stop, and say why.

    Per token, in vLLM's order: the EOS (``stop``, ``stop_reason`` null; ``eos_id`` is None under
    ``ignore_eos``), then a ``stop_token_ids`` hit (``stop``, ``stop_reason`` the id; not turned off
    by ``ignore_eos``), then the length cap (``length``). So an EOS landing exactly on
    ``max_tokens`` is ``stop`` here, where SGLang reports ``length``. ``token_ids`` must already be
    cut at the effective ``max_tokens``.
    """
    stops = set(stop_token_ids)
    for index, token in enumerate(token_ids):
        if token == eos_id:
            return VllmOutput(list(token_ids[: index + 1]), VllmFinish.STOP, None)
        if token in stops:
            return VllmOutput(list(token_ids[: index + 1]), VllmFinish.STOP, token)
    return VllmOutput(list(token_ids), VllmFinish.LENGTH, None)


def vllm_expected_output(
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    seed: int | None,
    special: SpecialIds,
    ignore_eos: bool = False,
    stop_token_ids: Collection[int] = (),
    **model_options: Any,
) -> VllmOutput:
    """What the simulator speaking vLLM returns for ``prompt_ids``: the same tokens as SGLang mode.

    ``max_tokens`` is the effective (lowered) limit; ``model_options`` go to
    :func:`simulator.expected_output` (mean lengths, ``tool_call_ids``).
    """
    ids = expected_output(
        prompt_ids,
        max_new_tokens=max_tokens,
        seed=seed,
        special=special,
        ignore_eos=ignore_eos,
        **model_options,
    ).output_ids
    return vllm_finish(ids, eos_id=None if ignore_eos else special.eos_id, stop_token_ids=stop_token_ids)
