"""The streaming front half of every export: committed record batches → deduplicated, filtered and
clipped batches, one storage batch (`datagen.records.reader.BATCH_ROWS` records) in memory at a time.

The one memory cost that grows with the job is the dedupe set (`datagen.records.reader.SeenKeys`: one
digest a key; its cost is in bench/README.md).

Every batch leaves with the arm columns (``arm``, ``chat_template_kwargs``), so that batches of shards
of every schema version share one schema (the shuffle's bucket files take only one): a shard from
before version 4 (`datagen.records.schema.has_arms`) gets a null arm, which it stands for (recipes
came with version 4), and the job's template variables, which its prompts were rendered with.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from datagen.errors import CorruptShardError
from datagen.records.reader import SeenKeys, iter_committed_batches
from datagen.records.schema import ARM, TEMPLATE_KWARGS, has_arms
from datagen.records.storage import Storage
from datagen.states import FinishType

__all__ = [
    "ROW_COLUMNS",
    "DropReason",
    "ExportStats",
    "RowFilter",
    "RowFilterOptions",
    "filtered_batches",
    "with_arm_columns",
]

# The record columns the exports read; the rest of a shard is never decoded.
ROW_COLUMNS = [
    "sample_id",
    "turn",
    "gen",
    "partition",
    "input_ids",
    "prompt_len",
    "output_len",
    "finish_type",
    "server",
    "sampling_params",
    ARM,
    TEMPLATE_KWARGS,
]


class DropReason(StrEnum):
    PARTITION = "partition"
    TRUNCATED = "truncated"
    MIN_SUPERVISED = "min_supervised"
    NO_INPUT = "no_input"


@dataclass
class ExportStats:
    """Counts of one export. ``records`` are committed records read (duplicates included);
    ``skipped`` the shards left out (``skip_unreadable``), each with the records its commit counts."""

    records: int = 0
    duplicates: int = 0
    written: int = 0
    tokens: int = 0
    clipped: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    files: list[str] = field(default_factory=list)
    skipped: list[CorruptShardError] = field(default_factory=list)
    # The arms side file of a ``specforge`` export (`datagen.export.formats.ArmsSink`), where written.
    arms_file: str | None = None

    @property
    def skipped_records(self) -> int:
        return sum(shard.records for shard in self.skipped)

    def summary(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "written": self.written,
            "duplicates": self.duplicates,
            "dropped": {reason.value: self.dropped.get(reason.value, 0) for reason in DropReason},
            "clipped": self.clipped,
            "tokens": self.tokens,
            "files": len(self.files),
            "skipped_shards": len(self.skipped),
            "skipped_records": self.skipped_records,
            "arms_file": self.arms_file,
        }


@dataclass(frozen=True)
class RowFilterOptions:
    partitions: frozenset[str] | None = None
    drop_truncated: bool = False
    min_supervised_tokens: int = 1
    max_length: int | None = None
    # Text exports: a row cut by max_length no longer holds the whole turn, so it counts as truncated.
    clipped_is_truncated: bool = False


class RowFilter:
    """Keeps the first record per key, then drops by partition, truncation and supervised tokens
    (counted after clipping to ``max_length``), and clips what it keeps."""

    def __init__(self, options: RowFilterOptions, stats: ExportStats) -> None:
        self.options = options
        self.stats = stats
        self.seen = SeenKeys()

    def _drop_reason(self, partition: str, finish: str, prompt_len: int, length: int) -> DropReason | None:
        opts = self.options
        if opts.partitions is not None and partition not in opts.partitions:
            return DropReason.PARTITION
        kept = length if opts.max_length is None else min(length, opts.max_length)
        truncated = finish == FinishType.LENGTH or (opts.clipped_is_truncated and kept < length)
        if opts.drop_truncated and truncated:
            return DropReason.TRUNCATED
        if kept - min(prompt_len, kept) < opts.min_supervised_tokens:
            return DropReason.MIN_SUPERVISED
        return None

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        keys = zip(*(batch.column(c).to_pylist() for c in ("sample_id", "turn", "gen")), strict=True)
        partitions = batch.column("partition").to_pylist()
        finishes = batch.column("finish_type").to_pylist()
        prompt_lens = batch.column("prompt_len").to_pylist()
        lengths = pc.list_value_length(batch.column("input_ids")).to_pylist()
        keep = []
        for i, key in enumerate(keys):
            self.stats.records += 1
            if not self.seen.first(*key):
                self.stats.duplicates += 1
                keep.append(False)
                continue
            reason = self._drop_reason(partitions[i], finishes[i], prompt_lens[i], lengths[i])
            if reason is not None:
                self.stats.dropped[reason.value] += 1
            keep.append(reason is None)
        if not any(keep):
            return None
        return self._clip(batch.filter(pa.array(keep)))

    def _clip(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        max_length = self.options.max_length
        ids = batch.column("input_ids")
        if max_length is None:
            return batch
        too_long = pc.sum(pc.greater(pc.list_value_length(ids), max_length)).as_py() or 0
        if not too_long:
            return batch
        self.stats.clipped += too_long
        # The same schema as an unclipped batch (types and nullability), so batches stay interchangeable.
        clipped = pc.list_slice(ids, 0, max_length).cast(ids.type)
        columns = [clipped if name == "input_ids" else batch.column(name) for name in batch.schema.names]
        return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def with_arm_columns(
    batch: pa.RecordBatch, columns: Sequence[str], template_kwargs: str | None
) -> pa.RecordBatch:
    """``batch`` of a shard from before version 4 with the arm columns it lacks (of those in
    ``columns``): a null arm, and ``template_kwargs`` (the job's, as canonical JSON; None where the
    export has no spec) for every row. Fields and their order are a newer shard's (``columns``
    order, nullability kept), so the batches of both are interchangeable. A batch that has them is
    returned as is."""
    filled = {ARM: None, TEMPLATE_KWARGS: template_kwargs}
    if has_arms(batch.schema) or not any(name in columns for name in filled):
        return batch
    fields = {f.name: (f, batch.column(f.name)) for f in batch.schema}
    for name, value in filled.items():
        if name in columns:
            fields[name] = (pa.field(name, pa.string()), pa.array([value] * batch.num_rows, pa.string()))
    names = [name for name in columns if name in fields]
    schema = pa.schema([fields[name][0] for name in names])
    return pa.RecordBatch.from_arrays([fields[name][1] for name in names], schema=schema)


def filtered_batches(
    storage: Storage,
    job_id: str,
    row_filter: RowFilter,
    on_read: Callable[[int], None] | None = None,
    *,
    skip_unreadable: bool = False,
    columns: Sequence[str] = ROW_COLUMNS,
    template_kwargs: str | None = None,
) -> Iterator[pa.RecordBatch]:
    """Committed records in commit order through ``row_filter`` (``columns`` decoded); ``on_read``
    gets rows read so far.
    A shard that differs from its commit object stops the export, or with ``skip_unreadable`` is
    left out whole and noted in the stats. A shard from before version 4 reads with a null arm and
    ``template_kwargs`` (the job's template variables, canonical JSON) as its ``chat_template_kwargs``.
    """
    on_corrupt = row_filter.stats.skipped.append if skip_unreadable else None
    for batch in iter_committed_batches(storage, job_id, list(columns), on_corrupt=on_corrupt):
        kept = row_filter(with_arm_columns(batch, columns, template_kwargs))
        if on_read is not None:
            on_read(row_filter.stats.records)
        if kept is not None and kept.num_rows:
            yield kept
