"""A dataset's rows admitted as prompts, chunk by chunk: how rows become the items ingestion adds
to its chunks, the chunk itself, and which rows become prompts, the one rule that ingestion
(`service.ingest`) and the dry run (`service.dryrun`) both apply, so a dry run counts what ingestion
admits.

A row is judged in this order, and the first check it fails says why it is refused:

1. a row that did not parse (`RowError`) is refused with the parser's reason;
2. a row outside the spec's ``partitions`` is left out, neither admitted nor refused;
3. content that spells special tokens as text is refused under ``special_text: reject``;
4. a row the chat template cannot render is refused (a row of token ids, in a capture-only job, is
   taken as it is, and refused only when it does not fit the context length);
5. a prompt with no room to generate in the context length is refused;
6. an admitted prompt gets its class (`JobSpec.classify`).

In a job with a recipe, a row's samples run under their arms (`datagen.prompts.recipes`), and checks 4-6
are made with each arm's rendering: the row is admitted only if every arm it uses admits it (a
refusal names the arm), so a row is never half taken. Special text is looked for once per row.

Row ids and hygiene (decontamination, deduplication) judge a set of rows, not one, and come after
this rule (`service.rowids`, `datagen.hygiene.screen`).

A chunk holds the rows read so far as prompts, rejections and flags; chunks grow from a small first
one (`chunk_sizes`) up to a limit that keeps each chunk within the job's queued window
(`chunk_limit`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from datagen.control.keys import UNKNOWN_LABEL, BreakdownField
from datagen.control.payload import Conversation, PromptPayload
from datagen.errors import InvalidRowError
from datagen.prompts.dataset import Prompt, RowError, iter_prompts
from datagen.prompts.recipes import arms_of_row
from datagen.prompts.special_text import special_text_reason
from datagen.prompts.tokenization import PromptRenderer, renderer_for
from datagen.spec import Arm, JobSpec
from datagen.states import MultiTurnMode, PromptClass, SpecialTextPolicy
from service.rowids import RowId

__all__ = [
    "Admitted",
    "AdmittedRow",
    "ArmRenderers",
    "Chunk",
    "Refused",
    "admit",
    "admit_row",
    "arm_renderers",
    "chunk_items",
    "chunk_limit",
    "chunk_sizes",
    "partition_breakdown",
    "rejected_breakdown",
]


@dataclass
class Chunk:
    input_name: str
    prompts: list[tuple[Prompt, PromptPayload]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    flagged: list[dict[str, Any]] = field(default_factory=list)
    ids: dict[int, RowId] = field(default_factory=dict)
    # Line -> digest of its bytes (`service.rowids.LineDigests`): what a rejected row is known by.
    line_digests: dict[int, str] = field(default_factory=dict)
    rows: int = 0
    last_line: int = 0


def chunk_limit(chunk: int, window: int, samples: int = 1) -> int:
    """The most items a chunk of an ingestion holds: the configured ``chunk``, capped so that the
    chunk never holds more prompts of a class than the job's queued window (``window``,
    ``DATAGEN_MAX_QUEUED_PER_CLASS``) lets in at once. A chunk larger than the window would wait for
    room that can never come.

    A chunk is cut once its items (prompts and rejected rows) reach the limit, looked at after each
    row, and a row adds ``samples`` prompts: a chunk holds at most ``limit - 1 + samples`` prompts,
    hence the cap. Cutting here, not splitting a chunk later, keeps one transaction and one
    checkpoint per chunk (`service.ingest`). Only a row whose samples alone outnumber the window can
    still hold more: such a chunk (of that one row) waits for an empty backlog instead."""
    return max(1, min(chunk, window - samples + 1))


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
) -> Iterator[tuple[Prompt | RowError, Conversation | None]]:
    """Rows as (first prompt, conversation); the conversation is set in multi-turn ``all`` mode.

    In ``all`` mode only a row's first turn is enqueued here: a worker enqueues turn k+1 when the
    record of turn k is committed, rendered from the regenerated turns (on-policy).
    """
    token_rows = spec.features is not None and spec.features.capture_only
    parsed = iter_prompts(stream, multi_turn=spec.multi_turn, token_rows=token_rows)
    items = (i for i in parsed if i.line > start_line)
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
        yield first, Conversation(last.messages, last.tools, cuts, generated=[], row_class=first.cls)


def partition_breakdown(
    fresh: Sequence[PromptPayload],
    done: Sequence[tuple[PromptPayload, int]] = (),
    continued: Sequence[PromptPayload] = (),
) -> dict[BreakdownField, int]:
    """Accepted prompts by partition and class, for the metrics: each field's label is the
    prompt's partition, which the chunk's landing replaces by the job's label for it
    (`datagen.control.ingest_chunks`). ``done``: prompts of ``fresh`` already committed (a rebuilt
    job), with how many turns each counts; ``continued``: the next turns of its conversations,
    enqueued from the records."""
    counts: Counter[BreakdownField] = Counter()
    for payload in [*fresh, *continued]:
        counts[BreakdownField("accepted", payload.partition, payload.cls.value)] += 1
    for payload, turns in done:
        counts[BreakdownField("accepted", payload.partition, payload.cls.value)] += turns - 1
        counts[BreakdownField("done", payload.partition, payload.cls.value)] += turns
        if payload.arm:  # as the ack scripts count a recipe's prompts (`tally` in lib.lua)
            counts[BreakdownField.of_arm("done", payload.arm, payload.partition, payload.cls.value)] += turns
    return dict(counts)


def rejected_breakdown(chunk: Chunk) -> dict[BreakdownField, int]:
    """The chunk's rejected rows in the breakdown (no partition or class: their label is unknown)."""
    if not chunk.rejected:
        return {}
    return {BreakdownField("rejected", UNKNOWN_LABEL, UNKNOWN_LABEL): len(chunk.rejected)}


@dataclass(frozen=True)
class Admitted:
    prompt_ids: list[int]
    cls: PromptClass
    # The special tokens the row's content spells (empty when none, or when nobody looked).
    special_text: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Refused:
    reason: str
    # The row rendered and was refused only for its length: ingestion still remembers its id (and
    # flags its special text), as for an admitted row.
    rendered: bool = False
    special_text: list[str] = field(default_factory=list)


def admit(
    item: Prompt | RowError,
    spec: JobSpec,
    renderer: PromptRenderer,
    context_len: int | None,
    *,
    scan_special_text: bool = False,
    scan: bool = True,
) -> Admitted | Refused | None:
    """The rule above for one parsed row; None for a row outside the spec's partitions.

    Special text is looked for unless the spec's policy allows it (the scan costs a pass over the
    row's text); ``scan_special_text`` looks anyway, for a report that counts it whatever the policy;
    ``scan`` False skips it (another arm's rendering of the row looked already).
    """
    if isinstance(item, RowError):
        return Refused(item.reason)
    if spec.partitions is not None and item.partition not in spec.partitions:
        return None
    if item.token_ids is not None:
        # Token ids, taken as they are: no text to scan or render. The capture's prefill holds the
        # sequence and one sampled token.
        if context_len is not None and len(item.token_ids) + 1 > context_len:
            return Refused(
                f"the sequence has {len(item.token_ids)} tokens, which does not fit the context length of "
                f"{context_len} tokens",
                rendered=True,
            )
        return Admitted(item.token_ids, spec.classify(len(item.token_ids), item.cls))
    found: list[str] = []
    if scan_special_text or (scan and spec.special_text is not SpecialTextPolicy.ALLOW):
        found = renderer.special_text(item.messages, item.tools)
    if found and spec.special_text is SpecialTextPolicy.REJECT:
        return Refused(special_text_reason(found), special_text=found)
    try:
        prompt_ids = renderer.render(item.messages, item.tools)
    except InvalidRowError as exc:
        return Refused(str(exc), special_text=found)
    if context_len is not None and len(prompt_ids) + 1 >= context_len:
        reason = (
            f"prompt has {len(prompt_ids)} tokens, which does not fit the context length of "
            f"{context_len} tokens (no room to generate)"
        )
        return Refused(reason, rendered=True, special_text=found)
    return Admitted(prompt_ids, spec.classify(len(prompt_ids), item.cls), found)


ArmRenderers = Callable[[Arm | None], PromptRenderer]


def arm_renderers(spec: JobSpec) -> ArmRenderers:
    """The renderer of each arm of ``spec`` (of the job itself for None), looked up once per arm. The
    job's own is built now, so a bad tokenizer or template fails before any row is read."""
    renderers: dict[str | None, PromptRenderer] = {None: renderer_for(spec)}

    def renderer(arm: Arm | None) -> PromptRenderer:
        name = None if arm is None else arm.name
        found = renderers.get(name)
        if found is None:
            found = renderers[name] = renderer_for(spec, arm)
        return found

    return renderer


@dataclass(frozen=True)
class AdmittedRow:
    """A row admitted under every arm its samples use: per sample (gen 0..samples-1), its arm and
    its rendering."""

    samples: list[tuple[Arm | None, Admitted]]
    special_text: list[str] = field(default_factory=list)


def admit_row(
    item: Prompt | RowError,
    spec: JobSpec,
    renderers: ArmRenderers,
    context_len: int | None,
    *,
    scan_special_text: bool = False,
) -> AdmittedRow | Refused | None:
    """`admit` for each arm the row's samples use (`datagen.prompts.recipes.arms_of_row`; one, None, without a
    recipe); the first refusal refuses the row. ``renderers``: the renderer of an arm."""
    if isinstance(item, RowError):
        return Refused(item.reason)
    if spec.recipe is None:
        arms: list[Arm | None] = [None] * spec.samples
    else:
        arms = arms_of_row(spec, sample_id=item.sample_id, row_index=item.row_index)
    verdicts: dict[str | None, Admitted] = {}
    found: list[str] = []
    for arm in arms:
        name = None if arm is None else arm.name
        if name in verdicts:
            continue
        verdict = admit(
            item, spec, renderers(arm), context_len, scan_special_text=scan_special_text, scan=not verdicts
        )
        if verdict is None:
            return None
        if isinstance(verdict, Refused):
            if name is None:
                return verdict
            return Refused(
                f"arm {name}: {verdict.reason}",
                rendered=verdict.rendered,
                special_text=verdict.special_text or found,
            )
        if not verdicts:
            found = verdict.special_text
        verdicts[name] = verdict
    return AdmittedRow([(arm, verdicts[None if arm is None else arm.name]) for arm in arms], found)
