"""The RQ job payload: one small JSON dict per prompt, token ids packed as base64 uint32 LE.

Only this module reads or writes the payload's keys: `PromptPayload` strictly (the prompt a worker
runs), `ParsedPayload` leniently (what counting a failed or cancelled prompt needs, even of a
malformed one)."""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datagen.control.keys import UNKNOWN_LABEL
from datagen.errors import FatalError
from datagen.states import PromptClass

__all__ = [
    "Conversation",
    "ParsedPayload",
    "PromptLabels",
    "PromptPayload",
    "counts_in",
    "pack_ids",
    "parse_payload",
    "unpack_ids",
]

_UINT32 = "I"
# The payload's keys.
_JOB = "job"
_SAMPLE_ID = "sample_id"
_TURN = "turn"
_CLS = "cls"
_PARTITION = "partition"
_INCARNATION = "inc"
_CONVERSATION = "conversation"
_GIVEN_PROMPT_LEN = "given_prompt_len"
_ARM = "arm"
# The partition of a payload written before payloads carried one.
DEFAULT_PARTITION = "default"


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
class Conversation:
    """Multi-turn ``all`` mode: a row's whole conversation, where each turn's history ends (``cuts``:
    how many messages precede each turn), and the turns regenerated so far (each the model's text,
    or its message with parsed tool calls, `workers.run.turns.assistant_turn`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    cuts: list[int]
    generated: list[str | dict[str, Any]]
    # The row's own class, which every turn keeps; None: each turn is classed by its length.
    row_class: PromptClass | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "tools": self.tools,
            "cuts": self.cuts,
            "generated": self.generated,
            "class": self.row_class.value if self.row_class is not None else None,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Conversation:
        row_class = raw.get("class")
        return cls(
            messages=list(raw["messages"]),
            tools=raw.get("tools"),
            cuts=[int(cut) for cut in raw["cuts"]],
            generated=list(raw["generated"]),
            row_class=PromptClass(row_class) if row_class else None,
        )


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
    conversation: Conversation | None = None
    # The job's incarnation (a new one each time the id is created after a delete): workers and
    # exports drop what belongs to another incarnation than the job's current one.
    incarnation: str = ""
    # A capture-only job's row: ``prompt_ids`` is the whole sequence, taken as it is, and its loss
    # mask's 1s start here; nothing is generated.
    given_prompt_len: int | None = None
    # A job with a recipe: the name of the arm this sample runs under (`datagen.prompts.recipes`); its
    # prompt ids were rendered with the arm's template variables, and the worker sends its sampling.
    arm: str | None = None

    def to_json(self) -> dict[str, Any]:
        body = {
            _JOB: self.job,
            _SAMPLE_ID: self.sample_id,
            _TURN: self.turn,
            "gen": self.gen,
            _CLS: self.cls.value,
            "prompt_ids": pack_ids(self.prompt_ids),
            "max_new_tokens": self.max_new_tokens,
            _PARTITION: self.partition,
        }
        if self.conversation is not None:
            body[_CONVERSATION] = self.conversation.to_json()
        if self.incarnation:
            body[_INCARNATION] = self.incarnation
        if self.given_prompt_len is not None:
            body[_GIVEN_PROMPT_LEN] = self.given_prompt_len
        if self.arm is not None:
            body[_ARM] = self.arm
        return body

    @classmethod
    def from_json(cls, raw: Any) -> PromptPayload:
        try:
            conversation = raw.get(_CONVERSATION)
            return cls(
                job=str(raw[_JOB]),
                sample_id=str(raw[_SAMPLE_ID]),
                turn=int(raw[_TURN]),
                gen=int(raw["gen"]),
                cls=PromptClass(raw[_CLS]),
                prompt_ids=unpack_ids(raw["prompt_ids"]),
                max_new_tokens=int(raw["max_new_tokens"]),
                partition=str(raw.get(_PARTITION, DEFAULT_PARTITION)),
                conversation=Conversation.from_json(conversation) if conversation is not None else None,
                incarnation=str(raw.get(_INCARNATION, "")),
                given_prompt_len=None if raw.get(_GIVEN_PROMPT_LEN) is None else int(raw[_GIVEN_PROMPT_LEN]),
                arm=None if raw.get(_ARM) is None else str(raw[_ARM]),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise FatalError(f"malformed prompt payload in RQ job: {exc!r}") from exc


def counts_in(incarnation: str, current: str | None) -> bool:
    """The incarnation rule: whether a prompt that carries ``incarnation`` ('' for none: a prompt
    older than incarnations) counts in a job whose incarnation is ``current`` (None: the job is
    gone; `datagen.control.jobs.JobStore.incarnation`). The same rule as ``job_incarnation`` and
    ``counts_in`` in ``datagen/control/lua/lib.lua``, which the count and ack scripts apply."""
    return current is not None and (incarnation == "" or incarnation == current)


@dataclass(frozen=True)
class PromptLabels:
    """Where a prompt counts in its job (`datagen.control.job_outcomes.JobOutcomes.count_failed` and
    ``count_cancelled`` take them as keywords): its partition and class (``unknown`` when its
    payload does not say) and the incarnation it belongs to ('' for none)."""

    partition: str = UNKNOWN_LABEL
    cls: str = UNKNOWN_LABEL
    incarnation: str = ""

    def kwargs(self) -> dict[str, str]:
        return {"partition": self.partition, "cls": self.cls, "incarnation": self.incarnation}


@dataclass(frozen=True)
class ParsedPayload:
    """A claimed RQ job's payload, read once by the worker that runs it (`parse_payload`).

    ``prompt`` is None when the payload is malformed, and ``error`` says how: the worker fails such a
    prompt. What the failure and cancel counts need (its job, `labels`, the sample and turn its
    failure report names) is still read leniently from ``raw``, here and nowhere else, so that
    even a malformed prompt (or an RQ job that is no prompt: ``raw`` empty) is counted on the job
    it names."""

    prompt: PromptPayload | None
    error: FatalError | None
    job: str | None
    raw: Mapping[str, Any]

    def require(self) -> PromptPayload:
        """The prompt, or the FatalError that says how its payload is malformed."""
        if self.prompt is None:
            raise self.error or FatalError("malformed prompt payload in RQ job")
        return self.prompt

    @property
    def labels(self) -> PromptLabels:
        raw = self.raw
        return PromptLabels(
            partition=str(raw.get(_PARTITION, UNKNOWN_LABEL)),
            cls=str(raw.get(_CLS, UNKNOWN_LABEL)),
            incarnation=str(raw.get(_INCARNATION, "")),
        )

    @property
    def sample_id(self) -> Any:
        """The sample id as stored (None when the payload has none)."""
        return self.raw.get(_SAMPLE_ID)

    @property
    def turn(self) -> Any:
        return self.raw.get(_TURN)


def parse_payload(raw: object) -> ParsedPayload:
    """``raw``: the RQ job's first argument (`datagen.control.rq_format.payload_of`), None when it
    has none."""
    fields: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    job = fields.get(_JOB)
    try:
        return ParsedPayload(PromptPayload.from_json(raw), None, str(job), fields)
    except FatalError as exc:
        return ParsedPayload(None, exc, None if job is None else str(job), fields)
