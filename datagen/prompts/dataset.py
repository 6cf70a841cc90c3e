"""Streaming JSONL dataset rows → prompts (conversation histories to render and regenerate).

Accepted row forms (one JSON object per line; blank lines are skipped)::

    {"id"?, "messages": [{"role", "content", ...}], "tools"?, "partition"?, "class"?}   OpenAI roles
    {"id"?, "conversations": [{"from", "value"}, ...], ...}                                ShareGPT
    {"id"?, "prompt": "...", "system"?: "...", ...}                                        plain prompt
    {"id"?, "input_ids": [...], "loss_mask": [...], "partition"?, "class"?}              token ids

The token-id form is read only in a capture-only job (``features.capture_only``: another job's
``specforge`` export, a peer's output), and only that form: nothing is rendered, and the sequence is
taken as it is. Its ``loss_mask`` must be 0s then 1s (one supervised span at the end, what a record
of one turn has); its sample id, without an ``id``, is ``"t"`` + 16 hex chars of the sha256 of the
ids' decimal text joined by commas.

When a row has more than one of ``messages`` / ``conversations`` / ``prompt``, the first in that order
is used. Messages are normalized to OpenAI form: ``role`` and ``content`` (a string; a list of
``{"type": "text", "text": ...}`` parts is joined with newlines), plus ``tool_calls`` and
``reasoning_content`` on assistant messages and ``tool_call_id`` / ``name`` on tool messages; other
keys are dropped.

Sample ids: the row's ``id`` (an integer becomes its decimal string), else ``"h"`` + the first 16 hex
chars of the sha256 of the canonical JSON (``sort_keys=True, separators=(",", ":"),
ensure_ascii=False``) of ``{"messages": <all normalized messages>, "tools": <tools or null>}``. So the
same conversation always gets the same id, whichever row form carried it and whatever its partition.

A row that cannot become a prompt yields a `RowError` (1-based line number + reason) and the stream
goes on; memory stays flat for any file size because lines are read one at a time with a size cap.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from datagen.errors import InvalidRowError
from datagen.states import MultiTurnMode, PromptClass

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_PARTITION",
    "Prompt",
    "RowError",
    "iter_prompts",
    "line_is_blank",
    "line_items",
    "read_lines",
    "sample_id_for",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
DEFAULT_PARTITION = "default"
SAMPLE_ID_PREFIX = "h"
SAMPLE_ID_HEX_CHARS = 16
# Reading the rest of an over-long line happens in pieces of this size, never the whole line.
_SKIP_CHUNK_BYTES = 64 * 1024
_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
_PROMPT_ENDS = ("user", "tool")
# A reason quotes at most this much of an unexpected error's text.
_MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class Prompt:
    """One assistant turn to generate: the history before it, normalized, plus row metadata."""

    line: int
    sample_id: str
    turn: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    partition: str
    cls: PromptClass | None
    original: dict[str, Any]
    # The token-id row form (capture-only jobs): the whole sequence, and where its loss mask's 1s
    # start; None for every other form.
    token_ids: list[int] | None = None
    prompt_len: int | None = None
    # The row's place among its file's non-blank lines, from 0 (a recipe's ``cycle`` counts by it).
    row_index: int = 0


@dataclass(frozen=True)
class RowError:
    line: int
    reason: str
    sample_id: str | None = None


def sample_id_for(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The content-hash sample id of a normalized conversation (see the module docstring)."""
    canonical = json.dumps(
        {"messages": messages, "tools": tools}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return SAMPLE_ID_PREFIX + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:SAMPLE_ID_HEX_CHARS]


# -- reading lines ---------------------------------------------------------------------------------


def read_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw bytes) per line; None for a line over the cap, whose rest is skipped in pieces."""
    line_no = 0
    while chunk := stream.readline(max_line_bytes + 1):
        line_no += 1
        if chunk.endswith(b"\n") or len(chunk) <= max_line_bytes:
            yield line_no, chunk
            continue
        while chunk and not chunk.endswith(b"\n"):
            chunk = stream.readline(_SKIP_CHUNK_BYTES)
        yield line_no, None


def _decode(raw: bytes, line: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRowError(f"invalid UTF-8 at byte {exc.start} of the line") from exc
    if line == 1:
        text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark
    return text.strip()


def _json_kind(value: object) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(value), "a value")


def _parse_json(text: str) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRowError(f"invalid JSON: {exc.msg} (column {exc.colno})") from exc
    except RecursionError as exc:
        raise InvalidRowError("invalid JSON: nested too deeply") from exc
    except ValueError as exc:  # an integer over Python's 4,300-digit conversion limit
        raise InvalidRowError(
            "a number has more than 4,300 digits; shorten it or write it as a string"
        ) from exc
    if not isinstance(row, dict):
        raise InvalidRowError(f"row is not a JSON object (got {_json_kind(row)})")
    # Raw UTF-8 cannot hold a surrogate: only a JSON escape ("\\ud83d") can, so most rows skip the walk.
    if "\\ud" in text.lower():
        _refuse_lone_surrogates(row)
    return row


def _refuse_lone_surrogates(row: dict[str, Any]) -> None:
    """Refuse a string that is not valid Unicode: it cannot be tokenized, hashed or stored."""
    stack: list[tuple[object, str]] = [(row, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                stack.extend([(key, f"{path or 'row'} key"), (item, f"{path}.{key}" if path else str(key))])
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{index}]") for index, item in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRowError(
                    f"{path} holds a lone surrogate {value[exc.start]!r} (half of an escaped pair such as "
                    "\\ud83d\\ude00), which is not valid Unicode; re-encode the file as UTF-8"
                ) from exc


# -- row fields ------------------------------------------------------------------------------------


def _row_id(row: Mapping[str, Any]) -> str | None:
    if "id" not in row or row["id"] is None:
        return None
    value = row["id"]
    if (
        isinstance(value, bool)
        or not isinstance(value, str | int)
        or (isinstance(value, str) and not value.strip())
    ):
        raise InvalidRowError(f"id must be a non-empty string or an integer, got {json.dumps(value)}")
    return str(value)


def _row_class(row: Mapping[str, Any]) -> PromptClass | None:
    value = row.get("class")
    if value is None:
        return None
    if value not in (PromptClass.SHORT.value, PromptClass.LONG.value):
        raise InvalidRowError(f'class must be "short" or "long", got {json.dumps(value)}')
    return PromptClass(value)


def _row_partition(row: Mapping[str, Any]) -> str:
    value = row.get("partition")
    if value is None:
        return DEFAULT_PARTITION
    if not isinstance(value, str) or not value.strip():
        raise InvalidRowError(f"partition must be a non-empty string, got {json.dumps(value)}")
    return value


def _row_tools(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    value = row.get("tools")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRowError(f"tools is a string but not valid JSON: {exc.msg}") from exc
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise InvalidRowError("tools must be a list of objects (function schemas)")
    for index, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise InvalidRowError(f"tools[{index}] is not an object")
    return value


# -- messages --------------------------------------------------------------------------------------


def _content(message: Mapping[str, Any], key: str, index: int) -> str | None:
    """The message text; None when absent. A list of text parts is joined with newlines."""
    value = message.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise InvalidRowError(
                    f'message {index}: content parts must be {{"type": "text", "text": ...}}'
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRowError(f"message {index}: content must be a string or a list of text parts")


def _tool_calls(value: object, index: int) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRowError(f"message {index}: tool_calls must be a list")
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRowError(f"message {index}: each tool call needs a function with a name")
        if not isinstance(function.get("arguments", {}), str | dict):
            raise InvalidRowError(f"message {index}: tool call arguments must be a JSON string or an object")
    return value


def _message(role: object, content: str | None, source: Mapping[str, Any], index: int) -> dict[str, Any]:
    if role not in _ROLES:
        raise InvalidRowError(
            f"message {index}: unknown role {json.dumps(role)} (expected {', '.join(_ROLES)})"
        )
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "assistant" and source.get("tool_calls"):
        out["tool_calls"] = _tool_calls(source["tool_calls"], index)
    elif not (content or "").strip():
        raise InvalidRowError(f"message {index} ({role}): empty content")
    if role == "assistant" and source.get("reasoning_content") is not None:
        reasoning = source["reasoning_content"]
        if not isinstance(reasoning, str):
            raise InvalidRowError(f"message {index}: reasoning_content must be a string")
        out["reasoning_content"] = reasoning
    if role == "tool":
        out.update({k: source[k] for k in ("tool_call_id", "name") if isinstance(source.get(k), str)})
    return out


def _openai_messages(value: object, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRowError(f"{key} must be a list of messages")
    if not value:
        raise InvalidRowError(f"{key} is empty")
    out = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRowError(f"message {index} is not an object")
        if "from" in item and "role" not in item:  # ShareGPT entry
            sharegpt = item["from"]
            role = _SHAREGPT_ROLES.get(sharegpt, sharegpt) if isinstance(sharegpt, str) else sharegpt
            out.append(_message(role, _content(item, "value", index), item, index))
        else:
            out.append(_message(item.get("role"), _content(item, "content", index), item, index))
    return out


def _prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    prompt, system = row["prompt"], row.get("system")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRowError("prompt must be a non-empty string")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise InvalidRowError("system must be a non-empty string")
    head = [{"role": "system", "content": system}] if system is not None else []
    return [*head, {"role": "user", "content": prompt}]


def _conversation(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "messages" in row:
        messages = _openai_messages(row["messages"], "messages")
    elif "conversations" in row:
        messages = _openai_messages(row["conversations"], "conversations")
    elif "prompt" in row:
        messages = _prompt_messages(row)
    else:
        raise InvalidRowError('row has none of "messages", "conversations" or "prompt"')
    if not any(m["role"] == "user" for m in messages):
        raise InvalidRowError("conversation has no user message")
    return messages


# -- turns -----------------------------------------------------------------------------------------


def _turn_cuts(messages: list[dict[str, Any]], mode: MultiTurnMode) -> list[int]:
    """Where each generated turn's history ends (an index into messages)."""
    trailing = len(messages) - 1 if messages[-1]["role"] == "assistant" else len(messages)
    if mode is MultiTurnMode.LAST:
        cuts = [trailing]
    else:
        # ALL: one prompt per assistant turn with the ORIGINAL history before it, plus the open turn
        # at the end. The caller regenerates turn k first and re-renders the history of turn k+1 from
        # the decoded text of that regenerated turn (as at inference); this history is the fallback.
        cuts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if trailing == len(messages):
            cuts.append(trailing)
    for cut in cuts:
        last = messages[cut - 1]["role"] if cut > 0 else None
        if last in _PROMPT_ENDS:
            continue
        if cut == len(messages):
            raise InvalidRowError(f"conversation ends with a {last} message, not a user or tool message")
        if cut == trailing and mode is MultiTurnMode.LAST:
            raise InvalidRowError(
                f"after dropping the trailing assistant turn the conversation ends with "
                f"{json.dumps(last)}, not a user or tool message"
            )
        raise InvalidRowError(
            f"assistant message {cut} follows {json.dumps(last)}, not a user or tool message"
        )
    return cuts


def _row_prompts(
    row: dict[str, Any], line: int, mode: MultiTurnMode, sample_id: str | None, row_index: int
) -> list[Prompt]:
    messages = _conversation(row)
    tools = _row_tools(row)
    partition, cls = _row_partition(row), _row_class(row)
    cuts = _turn_cuts(messages, mode)
    if sample_id is None:
        sample_id = sample_id_for(messages, tools)
    return [
        Prompt(
            line=line,
            sample_id=sample_id,
            turn=sum(1 for m in messages[:cut] if m["role"] == "assistant"),
            messages=messages[:cut],
            tools=tools,
            partition=partition,
            cls=cls,
            original=row,
            row_index=row_index,
        )
        for cut in cuts
    ]


# Token ids a row may carry (the largest vocabularies are near 262k; 2**31 keeps them Parquet int32-safe).
MAX_TOKEN_ID = 2**31 - 1
TOKEN_SAMPLE_ID_PREFIX = "t"


def _int_list(row: Mapping[str, Any], key: str) -> list[int]:
    value = row.get(key)
    if not isinstance(value, list) or not value:
        raise InvalidRowError(f"{key} must be a non-empty list of integers, got {json.dumps(value)[:80]}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_TOKEN_ID:
            raise InvalidRowError(f"{key}[{i}] must be a non-negative integer, got {json.dumps(item)[:40]}")
    return value


def _token_row(row: dict[str, Any], line: int, sample_id: str | None, row_index: int) -> Prompt:
    """The token-id form (module docstring): the sequence and where its supervised tail starts."""
    if "input_ids" not in row:
        raise InvalidRowError(
            'a capture-only job reads rows of token ids: {"id", "input_ids": [...], "loss_mask": [...]} '
            "(a specforge export's lines); this row has none"
        )
    ids = _int_list(row, "input_ids")
    mask = _int_list(row, "loss_mask")
    if len(mask) != len(ids):
        raise InvalidRowError(f"loss_mask has {len(mask)} values for {len(ids)} input_ids; give one per id")
    if any(m not in (0, 1) for m in mask):
        raise InvalidRowError("loss_mask values must be 0 or 1")
    prompt_len = mask.index(1) if 1 in mask else len(mask)
    if 0 in mask[prompt_len:]:
        raise InvalidRowError(
            f"loss_mask is 1 from position {prompt_len} and 0 again later: one supervised span at the end is "
            "supported (a record of one turn); split a multi-turn row into one row per turn"
        )
    if sample_id is None:
        text = ",".join(map(str, ids))
        sample_id = TOKEN_SAMPLE_ID_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:SAMPLE_ID_HEX_CHARS]
    return Prompt(
        line=line,
        sample_id=sample_id,
        turn=0,
        messages=[],
        tools=None,
        partition=_row_partition(row),
        cls=_row_class(row),
        original=row,
        token_ids=ids,
        prompt_len=prompt_len,
        row_index=row_index,
    )


def line_is_blank(raw: bytes, line: int) -> bool:
    """Whether a line holds no row (`line_items` gives nothing for it): whitespace only, or a
    byte-order mark on line 1. A line that is not UTF-8 is a row, refused."""
    try:
        return not _decode(raw, line)
    except InvalidRowError:
        return False


def line_items(
    raw: bytes, line: int, mode: MultiTurnMode, *, token_rows: bool = False, row_index: int = 0
) -> list[Prompt | RowError]:
    """The prompts of one line (a row's turns), or its error; nothing for a blank line. ``row_index``:
    the row's place among the file's non-blank lines (`Prompt.row_index`)."""
    sample_id = None
    try:
        text = _decode(raw, line)
        if not text:
            return []
        row = _parse_json(text)
        sample_id = _row_id(row)
        if token_rows:
            return [_token_row(row, line, sample_id, row_index)]
        return list[Prompt | RowError](_row_prompts(row, line, mode, sample_id, row_index))
    except InvalidRowError as exc:
        return [RowError(line, str(exc), sample_id)]
    except Exception as exc:  # one row, whatever it holds, must never stop the rest of the file
        log.debug("line %d: unexpected error reading the row", line, exc_info=True)
        detail = f"{type(exc).__name__}: {exc}"[:_MAX_REASON_CHARS]
        return [RowError(line, f"cannot read this row ({detail}); fix or remove it", sample_id)]


def iter_prompts(
    stream: BinaryIO,
    *,
    multi_turn: MultiTurnMode = MultiTurnMode.LAST,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    token_rows: bool = False,
) -> Iterator[Prompt | RowError]:
    """Prompts and row errors in file order, one line in memory at a time.

    ``LAST``: one prompt per row; a trailing assistant turn is dropped and regenerated.
    ``ALL``: one prompt per assistant turn (turns 0..k), each with the row's original history.
    ``token_rows``: rows of token ids, one prompt each (a capture-only job).
    """
    row_index = 0
    for line, raw in read_lines(stream, max_line_bytes):
        if raw is None:
            yield RowError(line, f"line is longer than {max_line_bytes} bytes; skipped")
            row_index += 1
            continue
        items = line_items(raw, line, multi_turn, token_rows=token_rows, row_index=row_index)
        if not items:  # a blank line
            continue
        yield from items
        row_index += 1
