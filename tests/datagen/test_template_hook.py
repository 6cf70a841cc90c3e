"""transformers' own ``apply_chat_template`` renders the budgeted template (the hook in
`datagen.prompts.template_budget`): a row renders once, to exactly what transformers renders alone,
with the budget kept; transformers' other callers get its own template; and a renderer whose probe
fails renders twice, as before."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

from datagen.errors import InvalidRowError
from datagen.prompts.template_budget import transformers_environment
from datagen.prompts.tokenization import PromptRenderer, default_chat_template_path

# Jinja's less common constructs, each of which the budget's rewriting touches or wraps: loop
# variables that need the loop's length or its neighbours, a filtered loop with an else, a
# recursive loop, break and continue, namespaces built up by `+` and `~`, `*` and `%` on strings,
# filters with arguments, macros with a caller, transformers' `{% generation %}` block and its
# tojson options.
CONSTRUCTS = """
{%- macro tag(m) -%}[{{ m.role | upper }}{{ '|' ~ caller() if caller is defined else '' }}]{%- endmacro -%}
{{ bos_token }}
{%- for m in messages if m.role != 'system' -%}
{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.cycle('a', 'b') }}{{ loop.revindex0 }}
{%- if loop.changed(m.role) %}~{% endif %} {{ m.role ~ ':' ~ (m.content or '') | trim }}
{%- if loop.previtem is defined %} after {{ loop.previtem.role }}{% endif %}
{%- if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endif %}
{% else -%}
no turns
{% endfor -%}
{%- set ns = namespace(n=0, s='', p='') -%}
{%- for m in messages -%}
{%- set ns.n = ns.n + (m.content or '') | length -%}{%- set ns.s = ns.s ~ m.role[0] -%}
{%- set ns.p = ns.p + m.role[:2] -%}
{%- endfor -%}
{{ ns.n }} {{ ns.s }} {{ ns.p * 2 }} {{ '%05d|%-6s|' % (ns.n, ns.s) }} {{ 2 ** 10 }} {{ 7 // 2 }}
{%- if tools %}
{% for t in tools %}{{ t | tojson(indent=2, sort_keys=True) }} {{ t.function.name | center(20) }}{% endfor %}
{%- endif %}
{{ messages | map(attribute='role') | join(',') }} \
{{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ (messages | last).content | replace('a', 'A') | truncate(12, true) }}
{% for k, v in {'y': 2, 'x': 1}.items() | sort %}{{ k }}={{ v }};{% endfor %}
{%- for i in range(6) %}{% if i == 1 %}{% continue %}{% elif i == 4 %}{% break %}{% endif %}\
{{ i }}{% endfor %}
{%- for m in messages recursive %}{{ m.role[0] }}\
{% if m.children %}<{{ loop(m.children) }}>{% endif %}{% endfor %}
{% call tag(messages[0]) %}inner {{ messages | length }}{% endcall %}{{ tag(messages[-1]) }}
{%- if add_generation_prompt %}<｜Assistant｜><think>
{% endif %}"""

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "system", "content": "Be brief."}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  a banana and an apple  "},
            {"role": "assistant", "content": "<think>r</think>two", "reasoning_content": "r"},
            {"role": "user", "content": "Ünïcödé, 中文 🎉"},
        ],
        [TOOL],
    ),
    (
        [
            {
                "role": "user",
                "content": "x",
                "children": [{"role": "assistant", "children": [{"role": "tool"}]}],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "lookup"}}]},
            {"role": "tool", "content": "found"},
        ],
        None,
    ),
]


def _transformers_alone(
    renderer: PromptRenderer, messages: list[dict[str, Any]], tools: Any, template: str
) -> tuple[str, list[int]]:
    """The text and ids transformers gives without the hook (no renderer's render is running)."""
    kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": True, "chat_template": template}
    text = renderer.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = renderer.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return str(text), list(ids)


def _renderer(tmp_path: Path, text: str, tokenizer_path: str) -> PromptRenderer:
    path = tmp_path / "template.jinja"
    path.write_text(text, encoding="utf-8")
    return PromptRenderer(tokenizer_path, chat_template_path=str(path))


@pytest.fixture
def template_renders(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every jinja render of a whole template, by kind: transformers' own template renders with
    ``Template.render``, the budget's streams with ``Template.generate``."""
    calls: list[str] = []
    render, generate = jinja2.Template.render, jinja2.Template.generate

    def counted_render(self: jinja2.Template, *args: Any, **kwargs: Any) -> str:
        calls.append("transformers")
        return render(self, *args, **kwargs)

    def counted_generate(self: jinja2.Template, *args: Any, **kwargs: Any) -> Iterator[str]:
        calls.append("budget")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(jinja2.Template, "render", counted_render)
    monkeypatch.setattr(jinja2.Template, "generate", counted_generate)
    yield calls


def test_a_row_renders_once_to_transformers_own_ids(tokenizer_path: str, template_renders: list[str]) -> None:
    renderer = PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))
    renderer.render([{"role": "user", "content": "warm"}])  # the probes render too
    assert renderer._renders_once()
    template_renders.clear()
    # Written by hand: bos, <｜User｜>, "Hi", <｜Assistant｜>, <think>, "\n".
    assert renderer.render([{"role": "user", "content": "Hi"}]) == [0, 128803, 23166, 128804, 128821, 201]
    assert template_renders == ["budget"]


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
def test_the_hooked_render_is_transformers_own_render(
    tmp_path: Path, tokenizer_path: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    renderer = _renderer(tmp_path, CONSTRUCTS, tokenizer_path)
    assert renderer._renders_once()
    text, ids = _transformers_alone(renderer, messages, tools, CONSTRUCTS)
    assert renderer.render(messages, tools) == ids
    assert renderer.decode(ids) == text


def test_the_constructs_template_renders_as_written(tmp_path: Path, tokenizer_path: str) -> None:
    # One row's text written out by hand, so that the comparison above is not of two renders of
    # one mistake.
    renderer = _renderer(tmp_path, CONSTRUCTS, tokenizer_path)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "an apple"}]
    # `-` and trim_blocks take the newlines after block tags; those after `}}` stay.
    expected = (
        "<｜begin▁of▁sentence｜>1/1!a0~ user:an apple"
        "9 su syussyus 00009|su    | 1024 3"
        'system,user 1\n{"a": 1, "b": [1, 2]} An Apple\n'
        "x=1;y=2;023su[SYSTEM|inner 2][USER]<｜Assistant｜><think>\n"
    )
    assert renderer.decode(renderer.render(messages)) == expected


def test_a_template_error_reads_as_transformers_own(tmp_path: Path, tokenizer_path: str) -> None:
    template = (
        "{% if messages | length > 1 %}{{ raise_exception('one turn only, got ' ~ messages | length) }}"
        "{% endif %}x"
    )
    renderer = _renderer(tmp_path, template, tokenizer_path)
    assert renderer._renders_once()
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as alone:
        _transformers_alone(renderer, two, None, template)
    with pytest.raises(InvalidRowError) as hooked:
        renderer.render(two)
    assert str(hooked.value) == f"chat template refused the conversation: {alone.value}"
    assert str(alone.value) == "one turn only, got 2"


def test_transformers_other_callers_get_its_own_template(tokenizer_path: str) -> None:
    from transformers.utils import chat_template_utils

    renderer = PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))
    assert renderer._renders_once()
    # Outside a render, transformers compiles as ever: its own, unbudgeted class.
    compiled = chat_template_utils._compile_jinja_template(default_chat_template_path().read_text())
    assert type(compiled) is jinja2.Template
    assert transformers_environment("x") is not None


def test_threads_render_their_own_templates(tmp_path: Path, tokenizer_path: str) -> None:
    shipped = PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))
    constructs = _renderer(tmp_path, CONSTRUCTS, tokenizer_path)
    expected = {
        id(r): [_transformers_alone(r, m, t, r._template_text or "")[1] for m, t in CONVERSATIONS]
        for r in (shipped, constructs)
    }
    wrong: list[str] = []

    def run(renderer: PromptRenderer) -> None:
        for _ in range(20):
            if [renderer.render(m, t) for m, t in CONVERSATIONS] != expected[id(renderer)]:
                wrong.append(renderer.chat_template_path or "")

    threads = [threading.Thread(target=run, args=(r,)) for r in (shipped, constructs) * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_template_the_probe_cannot_render_renders_twice_within_the_budget(
    tmp_path: Path, tokenizer_path: str, template_renders: list[str]
) -> None:
    # No probe row has three turns, which this template asks for: the renderer keeps both renders.
    template = (
        "{% if messages | length < 3 %}{{ raise_exception('three turns at least') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if 'boom' in messages[-1]['content'] %}{{ 'a' * 10000000 }}{% endif %}"
    )
    renderer = _renderer(tmp_path, template, tokenizer_path)
    assert not renderer._renders_once()
    row = [
        {"role": "user", "content": "S"},
        {"role": "assistant", "content": "T"},
        {"role": "user", "content": "Hi"},
    ]
    renderer.render(row)  # the direct encoder's probe renders too
    expected = _transformers_alone(renderer, row, None, template)[1]
    template_renders.clear()
    assert renderer.render(row) == expected
    assert template_renders == ["budget", "transformers"]
    with pytest.raises(InvalidRowError, match="output budget"):
        renderer.render([*row[:2], {"role": "user", "content": "boom"}])


@pytest.mark.parametrize(
    "refusal",
    [
        "{% if not tools %}{{ raise_exception('tools, please') }}{% endif %}",
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}",
    ],
)
def test_a_template_that_needs_tools_or_a_system_turn_renders_once(
    tmp_path: Path, tokenizer_path: str, refusal: str
) -> None:
    template = refusal + "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools | tojson }}"
    renderer = _renderer(tmp_path, template, tokenizer_path)
    assert renderer._renders_once()
    row = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert renderer.render(row, [TOOL]) == _transformers_alone(renderer, row, [TOOL], template)[1]


def test_a_recipe_arms_twin_probes_under_its_own_kwargs(
    tmp_path: Path, tokenizer_path: str, template_renders: list[str]
) -> None:
    # The probe rows render only with mode=ok: the renderer without it keeps both renders, and its
    # twin with it (a recipe's arm) probes for itself rather than taking the parent's verdict.
    template = (
        "{% if mode != 'ok' %}{{ raise_exception('mode ok, please') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    renderer = _renderer(tmp_path, template, tokenizer_path)
    assert not renderer._renders_once()
    twin = renderer.with_kwargs({"mode": "ok"})
    assert twin._renders_once()
    row = [{"role": "user", "content": "Hi"}]
    twin.render(row)  # the direct encoder's probe renders too
    template_renders.clear()
    # Written by hand: "Hi", the template's whole text.
    assert twin.render(row) == [23166]
    assert template_renders == ["budget"]
    with pytest.raises(InvalidRowError, match="mode ok"):
        renderer.render(row)
