"""The chat template's render budget (output size, render time) with the real tokenizer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jinja2.utils
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from datagen.errors import InvalidRowError
from datagen.prompts.template_budget import MAX_RENDER_CHARS, MAX_RENDER_S, BudgetedTemplate
from datagen.prompts.tokenization import PromptRenderer, bundled_tokenizer_path, default_chat_template_path
from tests.support.rendering import render_text

# Well under the minute `{{ 'a' * 10000000 }}` took before the budget (tokenizing 10 MB of text).
FAST_S = 5.0
# Renders the row normally, and runs the template's bomb only for a row that says "boom".
PREFIX = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if 'boom' in messages[0]['content'] %}"
)
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
SUFFIX = "{% endif %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
BOOM = [{"role": "user", "content": "boom"}]
HI = [{"role": "user", "content": "Hi"}]


def _renderer(tmp_path: Path, bomb: str) -> PromptRenderer:
    path = tmp_path / "bomb.jinja"
    path.write_text(PREFIX + bomb + SUFFIX)
    return PromptRenderer(bundled_tokenizer_path(), chat_template_path=str(path))


@pytest.mark.parametrize(
    ("bomb", "message"),
    [
        ("{{ 'a' * 10000000 }}", "output budget of 4,000,000 characters (operator *)"),
        ("{{ [0] * 100000000 }}", "output budget of 4,000,000 characters (operator *)"),
        ("{% for i in range(100000000) %}{% endfor %}", "(a call with argument 100,000,000)"),
        ("{{ 'a'|center(100000000) }}", "(filter center with argument 100,000,000)"),
        # Through a variable: Jinja would fold a constant `2 ** 100000000` when compiling.
        ("{% set n = 100000000 %}{{ 2 ** n }}", "(operator **)"),
        (DOUBLING.replace("OP", "~"), "(~ concatenation)"),
        (DOUBLING.replace("OP", "+"), "(operator +)"),
        ("{% for i in range(3000) %}{{ 'x' * 2000 }}{% endfor %}", "(streamed output)"),
    ],
)
def test_a_row_over_the_output_budget_is_rejected_quickly(tmp_path: Path, bomb: str, message: str) -> None:
    renderer = _renderer(tmp_path, bomb)
    # The same template renders a row that does not set it off, with the exact ids:
    # <｜begin▁of▁sentence｜> "Hi" <｜Assistant｜> <think> "\n".
    assert renderer.render(HI) == [0, 23166, 128804, 128821, 201]
    started = time.monotonic()
    with pytest.raises(InvalidRowError, match="fix the template") as info:
        renderer.render(BOOM)
    assert time.monotonic() - started < FAST_S
    assert message in str(info.value)


def test_a_row_over_the_time_budget_is_rejected(tmp_path: Path) -> None:
    # 10^10 empty iterations: nothing is output, so only the loop's own check can stop it.
    renderer = _renderer(
        tmp_path, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    )
    started = time.monotonic()
    with pytest.raises(InvalidRowError, match=f"render time budget of {MAX_RENDER_S:g} s"):
        renderer.render(BOOM)
    assert time.monotonic() - started < MAX_RENDER_S + FAST_S


def test_a_template_error_outside_the_sandbox_caps_is_a_row_error(tmp_path: Path) -> None:
    # A ZeroDivisionError (like the sandbox's OverflowError) used to escape as a server error.
    renderer = _renderer(tmp_path, "{{ 1 / 0 }}")
    with pytest.raises(InvalidRowError, match="division by zero"):
        renderer.render(BOOM)


CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    (HI, None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    (
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>r</think>A1", "reasoning_content": None},
            {"role": "user", "content": "Q2"},
        ],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    ),
]


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
def test_the_budget_sandbox_renders_what_transformers_renders(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    renderer = PromptRenderer(bundled_tokenizer_path(), chat_template_path=str(default_chat_template_path()))
    budgeted = BudgetedTemplate(default_chat_template_path().read_text())
    variables = {
        **renderer.tokenizer.special_tokens_map,
        "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
        "tools": tools,
        "add_generation_prompt": True,
    }
    assert budgeted.render(variables) == render_text(renderer, messages, tools)


def test_the_output_budget_allows_a_long_context() -> None:
    # 128K tokens of ordinary text are about 500K characters: far inside the budget.
    assert MAX_RENDER_CHARS >= 8 * 128 * 1024
    long_row = BudgetedTemplate("{{ messages[0]['content'] }}").render(
        {"messages": [{"content": "w" * 500_000}]}
    )
    assert len(long_row) == 500_000


def _function() -> None:
    """A function whose internals a template must not reach."""


@pytest.mark.parametrize(
    ("obj", "attr"),
    [
        ({"a": 1}, "items"),
        ({"a": 1}, "update"),
        ([1], "append"),
        ([1], "index"),
        ("text", "upper"),
        ("text", "__class__"),
        (jinja2.utils.Namespace(x=1), "x"),
        (_function, "__globals__"),
        (_function, "__code__"),
        (str, "mro"),
        ((i for i in ()), "gi_frame"),
    ],
)
def test_the_sandbox_remembers_jinjas_own_attribute_verdicts(obj: object, attr: str) -> None:
    budgeted = BudgetedTemplate("{{ x }}").template.environment
    plain = ImmutableSandboxedEnvironment()
    value = getattr(obj, attr)
    expected = plain.is_safe_attribute(obj, attr, value)
    # Asked twice: the second answer comes from what the first remembered.
    assert budgeted.is_safe_attribute(obj, attr, value) is expected
    assert budgeted.is_safe_attribute(obj, attr, value) is expected
    # Written by hand: reading is safe, changing a mutable or reaching internals is not.
    safe = {"items", "index", "upper", "x"}
    assert expected is (attr in safe)


def test_a_template_still_cannot_change_its_inputs_or_reach_internals(tmp_path: Path) -> None:
    renderer = _renderer(tmp_path, "{{ messages.append(1) }}")
    for _ in range(2):  # the second time from the remembered verdict
        with pytest.raises(InvalidRowError, match="unsafe"):
            renderer.render(BOOM)
    # An unsafe attribute reads as undefined: nothing is written in its place.
    renderer = _renderer(tmp_path, "{{ raise_exception.__globals__ }}{{ messages.__class__ }}")
    for _ in range(2):
        assert renderer.decode(renderer.render(BOOM)) == "<｜begin▁of▁sentence｜>boom<｜Assistant｜><think>\n"
