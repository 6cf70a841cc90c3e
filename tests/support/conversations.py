"""An independent oracle for multi-turn ``all`` jobs on the simulator: what every turn's record
must hold, computed without the worker's code.

It renders with transformers' ``apply_chat_template`` directly (not `datagen.prompts.tokenization`),
builds histories by its own rules (not `workers.run.turns`), and asks the simulator's pure functions
(`simulator.model`, `simulator.sglang.function_call`) what the model writes and what SGLang's parser reads.
Shared by the tests and by ``bench/conversations.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from simulator.model import SpecialIds, expected_output, tool_call_ids_for
from simulator.sglang.function_call import parse_function_call
from simulator.toolcalls import ToolCallFormat

__all__ = ["ExpectedConversation", "ExpectedTurn", "expected_conversation", "tool_rows"]

EOS_ID = 1  # <｜end▁of▁sentence｜> of the DeepSeek vocabulary
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone.",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]


@dataclass(frozen=True)
class ExpectedTurn:
    prompt_ids: list[int]
    output_ids: list[int]
    finish: str


@dataclass
class ExpectedConversation:
    turns: list[ExpectedTurn] = field(default_factory=list)
    stop: str | None = None  # the stop reason, when it ends before its last turn


def _call(call_id: str, name: str, arguments: dict[str, str]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_rows(n: int) -> list[dict[str, Any]]:
    """``n`` conversations of 2-3 assistant turns: system prompts, a tools schema, tool results
    between assistant turns, trailing assistant turns, and rows without tools."""
    rows = []
    for i in range(n):
        city = ("Paris", "Lima", "Oslo", "Cairo")[i % 4]
        system = [{"role": "system", "content": f"You are assistant number {i}. Be brief."}] if i % 2 else []
        if i % 3 == 0:  # tools, three assistant turns, the last one trailing
            messages = [
                *system,
                {"role": "user", "content": f"What is the weather in {city} (case {i})?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call(f"w{i}", "get_weather", {"city": city})],
                },
                {"role": "tool", "tool_call_id": f"w{i}", "content": f'{{"sky": "clear", "case": {i}}}'},
                {"role": "assistant", "content": f"It is clear in {city}."},
                {"role": "user", "content": "And what time is it there?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call(f"t{i}", "get_time", {"zone": city})],
                },
            ]
            rows.append({"id": f"conv{i}", "messages": messages, "tools": TOOLS})
        elif i % 3 == 1:  # tools, two assistant turns, an open turn at the end
            messages = [
                *system,
                {"role": "user", "content": f"Tell me the time in {city}, please (case {i})."},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call(f"t{i}", "get_time", {"zone": city})],
                },
                {"role": "tool", "tool_call_id": f"t{i}", "content": f'{{"time": "1{i % 10}:00"}}'},
            ]
            rows.append({"id": f"conv{i}", "messages": messages, "tools": TOOLS})
        else:  # no tools, two turns
            messages = [
                *system,
                {"role": "user", "content": f"Name a prime number above {i * 7}."},
                {"role": "assistant", "content": "<think>dataset reasoning</think>DATASET ANSWER"},
                {"role": "user", "content": "And one more?"},
            ]
            rows.append({"id": f"conv{i}", "messages": messages})
    return rows


def _cuts(messages: list[dict[str, Any]]) -> list[int]:
    cuts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] != "assistant":
        cuts.append(len(messages))
    return cuts


def _names(message: dict[str, Any] | None) -> list[str]:
    return [c["function"]["name"] for c in (message or {}).get("tool_calls") or []]


def expected_conversation(
    row: dict[str, Any],
    tokenizer: Any,
    template: str,
    *,
    seed: int,
    max_new_tokens: int,
    tool_call_format: ToolCallFormat | None,
    tool_mismatch: str = "stop",
    parse_calls: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> ExpectedConversation:
    """Every turn's exact prompt and output ids, and how the conversation ends. The model writes
    calls in ``tool_call_format``; with ``parse_calls`` the job's ``tool_call_parser`` is the parser
    of that name, without it the job has none (the dataset's calls stay in the history).
    ``chat_template_kwargs``: the template variables every turn is rendered with (a recipe's arm)."""
    messages = [dict(m) for m in row["messages"]]
    tools = row.get("tools")
    special = SpecialIds.from_tokenizer(tokenizer)
    cuts = _cuts(messages)
    out = ExpectedConversation()
    for k, cut in enumerate(cuts):
        prompt = tokenizer.apply_chat_template(
            messages[:cut],
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            chat_template=template,
            **(chat_template_kwargs or {}),
        )
        calls = (
            tool_call_ids_for(prompt, seed=seed, tokenizer=tokenizer, tool_call_format=tool_call_format)
            if tool_call_format
            else []
        )
        generated = expected_output(
            prompt, max_new_tokens=max_new_tokens, seed=seed, special=special, tool_call_ids=calls
        )
        finish = str(generated.finish_reason["type"])
        out.turns.append(ExpectedTurn(list(prompt), list(generated.output_ids), finish))
        if k + 1 == len(cuts):
            return out
        if finish != "stop":
            out.stop = "truncated"
            return out
        assert generated.output_ids[-1] == EOS_ID
        text = tokenizer.decode(generated.output_ids[:-1], skip_special_tokens=False)
        dataset_turn = messages[cut] if cut < len(messages) else None
        if tool_call_format is None or not parse_calls or not tools:
            messages[cut] = {**messages[cut], "content": text}
            continue
        names = [t["function"]["name"] for t in tools]
        parsed = parse_function_call(text, names, tool_call_format)
        made = [c.name for c in parsed.calls]
        if made != _names(dataset_turn) and tool_mismatch == "stop":
            out.stop = "tool_mismatch"
            return out
        ids = [c.get("id") for c in (dataset_turn or {}).get("tool_calls") or []]
        model_calls = []
        for index, call in enumerate(parsed.calls):
            shaped: dict[str, Any] = {
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.parameters)},
            }
            if index < len(ids) and ids[index] is not None:
                shaped["id"] = ids[index]
            model_calls.append(shaped)
        regenerated: dict[str, Any] = {"role": "assistant", "content": parsed.normal_text}
        if model_calls:
            regenerated["tool_calls"] = model_calls
        messages[cut] = regenerated
    return out
