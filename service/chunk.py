"""One ingestion chunk: the rows read so far (as prompts, rejections and flags), and how a dataset's
rows become the items ingestion adds to chunks."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from datagen.control.payload import PromptPayload
from datagen.prompts.dataset import Prompt, RowError, iter_prompts
from datagen.spec import JobSpec
from datagen.states import MultiTurnMode
from service.rowids import RowId

__all__ = ["UNKNOWN", "Chunk", "breakdown", "chunk_items", "chunk_sizes"]

# Rejected rows have no class (and often no parsed partition) to count them under.
UNKNOWN = "unknown"


@dataclass
class Chunk:
    input_name: str
    prompts: list[tuple[Prompt, PromptPayload]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    flagged: list[dict[str, Any]] = field(default_factory=list)
    ids: dict[int, RowId] = field(default_factory=dict)
    rows: int = 0
    last_line: int = 0


def chunk_sizes(first: int, most: int) -> Iterator[int]:
    """How many items each chunk of an ingestion holds: ``first``, then twice as many each time, up
    to ``most``. A small first chunk reaches idle workers within a fraction of a second of the submit;
    doubling keeps the backlog ahead of them while the rest of the chunks render, and costs only a
    handful of extra transactions per upload."""
    size = max(1, min(first, most))
    while True:
        yield size
        size = min(most, size * 2)


def chunk_items(
    stream: BinaryIO, spec: JobSpec, start_line: int
) -> Iterator[tuple[Prompt | RowError, dict[str, Any] | None]]:
    """Rows as (first prompt, conversation); the conversation is set in multi-turn ``all`` mode.

    In ``all`` mode only a row's first turn is enqueued here: a worker enqueues turn k+1 when the
    record of turn k is committed, rendered from the regenerated turns (on-policy).
    """
    items = (i for i in iter_prompts(stream, multi_turn=spec.multi_turn) if i.line > start_line)
    if spec.multi_turn is MultiTurnMode.LAST:
        for item in items:
            yield item, None
        return
    for _, group in itertools.groupby(items, key=lambda i: i.line):
        turns = list(group)
        first, last = turns[0], turns[-1]
        if isinstance(first, RowError) or isinstance(last, RowError):
            yield first, None
            continue
        cuts = [len(t.messages) for t in turns if isinstance(t, Prompt)]
        conversation: dict[str, Any] = {
            "messages": last.messages,
            "tools": last.tools,
            "cuts": cuts,
            "generated": [],
            "class": first.cls.value if first.cls is not None else None,
        }
        yield first, conversation


def breakdown(
    chunk: Chunk,
    fresh: list[PromptPayload],
    labels: dict[str, str],
    done: Sequence[tuple[PromptPayload, int]] = (),
) -> dict[tuple[str, str, str], int]:
    """Accepted prompts and rejected rows by partition label and class, for the metrics; ``done``:
    prompts of ``fresh`` already committed (a rebuilt job), with how many turns each counts."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for payload in fresh:
        counts["accepted", labels[payload.partition], payload.cls.value] += 1
    for payload, turns in done:
        label = labels[payload.partition]
        counts["accepted", label, payload.cls.value] += turns - 1
        counts["done", label, payload.cls.value] += turns
    if chunk.rejected:
        counts["rejected", UNKNOWN, UNKNOWN] += len(chunk.rejected)
    return dict(counts)
