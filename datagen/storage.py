"""Job storage on a local directory (a mounted volume on multi-node setups).

Layout (CONVENTIONS.md)::

    jobs/<job>/input/<upload>.jsonl     the dataset as uploaded
    jobs/<job>/manifest.json            provenance, written once
    jobs/<job>/records/<shard>.parquet  committed records
    jobs/<job>/commits/<shard>.json     one per committed shard; a shard without it is not data
    jobs/<job>/rejected.jsonl           rows that could not become prompts

A shard is committed by writing a temporary file, fsyncing it, renaming it into place, and only
then writing its commit file the same way; readers trust commit files only. Records are
therefore never half-visible, and a crash between the two steps leaves an orphan shard that
readers ignore.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from datagen.errors import InvalidSpecError, StorageError

__all__ = ["JOB_ID_PATTERN", "Storage", "validate_job_id"]

JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_SHARD_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
PARQUET_COMPRESSION = "zstd"


def validate_job_id(job_id: str) -> str:
    if not JOB_ID_PATTERN.match(job_id):
        raise InvalidSpecError(
            f"invalid job id {job_id!r}: use 1-64 letters, digits or underscores "
            "(it becomes a path and a Redis key)"
        )
    return job_id


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Storage:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / validate_job_id(job_id)

    def input_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "input"

    def new_input_path(self, job_id: str) -> Path:
        directory = self.input_dir(job_id)
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"{uuid.uuid4().hex}.jsonl"

    def rejected_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "rejected.jsonl"

    # Manifest -----------------------------------------------------------------------------------
    def write_manifest_once(self, job_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest unless one exists; return the one in force."""
        path = self.job_dir(job_id) / "manifest.json"
        existing = self.read_manifest(job_id)
        if existing is not None:
            return existing
        self._atomic_write(path, json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8"))
        return manifest

    def read_manifest(self, job_id: str) -> dict[str, Any] | None:
        path = self.job_dir(job_id) / "manifest.json"
        try:
            return json.loads(path.read_text("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read manifest {path}: {exc}") from exc

    # Shards -------------------------------------------------------------------------------------
    def commit_shard(self, job_id: str, shard: str, table: pa.Table, info: dict[str, Any]) -> Path:
        if not _SHARD_PATTERN.match(shard):
            raise ValueError(f"bad shard name {shard!r}")
        job_dir = self.job_dir(job_id)
        records_path = job_dir / "records" / f"{shard}.parquet"
        commit_path = job_dir / "commits" / f"{shard}.json"
        try:
            records_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = records_path.with_suffix(".parquet.tmp")
            pq.write_table(table, tmp, compression=PARQUET_COMPRESSION)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, records_path)
            _fsync_dir(records_path.parent)
            body = dict(info, shard=shard, records=table.num_rows, path=f"records/{shard}.parquet")
            self._atomic_write(commit_path, json.dumps(body, sort_keys=True).encode("utf-8"))
        except OSError as exc:
            raise StorageError(f"cannot commit shard {shard} of job {job_id} under {job_dir}: {exc}") from exc
        return records_path

    def list_commits(self, job_id: str) -> list[dict[str, Any]]:
        directory = self.job_dir(job_id) / "commits"
        if not directory.is_dir():
            return []
        commits = []
        for path in sorted(directory.glob("*.json")):
            try:
                commits.append(json.loads(path.read_text("utf-8")))
            except (OSError, ValueError) as exc:
                raise StorageError(f"cannot read commit file {path}: {exc}") from exc
        return commits

    def iter_record_batches(self, job_id: str, batch_rows: int = 1024) -> Iterator[pa.RecordBatch]:
        """Committed records only, in commit-file order, streaming (memory stays flat)."""
        job_dir = self.job_dir(job_id)
        for commit in self.list_commits(job_id):
            path = job_dir / commit["path"]
            try:
                yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
            except OSError as exc:
                raise StorageError(f"committed shard {path} is unreadable: {exc}") from exc

    def job_exists(self, job_id: str) -> bool:
        return self.job_dir(job_id).is_dir()

    # Helpers ------------------------------------------------------------------------------------
    def _atomic_write(self, path: Path, data: bytes) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc}") from exc
