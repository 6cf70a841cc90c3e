"""Content deduplication of dataset rows: exact (normalized prompt text) and near (MinHash LSH).

``exact``
    A 64-bit BLAKE2b digest of the row's prompt as the template sees it (every message's role and
    text, and the tools), each text normalized by Unicode NFKC, case folding and collapsed
    whitespace. The template is the same for every row of a job, so equal digests mean equal
    rendered prompts up to case and spacing.
``near``
    MinHash (``rensa``'s ``RMinHash``, Rust) of the word shingles of the user turns (normalized
    as for ``exact`` plus punctuation removed), cut into ``bands`` bands of ``rows`` values; two
    rows whose signatures agree on a whole band are near-duplicates. The band layout follows the
    threshold (`near_params`). Exact duplicates are caught first, by their digest.

Both kinds look up an in-process :class:`SeenIndex`: sorted runs of 64-bit keys (the exact digest,
and one key per band) in numpy arrays, merged as they grow (a log-structured merge), so a row
costs ``12 + 12 x bands`` bytes of coordinator memory and a lookup is a few binary searches. The
library's own LSH index (``RMinHashLSH``) keeps the signatures too, many times these bytes a row
(bench/README.md), which is why only the signature comes from it.

What a job has seen persists in Redis as packed records (:func:`pack_records`): 12 bytes a row
for ``exact``, ``12 + 8 x bands`` for ``near``, appended in each chunk's transaction and read back
into a :class:`SeenIndex` whenever ingestion (re)starts.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rensa import RMinHash

__all__ = [
    "NearParams",
    "SeenIndex",
    "exact_digest",
    "near_bands",
    "near_params",
    "normalize_text",
    "normalize_words",
    "pack_records",
    "record_dtype",
]


SHINGLE_WORDS = 2
NUM_PERM = 128
MINHASH_SEED = 20251201
# Runs of the index merge while the newer one is at least this fraction of the older one.
_MERGE_RATIO = 0.5
_NON_WORD = re.compile(r"[\W_]+")
# Odd 64-bit constants of the band-key fold (splitmix64's).
_BAND_SALT = np.uint64(0x9E3779B97F4A7C15)
_BAND_MIX = np.uint64(0xBF58476D1CE4E5B9)
_SHIFT = np.uint64(31)
# The record header carries the upload a run of records came from; a real digest is never 0.
_HEADER_DIGEST = 0


def normalize_text(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed to single spaces."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def normalize_words(text: str) -> list[str]:
    """:func:`normalize_text`'s words with punctuation and symbols removed."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).split()


def _u64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def exact_digest(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
    """The row's prompt (roles, normalized texts, tools) as a nonzero 64-bit digest."""
    parts = [f"{m.get('role', '')}\x1f{normalize_text(str(m.get('content') or ''))}" for m in messages]
    if tools:
        parts.append(normalize_text(repr(sorted(repr(t) for t in tools))))
    return _u64("\x1e".join(parts).encode("utf-8", "surrogatepass")) or 1


@dataclass(frozen=True)
class NearParams:
    bands: int
    rows: int

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def near_params(threshold: float) -> NearParams:
    """Bands x rows of ``NUM_PERM`` signature values whose LSH threshold ``(1/b)^(1/r)`` lies
    closest to ``threshold`` (ties: fewer bands, less memory)."""
    best: tuple[float, int, int] | None = None
    for rows in range(1, NUM_PERM + 1):
        bands = NUM_PERM // rows
        error = abs((1 / bands) ** (1 / rows) - threshold)
        if best is None or (error, bands) < (best[0], best[1]):
            best = (error, bands, rows)
    assert best is not None
    return NearParams(bands=best[1], rows=best[2])


def near_bands(user_turns: Iterable[str], params: NearParams) -> list[int] | None:
    """One 64-bit key per band of the MinHash of the user turns' word shingles (None: no words)."""
    shingles: list[str] = []
    for turn in user_turns:
        words = normalize_words(turn)
        if len(words) < SHINGLE_WORDS:
            shingles.extend(words)
        else:
            shingles.extend(
                " ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)
            )
    if not shingles:
        return None
    minhash = RMinHash(num_perm=params.num_perm, seed=MINHASH_SEED)
    minhash.update(shingles)
    signature = np.asarray(minhash.digest(), dtype=np.uint64).reshape(params.bands, params.rows)
    # Each band's values folded into one 64-bit key, salted by the band's number (array arithmetic
    # wraps modulo 2**64 without warnings).
    keys = np.arange(1, params.bands + 1, dtype=np.uint64) * _BAND_SALT
    for column in signature.T:
        keys = (keys ^ column) * _BAND_MIX
        keys ^= keys >> _SHIFT
    return [int(k) or 1 for k in keys]


def record_dtype(bands: int) -> np.dtype[Any]:
    """One seen row: its digest and line (and its band keys for ``near``); a header record
    (digest 0) gives the upload tag of the records after it in ``line``."""
    fields: list[Any] = [("digest", "<u8"), ("line", "<u4")]
    if bands:
        fields.append(("bands", "<u8", (bands,)))
    return np.dtype(fields)


def pack_records(upload_tag: int, rows: Sequence[tuple[int, int, Sequence[int] | None]], bands: int) -> bytes:
    """``(digest, line, band keys)`` of kept rows, after a header naming their upload."""
    out = np.zeros(len(rows) + 1, dtype=record_dtype(bands))
    out[0]["line"] = upload_tag
    for i, (digest, line, keys) in enumerate(rows, start=1):
        out[i]["digest"] = digest
        out[i]["line"] = line
        if bands and keys is not None:
            out[i]["bands"] = keys
    return out.tobytes()


class _U64Map:
    """64-bit keys → the first value stored for each, as sorted runs merged as they grow."""

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        if not keys.size:
            return
        order = np.argsort(keys, kind="stable")
        self._runs.append((keys[order], values[order]))
        while len(self._runs) > 1 and len(self._runs[-1][0]) >= _MERGE_RATIO * len(self._runs[-2][0]):
            newer, older = self._runs.pop(), self._runs.pop()
            # Insert the newer run into the older one (after equal keys: the older value wins),
            # without the temporaries of a full sort.
            at = np.searchsorted(older[0], newer[0], side="right")
            self._runs.append((np.insert(older[0], at, newer[0]), np.insert(older[1], at, newer[1])))

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key (-1 where absent); the oldest run wins."""
        found = np.full(keys.shape, -1, dtype=np.int64)
        for run_keys, run_values in self._runs:
            missing = found < 0
            if not missing.any():
                break
            wanted = keys[missing]
            at = np.searchsorted(run_keys, wanted)
            at_clipped = np.minimum(at, len(run_keys) - 1)
            hit = run_keys[at_clipped] == wanted
            values = np.where(hit, run_values[at_clipped].astype(np.int64), -1)
            found[missing] = values
        return found

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._runs)


class SeenIndex:
    """The rows a job kept: exact digests and near band keys → (line, upload tag)."""

    def __init__(self, bands: int = 0) -> None:
        self.bands = bands
        self._lines = array("I")
        self._tags = array("I")
        self._digests = _U64Map()
        self._band_keys = _U64Map()

    def __len__(self) -> int:
        return len(self._lines)

    def load(self, blob: bytes) -> None:
        """Records as :func:`pack_records` wrote them (any number of packs, concatenated)."""
        records = np.frombuffer(blob, dtype=record_dtype(self.bands))
        if not records.size:
            return
        header = records["digest"] == _HEADER_DIGEST
        # Each record's upload tag is the line field of the last header before it.
        last_header = np.maximum.accumulate(np.where(header, np.arange(records.size), 0))
        tags = records["line"][last_header]
        keep = ~header
        self._add(
            records["digest"][keep],
            records["line"][keep],
            tags[keep],
            records["bands"][keep] if self.bands else None,
        )

    def add(self, upload_tag: int, rows: Sequence[tuple[int, int, Sequence[int] | None]]) -> None:
        if not rows:
            return
        digests = np.array([r[0] for r in rows], dtype=np.uint64)
        lines = np.array([r[1] for r in rows], dtype=np.uint32)
        tags = np.full(len(rows), upload_tag, dtype=np.uint32)
        keys = None
        if self.bands:
            keys = np.array([r[2] or [0] * self.bands for r in rows], dtype=np.uint64)
        self._add(digests, lines, tags, keys)

    def _add(self, digests: np.ndarray, lines: np.ndarray, tags: np.ndarray, keys: np.ndarray | None) -> None:
        start = len(self._lines)
        ordinals = np.arange(start, start + digests.size, dtype=np.uint32)
        self._lines.frombytes(lines.astype("=u4").tobytes())
        self._tags.frombytes(tags.astype("=u4").tobytes())
        self._digests.add(digests.astype(np.uint64), ordinals)
        if keys is not None:
            flat = keys.reshape(-1)
            present = flat != 0  # rows without words have no band keys
            self._band_keys.add(flat[present], np.repeat(ordinals, self.bands)[present])

    def find_exact(self, digests: Sequence[int]) -> list[tuple[int, int] | None]:
        """``(line, upload tag)`` of the kept row with each digest, or None."""
        found = self._digests.lookup(np.array(digests, dtype=np.uint64))
        return [self._where(int(o)) for o in found]

    def find_near(self, bands: Sequence[Sequence[int] | None]) -> list[tuple[int, int] | None]:
        """``(line, upload tag)`` of a kept row sharing a band with each row, or None."""
        if not self.bands or not bands:
            return [None] * len(bands)
        keys = np.array([b or [0] * self.bands for b in bands], dtype=np.uint64).reshape(-1)
        found = self._band_keys.lookup(keys).reshape(len(bands), self.bands)
        found = np.where(keys.reshape(len(bands), self.bands) == 0, -1, found)
        firsts = np.where(found >= 0, found, np.iinfo(np.int64).max).min(axis=1)
        return [self._where(int(o)) if o != np.iinfo(np.int64).max else None for o in firsts]

    def _where(self, ordinal: int) -> tuple[int, int] | None:
        return None if ordinal < 0 else (self._lines[ordinal], self._tags[ordinal])

    def nbytes(self) -> int:
        """Bytes the index holds in arrays (its memory, less small fixed overheads)."""
        arrays = len(self._lines) * self._lines.itemsize + len(self._tags) * self._tags.itemsize
        return arrays + self._digests.nbytes() + self._band_keys.nbytes()
