"""Committed records, for `datagen.records.storage`: a shard is committed by writing its Parquet
object, then its commit object; readers trust commit objects only, and only those of the job's current
incarnation (the manifest's), in commit order.

Objects are written whole, never appended to or renamed, so the same code serves an object store.
Records are therefore never half-visible, and a crash between the two steps leaves an orphan shard
that readers ignore. On a local directory each object is written to a temporary file, fsynced and
renamed into place (`datagen.records.files`).

A commit object seals its shard (`datagen.records.shards`): readers hold the bytes they read to its size
and sha256, and the footer to its row count, before decoding a row, and name a shard that differs
(`CorruptShardError`): storage is not trusted blindly, since a changed byte that still decodes would
export other tokens. Commit objects written before seals existed stay readable, row count checked.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from datagen.errors import CorruptShardError
from datagen.records.layout import SHARD_PATTERN, translated
from datagen.records.manifests import JobManifests
from datagen.records.shards import (
    RECORDS,
    byte_mismatch,
    is_sealed,
    open_parquet,
    parquet_bytes,
    row_mismatch,
    seal,
)

__all__ = ["CommittedShards"]


class CommittedShards(JobManifests):
    def commit_shard(self, job_id: str, shard: str, table: pa.Table, info: dict[str, Any]) -> str:
        """Write the shard, then its commit object, which seals it (the size, sha256 and row count
        of the bytes written); returns where the shard is."""
        if not SHARD_PATTERN.match(shard):
            raise ValueError(f"bad shard name {shard!r}")
        records_path = self._path(job_id, "records", f"{shard}.parquet")
        commit_path = self._path(job_id, "commits", f"{shard}.json")
        with translated(f"cannot commit shard {shard} of job {job_id} under {self.url(job_id)}"):
            shard_data = parquet_bytes(table)
            body = dict(
                info, shard=shard, path=f"records/{shard}.parquet", **seal(shard_data, table.num_rows)
            )
            data = json.dumps(body, sort_keys=True).encode("utf-8")
            self._files.write(records_path, lambda fh: fh.write(memoryview(shard_data)))
            self._files.write(commit_path, lambda fh: fh.write(data))
        return self._files.display(records_path)

    def remove_shard(self, job_id: str, shard: str) -> None:
        """Best effort: take back a shard written for a job that was deleted meanwhile (its commit
        object first, so it is never seen without its records)."""
        if not SHARD_PATTERN.match(shard):
            raise ValueError(f"bad shard name {shard!r}")
        self._files.remove(self._path(job_id, "commits", f"{shard}.json"))
        self._files.remove(self._path(job_id, "records", f"{shard}.parquet"))

    def list_commits(self, job_id: str) -> list[dict[str, Any]]:
        """The commits of the job's current incarnation (the manifest's), in commit order (their
        ``committed_at_ms``, then shard name): a shard that a worker
        committed for an earlier job of the same id, after it was deleted, is not the job's data.
        Commits made before incarnations existed (no ``incarnation`` on either side) all count, and
        so do all commits where no manifest is stored."""
        directory = self._path(job_id, "commits")
        where = self._files.display(directory)
        with translated(f"cannot read the commit objects under {where}"):
            names = self._files.list_names(directory, ".json")
            bodies = self._files.read_many([posixpath.join(directory, n) for n in names])
            commits = self._in_commit_order([json.loads(body) for body in bodies])
        if not commits:
            return []
        manifest = self.read_manifest(job_id)
        if manifest is None:
            return commits  # no job made it (a test's or a tool's shards): nothing to tell apart
        current = str(manifest.get("incarnation", ""))
        return [c for c in commits if str(c.get("incarnation", "")) == current]

    @staticmethod
    def _in_commit_order(commits: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Shard names start with a random worker tag, so their order says nothing about time.
        return sorted(commits, key=lambda c: (int(c.get("committed_at_ms") or 0), str(c.get("shard", ""))))

    def _shard_path(self, job_id: str, commit: dict[str, Any]) -> str:
        return self._path(job_id, *str(commit["path"]).split("/"))

    def read_shard(self, job_id: str, commit: dict[str, Any]) -> pq.ParquetFile:
        """A committed shard, held to its commit object before any row is decoded: its bytes to the
        seal (size, sha256), its footer's row count to the commit's. Raises `CorruptShardError`
        naming the shard and what differs; `StorageError` when the store cannot be read."""
        path = self._shard_path(job_id, commit)
        where = self._files.display(path)
        with translated(f"cannot read committed shard {where}"):
            try:
                data = self._files.read_bytes(path)
            except FileNotFoundError as exc:
                raise self._corrupt(job_id, commit, "is missing, though its commit object names it") from exc
        self._hold(job_id, commit, byte_mismatch(commit, data))
        try:
            parquet = open_parquet(data)
        except Exception as exc:  # whatever pyarrow makes of damaged bytes
            raise self._corrupt(job_id, commit, f"is not readable Parquet ({exc})") from exc
        self._hold(job_id, commit, row_mismatch(commit, parquet.metadata.num_rows))
        return parquet

    def check_shard(self, job_id: str, commit: dict[str, Any]) -> int:
        """Hold one committed shard to its commit object and decode all of it (`datagen verify`);
        returns its rows. Raises as `read_shard` does."""
        parquet = self.read_shard(job_id, commit)
        rows = sum(batch.num_rows for batch in self._decoded(job_id, commit, parquet.iter_batches()))
        self._hold(job_id, commit, row_mismatch(commit, rows))
        return rows

    def iter_record_batches(
        self,
        job_id: str,
        batch_rows: int = 1024,
        columns: list[str] | None = None,
        *,
        on_corrupt: Callable[[CorruptShardError], None] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Committed records only, in commit order, streaming (memory stays flat but for one shard's
        bytes); ``columns`` decodes only those. Each shard is held to its commit object first
        (`read_shard`): a bad one raises `CorruptShardError`, or, with ``on_corrupt``, is handed to
        it and skipped whole (no row of it is yielded)."""
        for commit in self.list_commits(job_id):
            try:
                batches = self._shard_batches(job_id, commit, batch_rows, columns)
            except CorruptShardError as exc:
                if on_corrupt is None:
                    raise
                on_corrupt(exc)
                continue
            yield from batches

    def _shard_batches(
        self, job_id: str, commit: dict[str, Any], batch_rows: int, columns: list[str] | None
    ) -> Iterator[pa.RecordBatch]:
        if not is_sealed(commit):
            # Committed before seals existed: decoded whole first, so that a damaged one fails
            # before any row of it is used. A sealed one holds the very bytes written: it streams.
            table = self.read_shard_table(job_id, commit, columns)
            return iter(table.to_batches(max_chunksize=batch_rows))
        parquet = self.read_shard(job_id, commit)
        return self._decoded(job_id, commit, parquet.iter_batches(batch_size=batch_rows, columns=columns))

    def read_shard_table(
        self, job_id: str, commit: dict[str, Any], columns: list[str] | None = None
    ) -> pa.Table:
        """A committed shard decoded whole (``columns`` only), held to its commit object first;
        raises as `read_shard` does, a page that cannot be decoded included."""
        parquet = self.read_shard(job_id, commit)
        try:
            return parquet.read(columns=columns)
        except Exception as exc:  # a page pyarrow cannot decode, or whose CRC differs
            raise self._corrupt(job_id, commit, f"cannot be decoded ({exc})") from exc

    def _decoded(
        self, job_id: str, commit: dict[str, Any], batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        try:
            yield from batches
        except Exception as exc:  # a page pyarrow cannot decode, or whose CRC differs
            raise self._corrupt(job_id, commit, f"cannot be decoded ({exc})") from exc

    def _hold(self, job_id: str, commit: dict[str, Any], problem: str | None) -> None:
        if problem is not None:
            raise self._corrupt(job_id, commit, problem)

    def _corrupt(self, job_id: str, commit: dict[str, Any], problem: str) -> CorruptShardError:
        where = self._files.display(self._shard_path(job_id, commit))
        return CorruptShardError(
            f"job {job_id}: committed shard {where} {problem}; run `datagen verify {job_id}` to list "
            "every bad shard, or export the rest with --skip-unreadable",
            path=where,
            problem=problem,
            records=int(commit.get(RECORDS) or 0),
        )

    def iter_shard_metadata(self, job_id: str) -> Iterator[pq.FileMetaData]:
        """The Parquet footer of each committed shard, in commit order, for estimates (the shuffle's
        bucket count), unchecked. A shard whose footer cannot be read is left out here: reading its
        records (`read_shard`) is what names it, or skips it."""
        for commit in self.list_commits(job_id):
            try:
                with self._files.open_parquet(self._shard_path(job_id, commit)) as fh:
                    metadata = pq.read_metadata(fh)
            except Exception:  # a damaged footer raises ArrowInvalid, OSError or UnicodeDecodeError
                continue
            yield metadata
