"""Who a dataset row is: a second row with the same id and other content is rejected, not silently
dropped (ids compare as text, so ``5`` and ``"5"`` are one id). An exact repeat is fine: its prompts
are skipped as already enqueued.

A row with the id and content of an earlier row is a *repeat* (`repeated_lines`; within an upload
or a resubmission): its prompts are skipped as already enqueued, and content deduplication
(`datagen.hygiene.screen`) leaves it alone. Only the same content under another id is a duplicate.

Each job remembers, per sample id, ``<content digest>:<line>:<upload>`` of the row that used it first
(`JobStore.first_rows` / `remember_rows`), across every upload to the job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from datagen.control.keys import prompt_key
from datagen.prompts.dataset import Prompt

__all__ = ["RowId", "check_row_ids", "repeated_lines", "row_id"]

DIGEST_CHARS = 16
UPLOAD_TAG_CHARS = 8


@dataclass(frozen=True)
class RowId:
    sample_key: str
    sample_id: str
    digest: str


def row_id(item: Prompt) -> RowId:
    """The row's sample key and a digest of its content (the whole row as parsed)."""
    try:
        content = json.dumps(item.original, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        content = repr(item.original)
    digest = hashlib.sha1(content.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]
    sample_key = prompt_key(item.sample_id, 0, 0).split(":", 1)[0]
    return RowId(sample_key, item.sample_id, digest)


def check_row_ids(
    ids: Mapping[int, RowId], stored: Mapping[str, str], *, upload: str
) -> tuple[dict[str, str], dict[int, str]]:
    """Rows (by line) against what earlier chunks stored and each other: returns the entries to store
    for ids used here first, and the refused lines with their reasons."""
    first = dict(stored)
    tag = upload[:UPLOAD_TAG_CHARS]
    new: dict[str, str] = {}
    refused: dict[int, str] = {}
    for line in sorted(ids):
        row = ids[line]
        entry = first.get(row.sample_key)
        if entry is None:
            first[row.sample_key] = new[row.sample_key] = f"{row.digest}:{line}:{tag}"
            continue
        digest, _, rest = entry.partition(":")
        if digest == row.digest:
            continue
        then_line, _, then_upload = rest.partition(":")
        where = f"line {then_line}" + ("" if then_upload == tag else " of an earlier upload")
        refused[line] = (
            f"id {row.sample_id!r} is already used by {where} with other content (ids compare as "
            'text: 5 and "5" are one id); give each row its own id'
        )
    return new, refused


def repeated_lines(ids: Mapping[int, RowId], stored: Mapping[str, str]) -> set[int]:
    """Lines that repeat, id and content, the row that used their id first (stored by an earlier
    chunk or upload, or an earlier line of this chunk)."""
    first = {key: entry.partition(":")[0] for key, entry in stored.items()}
    repeats = set()
    for line in sorted(ids):
        row = ids[line]
        if row.sample_key not in first:
            first[row.sample_key] = row.digest
        elif first[row.sample_key] == row.digest:
            repeats.add(line)
    return repeats
