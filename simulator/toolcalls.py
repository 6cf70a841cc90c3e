"""Tool calls as text: the tools a prompt offers, calls spelled as a model writes them, and
SGLang's ``/parse_function_call`` parsers.

Pure functions of their arguments, like :mod:`simulator.model`. The parsers follow SGLang's
``FunctionCallParser.parse_non_stream`` with its ``Qwen25Detector`` and ``DeepSeekV3Detector``
(SGLang 0.5.15), including their quirks:

- ``normal_text`` is the text before the first call opener, stripped; but when no call survives
  (none found, every name unknown, no tools in the request), it is the whole text, unstripped.
- A call to a name not in ``tools`` is dropped (SGLang's default, ``SGLANG_FORWARD_UNKNOWN_TOOLS``
  off).
- qwen25 drops a call whose JSON does not parse; deepseekv3 gives up on the whole text instead
  (one bad call, or one that does not match its layout, and no call is returned at all).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "SUPPORTED_PARSERS",
    "TOOL_CALL_FORMATS",
    "OfferedTool",
    "ParseResult",
    "ParsedCall",
    "ToolCall",
    "ToolCallFormat",
    "UnsupportedParserError",
    "format_tool_calls",
    "offered_tools",
    "parse_function_call",
]

# The formats the simulated model writes calls in; each is also a parser name.
ToolCallFormat = Literal["qwen25", "deepseekv3"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = ("qwen25", "deepseekv3")

# How a prompt spells one offered tool (transformers' ``tojson`` of an OpenAI-style tool).
_TOOL_OPENER = '{"type": "function"'

# Qwen25Detector
_QWEN_BEGIN = "<tool_call>\n"
_QWEN_END = "\n</tool_call>"
_QWEN_SEPARATOR = "\n"
_QWEN_CALL_RE = re.compile(f"{re.escape(_QWEN_BEGIN)}(.*?){re.escape(_QWEN_END)}", re.DOTALL)

# DeepSeekV3Detector (the DeepSeek-V3/R1 vocabulary's added tokens)
_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALLS_END = "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_DS_SEPARATOR = "\n"
_DS_CALL_RE = re.compile(f"{_DS_CALL_BEGIN}.*?{_DS_CALL_END}", re.DOTALL)
_DS_DETAIL_RE = re.compile(f"{_DS_CALL_BEGIN}(.*){_DS_SEP}(.*)\n```json\n(.*)\n```{_DS_CALL_END}", re.DOTALL)


class UnsupportedParserError(ValueError):
    """A ``tool_call_parser`` the simulator does not implement."""


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


@dataclass(frozen=True)
class ParsedCall:
    """SGLang's ``ToolCallItem``: ``parameters`` is the arguments as JSON text."""

    tool_index: int
    name: str
    parameters: str


@dataclass(frozen=True)
class ParseResult:
    normal_text: str
    calls: tuple[ParsedCall, ...] = ()


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
        return _QWEN_SEPARATOR.join(
            _QWEN_BEGIN + _dumps({"name": call.name, "arguments": call.arguments}) + _QWEN_END
            for call in calls
        )
    if tool_call_format == "deepseekv3":
        body = _DS_SEPARATOR.join(
            f"{_DS_CALL_BEGIN}function{_DS_SEP}{call.name}\n```json\n{_dumps(call.arguments)}\n```{_DS_CALL_END}"
            for call in calls
        )
        return _DS_CALLS_BEGIN + body + _DS_CALLS_END
    raise ValueError(f"unknown tool call format {tool_call_format!r}; expected one of {TOOL_CALL_FORMATS}")


def parse_function_call(text: str, tool_names: Sequence[str], tool_call_parser: str | None) -> ParseResult:
    """SGLang's ``FunctionCallParser(tools, tool_call_parser).parse_non_stream(text)``.

    ``tool_names`` are the request's ``tools[i].function.name`` in order. Raises
    ``UnsupportedParserError`` for a parser not in ``SUPPORTED_PARSERS``.
    """
    detect = SUPPORTED_PARSERS.get(tool_call_parser or "")
    if detect is None:
        raise UnsupportedParserError(
            f"Unsupported tool_call_parser: {tool_call_parser} "
            f"(the simulator supports: {', '.join(sorted(SUPPORTED_PARSERS))})"
        )
    if not tool_names:
        return ParseResult(text)
    # Later duplicates win, as in BaseFormatDetector._get_tool_indices.
    indices = {name: i for i, name in enumerate(tool_names) if name}
    result = detect(text, indices)
    return result if result.calls else ParseResult(text)


def _detect_qwen25(text: str, indices: Mapping[str, int]) -> ParseResult:
    idx = text.find(_QWEN_BEGIN)
    if idx == -1:
        return ParseResult(text)
    calls: list[ParsedCall] = []
    for body in _QWEN_CALL_RE.findall(text):
        try:
            action = json.loads(body.strip())
        except json.JSONDecodeError:
            continue
        calls += _known_calls(action, indices)
    return ParseResult(text[:idx].strip(), tuple(calls))


def _detect_deepseekv3(text: str, indices: Mapping[str, int]) -> ParseResult:
    idx = text.find(_DS_CALLS_BEGIN)
    if idx == -1:
        return ParseResult(text)
    calls: list[ParsedCall] = []
    for match in _DS_CALL_RE.findall(text):
        detail = _DS_DETAIL_RE.search(match)
        if detail is None:
            return ParseResult(text)
        try:
            arguments = json.loads(detail.group(3))
        except json.JSONDecodeError:
            return ParseResult(text)
        calls += _known_calls({"name": detail.group(2), "parameters": arguments}, indices)
    return ParseResult(text[:idx].strip(), tuple(calls))


# Parser name -> detector, as in FunctionCallParser.ToolCallParserEnum ("qwen" is an alias).
SUPPORTED_PARSERS: Mapping[str, Callable[[str, Mapping[str, int]], ParseResult]] = {
    "deepseekv3": _detect_deepseekv3,
    "qwen": _detect_qwen25,
    "qwen25": _detect_qwen25,
}


def _known_calls(action: Any, indices: Mapping[str, int]) -> list[ParsedCall]:
    # BaseFormatDetector.parse_base_json. Where SGLang would crash (an item that is not an
    # object, a name that is not a string) the item is dropped instead.
    calls = []
    for act in action if isinstance(action, list) else [action]:
        name = act.get("name") if isinstance(act, dict) else None
        if not isinstance(name, str) or name not in indices:
            continue
        arguments = act.get("parameters") or act.get("arguments", {})
        calls.append(ParsedCall(indices[name], name, json.dumps(arguments, ensure_ascii=False)))
    return calls


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
