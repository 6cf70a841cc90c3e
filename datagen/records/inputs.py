"""What came into a job and what became of its rows short of a record, for
`datagen.records.storage`: the uploads, rejected and flagged rows, and stopped conversations.

Rejected (and flagged) rows are one object per ingestion chunk, named by the upload and the chunk's first
rejected line: a resumed ingestion rewrites the same object instead of appending a second copy,
and readers merge the objects, one row per upload and line (with the ``rejected.jsonl`` that jobs
stored before this layout have).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Iterable, Iterator
from typing import IO, Any, BinaryIO

from datagen.records.layout import INPUT_SUFFIX, LEGACY_REJECTED, stored_name, translated
from datagen.records.manifests import JobManifests
from datagen.states import sample_digest

__all__ = ["JobInputs"]

_LINE_DIGITS = 12


def _upload_of(rejected_chunk: str) -> str:
    """The upload a rejected-rows object belongs to (``<upload>-<first line>.jsonl``)."""
    return rejected_chunk.rsplit("-", 1)[0]


class JobInputs(JobManifests):
    def write_input(self, job_id: str, blocks: Iterable[bytes]) -> str:
        """Stream ``blocks`` into a new input object; returns its name. If ``blocks`` raises, the
        error propagates and no object is left."""
        name = f"{uuid.uuid4().hex}{INPUT_SUFFIX}"
        path = self._path(job_id, "input", name)

        def write(fh: BinaryIO) -> None:
            for block in blocks:
                fh.write(block)

        with translated(f"cannot store the upload at {self._files.display(path)}"):
            self._files.write(path, write)
        return name

    def input_names(self, job_id: str) -> list[str]:
        """The job's uploads, oldest first."""
        directory = self._path(job_id, "input")
        with translated(f"cannot list the input of job {job_id} under {self._files.display(directory)}"):
            names = self._files.list_names(directory, INPUT_SUFFIX)
            dated = [(self._files.modified_s(posixpath.join(directory, n)), n) for n in names]
        return [n for _, n in sorted(dated)]

    def input_exists(self, job_id: str, name: str) -> bool:
        path = self._path(job_id, "input", name)
        with translated(f"cannot look for {self._files.display(path)}"):
            return self._files.exists(path)

    def open_input(self, job_id: str, name: str, *, random_access: bool = False) -> BinaryIO:
        """An upload for reading (``readline``, ``seek``, ``tell``); ``random_access`` suits many
        seeks (small cached blocks on an object store) rather than one pass."""
        path = self._path(job_id, "input", name)
        with translated(f"cannot open the upload {self._files.display(path)}"):
            return self._files.open_read(path, random_access=random_access)

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
        self._write_object(path, json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")

    def iter_stopped(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Stopped conversations of the job's current incarnation, one row each, by object name.
        As with commits, a row of an earlier job of the same id (``inc`` another than the
        manifest's) is left out; rows without ``inc``, or with no manifest stored, all count."""
        directory = self._path(job_id, "stopped")
        with translated(f"cannot list {self._files.display(directory)}"):
            names = sorted(self._files.list_names(directory, ".jsonl"))
        if not names:
            return
        manifest = self.read_manifest(job_id)
        current = None if manifest is None else str(manifest.get("incarnation", ""))
        for name in names:
            for row in self._read_rows(posixpath.join(directory, name)):
                if current is None or not row.get("inc") or str(row["inc"]) == current:
                    yield row

    def _write_row_notes(self, job_id: str, folder: str, input_name: str, rows: list[dict[str, Any]]) -> None:
        # Named by the upload and the chunk's first line: a resumed chunk rewrites its own object.
        if not rows:
            return
        upload = input_name.removesuffix(INPUT_SUFFIX)
        first = min(int(r["line"]) for r in rows)
        path = self._path(job_id, folder, f"{stored_name(upload)}-{first:0{_LINE_DIGITS}d}.jsonl")
        self._write_object(
            path, b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in rows)
        )

    def _iter_row_notes(
        self, job_id: str, folder: str, *, legacy: str | None = None
    ) -> Iterator[dict[str, Any]]:
        directory = self._path(job_id, folder)
        with translated(f"cannot list {self._files.display(directory)}"):
            names = self._files.list_names(directory, ".jsonl")
        order = {
            n.removesuffix(INPUT_SUFFIX): i for i, n in enumerate(self.input_names(job_id) if names else [])
        }
        chunks = sorted(names, key=lambda n: (order.get(_upload_of(n), len(order)), n))
        sources = [("", self._path(job_id, legacy))] if legacy else []
        sources += [(_upload_of(n), posixpath.join(directory, n)) for n in chunks]
        seen: set[tuple[str, int]] = set()
        for upload, path in sources:
            for row in self._read_rows(path):
                line = row.get("line")
                if isinstance(line, int):
                    if (upload, line) in seen:
                        continue
                    seen.add((upload, line))
                yield row

    def _read_rows(self, path: str) -> Iterator[dict[str, Any]]:
        where = self._files.display(path)
        with translated(f"cannot read {where}"):
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
