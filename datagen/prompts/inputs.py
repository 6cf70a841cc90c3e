"""The inputs users have, read as the JSONL that `datagen.prompts.dataset.iter_prompts` reads.

Formats (`InputFormat`), told by the name or given explicitly::

    jsonl        one JSON object per line              .jsonl
    jsonl.gz     the same, gzip-compressed              .jsonl.gz
    jsonl.zst    the same, zstandard-compressed         .jsonl.zst, .jsonl.zstd
    parquet      one Parquet file                       .parquet
    parquet-dir  a directory of *.parquet shards        a directory holding *.parquet (not its subfolders)
    hf-dataset   a `datasets` save_to_disk directory    a directory holding dataset_info.json / state.json

Whatever the format, a `RowStream` gives the rows as a JSONL byte stream (``readline``, one line per
row), so everything downstream — line numbers, the rows guard's line digests, checkpoints by line,
resume — is the same for every format. JSONL is decompressed as it streams. Parquet and Arrow are
read a record batch at a time (`BATCH_ROWS`), only the columns a row form uses (`ROW_FIELDS`; others
are never read), each row written as ``json.dumps(row)``: ``--messages-column`` / ``--id-column``
(`ColumnMap`) name the columns that become ``messages`` and ``id``; a ``messages`` /
``conversations`` / ``tools`` value may be a list of structs (null struct fields are dropped, as
Arrow fills absent keys with null) or a JSON string (parsed). Memory is flat in the input's size.

A directory's rows are numbered across its files in sorted order; `RowStream.locate` maps a line
back to ``(file, row)`` (row from 1, within that file) for rejected rows. `RowStream.progress` says
how far the read is: rows of the total where the format knows it (Parquet metadata, the dataset's
info), bytes of the total otherwise.

A dataset given by reference (`resolve_reference`: any fsspec URL or a local path) is pinned when it
is submitted: each file's size and, on an object store, its ETag; elsewhere its mtime and the sha256
of its first and last MiB (`PIN_EDGE_BYTES`; a full digest would read the whole input before the
first prompt). Reading it again (a resumed or rebuilt ingestion) checks the pins first and refuses
an input that changed (`check_unchanged`).
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import hashlib
import io
import json
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, BinaryIO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from datagen.errors import DatagenError, InvalidSpecError, StorageError
from datagen.prompts.sources import redacted_url, without_password

__all__ = [
    "BATCH_ROWS",
    "ROW_FIELDS",
    "ColumnMap",
    "InputFile",
    "InputFormat",
    "Reference",
    "RowStream",
    "check_unchanged",
    "count_rows",
    "format_for_name",
    "open_reference",
    "open_upload",
    "parse_format",
    "resolve_reference",
]

BATCH_ROWS = 1024
# Pinned bytes at each end of a file that has no ETag (see the module docstring).
PIN_EDGE_BYTES = 1024 * 1024
# What each JSONL row form reads (`datagen.prompts.dataset`); a Parquet or Arrow input reads only these.
ROW_FIELDS = (
    "id",
    "messages",
    "conversations",
    "prompt",
    "system",
    "tools",
    "partition",
    "class",
    "input_ids",
    "loss_mask",
)
# Columns that may hold a list of structs or a JSON string.
_NESTED_FIELDS = ("messages", "conversations", "tools")
_STATE_FILE = "state.json"
_INFO_FILE = "dataset_info.json"
_DICT_FILE = "dataset_dict.json"
_READ_BUFFER_BYTES = 1024 * 1024


class InputFormat(StrEnum):
    JSONL = "jsonl"
    JSONL_GZ = "jsonl.gz"
    JSONL_ZST = "jsonl.zst"
    PARQUET = "parquet"
    PARQUET_DIR = "parquet-dir"
    HF_DATASET = "hf-dataset"

    @property
    def is_directory(self) -> bool:
        return self in (InputFormat.PARQUET_DIR, InputFormat.HF_DATASET)

    @property
    def suffix(self) -> str:
        """What a stored upload of this format is named with (directories are never uploaded)."""
        return "." + self.value


_SUFFIXES = (
    (".jsonl.gz", InputFormat.JSONL_GZ),
    (".jsonl.zst", InputFormat.JSONL_ZST),
    (".jsonl.zstd", InputFormat.JSONL_ZST),
    (".jsonl", InputFormat.JSONL),
    (".parquet", InputFormat.PARQUET),
)
ACCEPTED = ", ".join(f.value for f in InputFormat)


def format_for_name(name: str) -> InputFormat | None:
    """The single-file format a name's suffix tells, if any."""
    lowered = name.lower()
    return next((fmt for suffix, fmt in _SUFFIXES if lowered.endswith(suffix)), None)


def parse_format(text: str) -> InputFormat:
    try:
        return InputFormat(text.strip().lower())
    except ValueError:
        raise InvalidSpecError(f"unknown dataset format {text[:40]!r}: use one of {ACCEPTED}") from None


@dataclass(frozen=True)
class ColumnMap:
    """Columns of a Parquet or Arrow input that hold what JSONL calls ``messages`` and ``id``."""

    messages: str | None = None
    id: str | None = None

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in (("messages", self.messages), ("id", self.id)) if v}

    @classmethod
    def from_json(cls, value: object) -> ColumnMap:
        found = value if isinstance(value, dict) else {}
        return cls(messages=found.get("messages") or None, id=found.get("id") or None)

    def renames(self) -> dict[str, str]:
        """Column name -> row field."""
        return {column: name for name, column in (("messages", self.messages), ("id", self.id)) if column}


# -- rows as JSONL ----------------------------------------------------------------------------------


@dataclass
class _Progress:
    rows_read: int = 0
    rows_total: int | None = None
    bytes_read: int = 0
    bytes_total: int | None = None


class _Counting(io.RawIOBase):
    """A binary stream that counts the bytes read through it (progress of a compressed file)."""

    def __init__(self, inner: BinaryIO, progress: _Progress) -> None:
        self._inner = inner
        self._progress = progress

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._inner.read(len(buffer))
        buffer[: len(data)] = data
        self._progress.bytes_read += len(data)
        return len(data)

    def close(self) -> None:
        self._inner.close()
        super().close()


class RowStream:
    """An input's rows as a JSONL byte stream: ``readline(size)`` as a binary file has, one line per
    row; ``locate`` and ``progress`` say where the read is."""

    def __init__(self, fmt: InputFormat, progress: _Progress) -> None:
        self.format = fmt
        self._progress = progress
        self._closers: list[Callable[[], object]] = []
        self._lines: Iterator[bytes] = iter(())
        self._pending = b""
        self._direct: Any = None  # JSONL: lines straight from the (decompressed) file
        # Columnar: the first line of each file read so far (0-based count of rows before it).
        self._starts: list[int] = []
        self._names: list[str] = []
        self._single_name: str | None = None

    # The file interface `iter_prompts` and `service.rowids.LineDigests` use.
    def readline(self, size: int = -1) -> bytes:
        if self._direct is not None:
            piece = self._direct.readline(size)
            if piece.endswith(b"\n") or (piece and len(piece) != size):
                self._progress.rows_read += 1
            return piece
        if not self._pending:
            self._pending = next(self._lines, b"")
            if not self._pending:
                return b""
            self._progress.rows_read += 1
        if size < 0 or size >= len(self._pending):
            piece, self._pending = self._pending, b""
        else:
            piece, self._pending = self._pending[:size], self._pending[size:]
        return piece

    def close(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        self._closers.clear()

    def __enter__(self) -> RowStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def locate(self, line: int) -> tuple[str, int] | None:
        """The file and the row within it (from 1) of ``line`` (from 1); None when unknown."""
        if self._single_name is not None:
            return self._single_name, line
        index = bisect.bisect_right(self._starts, line - 1) - 1
        if index < 0 or line < 1:
            return None
        return self._names[index], line - self._starts[index]

    def progress(self) -> dict[str, Any]:
        """Rows read (of the total where the format knows it) and bytes read (JSONL, of the total)."""
        p = self._progress
        return {
            "format": self.format.value,
            "rows_read": p.rows_read,
            "rows_total": p.rows_total,
            "bytes_read": p.bytes_read if self._direct is not None else None,
            "bytes_total": p.bytes_total if self._direct is not None else None,
        }

    # Set-up, by the openers below.
    def _jsonl(self, raw: BinaryIO, fmt: InputFormat, name: str | None) -> None:
        counted = io.BufferedReader(_Counting(raw, self._progress), buffer_size=_READ_BUFFER_BYTES)
        stream: Any
        if fmt is InputFormat.JSONL_GZ:
            stream = gzip.GzipFile(fileobj=counted, mode="rb")
        elif fmt is InputFormat.JSONL_ZST:
            import zstandard  # only for .zst inputs

            reader = zstandard.ZstdDecompressor().stream_reader(counted, read_across_frames=True)
            stream = io.BufferedReader(reader, buffer_size=_READ_BUFFER_BYTES)
        else:
            stream = counted
        self._direct = stream
        self._closers += [counted.close, stream.close]
        self._single_name = name

    def _columnar(self, tables: Iterator[tuple[str, Iterator[pa.RecordBatch]]], columns: ColumnMap) -> None:
        self._lines = self._rows(tables, columns)

    def _rows(
        self, tables: Iterator[tuple[str, Iterator[pa.RecordBatch]]], columns: ColumnMap
    ) -> Iterator[bytes]:
        renames = columns.renames()
        served = 0
        for name, batches in tables:
            self._starts.append(served)
            self._names.append(name)
            for batch in batches:
                for row in _batch_rows(batch, renames):
                    served += 1
                    yield row


def _clean(value: Any) -> Any:
    """A struct's nulls dropped (Arrow fills a key a row lacks with null), inside lists too."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _nested(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value  # the row is rejected downstream, with what the field holds
    return _clean(value)


def _batch_rows(batch: pa.RecordBatch, renames: dict[str, str]) -> Iterator[bytes]:
    for found in batch.to_pylist():
        row = {renames.get(k, k): v for k, v in found.items() if v is not None}
        for key in _NESTED_FIELDS:
            if key in row:
                row[key] = _nested(row[key])
        try:
            text = json.dumps(row, ensure_ascii=False, default=str)
        except (TypeError, ValueError) as exc:  # such a line is rejected downstream, the rest goes on
            text = f"cannot write this row as JSON: {exc}"
        yield text.replace("\n", " ").encode("utf-8", "surrogatepass") + b"\n"


def _wanted(schema: pa.Schema, columns: ColumnMap) -> list[str]:
    """The columns a row form uses, in schema order; mapped ones in place of their field."""
    renames = columns.renames()
    mapped = set(renames.values())
    return [n for n in schema.names if n in renames or (n in ROW_FIELDS and n not in mapped)]


def _check_columns(schema: pa.Schema, columns: ColumnMap, name: str) -> None:
    for flag, column in (("--messages-column", columns.messages), ("--id-column", columns.id)):
        if column and column not in schema.names:
            shown = ", ".join(schema.names[:20])
            raise InvalidSpecError(f"{flag} {column!r}: {name} has no such column (it has: {shown})")


def _parquet_batches(parquet: pq.ParquetFile, columns: ColumnMap, name: str) -> Iterator[pa.RecordBatch]:
    schema = parquet.schema_arrow
    _check_columns(schema, columns, name)
    yield from parquet.iter_batches(batch_size=BATCH_ROWS, columns=_wanted(schema, columns))


def _arrow_batches(source: BinaryIO, columns: ColumnMap, name: str) -> Iterator[pa.RecordBatch]:
    """A `datasets` arrow file (the IPC streaming format), one record batch at a time."""
    reader = pa.ipc.open_stream(source)
    _check_columns(reader.schema, columns, name)
    wanted = _wanted(reader.schema, columns)
    for batch in reader:
        yield batch.select(wanted)


# -- uploads ------------------------------------------------------------------------------------


def open_upload(
    fh: BinaryIO, fmt: InputFormat, columns: ColumnMap, *, name: str | None = None, size: int | None = None
) -> RowStream:
    """One stored upload (a single file; Parquet needs ``fh`` seekable) as a `RowStream`; it closes
    ``fh`` when closed. ``name``: the file's name as given, for `RowStream.locate`."""
    progress = _Progress(bytes_total=size)
    stream = RowStream(fmt, progress)
    if fmt is InputFormat.PARQUET:
        stream._closers.append(fh.close)
        shown = name or "the upload"
        try:
            with _reading(shown):
                parquet = pq.ParquetFile(fh)
            # Checked before the first row, so a wrong flag fails the ingestion at once.
            _check_columns(parquet.schema_arrow, columns, shown)
        except BaseException:
            stream.close()
            raise
        progress.rows_total = parquet.metadata.num_rows
        stream._columnar(iter([(shown, _parquet_batches(parquet, columns, shown))]), columns)
        return stream
    if fmt.is_directory:
        raise InvalidSpecError(f"a {fmt.value} input is a directory: give it by reference (--dataset-url)")
    stream._jsonl(fh, fmt, name)
    return stream


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """A file that is not what its format says is the user's to fix: one line, not a retry."""
    try:
        yield
    except pa.ArrowInvalid as exc:
        raise InvalidSpecError(f"cannot read {what}: {exc}") from exc


# -- references ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputFile:
    """One file of a referenced input: its name within the reference and what pins it."""

    name: str
    pin: dict[str, Any]


@dataclass(frozen=True)
class Reference:
    url: str
    format: InputFormat
    files: list[InputFile]
    rows_total: int | None = None
    # Where the files are: the file system and the path of the reference in it.
    fs: Any = field(default=None, compare=False, repr=False)
    path: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "format": self.format.value,
            "files": [{"name": f.name, **f.pin} for f in self.files],
            "rows_total": self.rows_total,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Reference:
        files = [
            InputFile(str(f["name"]), {k: v for k, v in f.items() if k != "name"}) for f in value["files"]
        ]
        return cls(str(value["url"]), InputFormat(value["format"]), files, value.get("rows_total"))

    def file_path(self, name: str) -> str:
        return self.path if not self.format.is_directory else posixpath.join(self.path, name)


@contextlib.contextmanager
def _storage(url: str) -> Iterator[None]:
    """An unreachable store is waited out (`StorageError`); a missing input is the user's to fix."""
    try:
        yield
    except DatagenError:
        raise
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise InvalidSpecError(
            f"dataset {redacted_url(url)} is not there ({without_password(str(exc), url)}); check the URL"
        ) from exc
    except Exception as exc:
        raise StorageError(
            f"cannot read dataset {redacted_url(url)}: {without_password(str(exc), url)}"
        ) from exc


def _file_system(url: str) -> tuple[Any, str]:
    try:
        fs, path = fsspec.core.url_to_fs(url, use_listings_cache=False)
    except (ImportError, ValueError) as exc:
        raise InvalidSpecError(
            f"cannot read dataset {redacted_url(url)}: {without_password(str(exc), url)}"
        ) from exc
    return fs, str(path).rstrip("/") or str(path)


def resolve_reference(url: str, fmt: InputFormat | None = None) -> Reference:
    """What ``url`` holds, its format (told by the name when ``fmt`` is None) and its files' pins."""
    fs, path = _file_system(url)
    with _storage(url):
        is_dir = bool(fs.isdir(path))
        if is_dir:
            listing = {posixpath.basename(str(e["name"]).rstrip("/")): e for e in fs.ls(path, detail=True)}
            fmt = _directory_format(url, listing, fmt)
        else:
            info = fs.info(path)
            listing = {posixpath.basename(path): info}
            fmt = fmt or format_for_name(path)
            if fmt is None:
                raise InvalidSpecError(
                    f"cannot tell the format of {redacted_url(url)} from its name: "
                    f"give --format (one of {ACCEPTED})"
                )
            if fmt.is_directory:
                raise InvalidSpecError(
                    f"{redacted_url(url)} is a file, not a directory: a {fmt.value} input is a directory"
                )
        rows_total = None
        if fmt is InputFormat.HF_DATASET:
            names, rows_total = _dataset_files(fs, path, url)
        elif fmt is InputFormat.PARQUET_DIR:
            names = sorted(
                n for n, e in listing.items() if n.endswith(".parquet") and e.get("type") != "directory"
            )
        else:
            names = list(listing)
        files = [
            InputFile(n, _pin(fs, posixpath.join(path, n) if is_dir else path, listing.get(n))) for n in names
        ]
    return Reference(url, fmt, files, rows_total, fs=fs, path=path)


def _directory_format(url: str, listing: dict[str, Any], fmt: InputFormat | None) -> InputFormat:
    if _DICT_FILE in listing:
        raise InvalidSpecError(
            f"{redacted_url(url)} is a dataset with several splits: give one split's directory "
            f"(e.g. {redacted_url(url).rstrip('/')}/train)"
        )
    if fmt is None:
        if _STATE_FILE in listing or _INFO_FILE in listing:
            return InputFormat.HF_DATASET
        if any(n.endswith(".parquet") for n in listing):
            return InputFormat.PARQUET_DIR
        raise InvalidSpecError(
            f"{redacted_url(url)} is a directory with neither *.parquet files nor a saved dataset "
            "(dataset_info.json): "
            f"give a file, or --format (one of {ACCEPTED})"
        )
    if not fmt.is_directory:
        raise InvalidSpecError(f"{redacted_url(url)} is a directory, not a {fmt.value} file")
    return fmt


def _dataset_files(fs: Any, path: str, url: str) -> tuple[list[str], int | None]:
    """A `save_to_disk` directory's arrow files (its state.json lists them, in order) and its row
    count (dataset_info.json's split, where it says)."""
    try:
        state = json.loads(fs.cat_file(posixpath.join(path, _STATE_FILE)))
        names = [str(f["filename"]) for f in state["_data_files"]]
    except (FileNotFoundError, KeyError, TypeError, ValueError) as exc:
        raise InvalidSpecError(
            f"{redacted_url(url)}: cannot read the dataset's {_STATE_FILE} ({exc!r})"
        ) from exc
    rows_total = None
    with contextlib.suppress(FileNotFoundError, KeyError, TypeError, ValueError, AttributeError):
        info = json.loads(fs.cat_file(posixpath.join(path, _INFO_FILE)))
        splits = info.get("splits") or {}
        split = state.get("_split") or (next(iter(splits)) if len(splits) == 1 else None)
        if split in splits:
            rows_total = int(splits[split]["num_examples"])
    return names, rows_total


def _pin(fs: Any, path: str, info: dict[str, Any] | None) -> dict[str, Any]:
    """Size and ETag where the store has one; else mtime and digests of the first and last MiB."""
    info = info if info is not None and "size" in info else fs.info(path)
    size = int(info["size"])
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return {"size": size, "etag": str(etag).strip('"')}
    pin: dict[str, Any] = {"size": size}
    mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
    if mtime is not None:
        pin["mtime"] = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
    pin["head_sha256"] = hashlib.sha256(fs.cat_file(path, 0, min(size, PIN_EDGE_BYTES))).hexdigest()
    pin["tail_sha256"] = hashlib.sha256(fs.cat_file(path, max(0, size - PIN_EDGE_BYTES), size)).hexdigest()
    return pin


def check_unchanged(pinned: Reference, now: Reference) -> None:
    """Refuse an input that is not what was submitted (a resumed or rebuilt ingestion reads it again)."""
    shown = redacted_url(pinned.url)
    if [f.name for f in pinned.files] != [f.name for f in now.files]:
        raise InvalidSpecError(
            f"dataset {shown} changed since it was submitted (its files are not the same); "
            "the job cannot go on from its checkpoint: submit the input as it is under a new job id"
        )
    for was, is_ in zip(pinned.files, now.files, strict=True):
        differs = sorted(k for k in was.pin if is_.pin.get(k) != was.pin[k])
        if differs:
            raise InvalidSpecError(
                f"dataset {shown}: {was.name} changed since it was submitted ({', '.join(differs)} "
                "differ); the job cannot go on from its checkpoint: submit the input as it is under a "
                "new job id"
            )


def open_reference(pinned: Reference, columns: ColumnMap, *, fresh: bool = False) -> RowStream:
    """The referenced input as a `RowStream`, after checking its pins; files open one at a time.
    ``fresh``: ``pinned`` was resolved just now (`resolve_reference`, a dry run's), so its pins are
    not read again."""
    now = pinned if fresh else resolve_reference(pinned.url, pinned.format)
    if not fresh:
        check_unchanged(pinned, now)
    progress = _Progress(rows_total=pinned.rows_total)
    stream = RowStream(pinned.format, progress)
    fs = now.fs
    if not pinned.format.is_directory:
        progress.bytes_total = int(pinned.files[0].pin["size"])
        if pinned.format is not InputFormat.PARQUET:
            with _storage(pinned.url):
                raw = fs.open(now.path, "rb")
            stream._jsonl(raw, pinned.format, pinned.files[0].name)
            return stream

    def tables() -> Iterator[tuple[str, Iterator[pa.RecordBatch]]]:
        for number, f in enumerate(pinned.files):
            with _storage(pinned.url):
                fh = fs.open(now.file_path(f.name), "rb")
            stream._closers.append(fh.close)
            batches: Iterator[pa.RecordBatch]
            if pinned.format is InputFormat.HF_DATASET:
                batches = _arrow_batches(fh, columns, f.name)
            else:
                with _reading(f.name):
                    parquet = pq.ParquetFile(fh)
                batches = _parquet_batches(parquet, columns, f.name)
                if len(pinned.files) == 1:
                    progress.rows_total = parquet.metadata.num_rows
            if number == 0 and progress.rows_total is None:
                batches = _after_first(batches, lambda: _count_rows(fs, now, progress))
            yield f.name, batches
            fh.close()

    stream._columnar(tables(), columns)
    return stream


def _after_first(batches: Iterator[pa.RecordBatch], then: Callable[[], None]) -> Iterator[pa.RecordBatch]:
    """``batches``, calling ``then`` once the first is out (so the first prompt does not wait for it)."""
    first = True
    for batch in batches:
        yield batch
        if first:
            first = False
            then()


def _count_rows(fs: Any, reference: Reference, progress: _Progress) -> None:
    """The rows of a directory its info did not count: Parquet footers, or a local saved dataset's
    arrow files memory-mapped (record batch headers, no data copied). Best effort: progress only."""
    local = isinstance(fs, LocalFileSystem)
    if reference.format is InputFormat.HF_DATASET and not local:
        return  # counting would read every file; progress shows rows read without a total
    total = 0
    try:
        for f in reference.files:
            path = reference.file_path(f.name)
            if reference.format is InputFormat.HF_DATASET:
                with pa.memory_map(path) as mapped, pa.ipc.open_stream(mapped) as reader:
                    total += sum(batch.num_rows for batch in reader)
            else:
                with fs.open(path, "rb") as fh:
                    total += pq.read_metadata(fh).num_rows
    except Exception:  # progress without a total; the read itself reports its own errors
        return
    progress.rows_total = total


def count_rows(reference: Reference) -> int | None:
    """The rows of a resolved reference where they are cheap to know: its dataset info, else as
    `open_reference` counts them (Parquet footers, a local saved dataset's record batch headers);
    None for JSONL, or where counting would read every file."""
    columnar = (InputFormat.PARQUET, InputFormat.PARQUET_DIR, InputFormat.HF_DATASET)
    if reference.rows_total is not None or reference.format not in columnar:
        return reference.rows_total
    progress = _Progress()
    _count_rows(reference.fs, reference, progress)
    return progress.rows_total
