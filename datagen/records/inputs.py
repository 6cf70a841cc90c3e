"""What came into a job and what became of its rows short of a record, for
`datagen.records.storage`: the uploads and references, rejected and flagged rows, and stopped
conversations.

An input is an upload (stored as it came, named with its format's suffix, with a ``.read.json``
sidecar holding its format, column mapping and file name as given) or a reference (a ``.ref.json``
object holding the URL, format, column mapping and each file's pins; nothing is copied). Both are
read the same way by `open_rows` (`datagen.prompts.inputs`), so a resumed ingestion and a rebuild
from storage read an input as its first ingestion did.

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

from datagen.errors import InvalidSpecError
from datagen.prompts.inputs import (
    ColumnMap,
    InputFormat,
    Reference,
    RowStream,
    format_for_name,
    open_reference,
    open_upload,
)
from datagen.records.layout import (
    INPUT_SUFFIXES,
    LEGACY_REJECTED,
    READ_SIDECAR_SUFFIX,
    REFERENCE_SUFFIX,
    stored_name,
    translated,
)
from datagen.records.manifests import JobManifests
from datagen.states import sample_digest

__all__ = ["JobInputs", "upload_stem"]

_LINE_DIGITS = 12
# A file name as given, kept for rejected rows' ``file``: at most this long, its last path segment.
_MAX_FILENAME_CHARS = 200


def upload_stem(name: str) -> str:
    """An input's uuid: its name without the format's suffix (``<uuid>.parquet`` -> ``<uuid>``)."""
    return name.split(".", 1)[0]


def _upload_of(rejected_chunk: str) -> str:
    """The upload a rejected-rows object belongs to (``<upload>-<first line>.jsonl``)."""
    return rejected_chunk.rsplit("-", 1)[0]


class JobInputs(JobManifests):
    def write_input(
        self,
        job_id: str,
        blocks: Iterable[bytes],
        fmt: InputFormat = InputFormat.JSONL,
        *,
        columns: ColumnMap | None = None,
        filename: str | None = None,
    ) -> str:
        """Stream ``blocks`` (an upload of format ``fmt``) into a new input object; returns its
        name. How to read it (format, ``columns``, ``filename`` as given) goes beside it first. If
        ``blocks`` raises, the error propagates and no input object is left."""
        if fmt.is_directory:
            raise ValueError(f"a {fmt.value} input is never uploaded")
        stem = uuid.uuid4().hex
        name = f"{stem}{fmt.suffix}"
        path = self._path(job_id, "input", name)
        shown = (
            None
            if filename is None
            else posixpath.basename(filename.replace("\\", "/"))[-_MAX_FILENAME_CHARS:]
        )
        how = {"format": fmt.value, "columns": (columns or ColumnMap()).to_json(), "filename": shown or None}
        sidecar = self._path(job_id, "input", stem + READ_SIDECAR_SUFFIX)
        self._write_object(sidecar, _json_bytes(how))

        def write(fh: BinaryIO) -> None:
            for block in blocks:
                fh.write(block)

        try:
            with translated(f"cannot store the upload at {self._files.display(path)}"):
                self._files.write(path, write)
        except BaseException:
            self._files.remove(sidecar)  # nothing is left of an upload that failed
            raise
        return name

    def write_reference(self, job_id: str, reference: Reference, columns: ColumnMap) -> str:
        """A dataset given by reference, pinned (`datagen.prompts.inputs.resolve_reference`); returns
        the input's name."""
        name = f"{uuid.uuid4().hex}{REFERENCE_SUFFIX}"
        body = {**reference.to_json(), "columns": columns.to_json()}
        self._write_object(self._path(job_id, "input", name), _json_bytes(body))
        return name

    def remove_input(self, job_id: str, name: str) -> None:
        """Remove an input a refused submit stored, and what goes beside it (best effort): a
        rebuild ingests every input its job's storage holds."""
        stem = name.split(".", 1)[0]
        self._files.remove(self._path(job_id, "input", name))
        self._files.remove(self._path(job_id, "input", stem + READ_SIDECAR_SUFFIX))

    def input_names(self, job_id: str) -> list[str]:
        """The job's inputs (uploads and references), oldest first."""
        directory = self._path(job_id, "input")
        with translated(f"cannot list the input of job {job_id} under {self._files.display(directory)}"):
            names = [n for n in self._files.list_names(directory, "") if n.endswith(INPUT_SUFFIXES)]
            dated = [(self._files.modified_s(posixpath.join(directory, n)), n) for n in names]
        return [n for _, n in sorted(dated)]

    def input_exists(self, job_id: str, name: str) -> bool:
        path = self._path(job_id, "input", name)
        with translated(f"cannot look for {self._files.display(path)}"):
            return self._files.exists(path)

    def open_input(self, job_id: str, name: str, *, random_access: bool = False) -> BinaryIO:
        """An upload's bytes as stored (``readline``, ``seek``, ``tell``); ``random_access`` suits
        many seeks (small cached blocks on an object store) rather than one pass. Its rows, in any
        format: `open_rows`."""
        path = self._path(job_id, "input", name)
        with translated(f"cannot open the upload {self._files.display(path)}"):
            return self._files.open_read(path, random_access=random_access)

    def open_rows(self, job_id: str, name: str) -> RowStream:
        """An input's rows as JSONL, whatever its format (`datagen.prompts.inputs.RowStream`); a
        reference is checked against its pins first (an input that changed is refused)."""
        if name.endswith(REFERENCE_SUFFIX):
            body = self._read_json(self._path(job_id, "input", name))
            if body is None:
                raise FileNotFoundError(self.url(job_id, "input", name))
            try:
                reference = Reference.from_json(body)
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidSpecError(
                    f"the dataset reference {self.url(job_id, 'input', name)} cannot be read ({exc!r}); "
                    "submit the dataset again"
                ) from exc
            return open_reference(reference, ColumnMap.from_json(body.get("columns")))
        how = self._read_json(self._path(job_id, "input", upload_stem(name) + READ_SIDECAR_SUFFIX)) or {}
        fmt = format_for_name(name) or InputFormat.JSONL
        path = self._path(job_id, "input", name)
        fh = self.open_input(job_id, name, random_access=fmt is InputFormat.PARQUET)
        with translated(f"cannot read {self._files.display(path)}"):
            size = int(self._files.fs.size(path))
        return open_upload(
            fh, fmt, ColumnMap.from_json(how.get("columns")), name=how.get("filename") or None, size=size
        )

    def _read_json(self, path: str) -> dict[str, Any] | None:
        with translated(f"cannot read {self._files.display(path)}"):
            try:
                body = json.loads(self._files.read_bytes(path))
            except FileNotFoundError:
                return None
        return body if isinstance(body, dict) else None

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
        upload = upload_stem(input_name)
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
        order = {upload_stem(n): i for i, n in enumerate(self.input_names(job_id) if names else [])}
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


def _json_bytes(value: dict[str, Any]) -> bytes:
    return json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")
