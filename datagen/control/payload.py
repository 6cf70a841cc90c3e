"""The RQ job payload: one small JSON dict per prompt, token ids packed as base64 uint32 LE."""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from datagen.errors import FatalError
from datagen.states import PromptClass

__all__ = ["PromptPayload", "pack_ids", "unpack_ids"]

_UINT32 = "I"


def pack_ids(ids: Sequence[int]) -> str:
    arr = array(_UINT32, ids)
    if arr.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte "I"
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def unpack_ids(packed: str) -> list[int]:
    arr = array(_UINT32)
    arr.frombytes(base64.b64decode(packed))
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


@dataclass(frozen=True)
class PromptPayload:
    job: str
    sample_id: str
    turn: int
    gen: int
    cls: PromptClass
    prompt_ids: list[int]
    max_new_tokens: int
    partition: str
    # Multi-turn ``all`` mode only: the row's conversation, where each turn's history ends, and the
    # text of the turns regenerated so far (the worker renders turn k+1 from them).
    conversation: dict[str, Any] | None = None
    # The job's incarnation (a new one each time the id is created after a delete): workers and
    # exports drop what belongs to another incarnation than the job's current one.
    incarnation: str = ""

    def to_json(self) -> dict[str, Any]:
        body = {
            "job": self.job,
            "sample_id": self.sample_id,
            "turn": self.turn,
            "gen": self.gen,
            "cls": self.cls.value,
            "prompt_ids": pack_ids(self.prompt_ids),
            "max_new_tokens": self.max_new_tokens,
            "partition": self.partition,
        }
        if self.conversation is not None:
            body["conversation"] = self.conversation
        if self.incarnation:
            body["inc"] = self.incarnation
        return body

    @classmethod
    def from_json(cls, raw: Any) -> PromptPayload:
        try:
            return cls(
                job=str(raw["job"]),
                sample_id=str(raw["sample_id"]),
                turn=int(raw["turn"]),
                gen=int(raw["gen"]),
                cls=PromptClass(raw["cls"]),
                prompt_ids=unpack_ids(raw["prompt_ids"]),
                max_new_tokens=int(raw["max_new_tokens"]),
                partition=str(raw.get("partition", "default")),
                conversation=raw.get("conversation"),
                incarnation=str(raw.get("inc", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FatalError(f"malformed prompt payload in RQ job: {exc!r}") from exc
