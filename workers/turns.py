"""Multi-turn ``all`` mode: turn k+1 of a conversation, rendered from the regenerated turns.

On-policy regeneration: the history of turn k+1 holds the model's own earlier answers, decoded
from the exact output ids of their records, in place of the dataset's. The chat template then
treats them exactly as at inference (the R1 template drops everything up to ``</think>`` from
assistant turns in history). Each turn's own record keeps its exact ids.

The decoded text keeps every id but the stop id that ended the turn (`history_text`): a tokenizer
that marks ``</think>`` special would otherwise lose the delimiter, and the template could no
longer strip the reasoning from the history.

Tool calls: without a parser, a regenerated turn keeps the dataset's ``tool_calls`` and only its
text is the model's. With the job's ``tool_call_parser`` (`workers.conversation`), the turn is the
model's ``normal_text`` and its parsed calls, and the dataset's tool results follow by position.

Pure functions: `workers.conversation` runs them in threads and owns retries and stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from datagen.control.payload import Conversation, PromptPayload
from datagen.prompts.tokenization import PromptRenderer
from datagen.spec import JobSpec
from workers.sglang_replies import ToolCall

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


def next_turn(
    payload: PromptPayload,
    spec: JobSpec,
    renderer: PromptRenderer,
    regenerated: str | dict[str, Any],
) -> PromptPayload | None:
    """Turn k+1 with ``regenerated`` (turn k's text, or its message from `assistant_turn`) in its
    history; None after the last turn. The caller has checked that turn k stopped, not truncated."""
    conversation = payload.conversation
    if conversation is None:
        return None
    cuts = conversation.cuts
    turn = payload.turn
    if turn + 1 >= len(cuts):
        return None
    generated = [*conversation.generated, regenerated]
    messages = history(conversation.messages, cuts, generated, turn + 1)
    prompt_ids = renderer.render(messages, conversation.tools)
    cls = conversation.row_class or spec.classify(len(prompt_ids), None)
    return PromptPayload(
        job=payload.job,
        sample_id=payload.sample_id,
        turn=turn + 1,
        gen=payload.gen,
        cls=cls,
        prompt_ids=prompt_ids,
        max_new_tokens=spec.max_new_tokens(cls),
        partition=payload.partition,
        conversation=dataclasses.replace(conversation, generated=generated),
        incarnation=payload.incarnation,
    )


def history(
    messages: list[dict[str, Any]], cuts: list[int], generated: Sequence[str | dict[str, Any]], turn: int
) -> list[dict[str, Any]]:
    """The messages before ``turn``, with regenerated turns replacing the dataset's assistant turns.

    A regenerated turn is its text (the dataset's tool calls are kept: the rule without a parser) or
    a message with the model's own ``content`` and ``tool_calls`` (they replace the dataset's)."""
    out = [dict(m) for m in messages[: cuts[turn]]]
    for index, turn_of_model in zip(cuts, generated, strict=False):
        if index >= len(out) or out[index]["role"] != "assistant":
            continue
        out[index].pop("reasoning_content", None)
        if isinstance(turn_of_model, str):
            out[index]["content"] = turn_of_model
            continue
        out[index]["content"] = turn_of_model["content"]
        if turn_of_model.get("tool_calls"):
            out[index]["tool_calls"] = turn_of_model["tool_calls"]
        else:
            out[index].pop("tool_calls", None)
    return out
