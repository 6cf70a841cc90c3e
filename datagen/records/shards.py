"""What a commit object says about its shard, for `datagen.records.commits`: the shard's Parquet bytes,
built in memory, and the seal that holds them to their commit object.

A commit object carries its shard's ``size_bytes`` and ``sha256`` (of the bytes written) and
``records`` (its row count). Readers compare the bytes they read with the seal before decoding a
row: Parquet's own checks (page CRCs, the footer's structure) miss many single-byte changes, and a
change that still decodes would export different tokens without a word. Commit objects written
before seals existed carry only ``records``: their row count is checked, nothing more can be.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "PARQUET_COMPRESSION",
    "RECORDS",
    "SHA256",
    "SIZE_BYTES",
    "byte_mismatch",
    "is_sealed",
    "open_parquet",
    "parquet_bytes",
    "row_mismatch",
    "seal",
]

PARQUET_COMPRESSION = "zstd"
# The commit object's fields about its shard.
RECORDS = "records"
SIZE_BYTES = "size_bytes"
SHA256 = "sha256"


def parquet_bytes(table: pa.Table) -> pa.Buffer:
    """The shard as it is stored; built in memory so that its seal is of exactly these bytes."""
    sink = pa.BufferOutputStream()
    # Page CRCs let pyarrow name a damaged page itself, also for a reader that skips our seal.
    pq.write_table(table, sink, compression=PARQUET_COMPRESSION, write_page_checksum=True)
    return sink.getvalue()


def seal(data: pa.Buffer | bytes, records: int) -> dict[str, Any]:
    """The commit object's fields that hold ``data`` (the shard's bytes) to it."""
    return {SIZE_BYTES: len(data), SHA256: hashlib.sha256(data).hexdigest(), RECORDS: records}


def is_sealed(commit: Mapping[str, Any]) -> bool:
    """Whether the commit object names its shard's checksum (not one written before checksums)."""
    return isinstance(commit.get(SHA256), str)


def byte_mismatch(commit: Mapping[str, Any], data: bytes) -> str | None:
    """What differs between a shard's bytes and its commit object's seal; None when they agree or
    the commit has no seal. The size first: a truncated file says so, not only "another hash"."""
    if not is_sealed(commit):
        return None
    size = commit.get(SIZE_BYTES)
    if isinstance(size, int) and size != len(data):
        return f"is {len(data)} bytes but its commit says {size}: the file changed after it was committed"
    digest = hashlib.sha256(data).hexdigest()
    if digest != commit[SHA256]:
        return (
            f"has sha256 {digest} but its commit says {commit[SHA256]}: the file changed after it "
            "was committed"
        )
    return None


def row_mismatch(commit: Mapping[str, Any], rows: int) -> str | None:
    """What differs between a shard's row count and its commit object's; None when they agree (or
    the commit does not say)."""
    expected = commit.get(RECORDS)
    if isinstance(expected, int) and expected != rows:
        return f"holds {rows} rows but its commit says {expected}"
    return None


def open_parquet(data: bytes) -> pq.ParquetFile:
    """A shard's bytes as a Parquet file, checking page CRCs where the writer stored them."""
    return pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
