"""Multi-turn ``all`` mode: turn k+1 of a conversation as a payload, rendered from the regenerated
turns, and what a turn's record says follows it.

Workers build turn k+1 when turn k ends (`workers.run.conversation`); a coordinator rebuilding a job from
storage builds the same payload from the records (`service.committed`). Both render with these
functions, so a rebuilt next turn is the one a worker would have enqueued.

The record of turn k carries ``next_turn`` (`datagen.records.schema`), written with its commit: what
the worker decided follows it, as JSON:

- ``{"history": <turn>}``: turn k+1 follows, with ``<turn>`` (the model's text, or its message with
  the server's parse of its tool calls) in its history at turn k's place;
- ``{"stop": {"reason": …, "message": …}}``: the conversation stops before turn k+1;
- null: turn k is the conversation's last (or the job is not multi-turn ``all``).

Storage then holds everything turn k+1 is made of (the row, in the job's upload, and each earlier
turn's ``history``), so a Redis that loses the next turn's payload loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from datagen.control.payload import PromptPayload
from datagen.prompts.tokenization import PromptRenderer
from datagen.spec import JobSpec
from datagen.states import StopReason

__all__ = ["NoteOfTurn", "history", "history_note", "next_turn", "read_note", "stop_note"]

HISTORY = "history"
STOP = "stop"


def next_turn(
    payload: PromptPayload,
    spec: JobSpec,
    renderer: PromptRenderer,
    regenerated: str | dict[str, Any],
) -> PromptPayload | None:
    """Turn k+1 with ``regenerated`` (turn k's text, or its message with the model's calls) in its
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
        arm=payload.arm,
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


# The record's ``next_turn`` ----------------------------------------------------------------------
@dataclass(frozen=True)
class NoteOfTurn:
    """A record's ``next_turn``, read: the turn as the next turn's history holds it, or the stop."""

    history: str | dict[str, Any] | None = None
    stop_reason: StopReason | None = None
    stop_message: str = ""


def history_note(regenerated: str | dict[str, Any]) -> str:
    return json.dumps({HISTORY: regenerated}, ensure_ascii=False, separators=(",", ":"))


def stop_note(reason: StopReason, message: str) -> str:
    return json.dumps({STOP: {"reason": reason.value, "message": message}}, ensure_ascii=False)


def read_note(raw: str) -> NoteOfTurn:
    """Raises ValueError for a note that is neither (a damaged or foreign value)."""
    note = json.loads(raw)
    if isinstance(note, dict) and isinstance(note.get(HISTORY), str | dict):
        return NoteOfTurn(history=note[HISTORY])
    stop = note.get(STOP) if isinstance(note, dict) else None
    if isinstance(stop, dict):
        return NoteOfTurn(
            stop_reason=StopReason(str(stop.get("reason"))), stop_message=str(stop.get("message", ""))
        )
    raise ValueError(f"not a next-turn note: {raw[:80]!r}")
