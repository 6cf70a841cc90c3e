"""Evaluation hygiene at ingestion: benchmark decontamination, then content deduplication.

One :class:`Hygiene` per ingestion (and per dry run) judges the rows of a chunk, in line order,
after every other check has passed (a row rejected for another reason is neither a duplicate nor
seen). A contaminated row is rejected (``contaminated: <set> <item id>``) and not seen; a row whose
prompt a kept row already had is rejected (``duplicate of line N``, "of an earlier upload" when
that row came in another upload to the job); every other row is kept and seen from then on.

:meth:`Hygiene.judge` decides; the caller commits the chunk and then calls :meth:`Hygiene.keep`,
so a chunk whose transaction did not land is not seen either.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from datagen.errors import InvalidSpecError
from datagen.hygiene.benchmark_sets import BenchmarkSet, check_sets, sets_sha256
from datagen.hygiene.decontam import BenchmarkIndex, Contamination, index_of
from datagen.hygiene.dedup import (
    NearParams,
    SeenIndex,
    exact_digest,
    near_bands,
    near_params,
    pack_records,
)
from datagen.spec import JobSpec
from datagen.states import DedupMode

__all__ = ["Hygiene", "HygieneRow", "Verdicts", "check_benchmarks", "upload_tag"]

# Text of each side of an example shown in the dry run.
EXAMPLE_CHARS = 200


def check_benchmarks(spec: JobSpec) -> list[BenchmarkSet]:
    """The spec's decontamination sets, checked (limits, sha256) and parsed now, so that a bad set
    is refused before a submit is accepted; the index stays cached for the ingestion and dry runs
    (`datagen.hygiene.decontam.index_of`)."""
    sets = check_sets(spec.decontaminate)
    if sets:
        index_of(sets, spec.decontaminate_n)
    return sets


def upload_tag(upload: str) -> int:
    """A 32-bit tag of an upload's name, to tell "of an earlier upload" apart."""
    return zlib.crc32(upload.encode("utf-8"))


@dataclass(frozen=True)
class HygieneRow:
    """One row to judge: its prompt as rendered (messages and tools) and its user turns."""

    line: int
    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]] | None

    @property
    def user_turns(self) -> list[str]:
        return [str(m.get("content") or "") for m in self.messages if m.get("role") == "user"]

    def preview(self) -> str:
        return " / ".join(self.user_turns)[:EXAMPLE_CHARS]


@dataclass
class Verdicts:
    """A chunk's rejections (line -> rejected-row fields) and the rows it keeps."""

    rejected: dict[int, dict[str, Any]] = field(default_factory=dict)
    kept: list[tuple[int, int, list[int] | None]] = field(default_factory=list)
    upload_tag: int = 0

    def record_bytes(self, bands: int) -> bytes:
        return pack_records(self.upload_tag, self.kept, bands) if self.kept else b""


class Hygiene:
    def __init__(self, dedup: DedupMode, threshold: float, benchmarks: BenchmarkIndex | None = None) -> None:
        self.dedup = dedup
        self.near: NearParams | None = near_params(threshold) if dedup is DedupMode.NEAR else None
        self.bands = self.near.bands if self.near is not None else 0
        self.seen = SeenIndex(self.bands)
        self.benchmarks = benchmarks

    @classmethod
    def for_spec(cls, spec: JobSpec, *, pinned_sha256: str | None = None) -> Hygiene:
        """From a job spec's ``dedup``, ``dedup_threshold``, ``decontaminate`` and ``decontaminate_n``
        (the sets are hashed again, and parsed only if their content is not cached).
        ``pinned_sha256``: the sets' digest in the job's manifest; other content now is refused
        (`InvalidSpecError`), since it would judge the job's later rows by other sets."""
        if spec.features is not None and spec.features.capture_only:
            # Rows of token ids: no text to judge (the spec refuses decontaminate there).
            return cls(DedupMode.OFF, spec.dedup_threshold, None)
        if not spec.decontaminate:
            return cls(spec.dedup, spec.dedup_threshold, None)
        sets = check_sets(spec.decontaminate)
        if pinned_sha256 is not None and (now := sets_sha256(sets)) != pinned_sha256:
            raise InvalidSpecError(
                f"the decontamination sets changed since the job was submitted (sha256 "
                f"{pinned_sha256[:16]}… in its manifest, {now[:16]}… now): restore them, or submit "
                "the rest under a new job id"
            )
        return cls(spec.dedup, spec.dedup_threshold, index_of(sets, spec.decontaminate_n))

    @property
    def active(self) -> bool:
        return self.dedup is not DedupMode.OFF or self.benchmarks is not None

    def judge(
        self, rows: Sequence[HygieneRow], upload: str, *, repeats: frozenset[int] = frozenset()
    ) -> Verdicts:
        """Rows of one chunk, in line order. ``repeats`` are rows the job holds already (the same
        id and content in an earlier upload): neither checked nor seen again."""
        tag = upload_tag(upload)
        verdicts = Verdicts(upload_tag=tag)
        candidates: list[HygieneRow] = []
        for row in rows:
            if row.line in repeats:
                continue
            found = self.benchmarks.match(row.user_turns) if self.benchmarks is not None else None
            if found is not None:
                verdicts.rejected[row.line] = _contaminated(found)
            else:
                candidates.append(row)
        if self.dedup is DedupMode.OFF:
            return verdicts
        self._deduplicate(candidates, tag, verdicts)
        return verdicts

    def _deduplicate(self, rows: list[HygieneRow], tag: int, verdicts: Verdicts) -> None:
        digests = [exact_digest(r.messages, r.tools) for r in rows]
        bands = (
            [near_bands(r.user_turns, self.near) for r in rows]
            if self.near is not None
            else [None] * len(rows)
        )
        exact_hits = self.seen.find_exact(digests)
        near_hits = self.seen.find_near(bands) if self.near is not None else [None] * len(rows)
        chunk_digests: dict[int, int] = {}
        chunk_bands: dict[int, int] = {}
        for row, digest, keys, exact, near in zip(rows, digests, bands, exact_hits, near_hits, strict=True):
            kept_line = chunk_digests.get(digest)
            match = "exact"
            where: tuple[int, int] | None = exact or ((kept_line, tag) if kept_line is not None else None)
            if where is None and self.near is not None:
                match = "near"
                in_chunk = min((chunk_bands[k] for k in keys or () if k in chunk_bands), default=None)
                where = near or ((in_chunk, tag) if in_chunk is not None else None)
            if where is not None:
                verdicts.rejected[row.line] = _duplicate(where, tag, match)
                continue
            chunk_digests[digest] = row.line
            for key in keys or ():
                chunk_bands.setdefault(key, row.line)
            verdicts.kept.append((digest, row.line, keys))

    def keep(self, verdicts: Verdicts) -> None:
        """The chunk landed: its kept rows are seen from now on."""
        self.seen.add(verdicts.upload_tag, verdicts.kept)


def _contaminated(found: Contamination) -> dict[str, Any]:
    return {
        "reason": found.reason,
        "hygiene": "contaminated",
        "benchmark": found.benchmark,
        "item": found.item,
        "benchmark_text": found.text,
    }


def _duplicate(where: tuple[int, int], tag: int, match: str) -> dict[str, Any]:
    line, then_tag = where
    earlier = "" if then_tag == tag else " of an earlier upload"
    return {
        "reason": f"duplicate of line {line}{earlier}",
        "hygiene": "duplicate",
        "duplicate_of": line,
        "match": match,
    }
