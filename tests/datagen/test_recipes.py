"""Recipes: the arms in the spec, the one assignment rule (`datagen.prompts.recipes`), each arm's rendering
and sampling, and a row admitted only under every arm it uses (`service.admit.admit_row`)."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pytest

from datagen.control.payload import PromptPayload
from datagen.errors import FatalError, InvalidSpecError
from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.recipes import arm_shares, arms_of_row, assign_arm
from datagen.prompts.tokenization import renderer_for
from datagen.spec import validate_spec
from datagen.states import PromptClass
from service.admit import AdmittedRow, Refused, admit_row, arm_renderers
from tests.support.specs import job_spec, make_spec

# The project template's generation prompt for one user turn "Hi" (decoded:
# "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"), written out by hand from the tokenizer's
# vocabulary: 0 BOS, 128803 <｜User｜>, 23166 "Hi", 128804 <｜Assistant｜>, 128821 <think>, 201 "\n".
HI_THINKING = [0, 128803, 23166, 128804, 128821, 201]
# thinking: false closes an empty think block: 271 "\n\n", 128822 </think>, 271 "\n\n".
HI_NOT_THINKING = [0, 128803, 23166, 128804, 128821, 271, 128822, 271]
# reasoning_effort: high puts "Reasoning: high" in the system prompt: 77666 "Reason", 288 "ing", 28 ":",
# 1669 " high".
HI_HIGH_EFFORT = [0, 77666, 288, 28, 1669, 128803, 23166, 128804, 128821, 201]

THREE_ARMS: dict[str, Any] = {
    "assign": "weighted",
    "seed": 7,
    "arms": [
        {"name": "low", "weight": 4, "chat_template_kwargs": {"reasoning_effort": "low"}},
        {"name": "medium", "weight": 4, "chat_template_kwargs": {"reasoning_effort": "medium"}},
        {
            "name": "high",
            "weight": 2,
            "chat_template_kwargs": {"reasoning_effort": "high"},
            "sampling": {"temperature": 1.0, "top_p": 0.9},
        },
    ],
}


def _refusal(**overrides: Any) -> str:
    with pytest.raises(InvalidSpecError) as caught:
        validate_spec(make_spec(**overrides))
    return str(caught.value)


# -- the spec ---------------------------------------------------------------------------------------


def test_a_spec_without_a_recipe_is_stored_without_the_key() -> None:
    # Workers of the previous release forbid unknown fields: they still run such a job.
    assert "recipe" not in json.loads(job_spec().model_dump_json())
    assert json.loads(job_spec(recipe=THREE_ARMS).model_dump_json())["recipe"]["arms"][2]["name"] == "high"


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ({"arms": []}, "recipe.arms: List should have at least 1 item"),
        ({"arms": [{"name": "a"}, {"name": "a"}]}, "arm names ['a'] repeat"),
        ({"arms": [{"name": "a|b"}]}, "recipe.arms.0.name: String should match pattern"),
        ({"arms": [{"name": "a", "weight": 0}]}, "recipe.arms.0.weight"),
        ({"assign": "cycle", "arms": [{"name": "a", "weight": 2}, {"name": "b"}]}, "drop the weights"),
        (
            {"assign": "random", "arms": [{"name": "a"}]},
            "recipe.assign: Input should be 'weighted' or 'cycle'",
        ),
        (
            {"arms": [{"name": "hot", "sampling": {"temperature": -1.0}}]},
            "recipe.arms[0] (hot).sampling: temperature: Input should be greater than or equal to 0",
        ),
        (
            {"arms": [{"name": "hot", "sampling": {"temprature": 1.0}}]},
            "recipe.arms[0] (hot).sampling: temprature: Extra inputs are not permitted",
        ),
    ],
)
def test_a_bad_recipe_is_refused_saying_what_to_fix(recipe: dict[str, Any], expected: str) -> None:
    assert expected in _refusal(recipe=recipe)


def test_a_capture_only_job_refuses_a_recipe() -> None:
    message = _refusal(features={"layers": [2], "capture_only": True}, recipe=THREE_ARMS)
    assert "features.capture_only renders and generates nothing" in message


def test_an_arm_merges_its_kwargs_and_sampling_over_the_jobs() -> None:
    spec = job_spec(
        chat_template_kwargs={"thinking": True, "reasoning_effort": "medium"},
        sampling={"temperature": 0.6, "top_p": 0.95, "sampling_seed": 100},
        samples=2,
        temperatures=[0.2, 0.4],
        recipe=THREE_ARMS,
    )
    low, high = spec.arm_named("low"), spec.arm_named("high")
    assert spec.template_kwargs(low) == {"thinking": True, "reasoning_effort": "low"}
    assert spec.template_kwargs(None) == {"thinking": True, "reasoning_effort": "medium"}
    # An arm without a temperature of its own takes the gen's from `temperatures`; one with its own
    # keeps it. Seeds stay distinct per gen either way.
    low_1 = spec.sampling_for(1, 64, low)
    assert (low_1["temperature"], low_1["top_p"], low_1["sampling_seed"]) == (0.4, 0.95, 101)
    high_1 = spec.sampling_for(1, 64, high)
    assert (high_1["temperature"], high_1["top_p"], high_1["sampling_seed"]) == (1.0, 0.9, 101)
    assert high_1["max_new_tokens"] == 64
    with pytest.raises(FatalError, match="arm 'nope'"):
        spec.arm_named("nope")


# -- assignment -------------------------------------------------------------------------------------


def test_cycle_gives_the_i_th_sample_of_the_file_arm_i_mod_k() -> None:
    spec = job_spec(samples=2, recipe={"assign": "cycle", "arms": [{"name": n} for n in ("a", "b", "c")]})
    assert spec.recipe is not None
    names = [a.name for row in range(5) for a in arms_of_row(spec, sample_id=f"id{row}", row_index=row)]  # type: ignore[union-attr]
    assert names == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a"]
    assert arm_shares(spec.recipe) == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})


def test_weighted_meets_the_weights_on_3000_samples_and_never_changes_its_mind() -> None:
    spec = job_spec(recipe=THREE_ARMS)
    assert spec.recipe is not None
    assert arm_shares(spec.recipe) == pytest.approx({"low": 0.4, "medium": 0.4, "high": 0.2})
    drawn = [arms_of_row(spec, sample_id=f"s{i}", row_index=i)[0] for i in range(3000)]
    shares = Counter(arm.name for arm in drawn if arm is not None)
    assert abs(shares["low"] / 3000 - 0.4) <= 0.03
    assert abs(shares["medium"] / 3000 - 0.4) <= 0.03
    assert abs(shares["high"] / 3000 - 0.2) <= 0.03
    # The draw depends on the sample, not on where the row sits: a row moved keeps its arm.
    again = [
        assign_arm(spec.recipe, sample_id=f"s{i}", gen=0, row_index=3000 - i, samples=1) for i in range(3000)
    ]
    assert [a.name for a in again] == [a.name for a in drawn if a is not None]
    # Another seed draws again: most samples keep their arm by chance only.
    reseeded = spec.recipe.model_copy(update={"seed": 8})
    moved = sum(
        assign_arm(reseeded, sample_id=f"s{i}", gen=0, row_index=i, samples=1).name != drawn[i].name  # type: ignore[union-attr]
        for i in range(3000)
    )
    assert 0.4 * 3000 < moved < 0.8 * 3000


def test_row_index_counts_the_non_blank_lines_of_the_file() -> None:
    lines = [
        json.dumps({"id": "a", "prompt": "one"}),
        "",
        "{broken",
        json.dumps({"id": "b", "prompt": "two"}),
    ]
    items = list(iter_prompts(io.BytesIO(("\n".join(lines) + "\n").encode())))
    prompts = [i for i in items if isinstance(i, Prompt)]
    assert [(p.line, p.row_index) for p in prompts] == [(1, 0), (4, 2)]


# -- rendering and admission ------------------------------------------------------------------------


def _prompt(content: str = "Hi", sample_id: str = "x", row_index: int = 0) -> Prompt:
    return Prompt(
        line=row_index + 1,
        sample_id=sample_id,
        turn=0,
        messages=[{"role": "user", "content": content}],
        tools=None,
        partition="default",
        cls=None,
        original={},
        row_index=row_index,
    )


def test_each_arm_renders_the_row_with_its_own_kwargs_by_hand_written_ids() -> None:
    spec = job_spec(
        samples=3,
        recipe={
            "assign": "cycle",
            "arms": [
                {"name": "think"},
                {"name": "answer", "chat_template_kwargs": {"thinking": False}},
                {"name": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
            ],
        },
    )
    verdict = admit_row(_prompt(), spec, arm_renderers(spec), context_len=4096)
    assert isinstance(verdict, AdmittedRow)
    rendered = [(arm.name if arm else None, admitted.prompt_ids) for arm, admitted in verdict.samples]
    assert rendered == [("think", HI_THINKING), ("answer", HI_NOT_THINKING), ("high", HI_HIGH_EFFORT)]
    renderer = arm_renderers(spec)(spec.arm_named("answer"))
    assert renderer.tokenizer.decode(HI_NOT_THINKING) == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n\n</think>\n\n"
    )


def test_a_row_one_arm_cannot_take_is_refused_whole_naming_the_arm() -> None:
    # The 6 ids of "think" fit a context of 8 with room to generate; the 10 of "high" do not.
    spec = job_spec(
        samples=2,
        recipe={
            "assign": "cycle",
            "arms": [
                {"name": "think"},
                {"name": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
            ],
        },
    )
    verdict = admit_row(_prompt(), spec, arm_renderers(spec), context_len=8)
    assert isinstance(verdict, Refused)
    assert verdict.reason == (
        "arm high: prompt has 10 tokens, which does not fit the context length of 8 tokens "
        "(no room to generate)"
    )


def test_the_payload_carries_the_arm_and_a_payload_without_one_reads_as_none() -> None:
    payload = PromptPayload(
        job="j",
        sample_id="x",
        turn=0,
        gen=1,
        cls=PromptClass.SHORT,
        prompt_ids=[1, 2],
        max_new_tokens=8,
        partition="default",
        arm="high",
    )
    body = payload.to_json()
    assert body["arm"] == "high"
    assert PromptPayload.from_json(body).arm == "high"
    del body["arm"]
    assert PromptPayload.from_json(body).arm is None


def test_arms_share_the_loaded_tokenizer_and_keep_their_own_generation_prompt() -> None:
    spec = job_spec(recipe=THREE_ARMS, chat_template_kwargs={"thinking": False})
    plain, low = renderer_for(spec), renderer_for(spec, spec.arm_named("low"))
    high = renderer_for(spec, spec.arm_named("high"))
    # One tokenizer load for the job, whatever its arms: an arm costs no second copy in memory.
    assert low.tokenizer is high.tokenizer is plain.tokenizer
    assert (low.chat_template_kwargs, high.chat_template_kwargs) == (
        {"thinking": False, "reasoning_effort": "low"},
        {"thinking": False, "reasoning_effort": "high"},
    )
    # Written out: thinking off ends every prompt with the empty think block, whatever the effort.
    assert low.generation_prompt_ids() == high.generation_prompt_ids() == [128804, 128821, 271, 128822, 271]
    assert low.identity()["chat_template_kwargs"] == '{"reasoning_effort":"low","thinking":false}'
    assert renderer_for(spec, spec.arm_named("low")) is low  # cached by its variables
