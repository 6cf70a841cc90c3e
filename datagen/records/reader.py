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
  is used (`Storage.read_shard`); `verify_job` checks and decodes every shard, for `datagen verify`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa

from datagen.errors import CorruptShardError
from datagen.records.schema import loss_mask_values
from datagen.records.shards import is_sealed
from datagen.records.storage import Storage

__all__ = [
    "BATCH_ROWS",
    "RowViews",
    "SeenKeys",
    "Verification",
    "export_id",
    "export_ids",
    "iter_committed_batches",
    "key_digest",
    "list_parts",
    "total_records",
    "verify_job",
]

BATCH_ROWS = 1024
_KEY_DIGEST_BYTES = 16
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
    shards committed before checksums existed (their row count checked, their bytes not)."""

    shards: int = 0
    records: int = 0
    unsealed: int = 0
    bad: list[CorruptShardError] = field(default_factory=list)


def verify_job(
    storage: Storage, job_id: str, on_progress: Callable[[int, int], None] | None = None
) -> Verification:
    """Hold every committed shard of the job's current incarnation to its commit object and decode
    it whole (`Storage.check_shard`); ``on_progress`` gets (shards checked, shards)."""
    commits = storage.list_commits(job_id)
    result = Verification()
    for commit in commits:
        try:
            result.records += storage.check_shard(job_id, commit)
        except CorruptShardError as exc:
            result.bad.append(exc)
        else:
            if not is_sealed(commit):
                result.unsealed += 1
        result.shards += 1
        if on_progress is not None:
            on_progress(result.shards, len(commits))
    return result


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
