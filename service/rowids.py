"""Who a dataset row is: a second row with the same id and other content is rejected, not silently
dropped (ids compare as text, so ``5`` and ``"5"`` are one id). An exact repeat is fine: its prompts
are skipped as already enqueued.

A row with the id and content of an earlier row is a *repeat* (`repeated_lines`; within an upload
or a resubmission): its prompts are skipped as already enqueued, and content deduplication
(`datagen.hygiene.screen`) leaves it alone. Only the same content under another id is a duplicate.

Each job remembers, per sample id, ``<content digest>:<line>:<upload>`` of the row that used it first
(`JobStore.first_rows`; written as each chunk lands, `datagen.control.ingest_chunks`), across
every upload to the job.

A resubmission re-reads rows the job counted already (re-attaching to a job by resubmitting its
dataset): a row that repeats, id and content, a row of an *earlier upload* (`reread_lines`) counts
nothing again (neither ``rows`` nor ``skipped``); a repeat within one upload is ``skipped`` as before.
Rejected rows have no trustworthy id, so the guard remembers each by its line and the digest of the
line's bytes (`rejected_field`, `LineDigests`): the same bad line at the same place in a later upload
is not rejected (counted, reported) again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import BinaryIO

from datagen.prompts.dataset import Prompt
from datagen.states import sample_digest

__all__ = [
    "LineDigests",
    "RowId",
    "check_row_ids",
    "counted_before",
    "rejected_field",
    "repeated_lines",
    "reread_lines",
    "row_id",
    "upload_tag",
]

DIGEST_CHARS = 16
UPLOAD_TAG_CHARS = 8
# Rows guard fields of rejected rows; a sample key is hex (`datagen.states.sample_digest`), so never one.
REJECTED_FIELD_PREFIX = "rejected:"
# How many lines back `LineDigests` remembers: multi-turn `all` mode reads one line ahead.
RECENT_LINES = 8


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
    sample_key = sample_digest(item.sample_id)
    return RowId(sample_key, item.sample_id, digest)


def upload_tag(upload: str) -> str:
    """The part of an upload's name (its uuid, ``.jsonl`` removed) the rows guard stores."""
    return upload.removesuffix(".jsonl")[:UPLOAD_TAG_CHARS]


def rejected_field(line: int, line_digest: str) -> str:
    """The rows guard's field for a rejected row: its line and the digest of the line's bytes."""
    return f"{REJECTED_FIELD_PREFIX}{line}:{line_digest}"


def check_row_ids(
    ids: Mapping[int, RowId], stored: Mapping[str, str], *, upload: str
) -> tuple[dict[str, str], dict[int, str]]:
    """Rows (by line) against what earlier chunks stored and each other: returns the entries to store
    for ids used here first, and the refused lines with their reasons."""
    first = dict(stored)
    tag = upload_tag(upload)
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


def reread_lines(ids: Mapping[int, RowId], stored: Mapping[str, str], *, upload: str) -> set[int]:
    """Lines that repeat, id and content, a row an earlier upload of the job used first: rows that
    were counted when that upload was read (a resubmission re-reads them)."""
    tag = upload_tag(upload)
    reread = set()
    for line, row in ids.items():
        entry = stored.get(row.sample_key)
        if entry is None:
            continue
        digest, _, rest = entry.partition(":")
        then_upload = rest.partition(":")[2]
        if digest == row.digest and then_upload != tag:
            reread.add(line)
    return reread


def counted_before(fields: Collection[str], stored: Mapping[str, str], *, upload: str) -> set[str]:
    """The rejected rows' fields (`rejected_field`) an earlier upload of the job stored already."""
    tag = upload_tag(upload)
    return {f for f in fields if f in stored and stored[f] != tag}


class LineDigests:
    """A binary stream read by ``readline`` (as `datagen.prompts.dataset.iter_prompts` reads an
    upload) that keeps the digest of each of the last few lines' bytes, by line number (from 1)."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._line = 0
        self._hash = hashlib.sha1()
        self._pending = False
        self._recent: dict[int, str] = {}

    def readline(self, size: int = -1) -> bytes:
        piece = self._stream.readline(size)
        if piece:
            self._hash.update(piece)
            self._pending = True
        # A line ends at its newline, or where the stream ends (a short read without one).
        if self._pending and (piece.endswith(b"\n") or size < 0 or len(piece) < size):
            self._line += 1
            self._recent[self._line] = self._hash.hexdigest()[:DIGEST_CHARS]
            self._recent.pop(self._line - RECENT_LINES, None)
            self._hash, self._pending = hashlib.sha1(), False
        return piece

    def digest(self, line: int) -> str:
        """The digest of line ``line``'s bytes; '' for a line no longer (or not yet) remembered."""
        return self._recent.get(line, "")
