"""Job storage on a local directory or any fsspec URL (``s3://bucket/prefix``; a shared volume or an
object store on multi-node setups).

Layout (one folder per job under the root)::

    datagen-namespace.json                      the Redis namespace that owns this root
    jobs/<job>/input/<upload>.jsonl             the dataset as uploaded
    jobs/<job>/manifest.json                    provenance and incarnation, written once per incarnation
    jobs/<job>/records/<shard>.parquet          committed records
    jobs/<job>/commits/<shard>.json             one per committed shard (with its incarnation and its
                                                shard's size, sha256 and row count); a shard without it
                                                is not data
    jobs/<job>/rejected/<upload>-<line>.jsonl   rows of one ingestion chunk that could not become prompts
    jobs/<job>/flagged/<upload>-<line>.jsonl    rows of one chunk accepted with a warning
    jobs/<job>/stopped/<digest>-g<gen>.jsonl    multi-turn ``all``: why a conversation stopped before
                                                its last turn (one object per sample and gen)

Objects are written whole, never appended to or renamed, so the same code serves an object store.
A shard is committed by writing its Parquet object, then its commit object; readers trust commit
objects only. Records are therefore never half-visible, and a crash between the two steps leaves
an orphan shard that readers ignore. On a local directory each object is written to a temporary
file, fsynced and renamed into place (`datagen.records.files`).

A commit object seals its shard (`datagen.records.shards`): readers hold the bytes they read to its size
and sha256, and the footer to its row count, before decoding a row, and name a shard that differs
(`CorruptShardError`): storage is not trusted blindly, since a changed byte that still decodes would
export other tokens. Commit objects written before seals existed stay readable, row count checked.

Rejected (and flagged) rows are one object per ingestion chunk, named by the upload and the chunk's first
rejected line: a resumed ingestion rewrites the same object instead of appending a second copy,
and readers merge the objects, one row per upload and line (with the ``rejected.jsonl`` that jobs
stored before this layout have).

Every stored path is built here, from validated job ids and names. An object store's credentials
and endpoint come from its library's environment (for S3: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), never from the URL, so messages cannot leak them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from datagen.errors import (
    ConfigError,
    CorruptShardError,
    DatagenError,
    ForeignFileError,
    InvalidSpecError,
    StorageError,
)
from datagen.records.belonging import ending_body, judge_ending, manifest_problem
from datagen.records.files import ObjectFiles
from datagen.records.shards import (
    RECORDS,
    byte_mismatch,
    is_sealed,
    open_parquet,
    parquet_bytes,
    row_mismatch,
    seal,
)
from datagen.states import sample_digest

__all__ = ["JOB_ID_PATTERN", "Storage", "validate_job_id"]

log = logging.getLogger(__name__)

# Matched in full: "$" alone accepts a trailing newline. No "-" or ":", the separators of our Redis
# keys and RQ ids, so one job's id can never alias another key.
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9_]{1,64}")
_SHARD_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# One path segment: no separator, and no leading dot (so never "." or "..").
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$")
INPUT_SUFFIX = ".jsonl"
LEGACY_REJECTED = "rejected.jsonl"
# At the storage root: the Redis namespace whose jobs live here.
NAMESPACE_MARKER = "datagen-namespace.json"
_LINE_DIGITS = 12


def validate_job_id(job_id: str) -> str:
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise InvalidSpecError(
            f"invalid job id {job_id[:80]!r}: use 1-64 letters, digits or underscores "
            "(it becomes a path and a Redis key)"
        )
    return job_id


def _name(part: str) -> str:
    if not _NAME_PATTERN.match(part):
        raise StorageError(f"bad stored name {part!r}")
    return part


def _upload_of(rejected_chunk: str) -> str:
    """The upload a rejected-rows object belongs to (``<upload>-<first line>.jsonl``)."""
    return rejected_chunk.rsplit("-", 1)[0]


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """Storage failures as `StorageError`: OSError locally; an object store's client (botocore,
    aiohttp) raises its own types too, so everything but our own errors is translated here."""
    try:
        yield
    except DatagenError:
        raise
    except Exception as exc:
        raise StorageError(f"{what}: {exc}") from exc


class Storage:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._files = ObjectFiles(root)
        self._refused: set[tuple[str, str]] = set()  # (path, sha256) of files refused and logged
        # What `Storage(root)` accepts again: a resolved local path, or the URL.
        self.root: str = self._files.root
        self.is_local: bool = self._files.local

    def _path(self, job_id: str, *parts: str) -> str:
        return self._files.under_root("jobs", validate_job_id(job_id), *(_name(p) for p in parts))

    def url(self, job_id: str, *parts: str) -> str:
        """Where a job (or an object of it) is, for messages and tools: a local path or a URL."""
        return self._files.display(self._path(job_id, *parts))

    def job_exists(self, job_id: str) -> bool:
        path = self._path(job_id)
        with _translated(f"cannot look for job {job_id} under {self.root}"):
            return self._files.is_dir(path)

    def delete_job(self, job_id: str) -> bool:
        """Remove everything stored for the job (inputs, records, manifest); False if nothing was."""
        with _translated(f"cannot delete job {job_id} under {self.root}"):
            return self._files.remove_tree(self._path(job_id))

    # Uploads ------------------------------------------------------------------------------------
    def write_input(self, job_id: str, blocks: Iterable[bytes]) -> str:
        """Stream ``blocks`` into a new input object; returns its name. If ``blocks`` raises, the
        error propagates and no object is left."""
        name = f"{uuid.uuid4().hex}{INPUT_SUFFIX}"
        path = self._path(job_id, "input", name)

        def write(fh: BinaryIO) -> None:
            for block in blocks:
                fh.write(block)

        with _translated(f"cannot store the upload at {self._files.display(path)}"):
            self._files.write(path, write)
        return name

    def input_names(self, job_id: str) -> list[str]:
        """The job's uploads, oldest first."""
        directory = self._path(job_id, "input")
        with _translated(f"cannot list the input of job {job_id} under {self._files.display(directory)}"):
            names = self._files.list_names(directory, INPUT_SUFFIX)
            dated = [(self._files.modified_s(posixpath.join(directory, n)), n) for n in names]
        return [n for _, n in sorted(dated)]

    def input_exists(self, job_id: str, name: str) -> bool:
        path = self._path(job_id, "input", name)
        with _translated(f"cannot look for {self._files.display(path)}"):
            return self._files.exists(path)

    def open_input(self, job_id: str, name: str, *, random_access: bool = False) -> BinaryIO:
        """An upload for reading (``readline``, ``seek``, ``tell``); ``random_access`` suits many
        seeks (small cached blocks on an object store) rather than one pass."""
        path = self._path(job_id, "input", name)
        with _translated(f"cannot open the upload {self._files.display(path)}"):
            return self._files.open_read(path, random_access=random_access)

    # Manifest -----------------------------------------------------------------------------------
    def write_manifest_once(self, job_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest unless one exists; return the one in force."""
        existing = self.read_manifest(job_id)
        if existing is not None:
            return existing
        path = self._path(job_id, "manifest.json")
        data = json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8")
        with _translated(f"cannot write {self._files.display(path)}"):
            self._files.write(path, lambda fh: fh.write(data))
        return manifest

    def write_manifest(self, job_id: str, manifest: dict[str, Any]) -> None:
        """Write the manifest of a new incarnation of the job, replacing an earlier one's (whose
        records, if any are left, then drop out of exports: they carry the old incarnation)."""
        path = self._path(job_id, "manifest.json")
        data = json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8")
        with _translated(f"cannot write {self._files.display(path)}"):
            self._files.write(path, lambda fh: fh.write(data))

    def read_manifest(self, job_id: str) -> dict[str, Any] | None:
        """The job's manifest (None: none stored). `ForeignFileError` naming the file when it is not
        the job's (it names another job: copied or planted) or not a JSON object
        (`datagen.records.belonging`): nothing is made of it, nor dropped for it."""
        path = self._path(job_id, "manifest.json")
        with _translated(f"cannot read manifest {self._files.display(path)}"):
            try:
                data = self._files.read_bytes(path)
            except FileNotFoundError:
                return None
        return self._own_manifest(job_id, path, data)

    def _own_manifest(self, job_id: str, path: str, data: bytes) -> dict[str, Any]:
        try:
            manifest = json.loads(data)
        except ValueError:  # not JSON, or not UTF-8
            manifest = None
        problem = manifest_problem(manifest, job_id)
        if problem is not None:
            raise ForeignFileError(
                f"{self._files.display(path)} {problem}: refused, not acted on (nothing of job {job_id} "
                "was rebuilt from it or dropped). Put the job's own manifest.json back, or remove the file"
            )
        assert isinstance(manifest, dict)
        return manifest

    # Shards -------------------------------------------------------------------------------------
    def commit_shard(self, job_id: str, shard: str, table: pa.Table, info: dict[str, Any]) -> str:
        """Write the shard, then its commit object, which seals it (the size, sha256 and row count
        of the bytes written); returns where the shard is."""
        if not _SHARD_PATTERN.match(shard):
            raise ValueError(f"bad shard name {shard!r}")
        records_path = self._path(job_id, "records", f"{shard}.parquet")
        commit_path = self._path(job_id, "commits", f"{shard}.json")
        with _translated(f"cannot commit shard {shard} of job {job_id} under {self.url(job_id)}"):
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
        if not _SHARD_PATTERN.match(shard):
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
        with _translated(f"cannot read the commit objects under {where}"):
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

    # What Redis may lose: which jobs exist, and how they ended --------------------------------------
    def list_jobs(self) -> list[str]:
        """Every job id with something stored (`service.rebuild` rebuilds jobs Redis lost from these),
        but those whose manifest is not theirs (:meth:`read_manifest`; one log line each): nothing is
        rebuilt from a copied or planted manifest, and no job is dropped for one."""
        directory = self._files.under_root("jobs")
        with _translated(f"cannot list the jobs under {self._files.display(directory)}"):
            names = self._files.list_names(directory, "")
            job_ids = [n for n in names if JOB_ID_PATTERN.fullmatch(n)]
            paths = [self._path(job_id, "manifest.json") for job_id in job_ids]
            manifests = self._files.read_present(paths)
        kept = []
        for job_id, path, data in zip(job_ids, paths, manifests, strict=True):
            try:
                if data is not None:
                    self._own_manifest(job_id, path, data)
            except ForeignFileError as exc:
                log.warning("job %s left alone: %s", job_id, exc)
                continue
            kept.append(job_id)
        return kept

    def write_ending(self, job_id: str, ending: str, incarnation: str) -> None:
        """Mark the incarnation ``ending`` (``deleted``, ``cancelled``): a job that Redis forgot is
        rebuilt as it ended, never brought back to life. A new incarnation's manifest outdates it.
        The marker names the job, the ending and the incarnation (`datagen.records.belonging`)."""
        path = self._path(job_id, f"{ending}.json")
        body = ending_body(job_id, ending, incarnation, int(time.time() * 1000))
        data = json.dumps(body).encode("utf-8")
        with _translated(f"cannot write {self._files.display(path)}"):
            self._files.write(path, lambda fh: fh.write(data))

    def ending(self, job_id: str, ending: str, incarnation: str) -> bool:
        """Whether :meth:`write_ending` marked this incarnation (the manifest's) of the job
        ``ending``. A marker that is not the job's (another job's, another ending's, one of another
        incarnation newer than the manifest, or unreadable) is refused with one log line naming it,
        and never acted on (`datagen.records.belonging`)."""
        path = self._path(job_id, f"{ending}.json")
        with _translated(f"cannot read {self._files.display(path)}"):
            try:
                data = self._files.read_bytes(path)
            except FileNotFoundError:
                return False
        try:
            marker = json.loads(data)
        except ValueError:  # not JSON, or not UTF-8
            marker = None
        verdict = judge_ending(
            marker,
            job_id=job_id,
            ending=ending,
            incarnation=incarnation,
            manifest_created_ms=self._created_ms(job_id, marker, incarnation),
        )
        if verdict.problem is not None:
            self._refuse_once(path, data, verdict.problem)
        return verdict.honoured

    def _created_ms(self, job_id: str, marker: object, incarnation: str) -> int:
        """When the manifest's incarnation was made (0: unknown), read only for a marker of
        another incarnation (the rare case that needs it)."""
        if not isinstance(marker, dict) or marker.get("incarnation") in (None, incarnation):
            return 0
        try:
            manifest = self.read_manifest(job_id) or {}
        except ForeignFileError:
            return 0
        created = manifest.get("created_at_ms")
        return created if isinstance(created, int) and not isinstance(created, bool) else 0

    def _refuse_once(self, path: str, data: bytes, problem: str) -> None:
        """One log line per refused file (and content) in this process, however often it is read."""
        seen = (path, hashlib.sha256(data).hexdigest())
        if seen in self._refused:
            return
        self._refused.add(seen)
        log.warning(
            "%s %s: refused, not acted on (a file copied or planted from elsewhere); remove it",
            self._files.display(path),
            problem,
        )

    # Namespace ------------------------------------------------------------------------------------
    def claim_namespace(self, namespace: str) -> None:
        """Bind this storage root to one Redis namespace, or refuse: job ids are unique only within
        a namespace, so two namespaces under one root would write (and delete) each other's jobs."""
        path = self._files.under_root(NAMESPACE_MARKER)
        with _translated(f"cannot read {self._files.display(path)}"):
            try:
                owner = json.loads(self._files.read_bytes(path)).get("namespace")
            except FileNotFoundError:
                owner = None
        if owner is None:
            data = json.dumps({"namespace": namespace}).encode("utf-8")
            with _translated(f"cannot write {self._files.display(path)}"):
                self._files.write(path, lambda fh: fh.write(data))
            return
        if owner != namespace:
            raise ConfigError(
                f"storage {self.root} belongs to Redis namespace {owner!r}, not {namespace!r}: give each "
                "namespace its own storage root (DATAGEN_STORAGE), e.g. a subdirectory named after it"
            )

    def _shard_path(self, job_id: str, commit: dict[str, Any]) -> str:
        return self._path(job_id, *str(commit["path"]).split("/"))

    def read_shard(self, job_id: str, commit: dict[str, Any]) -> pq.ParquetFile:
        """A committed shard, held to its commit object before any row is decoded: its bytes to the
        seal (size, sha256), its footer's row count to the commit's. Raises `CorruptShardError`
        naming the shard and what differs; `StorageError` when the store cannot be read."""
        path = self._shard_path(job_id, commit)
        where = self._files.display(path)
        with _translated(f"cannot read committed shard {where}"):
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

    # Rejected and flagged rows ------------------------------------------------------------------
    def write_rejected(self, job_id: str, input_name: str, rows: list[dict[str, Any]]) -> None:
        """One ingestion chunk's rejected rows (each with its ``line``) of upload ``input_name``."""
        self._write_row_notes(job_id, "rejected", input_name, rows)

    def iter_rejected(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Rejected rows, one per upload and line (a resumed chunk reports a row again), by upload
        (oldest first) and line. An unreadable entry comes out as ``{"line": None, "reason": ...}``."""
        return self._iter_row_notes(job_id, "rejected", legacy=LEGACY_REJECTED)

    def write_flagged(self, job_id: str, input_name: str, rows: list[dict[str, Any]]) -> None:
        """One ingestion chunk's flagged rows (accepted, with a warning such as special-token text,
        each with its ``line``) of upload ``input_name``."""
        self._write_row_notes(job_id, "flagged", input_name, rows)

    def iter_flagged(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Flagged rows, ordered and merged as :meth:`iter_rejected`."""
        return self._iter_row_notes(job_id, "flagged")

    def write_stopped(self, job_id: str, sample_id: str, gen: int, row: dict[str, Any]) -> None:
        """Why one conversation stopped before its last turn (`workers.run.conversation`), named by the
        conversation: writing it again (a redone turn) replaces the object instead of adding one."""
        path = self._path(job_id, "stopped", f"{sample_digest(sample_id)}-g{gen}.jsonl")
        data = json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"
        with _translated(f"cannot write {self._files.display(path)}"):
            self._files.write(path, lambda fh: fh.write(data))

    def iter_stopped(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Stopped conversations of the job's current incarnation, one row each, by object name.
        As with commits, a row of an earlier job of the same id (``inc`` another than the
        manifest's) is left out; rows without ``inc``, or with no manifest stored, all count."""
        directory = self._path(job_id, "stopped")
        with _translated(f"cannot list {self._files.display(directory)}"):
            names = sorted(self._files.list_names(directory, ".jsonl"))
        if not names:
            return
        manifest = self.read_manifest(job_id)
        current = None if manifest is None else str(manifest.get("incarnation", ""))
        for name in names:
            for row in self._read_rejected(posixpath.join(directory, name)):
                if current is None or not row.get("inc") or str(row["inc"]) == current:
                    yield row

    def _write_row_notes(self, job_id: str, folder: str, input_name: str, rows: list[dict[str, Any]]) -> None:
        # Named by the upload and the chunk's first line: a resumed chunk rewrites its own object.
        if not rows:
            return
        upload = input_name.removesuffix(INPUT_SUFFIX)
        first = min(int(r["line"]) for r in rows)
        path = self._path(job_id, folder, f"{_name(upload)}-{first:0{_LINE_DIGITS}d}.jsonl")
        data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in rows)
        with _translated(f"cannot write {self._files.display(path)}"):
            self._files.write(path, lambda fh: fh.write(data))

    def _iter_row_notes(
        self, job_id: str, folder: str, *, legacy: str | None = None
    ) -> Iterator[dict[str, Any]]:
        directory = self._path(job_id, folder)
        with _translated(f"cannot list {self._files.display(directory)}"):
            names = self._files.list_names(directory, ".jsonl")
        order = {
            n.removesuffix(INPUT_SUFFIX): i for i, n in enumerate(self.input_names(job_id) if names else [])
        }
        chunks = sorted(names, key=lambda n: (order.get(_upload_of(n), len(order)), n))
        sources = [("", self._path(job_id, legacy))] if legacy else []
        sources += [(_upload_of(n), posixpath.join(directory, n)) for n in chunks]
        seen: set[tuple[str, int]] = set()
        for upload, path in sources:
            for row in self._read_rejected(path):
                line = row.get("line")
                if isinstance(line, int):
                    if (upload, line) in seen:
                        continue
                    seen.add((upload, line))
                yield row

    def _read_rejected(self, path: str) -> Iterator[dict[str, Any]]:
        where = self._files.display(path)
        with _translated(f"cannot read {where}"):
            try:
                fh: IO[bytes] = self._files.open_read(path)
            except FileNotFoundError:
                return
            with fh:
                for raw in fh:
                    if not raw.strip():
                        continue
                    try:
                        row = json.loads(raw)
                    except ValueError:
                        row = None
                    if not isinstance(row, dict):
                        row = {"line": None, "reason": f"unreadable entry in {where}"}
                    yield row
