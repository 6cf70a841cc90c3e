"""Exports read committed records straight from storage (no Redis, no coordinator).

Records are deduplicated on (sample id, turn, gen): processing is at-least-once, so a prompt
that ran twice (a worker died after committing but before acknowledging) has two records, and
the first committed one wins.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from datagen.records import loss_mask
from datagen.storage import Storage

__all__ = ["ExportStats", "export_id", "export_specforge", "iter_unique_rows"]

_COLUMNS = ["sample_id", "turn", "gen", "input_ids", "prompt_len", "finish_type"]


@dataclass
class ExportStats:
    records: int = 0
    duplicates: int = 0
    written: int = 0
    tokens: int = 0


def export_id(sample_id: str, turn: int, gen: int) -> str:
    return sample_id if turn == 0 and gen == 0 else f"{sample_id}_t{turn}_g{gen}"


def iter_unique_rows(storage: Storage, job_id: str, stats: ExportStats) -> Iterator[dict[str, Any]]:
    seen: set[tuple[str, int, int]] = set()
    for batch in storage.iter_record_batches(job_id):
        for row in batch.select(_COLUMNS).to_pylist():
            stats.records += 1
            key = (row["sample_id"], row["turn"], row["gen"])
            if key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            yield row


def export_specforge(
    storage: Storage,
    job_id: str,
    out: TextIO,
    *,
    on_row: Callable[[int], None] | None = None,
) -> ExportStats:
    """Write ``{"id", "input_ids", "loss_mask"}`` JSONL, SpecForge's pre-tokenized input."""
    stats = ExportStats()
    for row in iter_unique_rows(storage, job_id, stats):
        ids = row["input_ids"]
        line = {
            "id": export_id(row["sample_id"], row["turn"], row["gen"]),
            "input_ids": ids,
            "loss_mask": loss_mask(len(ids), row["prompt_len"]),
        }
        out.write(json.dumps(line, separators=(",", ":")) + "\n")
        stats.written += 1
        stats.tokens += len(ids)
        if on_row is not None:
            on_row(stats.written)
    return stats


def open_output(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w", encoding="utf-8")
