"""PromptRenderer with the real bundled DeepSeek tokenizer and the shipped template.

Expected strings and ids are written out by hand (ids read once off the tokenizer and checked:
bos 0, <｜User｜> 128803, <｜Assistant｜> 128804, <think> 128821, "\\n" 201).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest

from datagen.errors import InvalidRowError, InvalidSpecError
from datagen.prompts.provenance import canonical_kwargs_json
from datagen.prompts.tokenization import (
    PromptRenderer,
    SpecialIds,
    bundled_tokenizer_path,
    default_chat_template_path,
    get_renderer,
)
from tests.support.rendering import render_text

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
NEWLINE, BLANK_LINE = 201, 271
# <｜Assistant｜><think>\n
GENERATION_PROMPT = [128804, 128821, 201]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]] = {
    "plain": (
        [{"role": "user", "content": "What is 2+2?"}],
        None,
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n",
    ),
    "system": (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hi!"},
        ],
        None,
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi!<｜Assistant｜><think>\n",
    ),
    "tools": (
        [{"role": "user", "content": "Weather in Paris?"}],
        [WEATHER_TOOL],
        "<｜begin▁of▁sentence｜>## Tools\n\n"
        "You can call the functions below. Each line is one function, as a JSON schema:\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
        "<｜User｜>Weather in Paris?<｜Assistant｜><think>\n",
    ),
    "multi_turn": (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nSimple.\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        None,
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>\n\n4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜><think>\n",
    ),
    "unicode": (
        [{"role": "user", "content": "你好！Café 👋 שלום"}],
        None,
        "<｜begin▁of▁sentence｜><｜User｜>你好！Café 👋 שלום<｜Assistant｜><think>\n",
    ),
}

EXPECTED_IDS = {
    # What(3085) is(344) ' '(223) 2(20) +(13) 2(20) ?(33)
    "plain": [0, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804, 128821, 201],
    "system": [0, 3476, 477, 260, 11502, 22896, 16, 128803, 23166, 3, 128804, 128821, 201],
    # the history answer keeps only "\n\n4" (271, 22) after </think>, then eos 1
    "multi_turn": [
        *[0, 128803, 3085, 344, 223, 20, 13, 20, 33],
        *[128804, 271, 22, 1],
        *[128803, 4195, 223, 21, 13, 21, 33, 128804, 128821, 201],
    ],
    "unicode": [0, 128803, 30594, 1175, 37, 2797, 619, 52780, 236, 9500, 16467, 128804, 128821, 201],
}


@pytest.fixture(scope="module", autouse=True)
def _offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        # huggingface_hub reads the variable once, at import; pin it in case it was imported earlier
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    return PromptRenderer(bundled_tokenizer_path(), chat_template_path=str(default_chat_template_path()))


def _template_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "template.jinja"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_bundled_paths_exist() -> None:
    assert (Path(bundled_tokenizer_path()) / "tokenizer.json").is_file()
    assert default_chat_template_path().is_file()
    assert default_chat_template_path().name == "deepseek_r1.jinja"


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_text_matches_hand_written(renderer: PromptRenderer, case: str) -> None:
    messages, tools, expected = CASES[case]
    assert render_text(renderer, messages, tools) == expected


@pytest.mark.parametrize("case", sorted(EXPECTED_IDS))
def test_render_ids_match_hand_written(renderer: PromptRenderer, case: str) -> None:
    messages, tools, expected_text = CASES[case]
    ids = renderer.render(messages, tools)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == EXPECTED_IDS[case]
    assert ids[0] == BOS
    assert renderer.decode(ids) == expected_text


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_prompt_ends_with_the_whole_generation_prompt(renderer: PromptRenderer, case: str) -> None:
    messages, tools, _ = CASES[case]
    assert renderer.render(messages, tools)[-3:] == [ASSISTANT, THINK, NEWLINE]


def test_generation_prompt_ids(renderer: PromptRenderer) -> None:
    assert renderer.generation_prompt_ids() == GENERATION_PROMPT
    assert GENERATION_PROMPT == [ASSISTANT, THINK, NEWLINE]


def test_special_ids_and_vocab(renderer: PromptRenderer) -> None:
    assert renderer.special_ids() == SpecialIds(eos_id=EOS, think_start_id=THINK, think_end_id=END_THINK)
    assert renderer.vocab_size == 129280
    assert renderer.decode([THINK, END_THINK]) == "<think></think>"
    assert renderer.decode([BOS, 3085, EOS], skip_special_tokens=True) == "What"


def test_tools_change_the_prompt(renderer: PromptRenderer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert renderer.render(messages, [WEATHER_TOOL]) != renderer.render(messages)
    assert renderer.render(messages, []) == renderer.render(messages)


def test_system_prompt_and_tools_together(renderer: PromptRenderer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Hi"},
    ]
    text = render_text(renderer, messages, [WEATHER_TOOL])
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\nUse tools.\n\n## Tools\n\n")
    assert text.endswith('"required": ["city"]}}}<｜User｜>Hi<｜Assistant｜><think>\n')


def test_tool_calls_and_outputs(renderer: PromptRenderer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
            ],
        },
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "12:00"},
    ]
    assert render_text(renderer, messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜>"
        "<｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "<｜Assistant｜><think>\n"
    )
    ids = renderer.render(messages)
    # the tool tokens are single added tokens
    for token_id in (128806, 128807, 128808, 128809, 128810, 128811, 128812, 128813, 128814):
        assert token_id in ids
    assert ids[-3:] == GENERATION_PROMPT


def test_thinking_off_appends_an_empty_think_block() -> None:
    off = PromptRenderer(
        bundled_tokenizer_path(),
        chat_template_path=str(default_chat_template_path()),
        chat_template_kwargs={"thinking": False},
    )
    text = render_text(off, [{"role": "user", "content": "Hi!"}])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hi!<｜Assistant｜><think>\n\n</think>\n\n"
    assert off.generation_prompt_ids() == [ASSISTANT, THINK, BLANK_LINE, END_THINK, BLANK_LINE]
    assert off.identity()["chat_template_kwargs"] == '{"thinking":false}'


def test_identity_pins_tokenizer_and_template(renderer: PromptRenderer) -> None:
    identity = renderer.identity()
    assert identity["tokenizer"] == bundled_tokenizer_path()
    assert len(identity["tokenizer_sha256"]) == 64
    template_bytes = default_chat_template_path().read_bytes()
    assert identity["chat_template_sha256"] == hashlib.sha256(template_bytes).hexdigest()
    assert identity["chat_template"] == str(default_chat_template_path())
    assert identity["chat_template_kwargs"] == "{}"
    assert identity["vocab_size"] == "129280"
    assert renderer.identity() == identity


def test_get_renderer_caches_by_arguments() -> None:
    template = str(default_chat_template_path())
    first = get_renderer(bundled_tokenizer_path(), template, False, canonical_kwargs_json(None))
    again = get_renderer(bundled_tokenizer_path(), template, False, canonical_kwargs_json({}))
    assert first is again
    assert first.render(CASES["plain"][0]) == EXPECTED_IDS["plain"]
    with pytest.raises(InvalidSpecError, match="not valid JSON"):
        get_renderer(bundled_tokenizer_path(), template, False, "{thinking")
    with pytest.raises(InvalidSpecError, match="JSON object"):
        get_renderer(bundled_tokenizer_path(), template, False, "[1]")


def test_canonical_kwargs_json_is_order_independent() -> None:
    assert canonical_kwargs_json({"b": 1, "a": True}) == canonical_kwargs_json({"a": True, "b": 1})
    assert canonical_kwargs_json({"b": 1, "a": True}) == '{"a":true,"b":1}'


# -- spec errors -----------------------------------------------------------------------------------


def test_missing_tokenizer_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(InvalidSpecError, match="no-such-tokenizer") as info:
        PromptRenderer(str(missing))
    assert str(missing) in str(info.value)


def test_tokenizer_directory_without_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="holds no tokenizer files"):
        PromptRenderer(str(tmp_path))


def test_unknown_hub_id_offline() -> None:
    with pytest.raises(InvalidSpecError, match="cannot load tokenizer 'no-such-org/no-such-model'"):
        PromptRenderer("no-such-org/no-such-model", chat_template_path=str(default_chat_template_path()))


def test_missing_template_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jinja"
    with pytest.raises(InvalidSpecError, match="does not exist") as info:
        PromptRenderer(bundled_tokenizer_path(), chat_template_path=str(missing))
    assert str(missing) in str(info.value)


def test_template_that_does_not_parse(tmp_path: Path) -> None:
    path = _template_file(tmp_path, "{% for m in messages %}{{ m.content }")
    with pytest.raises(InvalidSpecError, match="not valid Jinja"):
        PromptRenderer(bundled_tokenizer_path(), chat_template_path=path)


def test_tokenizer_without_template_asks_for_chat_template() -> None:
    with pytest.raises(InvalidSpecError, match="--chat-template"):
        PromptRenderer(bundled_tokenizer_path())


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "add_generation_prompt", "not an identifier"])
def test_reserved_or_bad_kwargs(key: str) -> None:
    with pytest.raises(InvalidSpecError, match="chat_template_kwargs"):
        PromptRenderer(bundled_tokenizer_path(), chat_template_kwargs={key: True})


# -- row errors ------------------------------------------------------------------------------------


def test_template_that_raises(tmp_path: Path) -> None:
    path = _template_file(
        tmp_path,
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    custom = PromptRenderer(bundled_tokenizer_path(), chat_template_path=path)
    assert custom.render([{"role": "user", "content": "Hi"}])[0] == BOS
    with pytest.raises(InvalidRowError, match="first message must be user"):
        custom.render([{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}])


def test_unknown_role_is_a_row_error(renderer: PromptRenderer) -> None:
    with pytest.raises(InvalidRowError, match="unknown role bot"):
        renderer.render([{"role": "bot", "content": "Hi"}])


def test_non_string_content_is_a_row_error(renderer: PromptRenderer) -> None:
    with pytest.raises(InvalidRowError, match="content must be a string"):
        renderer.render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])


def test_empty_conversation_is_a_row_error(renderer: PromptRenderer) -> None:
    with pytest.raises(InvalidRowError):
        renderer.render([])


def test_renderers_load_once_per_key_however_many_threads_ask(tokenizer_path: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from datagen.prompts.tokenization import _RendererCache

    loads: list[str] = []
    cache = _RendererCache(2)
    gate = threading.Barrier(16)

    def load(name: str) -> Any:
        loads.append(name)
        time.sleep(0.05)  # a slow load: the other callers arrive while it runs
        return object()

    def ask(i: int) -> Any:
        gate.wait()
        key = (f"tok{i % 2}", None, False, "{}")
        return cache.get(key, lambda: load(key[0]))

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert sorted(loads) == ["tok0", "tok1"]
    assert len({id(g) for g in got}) == 2
    cache.get(("tok0", None, False, "{}"), lambda: load("not again"))  # a hit: tok0 is now the newest
    assert len(loads) == 2
    # A failed load is not kept: the next caller loads again.
    with pytest.raises(InvalidSpecError):
        cache.get(("bad", None, False, "{}"), lambda: (_ for _ in ()).throw(InvalidSpecError("no")))
    cache.get(("bad", None, False, "{}"), lambda: load("bad"))
    assert loads[-1] == "bad"
    # The least recently used key (tok1) left when "bad" came in.
    cache.get(("tok0", None, False, "{}"), lambda: load("again"))
    assert loads[-1] == "bad"
    cache.get(("tok1", None, False, "{}"), lambda: load("tok1 again"))
    assert loads[-1] == "tok1 again"
