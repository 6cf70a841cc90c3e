"""The by-arm section of a job's report (a job with a ``recipe``): per arm of the recipe, its records and
share of the job's, prompt and output lengths, finishes and truncation, the think structure of its
outputs, and the template variables and sampling its records were made with.

`ArmTally` is fed the scan's first record per key. Its memory is fixed: per arm, the histograms of
`datagen.report.stats`, a few counters, and at most `MAX_VALUES_KEPT` distinct ``chat_template_kwargs``
and ``sampling_params`` texts (one each in the common case; ``max_new_tokens`` by class and a seed per
``gen`` make a few more). A record without an arm (a shard written before schema version 4, which has
no ``arm`` column, read as null) is counted under `NO_ARM`; a job none of whose records has an arm
gets no section (`ArmTally.present`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa

from datagen.records.schema import ARM, TEMPLATE_KWARGS
from datagen.report.stats import LengthHistogram
from datagen.states import FinishType

__all__ = [
    "ARM_REPORT_COLUMNS",
    "NO_ARM",
    "UNKNOWN_VALUE",
    "ArmStats",
    "ArmTally",
    "ThinkShape",
    "ValueTally",
    "column_or_null",
    "think_shape",
]

SAMPLING_PARAMS = "sampling_params"
ARM_REPORT_COLUMNS = [ARM, TEMPLATE_KWARGS, SAMPLING_PARAMS]
# Records with a null arm: not a valid arm name (`datagen.spec.ARM_NAME_PATTERN`), so it cannot clash.
NO_ARM = "(none)"
# Distinct JSON texts counted per arm and column; the records of further ones are counted, not kept.
MAX_VALUES_KEPT = 8
SHARE_DIGITS = 4
# A shard before schema version 4 has no template-variables column: its records' text is unknown.
UNKNOWN_VALUE = "(not recorded)"


class ThinkShape(StrEnum):
    """The think structure of one output, as the ``think_end`` check sees it."""

    CLOSED = "closed"  # the prompt opens a think block, the output closes it once
    UNCLOSED = "unclosed"  # ... and the output never closes it (a length-truncated one may stop there)
    REPEATED = "repeated"  # ... and the output closes it more than once
    NONE = "none"  # the prompt leaves no think block open (thinking off), the output has no think-end
    STRAY = "stray"  # the prompt leaves no think block open, yet the output holds a think-end


def think_shape(opens_think: bool, think_ends: int) -> ThinkShape:
    if not opens_think:
        return ThinkShape.STRAY if think_ends else ThinkShape.NONE
    if think_ends == 1:
        return ThinkShape.CLOSED
    return ThinkShape.UNCLOSED if think_ends == 0 else ThinkShape.REPEATED


@dataclass
class ValueTally:
    """Records per distinct text, the first `MAX_VALUES_KEPT` texts kept; ``unlisted`` counts the rest."""

    counts: Counter[str] = field(default_factory=Counter)
    unlisted: int = 0

    def add(self, value: str) -> None:
        if value in self.counts or len(self.counts) < MAX_VALUES_KEPT:
            self.counts[value] += 1
        else:
            self.unlisted += 1

    @property
    def common(self) -> str | None:
        """The text most of the arm's records carry."""
        return self.counts.most_common(1)[0][0] if self.counts else None

    @property
    def distinct(self) -> str:
        """How many distinct texts: ``"3"``, or ``"8+"`` when some were not kept."""
        return f"{len(self.counts)}+" if self.unlisted else str(len(self.counts))

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.common,
            "distinct": self.distinct,
            "values": dict(self.counts.most_common()),
            "unlisted_records": self.unlisted,
        }


@dataclass
class ArmStats:
    """One arm's first records."""

    records: int = 0
    by_finish: Counter[str] = field(default_factory=Counter)
    prompt_lengths: LengthHistogram = field(default_factory=LengthHistogram)
    output_lengths: dict[str, LengthHistogram] = field(default_factory=dict)
    think: Counter[str] = field(default_factory=Counter)
    template_kwargs: ValueTally = field(default_factory=ValueTally)
    sampling_params: ValueTally = field(default_factory=ValueTally)

    @property
    def truncated(self) -> int:
        return self.by_finish[FinishType.LENGTH]

    @property
    def truncation_rate(self) -> float:
        return round(self.truncated / self.records, SHARE_DIGITS) if self.records else 0.0

    def all_outputs(self) -> LengthHistogram:
        """The output lengths of every finish together."""
        combined = LengthHistogram()
        for histogram in self.output_lengths.values():
            combined.merge(histogram)
        return combined

    def to_json(self, share: float) -> dict[str, Any]:
        return {
            "records": self.records,
            "share": share,
            "by_finish": dict(self.by_finish.most_common()),
            "truncated": self.truncated,
            "truncation_rate": self.truncation_rate,
            "prompt_lengths": self.prompt_lengths.to_json(),
            "output_lengths": self.all_outputs().to_json(),
            "output_lengths_by_finish": {f: h.to_json() for f, h in sorted(self.output_lengths.items())},
            "think": {shape.value: self.think[shape] for shape in ThinkShape if self.think[shape]},
            "chat_template_kwargs": self.template_kwargs.to_json(),
            "sampling_params": self.sampling_params.to_json(),
        }


def column_or_null(batch: pa.RecordBatch, name: str) -> list[str | None]:
    """A string column, or None for every row of a batch without it (not read, or of a shard written
    before it existed)."""
    if name in batch.schema.names:
        values: list[str | None] = batch.column(name).to_pylist()
        return values
    return [None] * batch.num_rows


@dataclass
class ArmTally:
    """Per arm (the recipe's arms first, in its order, then any other name met), its first records."""

    arm_names: Sequence[str] = ()
    records: int = 0
    arms: dict[str, ArmStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.arm_names:
            self.arms.setdefault(name, ArmStats())

    def add(
        self,
        batch: pa.RecordBatch,
        new: np.ndarray,
        prompt_lens: np.ndarray,
        output_lens: np.ndarray,
        shapes: Sequence[ThinkShape | None],
    ) -> None:
        """One batch (with `ARM_REPORT_COLUMNS` where its shard has them); ``new`` marks the first record
        of each key, ``shapes`` the think structure of each checked record (None: not checked)."""
        names = [name or NO_ARM for name in column_or_null(batch, ARM)]
        kwargs = column_or_null(batch, TEMPLATE_KWARGS)
        sampling = column_or_null(batch, SAMPLING_PARAMS)
        finishes = batch.column("finish_type").to_pylist()
        for i in np.flatnonzero(new).tolist():
            stats = self.arms.setdefault(names[i], ArmStats())
            self.records += 1
            stats.records += 1
            stats.by_finish[finishes[i]] += 1
            shape = shapes[i]
            if shape is not None:
                stats.think[shape] += 1
            stats.template_kwargs.add(kwargs[i] or UNKNOWN_VALUE)
            stats.sampling_params.add(sampling[i] or UNKNOWN_VALUE)
        name_array, finish_array = np.array(names, dtype=object), np.array(finishes, dtype=object)
        for name in set(names):
            in_arm = new & (name_array == name)
            if not in_arm.any():
                continue
            stats = self.arms[name]
            stats.prompt_lengths.add(prompt_lens[in_arm])
            for finish in set(finish_array[in_arm].tolist()):
                selected = in_arm & (finish_array == finish)
                stats.output_lengths.setdefault(finish, LengthHistogram()).add(output_lens[selected])

    @property
    def present(self) -> bool:
        """Whether any record names an arm: a job without a recipe, or only older shards, has none."""
        return any(stats.records for name, stats in self.arms.items() if name != NO_ARM)

    def share(self, name: str) -> float:
        return round(self.arms[name].records / self.records, SHARE_DIGITS) if self.records else 0.0

    def rows(self) -> list[tuple[str, ArmStats, float]]:
        """(name, stats, share) per arm, records without an arm last (when there are any)."""
        rows = [(name, stats, self.share(name)) for name, stats in self.arms.items() if name != NO_ARM]
        if NO_ARM in self.arms:
            rows.append((NO_ARM, self.arms[NO_ARM], self.share(NO_ARM)))
        return rows

    def finishes(self) -> list[str]:
        """Every finish any arm has, sorted."""
        return sorted({finish for stats in self.arms.values() for finish in stats.by_finish})

    def summary(self) -> tuple[list[str], list[list[str]]]:
        """The header and rows of the records-by-arm table, the same in every view."""
        finishes = self.finishes()
        header = ["arm", "records", "share", *finishes, "truncated", "think"]
        rows = [
            [
                name,
                f"{stats.records:,}",
                f"{share:.1%}",
                *(f"{stats.by_finish[f]:,}" for f in finishes),
                f"{stats.truncation_rate:.1%}",
                ", ".join(
                    f"{shape.value} {stats.think[shape]:,}" for shape in ThinkShape if stats.think[shape]
                ),
            ]
            for name, stats, share in self.rows()
        ]
        return header, rows

    def lengths(self) -> list[tuple[str, LengthHistogram]]:
        """(label, histogram): each arm's prompt lengths, then its output lengths (every finish); arms
        without records left out."""
        rows: list[tuple[str, LengthHistogram]] = []
        for name, stats, _ in self.rows():
            if stats.records:
                rows += [(f"{name}: prompt", stats.prompt_lengths), (f"{name}: output", stats.all_outputs())]
        return rows

    def settings(self) -> list[list[str]]:
        """(arm, column, the text most of its records carry, distinct texts) per arm with records and
        column."""
        return [
            [name, column, values.common or "-", values.distinct]
            for name, stats, _ in self.rows()
            if stats.records
            for column, values in (
                (TEMPLATE_KWARGS, stats.template_kwargs),
                (SAMPLING_PARAMS, stats.sampling_params),
            )
        ]

    def to_json(self) -> list[dict[str, Any]]:
        """One object per arm, in `rows` order; records without an arm have ``name`` null."""
        return [
            {"name": None if name == NO_ARM else name, **stats.to_json(share)}
            for name, stats, share in self.rows()
        ]
