"""SGLang's ``/generate`` request: body model, normalization and validation.

This mirrors ``GenerateReqInput.normalize_batch_and_arguments``, ``TokenizerManager``'s
``_validate_one_request`` and ``SamplingParams`` (``__post_init__`` and ``verify``), keeping
their messages word for word. Errors come out in the two ways SGLang lets them out:
``RequestError`` (a ``ValueError``; HTTP 400 ``{"error": {"message": ...}}``) and ``ServerBug``
(an exception SGLang does not catch, e.g. ``TypeError`` from an unknown sampling key; HTTP 500
text/plain).
"""

from __future__ import annotations

import math
import uuid
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator

__all__ = [
    "GenerateReqInput",
    "NormalizedRequest",
    "PromptSpec",
    "RequestError",
    "SamplingParams",
    "ServerBug",
    "normalize_request",
    "validate_prompt",
]

_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
NO_TOKENIZER_MESSAGE = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


class RequestError(ValueError):
    """A request SGLang rejects with HTTP 400 ``{"error": {"message": ...}}``."""


class ServerBug(Exception):
    """A request SGLang crashes on (HTTP 500 text/plain "Internal Server Error")."""


def _validate_list_i64_1d(v: Any) -> list[int]:
    if v is None:
        raise ValueError("must not be None")
    if not isinstance(v, list):
        raise ValueError(f"must be list; got {type(v).__name__}")
    if not v:
        return v
    if not isinstance(v[0], int):
        raise ValueError(f"elements must be int; got {type(v[0]).__name__}")
    try:
        array("q", v)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"contains non-int64 element: {exc}") from None
    return v


def _validate_optional_list_i64_1d_2d(v: Any) -> list[int] | list[list[int]] | None:
    # SGLang's sglang.srt.utils.field_validators, so bad ids fail as a 400 body error.
    if v is None:
        return v
    if not isinstance(v, list):
        raise ValueError(f"must be list or null; got {type(v).__name__}")
    if not v:
        return v
    if isinstance(v[0], int):
        return _validate_list_i64_1d(v)
    if isinstance(v[0], list):
        for i, row in enumerate(v):
            try:
                _validate_list_i64_1d(row)
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from None
        return v
    raise ValueError(f"elements must be int or list; got {type(v[0]).__name__}")


class GenerateReqInput(BaseModel):
    """The fields of SGLang's ``GenerateReqInput`` that the simulator reads or refuses.

    Unknown top-level keys are ignored, as FastAPI does for SGLang's dataclass.
    """

    model_config = ConfigDict(extra="ignore")

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: Annotated[
        list[list[int]] | list[int] | None, PlainValidator(_validate_optional_list_i64_1d_2d)
    ] = None
    input_embeds: list[list[list[float]]] | list[list[float]] | None = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    return_logprob: list[bool] | bool | None = None
    logprob_start_len: list[int] | int | None = None
    top_logprobs_num: list[int] | int | None = None
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: list[bool] | bool = False
    custom_logit_processor: list[str | None] | str | None = None
    require_reasoning: bool = False
    return_prompt_token_ids: bool = False
    priority: int | None = None


@dataclass
class SamplingParams:
    """SGLang's ``SamplingParams`` struct: same field names, defaults and checks."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: set[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # Internal struct fields; SamplingParams(**kwargs) accepts them, so a client may send them.
    stop_strs: str | list[str] | None = None
    stop_regex_strs: str | list[str] | None = None
    stop_str_max_len: int = 0
    stop_regex_max_len: int = 0
    is_normalized: bool = False

    @classmethod
    def parse(cls, raw: dict[str, Any], *, vocab_size: int) -> SamplingParams:
        """``SamplingParams(**raw)``, ``__post_init__`` and ``verify`` with SGLang's outcomes."""
        unknown = sorted(set(raw) - _SAMPLING_FIELDS)
        if unknown:
            raise ServerBug(f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
        try:
            params = cls(**raw)
            params._post_init()
            params._verify(vocab_size)
        except RequestError:
            raise
        except ValueError as exc:  # e.g. int("x") in a stop id or a logit_bias key
            raise RequestError(str(exc)) from exc
        except Exception as exc:  # TypeError from a value of the wrong type
            raise ServerBug(f"{type(exc).__name__}: {exc}") from exc
        return params

    def _post_init(self) -> None:
        # null means "use the default" for the non-optional fields.
        if self.stop_token_ids:
            self.stop_token_ids = {int(t) for t in self.stop_token_ids if t is not None} or None
        else:
            self.stop_token_ids = None
        for name, default in _NULL_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if 0 <= self.temperature < _SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1  # greedy
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    def _verify(self, vocab_size: int) -> None:
        self._verify_sampling()
        self._verify_lengths()
        self._verify_extras(vocab_size)

    def _verify_sampling(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise RequestError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 or self.top_k == -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise RequestError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise RequestError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise RequestError(
                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}."
            )

    def _verify_lengths(self) -> None:
        if self.min_new_tokens < 0:
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise RequestError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if not self.min_new_tokens <= self.max_new_tokens:
                raise RequestError(
                    f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got "
                    f"{self.min_new_tokens}."
                )

    def _verify_extras(self, vocab_size: int) -> None:
        if self.logit_bias is not None:
            for token_id in self.logit_bias:
                if not 0 <= int(token_id) < vocab_size:
                    raise RequestError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
        if sum(x is not None for x in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise RequestError("Only one of regex, json_schema, or ebnf can be set.")
        # Not SGLang checks, but a crash there too: the simulator needs these as ints.
        if self.max_new_tokens is not None and not isinstance(self.max_new_tokens, int):
            raise TypeError("max_new_tokens must be an int")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            raise TypeError("sampling_seed must be an int")


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_NULL_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
}


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a request, before parallel-sampling expansion."""

    input_ids: list[int]
    raw_params: dict[str, Any]


@dataclass(frozen=True)
class NormalizedRequest:
    is_single: bool
    prompts: list[PromptSpec]
    # The rids the request claims while in flight, one per prompt and sample.
    rids: list[str]
    parallel_sample_num: int

    def run_rids(self) -> list[str]:
        """The rids the samples run under: the client's, or fresh uuids when ``n > 1``."""
        if self.parallel_sample_num == 1:
            return list(self.rids)
        return [uuid.uuid4().hex for _ in range(len(self.prompts) * self.parallel_sample_num)]


def normalize_request(
    obj: GenerateReqInput, *, tokenize: Callable[[str], list[int]] | None
) -> NormalizedRequest:
    """``normalize_batch_and_arguments`` plus tokenization of ``text``."""
    _refuse_unsimulated(obj)
    if (obj.text is None and obj.input_ids is None and obj.input_embeds is None) or (
        obj.text is not None and obj.input_ids is not None and obj.input_embeds is not None
    ):
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if obj.input_embeds is not None and obj.input_ids is None and obj.text is None:
        raise RequestError("input_embeds are not supported by the simulator; send input_ids.")

    is_single, prompts_ids = _prompt_ids(obj, tokenize)
    n = _parallel_sample_num(obj.sampling_params)
    if n > 1:
        is_single = False
    batch_size = len(prompts_ids)
    rids = _normalize_rids(obj.rid, is_single=is_single, batch_size=batch_size, num=batch_size * n)

    prompts: list[PromptSpec] = []
    for i, ids in enumerate(prompts_ids):
        raw = obj.sampling_params
        if isinstance(raw, list):
            if i >= len(raw):
                raise ServerBug("IndexError: list index out of range")
            raw = raw[i]
        prompts.append(PromptSpec(input_ids=ids, raw_params=dict(raw or {})))
    return NormalizedRequest(is_single=is_single, prompts=prompts, rids=rids, parallel_sample_num=n)


def validate_prompt(
    prompt: PromptSpec, *, context_len: int, max_req_input_len: int, vocab_size: int
) -> SamplingParams:
    """The tokenizer manager's length checks, then the sampling params, then the scheduler's."""
    input_len = len(prompt.input_ids)
    if input_len >= context_len:
        raise RequestError(
            f"The input ({input_len} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    max_new_tokens = prompt.raw_params.get("max_new_tokens")
    if max_new_tokens is not None:
        try:
            total = max_new_tokens + input_len
        except TypeError as exc:
            raise ServerBug(f"TypeError: {exc}") from exc
        if total >= context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {context_len} "
                f"tokens. You requested a total of {total} tokens: {input_len} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit."
            )
    params = SamplingParams.parse(prompt.raw_params, vocab_size=vocab_size)
    if input_len >= max_req_input_len:
        raise RequestError(
            f"Input length ({input_len} tokens) exceeds the maximum allowed length ({max_req_input_len} "
            f"tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    return params


def _refuse_unsimulated(obj: GenerateReqInput) -> None:
    # Refusing loudly beats answering without the fields a client asked for.
    if obj.stream:
        raise RequestError(
            "Streaming is not simulated; send stream=false (the simulator answers in one body)."
        )
    if obj.return_logprob is True or (isinstance(obj.return_logprob, list) and any(obj.return_logprob)):
        raise RequestError("return_logprob is not simulated; the simulator has no logits.")
    hidden = obj.return_hidden_states
    if hidden is True or (isinstance(hidden, list) and any(hidden)):
        raise RequestError(
            "The server is not configured to return the hidden states. "
            "Please set `--enable-return-hidden-states` to enable this feature."
        )
    if obj.custom_logit_processor:
        raise RequestError("The server is not configured to enable custom logit processor.")


def _prompt_ids(
    obj: GenerateReqInput, tokenize: Callable[[str], list[int]] | None
) -> tuple[bool, list[list[int]]]:
    # The batch shape comes from `text` when it is present, the ids from `input_ids` (SGLang's
    # _determine_batch_size and _tokenize_one_request).
    if obj.text is not None:
        if obj.input_ids:
            return isinstance(obj.text, str), _id_rows(obj.input_ids)
        if tokenize is None:
            raise RequestError(NO_TOKENIZER_MESSAGE)
        texts = [obj.text] if isinstance(obj.text, str) else obj.text
        return isinstance(obj.text, str), [tokenize(t) for t in texts]
    if not obj.input_ids:
        raise RequestError("input_ids cannot be empty.")
    rows = _id_rows(obj.input_ids)
    if any(len(r) == 0 for r in rows):
        raise RequestError("input_ids cannot be empty.")
    return isinstance(obj.input_ids[0], int), rows


def _id_rows(ids: list[int] | list[list[int]]) -> list[list[int]]:
    # The validator guarantees a flat list of ints or a list of such lists.
    if isinstance(ids[0], int):
        return [[int(i) for i in ids]]
    return [list(row) for row in ids]


def _parallel_sample_num(sampling_params: list[dict[str, Any]] | dict[str, Any] | None) -> int:
    if sampling_params is None:
        return 1
    if isinstance(sampling_params, dict):
        n = sampling_params.get("n", 1)
    else:
        if not sampling_params:
            raise ServerBug("IndexError: list index out of range")
        n = sampling_params[0].get("n", 1)
        for params in sampling_params:
            if params.get("n", 1) != n:
                raise RequestError(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
    if not isinstance(n, int):
        raise ServerBug(f"TypeError: n must be an int, got {type(n).__name__}")
    # SGLang only expands when n > 1; smaller values run the prompt once.
    return max(n, 1)


def _normalize_rids(rid: str | list[str] | None, *, is_single: bool, batch_size: int, num: int) -> list[str]:
    if is_single:
        if isinstance(rid, list):  # SGLang would key its state dict by a list
            raise ServerBug("TypeError: unhashable type: 'list'")
        return [rid if rid is not None else uuid.uuid4().hex]
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    else:
        if len(rid) != batch_size:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = list(rid)
    if len(set(rids)) != len(rids):
        duplicates = [r for r, count in Counter(rids).items() if count > 1]
        raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    return rids
