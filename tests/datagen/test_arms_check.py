"""A recipe's arms must render apart, with the real DeepSeek tokenizer and the project template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from datagen.errors import PreflightError
from datagen.prompts.arms_check import check_arms_render_apart, differing_keys
from datagen.prompts.preflight import preflight_submit
from datagen.prompts.tokenization import default_chat_template_path, renderer_for
from datagen.spec import Arm, JobSpec
from tests.support.specs import NO_CONTEXT_LEN, job_spec

HI = [{"role": "user", "content": "Hi"}]
# Read off the DeepSeek tokenizer once and written here by hand.
# <｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n
THINKING_IDS = [0, 128803, 23166, 128804, 128821, 201]
# ... <｜Assistant｜><think>\n\n</think>\n\n: the empty think block of thinking off.
NOT_THINKING_IDS = [0, 128803, 23166, 128804, 128821, 271, 128822, 271]
# <｜begin▁of▁sentence｜>Reasoning: low<｜User｜>Hi<｜Assistant｜><think>\n
LOW_EFFORT_IDS = [0, 77666, 288, 28, 3157, 128803, 23166, 128804, 128821, 201]


def _recipe(*arms: dict[str, Any]) -> dict[str, Any]:
    return {"assign": "cycle", "arms": list(arms)}


def _arms(spec: JobSpec) -> list[Arm]:
    assert spec.recipe is not None
    return spec.recipe.arms


def test_each_arm_renders_a_row_with_its_own_variables() -> None:
    spec = job_spec(
        recipe=_recipe(
            {"name": "on"},
            {"name": "off", "chat_template_kwargs": {"thinking": False}},
            {"name": "low", "chat_template_kwargs": {"reasoning_effort": "low"}},
        )
    )
    assert [renderer_for(spec, arm).render(HI) for arm in _arms(spec)] == [
        THINKING_IDS,
        NOT_THINKING_IDS,
        LOW_EFFORT_IDS,
    ]
    check_arms_render_apart(spec)  # three modes, three renderings


def test_a_variable_the_template_ignores_is_refused_naming_both_arms_and_the_variable() -> None:
    spec = job_spec(
        recipe=_recipe({"name": "plain"}, {"name": "eager", "chat_template_kwargs": {"effort_level": "x"}})
    )
    assert renderer_for(spec, _arms(spec)[1]).render(HI) == THINKING_IDS  # as if unset
    with pytest.raises(PreflightError) as refused:
        check_arms_render_apart(spec)
    assert str(refused.value) == (
        'recipe: arms "plain" and "eager" render the same prompt ids: the chat template ignores the '
        'difference in effort_level (unset vs "x"); use the variable the template reads, or drop one arm'
    )


def test_a_value_the_template_reads_but_renders_as_its_default_is_refused() -> None:
    # thinking defaults to true in the project template: the two arms are one mode.
    spec = job_spec(
        recipe=_recipe(
            {"name": "default"},
            {"name": "off", "chat_template_kwargs": {"thinking": False}},
            {"name": "on", "chat_template_kwargs": {"thinking": True}},
        )
    )
    with pytest.raises(PreflightError, match=r'arms "default" and "on" .* thinking \(unset vs true\)'):
        check_arms_render_apart(spec)


def test_arms_with_equal_variables_and_other_sampling_pass() -> None:
    spec = job_spec(
        recipe=_recipe(
            {"name": "cool", "sampling": {"temperature": 0.2}},
            {"name": "hot", "sampling": {"temperature": 1.0}},
        )
    )
    check_arms_render_apart(spec)


def test_arms_are_compared_by_their_variables_over_the_jobs() -> None:
    # The job sets low effort: "job" and "same" render alike because their variables are equal.
    spec = job_spec(
        chat_template_kwargs={"reasoning_effort": "low"},
        recipe=_recipe(
            {"name": "job"},
            {"name": "same", "chat_template_kwargs": {"reasoning_effort": "low"}, "sampling": {"top_p": 0.5}},
            {"name": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
        ),
    )
    check_arms_render_apart(spec)
    # An arm whose only difference from the job's variables is one the template ignores.
    spec = job_spec(
        chat_template_kwargs={"reasoning_effort": "low"},
        recipe=_recipe({"name": "job"}, {"name": "odd", "chat_template_kwargs": {"verbosity": 2}}),
    )
    with pytest.raises(PreflightError, match=r"ignores the difference in verbosity \(unset vs 2\);"):
        check_arms_render_apart(spec)


def test_one_arm_or_no_recipe_has_nothing_to_compare() -> None:
    check_arms_render_apart(job_spec(recipe=_recipe({"name": "only", "chat_template_kwargs": {"nope": 1}})))
    check_arms_render_apart(job_spec())


def test_a_variable_that_only_changes_tool_definitions_is_read(tmp_path: Path) -> None:
    template = tmp_path / "tools.jinja"
    text = default_chat_template_path().read_text()
    template.write_text("{% if tools and terse_tools is defined %}TERSE {% endif %}" + text)
    spec = job_spec(
        chat_template=str(template),
        recipe=_recipe({"name": "plain"}, {"name": "terse", "chat_template_kwargs": {"terse_tools": True}}),
    )
    assert renderer_for(spec, _arms(spec)[1]).render(HI) == THINKING_IDS  # no tools: no change
    check_arms_render_apart(spec)  # the probe with a tool shows the difference


def test_pre_flight_refuses_the_arms_before_waiting_for_servers() -> None:
    spec = job_spec(
        NO_CONTEXT_LEN,
        recipe=_recipe({"name": "a"}, {"name": "b", "chat_template_kwargs": {"effort_level": "x"}}),
    )
    # With no server and no context_len the pre-flight would otherwise answer NoServersYetError,
    # which `datagen submit` waits on.
    with pytest.raises(PreflightError, match='arms "a" and "b" render the same prompt ids') as refused:
        preflight_submit(spec, renderer_for(spec), {})
    assert type(refused.value) is PreflightError


def test_differing_keys_lists_values_set_differently_or_in_one_only() -> None:
    assert differing_keys({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": None}) == ["b", "c"]
    assert differing_keys({"a": 1}, {"a": 1}) == []
