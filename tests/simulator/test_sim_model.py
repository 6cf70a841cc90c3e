from __future__ import annotations

import statistics
from typing import Any

import pytest

from datagen.states import FinishType as DatagenFinishType
from simulator.model import (
    DEFAULT_MEAN_ANSWER_TOKENS,
    DEFAULT_MEAN_REASONING_TOKENS,
    ORDINARY_ID_MIN,
    FinishType,
    SimOutput,
    SpecialIds,
    apply_stop_token_ids,
    expected_output,
)

SPECIAL = SpecialIds.deepseek_default()
LONG = 100_000


def out(prompt: list[int], *, max_new_tokens: int = LONG, seed: int | None = None, **kw: Any) -> SimOutput:
    return expected_output(prompt, max_new_tokens=max_new_tokens, seed=seed, special=SPECIAL, **kw)


def test_same_arguments_give_the_same_output() -> None:
    assert out([5, 6, 7], seed=3) == out([5, 6, 7], seed=3)


def test_pinned_output_never_changes() -> None:
    # Other packages recompute outputs with this function; any change here breaks them.
    assert out([1, 2, 3], max_new_tokens=8, seed=0).output_ids == [
        63217, 83723, 60337, 123141, 87496, 118802, 57740, 50740,
    ]  # fmt: skip
    assert out([1, 2, 3], max_new_tokens=8).output_ids == [
        69132, 5871, 121615, 122415, 122797, 71118, 64040, 21650,
    ]  # fmt: skip


def test_seed_and_prompt_change_the_output() -> None:
    base = out([5, 6, 7], seed=1).output_ids
    assert out([5, 6, 7], seed=2).output_ids != base
    assert out([5, 6, 7]).output_ids != base
    assert out([5, 6, 8], seed=1).output_ids != base


def test_structure_is_reasoning_think_end_answer_eos() -> None:
    for i in range(200):
        result = out([i, 42])
        ids = result.output_ids
        assert result.finish_reason == {"type": "stop", "matched": SPECIAL.eos_id}
        assert ids[-1] == SPECIAL.eos_id
        assert ids.count(SPECIAL.eos_id) == 1
        assert ids.count(SPECIAL.think_end_id) == 1
        assert ids.index(SPECIAL.think_end_id) < len(ids) - 1


def test_ordinary_tokens_avoid_special_and_byte_ids() -> None:
    markers = {SPECIAL.eos_id, SPECIAL.think_end_id}
    for i in range(200):
        ordinary = [t for t in out([i]).output_ids if t not in markers]
        assert all(ORDINARY_ID_MIN <= t < SPECIAL.vocab_size for t in ordinary)
        assert not set(ordinary) & SPECIAL.excluded_ids


def test_lengths_are_heavy_tailed_with_a_few_hundred_median() -> None:
    lengths = sorted(len(out([i, 9]).output_ids) for i in range(3000))
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    assert 150 <= median <= 300
    assert p99 / median > 4
    assert lengths[-1] > 2000


def test_mean_lengths_follow_the_arguments() -> None:
    short = [len(out([i], mean_reasoning_tokens=20, mean_answer_tokens=5).output_ids) for i in range(500)]
    assert statistics.mean(short) < 40
    reasoning = []
    for i in range(2000):
        ids = out([i], mean_reasoning_tokens=100, mean_answer_tokens=DEFAULT_MEAN_ANSWER_TOKENS).output_ids
        reasoning.append(ids.index(SPECIAL.think_end_id))
    assert 85 <= statistics.mean(reasoning) <= 115
    assert DEFAULT_MEAN_REASONING_TOKENS > DEFAULT_MEAN_ANSWER_TOKENS


@pytest.mark.parametrize("max_new_tokens", [1, 2, 17, 150])
def test_a_cut_output_is_a_prefix_with_exactly_max_new_tokens(max_new_tokens: int) -> None:
    prompt = next(p for p in ([i] for i in range(1000)) if len(out(p).output_ids) > 200)
    full = out(prompt).output_ids
    cut = out(prompt, max_new_tokens=max_new_tokens)
    assert cut.output_ids == full[:max_new_tokens]
    assert cut.finish_reason == {"type": "length", "length": max_new_tokens}


def test_zero_max_new_tokens_gives_nothing() -> None:
    assert out([1, 2], max_new_tokens=0) == SimOutput([], {"type": "length", "length": 0})
    with pytest.raises(ValueError, match="at least 0"):
        out([1, 2], max_new_tokens=-1)


def test_eos_exactly_at_the_limit_reports_length() -> None:
    # SGLang checks the length limit before the EOS, so this is not a "stop".
    full = out([4, 4]).output_ids
    boundary = out([4, 4], max_new_tokens=len(full))
    assert boundary.output_ids == full
    assert boundary.finish_reason == {"type": "length", "length": len(full)}
    assert out([4, 4], max_new_tokens=len(full) + 1).finish_reason["type"] == "stop"


def test_ignore_eos_generates_until_the_limit() -> None:
    normal = out([8, 9]).output_ids
    ignored = out([8, 9], max_new_tokens=len(normal) + 500, ignore_eos=True)
    assert len(ignored.output_ids) == len(normal) + 500
    assert SPECIAL.eos_id not in ignored.output_ids
    assert ignored.output_ids[: len(normal) - 1] == normal[:-1]
    assert ignored.finish_reason == {"type": "length", "length": len(normal) + 500}


def test_zero_means_give_only_the_markers() -> None:
    result = out([3], mean_reasoning_tokens=0, mean_answer_tokens=0)
    assert result.output_ids == [SPECIAL.think_end_id, SPECIAL.eos_id]


def test_stop_token_ids_cut_at_the_first_match() -> None:
    full = out([11, 12])
    target = full.output_ids[5]
    cut = apply_stop_token_ids(full, {target}, max_new_tokens=LONG)
    assert cut.output_ids == full.output_ids[: full.output_ids.index(target) + 1]
    assert cut.finish_reason == {"type": "stop", "matched": target}
    assert apply_stop_token_ids(full, set(), max_new_tokens=LONG) is full
    assert apply_stop_token_ids(full, {7}, max_new_tokens=LONG) is full
    at_limit = apply_stop_token_ids(full, {target}, max_new_tokens=full.output_ids.index(target) + 1)
    assert at_limit.finish_reason["type"] == "length"


def test_finish_types_are_the_ones_datagen_reads() -> None:
    # The simulator keeps its own copy so that it imports none of our packages.
    assert {t.name: t.value for t in FinishType} == {t.name: t.value for t in DatagenFinishType}


def test_deepseek_default_matches_the_real_tokenizer(deepseek_tokenizer: Any) -> None:
    from_tokenizer = SpecialIds.from_tokenizer(deepseek_tokenizer)
    assert from_tokenizer == SpecialIds.deepseek_default()
    assert from_tokenizer.eos_id == 1
    assert from_tokenizer.think_end_id == 128822
    assert from_tokenizer.vocab_size == 129280
    assert {0, 1, 2} <= from_tokenizer.excluded_ids
    assert min(from_tokenizer.excluded_ids - {0, 1, 2}) == 128000


def test_outputs_decode_to_text(deepseek_tokenizer: Any) -> None:
    ids = out([0, 100, 200]).output_ids
    text = deepseek_tokenizer.decode(ids[:-1], skip_special_tokens=True)
    assert text.count("</think>") == 1
    # Ordinary ids are whole pieces, not byte fallbacks: replacement characters stay rare.
    assert len(text) > len(ids)
    assert text.count("\ufffd") < 0.02 * len(text)
