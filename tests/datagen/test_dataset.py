"""iter_prompts: streaming JSONL rows → prompts and row errors, with exact line numbers."""

from __future__ import annotations

import hashlib
import io
import json
import runpy
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest

from datagen.prompts.dataset import DEFAULT_PARTITION, Prompt, RowError, iter_prompts, sample_id_for
from datagen.prompts.tokenization import PromptRenderer, bundled_tokenizer_path, default_chat_template_path
from datagen.states import MultiTurnMode, PromptClass

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GENERATION_PROMPT = [128804, 128821, 201]  # <｜Assistant｜><think>\n


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


def parse(
    data: bytes | str, mode: MultiTurnMode = MultiTurnMode.LAST, **kwargs: Any
) -> list[Prompt | RowError]:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return list(iter_prompts(io.BytesIO(raw), multi_turn=mode, **kwargs))


def jsonl(*rows: object) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def only_prompt(data: bytes | str, mode: MultiTurnMode = MultiTurnMode.LAST) -> Prompt:
    [item] = parse(data, mode)
    assert isinstance(item, Prompt), item
    return item


def only_error(data: bytes | str, **kwargs: Any) -> RowError:
    [item] = parse(data, **kwargs)
    assert isinstance(item, RowError), item
    return item


USER_HI = {"role": "user", "content": "Hi"}


# -- row forms -------------------------------------------------------------------------------------


def test_messages_form() -> None:
    row = {
        "id": "a1",
        "partition": "math",
        "class": "long",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
    }
    prompt = only_prompt(jsonl(row))
    assert prompt == Prompt(
        line=1,
        sample_id="a1",
        turn=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        tools=None,
        partition="math",
        cls=PromptClass.LONG,
        original=row,
    )


def test_sharegpt_form() -> None:
    row = {
        "id": 7,
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "1+1?"},
            {"from": "gpt", "value": "2"},
        ],
    }
    prompt = only_prompt(jsonl(row))
    assert prompt.sample_id == "7"
    assert prompt.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
    ]
    assert prompt.partition == DEFAULT_PARTITION
    assert prompt.cls is None
    assert prompt.original["conversations"][2] == {"from": "gpt", "value": "2"}


def test_conversations_with_role_content_entries() -> None:
    row = {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    assert only_prompt(jsonl(row)).messages == [USER_HI]


def test_prompt_form() -> None:
    prompt = only_prompt(jsonl({"prompt": "1+1?", "system": "Be brief."}))
    assert prompt.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
    ]
    assert only_prompt(jsonl({"prompt": "Hi"})).messages == [USER_HI]


def test_text_parts_are_joined_with_newlines() -> None:
    parts = [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]
    prompt = only_prompt(jsonl({"messages": [{"role": "user", "content": parts}]}))
    assert prompt.messages == [{"role": "user", "content": "Line one.\nLine two."}]


def test_tool_calls_reasoning_and_extra_keys() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    row = {
        "tools": json.dumps([{"type": "function", "function": {"name": "f"}}]),
        "messages": [
            {"role": "user", "content": "Call f", "weight": 0.5},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "need f"},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
    }
    prompt = only_prompt(jsonl(row))
    assert prompt.tools == [{"type": "function", "function": {"name": "f"}}]
    assert prompt.turn == 1
    assert prompt.messages == [
        {"role": "user", "content": "Call f"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "need f"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


# -- sample ids ------------------------------------------------------------------------------------


def test_hash_id_is_sha256_of_canonical_json() -> None:
    # written out by hand: canonical JSON of the normalized messages + tools
    canonical = '{"messages":[{"content":"Hi","role":"user"}],"tools":null}'
    expected = "h" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    assert only_prompt(jsonl({"messages": [USER_HI]})).sample_id == expected
    assert sample_id_for([USER_HI], None) == expected


def test_hash_id_uses_unescaped_unicode() -> None:
    canonical = '{"messages":[{"content":"你好 👋","role":"user"}],"tools":null}'
    expected = "h" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    assert only_prompt(jsonl({"prompt": "你好 👋"})).sample_id == expected


def test_hash_id_is_stable_and_form_independent() -> None:
    forms = [
        {"messages": [USER_HI]},
        {"conversations": [{"from": "human", "value": "Hi"}]},
        {"prompt": "Hi"},
        {"prompt": "Hi", "partition": "other", "class": "short"},
    ]
    ids = {item.sample_id for item in parse(jsonl(*forms, *forms)) if isinstance(item, Prompt)}
    assert len(ids) == 1
    (sample_id,) = ids
    assert sample_id.startswith("h") and len(sample_id) == 17
    assert only_prompt(jsonl({"prompt": "Hi!"})).sample_id != sample_id
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert only_prompt(jsonl({"prompt": "Hi", "tools": tools})).sample_id != sample_id


def test_hash_id_covers_the_trailing_assistant_turn() -> None:
    a = only_prompt(jsonl({"messages": [USER_HI, {"role": "assistant", "content": "A"}]}))
    b = only_prompt(jsonl({"messages": [USER_HI, {"role": "assistant", "content": "B"}]}))
    assert a.messages == b.messages
    assert a.sample_id != b.sample_id


# -- multi-turn ------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "<think>\nr\n</think>\n\nA1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "A2"},
]


def test_last_mode_drops_the_trailing_assistant_turn() -> None:
    prompt = only_prompt(jsonl({"id": "c", "messages": CONVERSATION}))
    assert prompt.turn == 1
    assert prompt.messages == CONVERSATION[:4]


def test_all_mode_one_prompt_per_assistant_turn() -> None:
    items = parse(jsonl({"id": "c", "messages": CONVERSATION}), MultiTurnMode.ALL)
    assert [(p.sample_id, p.line, p.turn) for p in items if isinstance(p, Prompt)] == [
        ("c", 1, 0),
        ("c", 1, 1),
    ]
    first, second = items
    assert isinstance(first, Prompt) and isinstance(second, Prompt)
    assert first.messages == CONVERSATION[:2]
    assert second.messages == CONVERSATION[:4]  # the original history, re-rendered later by the caller


def test_all_mode_with_an_open_last_turn() -> None:
    row = {"messages": CONVERSATION[:4]}
    items = parse(jsonl(row), MultiTurnMode.ALL)
    assert [p.turn for p in items if isinstance(p, Prompt)] == [0, 1]
    assert only_prompt(jsonl(row)).turn == 1


def test_all_mode_with_tool_turns() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "out"},
        {"role": "assistant", "content": "done"},
    ]
    items = parse(jsonl({"messages": messages}), MultiTurnMode.ALL)
    assert [(p.turn, len(p.messages)) for p in items if isinstance(p, Prompt)] == [(0, 1), (1, 3)]


def test_all_mode_refuses_an_assistant_turn_without_a_question() -> None:
    row = {
        "messages": [
            {"role": "assistant", "content": "Hello!"},
            USER_HI,
            {"role": "assistant", "content": "Hi"},
        ]
    }
    error = only_error(jsonl(row), mode=MultiTurnMode.ALL)
    assert error.reason == "assistant message 0 follows null, not a user or tool message"
    assert only_prompt(jsonl(row)).turn == 1  # LAST only needs the final history


# -- row errors ------------------------------------------------------------------------------------

GOOD = {"prompt": "fine"}
BAD_ROWS: list[tuple[str, str]] = [
    ('{"messages": [', "invalid JSON: Expecting value (column 15)"),
    ("[1, 2]", "row is not a JSON object (got an array)"),
    ('{"foo": 1}', 'row has none of "messages", "conversations" or "prompt"'),
    ('{"messages": "hi"}', "messages must be a list of messages"),
    ('{"messages": []}', "messages is empty"),
    ('{"messages": ["hi"]}', "message 0 is not an object"),
    (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "x"}]}',
        'message 1: unknown role "bot"',
    ),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', 'message 0: unknown role "robot"'),
    ('{"messages": [{"role": "user", "content": "  "}]}', "message 0 (user): empty content"),
    ('{"messages": [{"role": "user"}]}', "message 0 (user): empty content"),
    (
        '{"messages": [{"role": "user", "content": 5}]}',
        "message 0: content must be a string or a list of text parts",
    ),
    ('{"messages": [{"role": "system", "content": "s"}]}', "conversation has no user message"),
    ('{"prompt": ""}', "prompt must be a non-empty string"),
    ('{"prompt": "p", "system": 3}', "system must be a non-empty string"),
    ('{"prompt": "p", "class": "medium"}', 'class must be "short" or "long", got "medium"'),
    ('{"prompt": "p", "id": ""}', 'id must be a non-empty string or an integer, got ""'),
    ('{"prompt": "p", "id": 1.5}', "id must be a non-empty string or an integer, got 1.5"),
    ('{"prompt": "p", "id": true}', "id must be a non-empty string or an integer, got true"),
    ('{"prompt": "p", "partition": 3}', "partition must be a non-empty string, got 3"),
    ('{"prompt": "p", "tools": {"a": 1}}', "tools must be a list of objects (function schemas)"),
    ('{"prompt": "p", "tools": [1]}', "tools[0] is not an object"),
    ('{"prompt": "p", "tools": "[oops"}', "tools is a string but not valid JSON"),
    (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}',
        "conversation ends with a system message, not a user or tool message",
    ),
    (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},'
        ' {"role": "assistant", "content": "c"}]}',
        'after dropping the trailing assistant turn the conversation ends with "assistant"',
    ),
    (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": "f"}]}',
        "message 1: tool_calls must be a list",
    ),
]


@pytest.mark.parametrize(("line", "reason"), BAD_ROWS, ids=[reason for _, reason in BAD_ROWS])
def test_row_error_reason(line: str, reason: str) -> None:
    error = only_error(line + "\n")
    assert error.line == 1
    assert reason in error.reason


def test_mixed_file_reports_exact_lines_and_keeps_good_rows() -> None:
    lines = []
    for bad, _ in BAD_ROWS:
        lines += [json.dumps(GOOD), bad, ""]  # good row, bad row, blank line
    items = parse("\n".join(lines) + "\n")
    errors = [item for item in items if isinstance(item, RowError)]
    prompts = [item for item in items if isinstance(item, Prompt)]
    assert [e.line for e in errors] == [3 * i + 2 for i in range(len(BAD_ROWS))]
    assert [p.line for p in prompts] == [3 * i + 1 for i in range(len(BAD_ROWS))]
    for error, (_, reason) in zip(errors, BAD_ROWS, strict=True):
        assert reason in error.reason


@pytest.mark.parametrize(("line", "kind"), [("null", "null"), ('"text"', "a string"), ("3", "a number")])
def test_non_object_rows(line: str, kind: str) -> None:
    assert only_error(line + "\n").reason == f"row is not a JSON object (got {kind})"


def test_row_error_carries_a_valid_id() -> None:
    error = only_error(jsonl({"id": "x9", "prompt": "p", "class": "huge"}))
    assert (error.line, error.sample_id) == (1, "x9")
    assert only_error("[1]\n").sample_id is None


def test_blank_lines_and_crlf() -> None:
    data = b'\r\n   \r\n{"prompt": "a"}\r\n\t\n{"messages": [{"role": "user", "content": "b"}]}\r\n\r\n'
    items = parse(data)
    assert [(p.line, p.messages) for p in items if isinstance(p, Prompt)] == [
        (3, [{"role": "user", "content": "a"}]),
        (5, [{"role": "user", "content": "b"}]),
    ]
    assert len(items) == 2


def test_last_line_without_newline_and_bom() -> None:
    items = parse(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}')
    assert [p.line for p in items if isinstance(p, Prompt)] == [1, 2]


def test_invalid_utf8_names_the_byte_offset() -> None:
    data = b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": "next"}\n'
    items = parse(data)
    error = items[1]
    assert isinstance(error, RowError)
    assert (error.line, error.reason) == (2, "invalid UTF-8 at byte 15 of the line")
    assert isinstance(items[2], Prompt) and items[2].line == 3


class RecordingStream(io.BytesIO):
    """A BytesIO that remembers how much each readline asked for."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.sizes: list[int | None] = []

    def readline(self, size: int | None = -1, /) -> bytes:
        self.sizes.append(size)
        return super().readline(size)


def test_line_over_the_limit_is_skipped_in_bounded_reads() -> None:
    limit = 100
    huge = json.dumps({"prompt": "x" * 10_000}).encode()
    exact = json.dumps({"prompt": "y" * (limit - 14)}).encode()
    assert len(exact) == limit
    stream = RecordingStream(b'{"prompt": "a"}\n' + huge + b"\n" + exact + b"\n" + exact)
    items = list(iter_prompts(stream, max_line_bytes=limit))
    assert [type(i).__name__ for i in items] == ["Prompt", "RowError", "Prompt", "Prompt"]
    assert items[1] == RowError(2, "line is longer than 100 bytes; skipped")
    assert [i.line for i in items] == [1, 2, 3, 4]
    assert all(size is not None and 0 < size <= 64 * 1024 for size in stream.sizes)


def test_over_long_last_line_without_newline() -> None:
    items = parse(b'{"prompt": "a"}\n' + b"z" * 500, max_line_bytes=100)
    assert items[1] == RowError(2, "line is longer than 100 bytes; skipped")
    assert len(items) == 2


def test_line_one_byte_over_the_limit() -> None:
    line = json.dumps({"prompt": "y" * (101 - 14)}).encode()
    assert len(line) == 101
    assert only_error(line + b"\n", max_line_bytes=100).line == 1


# -- the example dataset ---------------------------------------------------------------------------


def test_example_file_is_what_the_generator_writes() -> None:
    build_rows = runpy.run_path(str(EXAMPLES / "make_prompts.py"))["build_rows"]
    expected = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in build_rows())
    assert (EXAMPLES / "prompts.jsonl").read_text(encoding="utf-8") == expected


@pytest.mark.parametrize("mode", list(MultiTurnMode))
def test_example_file_parses_without_errors(mode: MultiTurnMode) -> None:
    with (EXAMPLES / "prompts.jsonl").open("rb") as f:
        items = list(iter_prompts(f, multi_turn=mode))
    assert [item for item in items if isinstance(item, RowError)] == []
    prompts = [item for item in items if isinstance(item, Prompt)]
    rows = {p.line for p in prompts}
    assert len(rows) >= 250
    assert len({p.sample_id for p in prompts}) == len(rows)
    partitions = Counter(p.partition for p in prompts)
    assert {"math", "code", "chat", "reasoning", "multilingual"} <= set(partitions)
    assert any(p.cls is PromptClass.LONG for p in prompts)
    assert any(p.tools for p in prompts)
    assert any(p.turn > 0 for p in prompts)
    assert any(p.sample_id.startswith("h") for p in prompts)


def test_example_file_renders_with_the_shipped_template(renderer: PromptRenderer) -> None:
    with (EXAMPLES / "prompts.jsonl").open("rb") as f:
        prompts = [item for item in iter_prompts(f) if isinstance(item, Prompt)]
    lengths = []
    for prompt in prompts:
        ids = renderer.render(prompt.messages, prompt.tools)
        assert ids[0] == 0
        assert ids[-len(GENERATION_PROMPT) :] == GENERATION_PROMPT, prompt.sample_id
        lengths.append(len(ids))
    assert renderer.generation_prompt_ids() == GENERATION_PROMPT
    long_prompts = sum(n > 2000 for n in lengths)
    assert 0.05 * len(prompts) <= long_prompts <= 0.2 * len(prompts)
    assert sorted(lengths)[len(lengths) // 2] < 200  # mostly short


# -- rows that used to stop the whole file ---------------------------------------------------------


def test_an_integer_over_4300_digits_rejects_only_its_row() -> None:
    huge = "1" + "0" * 5000
    items = parse(
        f'{{"id": {huge}, "prompt": "x"}}\n{{"prompt": "ok", "n": [{huge}]}}\n{{"prompt": "fine"}}\n'
    )
    assert [type(i).__name__ for i in items] == ["RowError", "RowError", "Prompt"]
    assert [i.line for i in items] == [1, 2, 3]
    assert all("more than 4,300 digits" in i.reason for i in items if isinstance(i, RowError))


def test_a_lone_surrogate_names_where_it_is_and_what_to_do() -> None:
    error = only_error('{"messages": [{"role": "user", "content": "a \\ud83d b"}]}\n')
    assert error.reason.startswith("messages[0].content holds a lone surrogate '\\ud83d'")
    assert "re-encode the file as UTF-8" in error.reason
    assert "id holds a lone surrogate" in only_error('{"id": "x\\udc00", "prompt": "p"}\n').reason


def test_an_escaped_surrogate_pair_is_one_character() -> None:
    prompt = only_prompt('{"prompt": "smile \\ud83d\\ude00"}\n')
    assert prompt.messages[0]["content"] == "smile \U0001f600"


def test_any_error_inside_a_row_becomes_a_row_error_and_the_file_goes_on() -> None:
    # A string "tools" is parsed again; nested past the recursion limit it used to escape the row.
    deep_tools = json.dumps({"prompt": "x", "tools": "[" * 100_000})
    items = parse(deep_tools + "\n" + jsonl({"prompt": "after"}))
    error, prompt = items
    assert isinstance(error, RowError) and error.line == 1
    assert "RecursionError" in error.reason and "fix or remove it" in error.reason
    assert isinstance(prompt, Prompt) and prompt.line == 2


# -- token-id rows (capture-only jobs) ---------------------------------------------------------------


def _token_items(*rows: object) -> list[Prompt | RowError]:
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    return list(iter_prompts(io.BytesIO(data), token_rows=True))


def test_a_token_row_is_its_sequence_and_where_its_supervised_tail_starts() -> None:
    (item,) = _token_items({"id": "a", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 1, 1]})
    assert isinstance(item, Prompt)
    assert (item.sample_id, item.token_ids, item.prompt_len, item.messages) == ("a", [1, 2, 3, 4, 5], 3, [])
    # No id: "t" + the first 16 hex chars of sha256("7,8,9"), written out by hand.
    (anonymous,) = _token_items({"input_ids": [7, 8, 9], "loss_mask": [0, 0, 0]})
    assert isinstance(anonymous, Prompt)
    assert anonymous.sample_id == "t" + hashlib.sha256(b"7,8,9").hexdigest()[:16]
    assert anonymous.prompt_len == 3  # nothing supervised


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 0]}, "one supervised span at the end"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "loss_mask has 2 values for 3 input_ids"),
        ({"input_ids": [1, -2], "loss_mask": [0, 1]}, "input_ids[1] must be a non-negative integer"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "loss_mask values must be 0 or 1"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "a capture-only job reads rows of token ids"),
    ],
)
def test_bad_token_rows_are_reported_with_their_line_and_the_rest_goes_on(row: object, reason: str) -> None:
    good = {"id": "g", "input_ids": [5, 6], "loss_mask": [0, 1]}
    error, kept = _token_items(row, good)
    assert isinstance(error, RowError) and error.line == 1 and reason in error.reason, error
    assert isinstance(kept, Prompt) and kept.line == 2 and kept.token_ids == [5, 6]
