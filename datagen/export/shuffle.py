"""A deterministic, bounded-memory shuffle: a two-pass bucket shuffle through temporary files.

Pass 1 sends every row to one of B buckets drawn uniformly at random (Arrow IPC files in a
temporary directory next to the output). Pass 2 reads the buckets one at a time, permutes each in
memory and emits it in batches. Random bucket assignment plus a uniform permutation inside each
bucket is a uniform permutation of the whole export, with one bucket in memory at a time.

B is chosen so that a bucket holds about ``SHUFFLE_BUCKET_BYTES`` of records in Arrow form
(estimated from the shards' Parquet metadata: the token count of the id column plus a per-row
allowance), capped at ``MAX_SHUFFLE_BUCKETS`` open files; past 16 GiB of records the buckets grow
instead. Peak memory is about one bucket on the heap, plus its memory-mapped file in the page
cache. Temporary disk use is about the size of the exported columns in Arrow form. The same seed
over the same committed shards gives the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from datagen.records.reader import BATCH_ROWS
from datagen.records.storage import Storage

__all__ = ["MAX_SHUFFLE_BUCKETS", "SHUFFLE_BUCKET_BYTES", "bucket_count", "shuffled_batches"]

SHUFFLE_BUCKET_BYTES = 64 * 1024 * 1024
MAX_SHUFFLE_BUCKETS = 256
IDS_COLUMN = "input_ids"
TOKEN_ID_BYTES = 4
ROW_BYTES = 256  # ids, partition, sampling params and offsets of one row, generously


def _estimated_bytes(metadata: pq.FileMetaData) -> int:
    """Arrow bytes of a shard's exported columns: 4 per token id (``num_values`` of the id column)
    plus ``ROW_BYTES`` per row for the other columns. Parquet's own sizes are of encoded pages,
    several times smaller than the ids in memory."""
    total = 0
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        total += group.num_rows * ROW_BYTES
        for j in range(group.num_columns):
            column = group.column(j)
            if column.path_in_schema.startswith(f"{IDS_COLUMN}."):
                total += column.num_values * TOKEN_ID_BYTES
    return total


def _estimated_or_zero(metadata: pq.FileMetaData) -> int:
    try:
        return _estimated_bytes(metadata)
    except Exception:  # a damaged footer (read unchecked); reading the shard's records names it
        return 0


def bucket_count(storage: Storage, job_id: str, bucket_bytes: int = SHUFFLE_BUCKET_BYTES) -> int:
    total = sum(_estimated_or_zero(metadata) for metadata in storage.iter_shard_metadata(job_id))
    return max(1, min(MAX_SHUFFLE_BUCKETS, math.ceil(total / bucket_bytes)))


def _scatter(
    batches: Iterable[pa.RecordBatch], rng: np.random.Generator, buckets: int, tmp_dir: Path
) -> list[Path]:
    writers: dict[int, ipc.RecordBatchFileWriter] = {}
    paths = [tmp_dir / f"bucket-{b:05d}.arrow" for b in range(buckets)]
    try:
        for batch in batches:
            assignment = rng.integers(0, buckets, batch.num_rows)
            order = np.argsort(assignment, kind="stable")
            bounds = np.concatenate([[0], np.cumsum(np.bincount(assignment, minlength=buckets))])
            grouped = batch.take(pa.array(order))
            for b in map(int, np.flatnonzero(np.diff(bounds))):
                if b not in writers:
                    writers[b] = ipc.new_file(str(paths[b]), batch.schema)
                writers[b].write_batch(grouped.slice(bounds[b], bounds[b + 1] - bounds[b]))
    finally:
        for writer in writers.values():
            writer.close()
    return [paths[b] for b in sorted(writers)]


def shuffled_batches(
    batches: Iterable[pa.RecordBatch], *, seed: int, buckets: int, tmp_dir: Path
) -> Iterator[pa.RecordBatch]:
    """``batches`` in a random order fixed by ``seed``; ``tmp_dir`` must exist and is left empty."""
    rng = np.random.default_rng(seed)
    for path in _scatter(batches, rng, buckets, tmp_dir):
        with pa.memory_map(str(path)) as source:
            # One copy of the bucket on the heap (the mapped file pages are clean page cache);
            # each output batch is a small take from it.
            table = ipc.open_file(source).read_all().combine_chunks()
        order = rng.permutation(table.num_rows)
        for start in range(0, table.num_rows, BATCH_ROWS):
            yield from table.take(pa.array(order[start : start + BATCH_ROWS])).to_batches()
        del table
        path.unlink()
