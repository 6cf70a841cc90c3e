"""SGLang's ``/parse_function_call`` parsers, so a client reads the simulator's calls as SGLang would.

They follow SGLang's ``FunctionCallParser.parse_non_stream`` with its ``Qwen25Detector`` and
``DeepSeekV3Detector`` (SGLang 0.5.15), including their quirks:

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
from typing import Any

from simulator.toolcalls import (
    DEEPSEEKV3_CALL_BEGIN,
    DEEPSEEKV3_CALL_END,
    DEEPSEEKV3_CALLS_BEGIN,
    DEEPSEEKV3_SEP,
    QWEN25_CALL_BEGIN,
    QWEN25_CALL_END,
)

__all__ = [
    "SUPPORTED_PARSERS",
    "ParseResult",
    "ParsedCall",
    "UnsupportedParserError",
    "parse_function_call",
]

_QWEN25_CALL_RE = re.compile(f"{re.escape(QWEN25_CALL_BEGIN)}(.*?){re.escape(QWEN25_CALL_END)}", re.DOTALL)
_DEEPSEEKV3_CALL_RE = re.compile(f"{DEEPSEEKV3_CALL_BEGIN}.*?{DEEPSEEKV3_CALL_END}", re.DOTALL)
_DEEPSEEKV3_DETAIL_RE = re.compile(
    f"{DEEPSEEKV3_CALL_BEGIN}(.*){DEEPSEEKV3_SEP}(.*)\n```json\n(.*)\n```{DEEPSEEKV3_CALL_END}", re.DOTALL
)


class UnsupportedParserError(ValueError):
    """A ``tool_call_parser`` the simulator does not implement."""


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
    idx = text.find(QWEN25_CALL_BEGIN)
    if idx == -1:
        return ParseResult(text)
    calls: list[ParsedCall] = []
    for body in _QWEN25_CALL_RE.findall(text):
        try:
            action = json.loads(body.strip())
        except json.JSONDecodeError:
            continue
        calls += _known_calls(action, indices)
    return ParseResult(text[:idx].strip(), tuple(calls))


def _detect_deepseekv3(text: str, indices: Mapping[str, int]) -> ParseResult:
    idx = text.find(DEEPSEEKV3_CALLS_BEGIN)
    if idx == -1:
        return ParseResult(text)
    calls: list[ParsedCall] = []
    for match in _DEEPSEEKV3_CALL_RE.findall(text):
        detail = _DEEPSEEKV3_DETAIL_RE.search(match)
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
