"""Multi-turn ``all`` mode: turn k+1 of a conversation, rendered from the regenerated turns.

On-policy regeneration: the history of turn k+1 holds the model's own earlier answers, decoded
from the exact output ids of their records, in place of the dataset's. The chat template then
treats them exactly as at inference (the R1 template drops everything up to ``</think>`` from
assistant turns in history). Each turn's own record keeps its exact ids.

A conversation stops at a turn that was cut at ``max_new_tokens``: its text has no end of
reasoning, and a history built from it would train on a state the model never reaches.
"""

from __future__ import annotations

from typing import Any

from datagen.payload import PromptPayload
from datagen.records import Record
from datagen.spec import JobSpec
from datagen.states import FinishType, PromptClass
from datagen.tokenization import PromptRenderer

__all__ = ["next_turn"]


def next_turn(
    payload: PromptPayload, record: Record, spec: JobSpec, renderer: PromptRenderer
) -> PromptPayload | None:
    conversation = payload.conversation
    if conversation is None or record.finish_type != FinishType.STOP.value:
        return None
    cuts: list[int] = conversation["cuts"]
    turn = payload.turn
    if turn + 1 >= len(cuts):
        return None
    output_ids = record.input_ids[record.prompt_len :]
    generated = [*conversation["generated"], renderer.decode(output_ids, skip_special_tokens=True)]
    messages = history(conversation["messages"], cuts, generated, turn + 1)
    prompt_ids = renderer.render(messages, conversation.get("tools"))
    row_class = conversation.get("class")
    cls = PromptClass(row_class) if row_class else spec.classify(len(prompt_ids), None)
    return PromptPayload(
        job=payload.job,
        sample_id=payload.sample_id,
        turn=turn + 1,
        gen=payload.gen,
        cls=cls,
        prompt_ids=prompt_ids,
        max_new_tokens=spec.max_new_tokens(cls),
        partition=payload.partition,
        conversation={**conversation, "generated": generated},
        incarnation=payload.incarnation,
    )


def history(
    messages: list[dict[str, Any]], cuts: list[int], generated: list[str], turn: int
) -> list[dict[str, Any]]:
    """The messages before ``turn``, with regenerated text replacing the dataset's assistant turns."""
    out = [dict(m) for m in messages[: cuts[turn]]]
    for index, text in zip(cuts, generated, strict=False):
        if index < len(out) and out[index]["role"] == "assistant":
            # Tool calls of the dataset's turn are kept; only its text is the model's own.
            out[index]["content"] = text
            out[index].pop("reasoning_content", None)
    return out
