"""Tool calls as text: the tools a prompt offers and calls spelled as a model writes them.

Both front ends' simulated model writes calls, so this is shared; reading them back is SGLang's
``/parse_function_call`` (:mod:`simulator.sglang.function_call`), which uses the markers below.
Pure functions of their arguments, like :mod:`simulator.model`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DEEPSEEKV3_CALLS_BEGIN",
    "DEEPSEEKV3_CALLS_END",
    "DEEPSEEKV3_CALL_BEGIN",
    "DEEPSEEKV3_CALL_END",
    "DEEPSEEKV3_SEP",
    "QWEN25_CALL_BEGIN",
    "QWEN25_CALL_END",
    "TOOL_CALL_FORMATS",
    "OfferedTool",
    "ToolCall",
    "ToolCallFormat",
    "format_tool_calls",
    "offered_tools",
]

# The formats the simulated model writes calls in; each is also a parser name.
ToolCallFormat = Literal["qwen25", "deepseekv3"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = ("qwen25", "deepseekv3")

# How a prompt spells one offered tool (transformers' ``tojson`` of an OpenAI-style tool).
_TOOL_OPENER = '{"type": "function"'

# SGLang's Qwen25Detector
QWEN25_CALL_BEGIN = "<tool_call>\n"
QWEN25_CALL_END = "\n</tool_call>"
_QWEN25_SEPARATOR = "\n"

# SGLang's DeepSeekV3Detector (the DeepSeek-V3/R1 vocabulary's added tokens)
DEEPSEEKV3_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEKV3_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEKV3_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEKV3_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEKV3_SEP = "<｜tool▁sep｜>"
_DEEPSEEKV3_SEPARATOR = "\n"


@dataclass(frozen=True)
class OfferedTool:
    """One function a prompt offers: its name and its parameters' property names, in order."""

    name: str
    properties: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """One call as the model writes it."""

    name: str
    arguments: Mapping[str, Any]


def offered_tools(prompt_text: str) -> tuple[OfferedTool, ...]:
    """The tools a prompt offers: each JSON object starting ``{"type": "function"`` with a
    ``function.name``, in order of appearance, the first of each name kept."""
    decoder = json.JSONDecoder()
    found: dict[str, OfferedTool] = {}
    start = prompt_text.find(_TOOL_OPENER)
    while start != -1:
        end = start + len(_TOOL_OPENER)
        try:
            obj, end = decoder.raw_decode(prompt_text, start)
        except ValueError:
            obj = None
        tool = _offered_tool(obj)
        if tool is not None and tool.name not in found:
            found[tool.name] = tool
        start = prompt_text.find(_TOOL_OPENER, end)
    return tuple(found.values())


def format_tool_calls(calls: Sequence[ToolCall], tool_call_format: ToolCallFormat) -> str:
    """``calls`` spelled as a model writes them in ``tool_call_format`` ("" for no calls)."""
    if not calls:
        return ""
    if tool_call_format == "qwen25":
        return _QWEN25_SEPARATOR.join(
            QWEN25_CALL_BEGIN + _dumps({"name": call.name, "arguments": call.arguments}) + QWEN25_CALL_END
            for call in calls
        )
    if tool_call_format == "deepseekv3":
        body = _DEEPSEEKV3_SEPARATOR.join(
            f"{DEEPSEEKV3_CALL_BEGIN}function{DEEPSEEKV3_SEP}{call.name}\n```json\n{_dumps(call.arguments)}\n```"
            f"{DEEPSEEKV3_CALL_END}"
            for call in calls
        )
        return DEEPSEEKV3_CALLS_BEGIN + body + DEEPSEEKV3_CALLS_END
    raise ValueError(f"unknown tool call format {tool_call_format!r}; expected one of {TOOL_CALL_FORMATS}")


def _offered_tool(obj: object) -> OfferedTool | None:
    function = obj.get("function") if isinstance(obj, dict) else None
    if not isinstance(function, dict):
        return None
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return None
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return OfferedTool(name, tuple(properties) if isinstance(properties, dict) else ())


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
