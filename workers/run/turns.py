"""Multi-turn ``all`` mode: turn k+1 of a conversation, rendered from the regenerated turns.

On-policy regeneration: the history of turn k+1 holds the model's own earlier answers, decoded
from the exact output ids of their records, in place of the dataset's. The chat template then
treats them exactly as at inference (the R1 template drops everything up to ``</think>`` from
assistant turns in history). Each turn's own record keeps its exact ids.

The decoded text keeps every id but the stop id that ended the turn (`history_text`): a tokenizer
that marks ``</think>`` special would otherwise lose the delimiter, and the template could no
longer strip the reasoning from the history.

Tool calls: without a parser, a regenerated turn keeps the dataset's ``tool_calls`` and only its
text is the model's. With the job's ``tool_call_parser`` (`workers.run.conversation`), the turn is the
model's ``normal_text`` and its parsed calls, and the dataset's tool results follow by position.

Pure functions: `workers.run.conversation` runs them in threads and owns retries and stops. Rendering
turn k+1 (`history`, `next_turn`) lives in `datagen.control.turns`, shared with the coordinator's
rebuild; they are named here too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from datagen.control.payload import Conversation
from datagen.control.turns import history, next_turn
from datagen.prompts.tokenization import PromptRenderer
from workers.engines.base import ToolCall

__all__ = ["assistant_turn", "dataset_call_names", "history", "history_text", "next_turn"]


def history_text(renderer: PromptRenderer, output_ids: Sequence[int], stop_ids: Collection[int]) -> str:
    """The text of a regenerated turn for the next turn's history: every id decoded, special ones
    included, but the trailing stop ids (end of turn) that the template writes itself."""
    end = len(output_ids)
    while end and output_ids[end - 1] in stop_ids:
        end -= 1
    return renderer.decode(output_ids[:end], skip_special_tokens=False)


def dataset_call_names(conversation: Conversation, turn: int) -> list[str]:
    """The function names the dataset's assistant message of ``turn`` calls, in order."""
    messages, cut = conversation.messages, conversation.cuts[turn]
    if cut >= len(messages):
        return []  # the open turn at the end: the dataset has no answer to compare with
    names = []
    for call in messages[cut].get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        names.append(str(function.get("name", "")) if isinstance(function, dict) else "")
    return names


def assistant_turn(
    conversation: Conversation, turn: int, normal_text: str, calls: Sequence[ToolCall]
) -> dict[str, Any]:
    """The model's turn as a message: its text, and its calls in the OpenAI shape; a call keeps the
    ``id`` of the dataset's call at its position, so the dataset's tool results still answer it."""
    messages, cut = conversation.messages, conversation.cuts[turn]
    dataset_calls = (messages[cut].get("tool_calls") or []) if cut < len(messages) else []
    tool_calls = []
    for index, call in enumerate(calls):
        shaped: dict[str, Any] = {
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        original = dataset_calls[index] if index < len(dataset_calls) else None
        if isinstance(original, dict) and "id" in original:
            shaped["id"] = original["id"]
        tool_calls.append(shaped)
    return {"content": normal_text, "tool_calls": tool_calls}
