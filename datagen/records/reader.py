"""A job's committed records as the exports and the report read them, one batch at a time.

- Order: `iter_committed_batches` reads shards in commit order (`Storage.iter_record_batches`: each
  commit's ``committed_at_ms``, then its shard name), decoding only the columns asked for.
- Dedupe: processing is at-least-once, so a key ``(sample_id, turn, gen)`` may have been committed
  twice; the first record read wins. `SeenKeys` holds a 16-byte digest per key (`key_digest`; what a
  key costs with the set's own overhead is measured by ``bench/export.py``, see bench/README.md).
- Rows: `RowViews` gives a batch's export ids (`export_id`), token slices and loss masks
  (`datagen.records.schema.loss_mask_values`: 0 over the prompt, 1 over the output, after any clipping) as
  numpy views, without a Python list per row.
- Integrity: every shard is held to its commit object (size, sha256, row count) before a row of it
  is used (`Storage.read_shard`); `verify_job` checks and decodes every shard, for `datagen verify`,
  and holds every features file a committed record names to the record's size and sha256.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from datagen.errors import CorruptShardError
from datagen.records.layout import translated
from datagen.records.schema import FEATURE_COLUMNS, FEATURES_FILE, has_features, loss_mask_values
from datagen.records.shards import is_sealed
from datagen.records.storage import Storage

__all__ = [
    "BATCH_ROWS",
    "MAX_NAMED_FEATURE_PROBLEMS",
    "RowViews",
    "SeenKeys",
    "Verification",
    "export_id",
    "export_ids",
    "feature_sha256",
    "iter_committed_batches",
    "key_digest",
    "list_parts",
    "total_records",
    "verify_job",
]

BATCH_ROWS = 1024
# `datagen verify` names this many bad features files, then counts the rest.
MAX_NAMED_FEATURE_PROBLEMS = 20
HASH_CHUNK_BYTES = 1024 * 1024
_KEY_DIGEST_BYTES = 16
_KEY_COLUMNS = ["sample_id", "turn", "gen"]
_TURN_GEN = struct.Struct("<ii")


def total_records(storage: Storage, job_id: str) -> int:
    """Committed records of a job, duplicates included, from its commit files alone."""
    return sum(int(commit.get("records", 0)) for commit in storage.list_commits(job_id))


def iter_committed_batches(
    storage: Storage,
    job_id: str,
    columns: list[str],
    batch_rows: int = BATCH_ROWS,
    *,
    on_corrupt: Callable[[CorruptShardError], None] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Like `Storage.iter_record_batches`, but decoding only ``columns``."""
    return storage.iter_record_batches(job_id, batch_rows, columns=columns, on_corrupt=on_corrupt)


@dataclass
class Verification:
    """What `verify_job` found. ``records`` are the rows of the good shards; ``unsealed`` counts good
    shards committed before checksums existed (their row count checked, their bytes not).

    Features files: ``features`` records of the good shards name one (each checked: there, of the
    size and sha256 the record says); ``features_missing`` and ``features_bad`` are those that are
    not there or differ, the first `MAX_NAMED_FEATURE_PROBLEMS` named in ``feature_problems``;
    ``features_none`` records have none (``features_error``: capture gave up on them)."""

    shards: int = 0
    records: int = 0
    unsealed: int = 0
    bad: list[CorruptShardError] = field(default_factory=list)
    features: int = 0
    features_missing: int = 0
    features_bad: int = 0
    features_none: int = 0
    feature_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.features_missing and not self.features_bad

    def add_feature_problem(self, missing: bool, problem: str) -> None:
        if missing:
            self.features_missing += 1
        else:
            self.features_bad += 1
        if len(self.feature_problems) < MAX_NAMED_FEATURE_PROBLEMS:
            self.feature_problems.append(problem)


def verify_job(
    storage: Storage, job_id: str, on_progress: Callable[[int, int], None] | None = None
) -> Verification:
    """Hold every committed shard of the job's current incarnation to its commit object and decode
    it whole (`Storage.check_shard`), then every features file a record of a good shard names to the
    record (a job whose manifest has no ``features`` has none to check); ``on_progress`` gets
    (shards checked, shards)."""
    commits = storage.list_commits(job_id)
    manifest = storage.read_manifest(job_id) if commits else None
    check_features = manifest is None or bool((manifest.get("spec") or {}).get("features"))
    result = Verification()
    for commit in commits:
        try:
            rows = storage.check_shard(job_id, commit)
            features = _feature_rows(storage, job_id, commit) if check_features else []
        except CorruptShardError as exc:
            result.bad.append(exc)
        else:
            result.records += rows
            if not is_sealed(commit):
                result.unsealed += 1
            _verify_features(storage, job_id, features, result)
        result.shards += 1
        if on_progress is not None:
            on_progress(result.shards, len(commits))
    return result


def _feature_rows(storage: Storage, job_id: str, commit: dict[str, Any]) -> list[dict[str, Any]]:
    """The keys and features columns of one good shard's records (none for a shard written before
    features existed)."""
    parquet = storage.read_shard(job_id, commit)
    if not has_features(parquet.schema_arrow):
        return []
    rows: list[dict[str, Any]] = parquet.read(columns=[*_KEY_COLUMNS, *FEATURE_COLUMNS]).to_pylist()
    return rows


def _verify_features(storage: Storage, job_id: str, rows: list[dict[str, Any]], result: Verification) -> None:
    """Hold the features files that records name to the records' sizes and sha256s."""
    for row in rows:
        name = row[FEATURES_FILE]
        if name is None:
            result.features_none += row["features_error"] is not None
            continue
        result.features += 1
        record = f"record {export_id(row['sample_id'], row['turn'], row['gen'])}"
        where = f"features file {storage.feature_url(job_id, name)}"
        size = storage.feature_size(job_id, name)
        if size is None:
            result.add_feature_problem(True, f"{record}: {where} is missing")
        elif size != row["features_bytes"]:
            said = f"{size} bytes but the record says {row['features_bytes']}"
            result.add_feature_problem(False, f"{record}: {where} has {said}")
        elif (digest := feature_sha256(storage, job_id, name)) != row["features_sha256"]:
            said = f"sha256 {digest} but the record says {row['features_sha256']}"
            result.add_feature_problem(False, f"{record}: {where} has {said}")


def feature_sha256(storage: Storage, job_id: str, name: str) -> str:
    """The sha256 of a stored features file, read in one streaming pass."""
    where = storage.feature_url(job_id, name)
    digest = hashlib.sha256()
    with translated(f"cannot read the features file {where}"), storage.open_feature(job_id, name) as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def key_digest(sample_id: str, turn: int, gen: int) -> bytes:
    """16 bytes standing for a record key (injective input: the id's bytes, then fixed-size ints)."""
    data = sample_id.encode("utf-8") + _TURN_GEN.pack(turn, gen)
    return hashlib.blake2b(data, digest_size=_KEY_DIGEST_BYTES).digest()


class SeenKeys:
    """The record keys read so far, to keep the first record of each."""

    def __init__(self) -> None:
        self._digests: set[bytes] = set()

    def first(self, sample_id: str, turn: int, gen: int) -> bool:
        """Whether this is the first record of its key; the key counts as seen from now on."""
        digest = key_digest(sample_id, turn, gen)
        if digest in self._digests:
            return False
        self._digests.add(digest)
        return True

    def __len__(self) -> int:
        return len(self._digests)


def export_id(sample_id: str, turn: int, gen: int) -> str:
    return sample_id if turn == 0 and gen == 0 else f"{sample_id}_t{turn}_g{gen}"


def export_ids(batch: pa.RecordBatch) -> list[str]:
    columns = (batch.column(c).to_pylist() for c in ("sample_id", "turn", "gen"))
    return [export_id(*key) for key in zip(*columns, strict=True)]


def list_parts(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list array's flat values and offsets into them (row i is values[offsets[i]:offsets[i+1]])."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    return array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()


class RowViews:
    """The per-row views of a batch (columns ``sample_id``, ``turn``, ``gen``, ``input_ids``,
    ``prompt_len``): ids, masks and prompt and output slices as numpy views."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.values, self.offsets = list_parts(batch.column("input_ids"))
        self.prompt_lens = batch.column("prompt_len").to_numpy()
        self.ids = export_ids(batch)

    @cached_property
    def mask(self) -> np.ndarray:
        return loss_mask_values(self.offsets, self.prompt_lens)

    def __len__(self) -> int:
        return len(self.ids)

    def input_ids(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def loss_mask(self, i: int) -> np.ndarray:
        base = self.offsets[0]
        return self.mask[self.offsets[i] - base : self.offsets[i + 1] - base]

    def output(self, i: int) -> np.ndarray:
        return self.values[
            min(self.offsets[i] + int(self.prompt_lens[i]), self.offsets[i + 1]) : self.offsets[i + 1]
        ]

    def prompt(self, i: int) -> np.ndarray:
        return self.values[
            self.offsets[i] : min(self.offsets[i] + int(self.prompt_lens[i]), self.offsets[i + 1])
        ]
