"""`PromptRenderer.render` hands the rendered text to the tokenizers library itself where that is all
transformers' ``apply_chat_template(tokenize=True)`` does: its ids must be transformers' own, row for
row, and it must step aside whenever transformers would encode differently."""

from __future__ import annotations

from typing import Any

import pytest

from datagen.prompts.tokenization import PromptRenderer, default_chat_template_path

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}

ROWS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "user", "content": "  leading and trailing spaces  \n\n"}], None),
    ([{"role": "user", "content": "Ünïcödé, 中文, emoji 🎉, tabs\tand\r\nCRLF"}], None),
    # Special tokens spelled as text: transformers matches them as added tokens, so must we.
    ([{"role": "user", "content": "say <think> then </think> and <｜Assistant｜>"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ],
        None,
    ),
    ([{"role": "user", "content": "Define 'apple'."}], [TOOL]),
    ([{"role": "user", "content": "x" * 5000}], None),
]


@pytest.fixture(scope="module")
def renderer(tokenizer_path: str) -> PromptRenderer:
    return PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))


def _transformers_ids(renderer: PromptRenderer, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    return list(
        renderer.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            chat_template=default_chat_template_path().read_text(encoding="utf-8"),
        )
    )


def test_the_direct_path_is_taken_and_gives_transformers_ids(renderer: PromptRenderer) -> None:
    assert renderer._direct_encoder() is not None
    for messages, tools in ROWS:
        assert renderer.render(messages, tools) == _transformers_ids(renderer, messages, tools)
    # Written by hand: bos, <｜User｜>, "Hi", <｜Assistant｜>, <think>, "\n".
    assert renderer.render([{"role": "user", "content": "Hi"}]) == [0, 128803, 23166, 128804, 128821, 201]


def test_truncation_on_the_backend_sends_rendering_through_transformers(tokenizer_path: str) -> None:
    renderer = PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))
    messages = [{"role": "user", "content": "word " * 100}]
    expected = renderer.render(messages)
    backend = renderer.tokenizer._tokenizer
    backend.enable_truncation(max_length=8)
    try:
        assert renderer._direct_encoder() is None
        # transformers turns the backend's truncation off for its own call: the whole prompt.
        assert renderer.render(messages) == expected
    finally:
        backend.no_truncation()
    assert renderer._direct_encoder() is not None


def test_split_special_tokens_is_honoured(tokenizer_path: str) -> None:
    renderer = PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))
    messages = [{"role": "user", "content": "a <think> b"}]
    whole = renderer.render(messages)
    renderer.tokenizer.split_special_tokens = True
    split = renderer.render(messages)
    assert split == _transformers_ids(renderer, messages, None)
    # Split: special tokens spelled in the text (the template's own too) are encoded as text.
    assert 128821 in whole and split != whole
