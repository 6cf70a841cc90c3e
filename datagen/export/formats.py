"""Token-id export formats, built batch by batch from the filtered record columns, and the files they
go to.

- ``specforge`` (trainer-formats §4.2): ``{"id", "input_ids", "loss_mask"}`` per line, and
  optionally the arms side file (`ArmsSink`).
- ``speculators`` (§4.4): ``{"id", "primary_id", "input_ids", "loss_mask", "text", "metadata"}``.
- ``parquet``: ``id, primary_id, input_ids (list<int64>), loss_mask (list<int8>), finish_reason,
  partition, arm, chat_template_kwargs, sampling_params`` (int64 ids are what trainers' embedding
  lookups take; the 0/1 mask fits a byte).

Each row says how it was made: its recipe arm (null in a job without a recipe), the template
variables its prompt was rendered with and the sampling params sent. ``parquet`` keeps the last two
as the records' JSON strings; ``speculators`` has them as objects in ``metadata`` (``arm``,
``chat_template_kwargs``, ``sampling_params``). SpecForge's reader fixes its rows, so ``specforge``
puts them in a side file beside the export (`arms_file_path`): one line a row, in the rows' order.

Ids are the same in every format: ``{sample_id}`` for turn 0 / gen 0, else
``{sample_id}_t{turn}_g{gen}``; ``primary_id`` is the sample id. The loss mask is 0 over the prompt
and 1 over the output, after clipping. Both come from `datagen.records.reader` (`RowViews`), as the
report reads them.

The files (`JsonlSink`, `ParquetSink`) are written under temporary names and renamed into place when
the export completes, so a failed export never leaves a file that looks whole.

- JSONL without a shard size: one file at ``out``.
- JSONL with a shard size: ``out/train-00000-of-00003.jsonl`` …, ``shard_size`` rows each.
- Parquet: ``out/data/train-00000-of-00003.parquet`` …, the layout ``datasets.load_dataset(out)``
  and ``load_dataset("parquet", data_dir=out/"data")`` read as one ``train`` split.

A sharded output directory must be empty or absent: files of an earlier export with another shard
count would otherwise mix with the new ones. A Parquet export with no rows writes one empty file
(pyarrow reads it; ``datasets`` refuses an empty split).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from datagen.errors import ConfigError, StorageError
from datagen.export.tokens import JobTokens
from datagen.records.reader import RowViews, export_ids, list_parts
from datagen.records.schema import ARM, TEMPLATE_KWARGS, loss_mask_values

__all__ = [
    "ARMS_FILE_SUFFIX",
    "DEFAULT_PARQUET_SHARD_ROWS",
    "PARQUET_SCHEMA",
    "SPECULATORS_ENDPOINT",
    "ArmsSink",
    "JsonTexts",
    "JsonlSink",
    "ParquetSink",
    "SpeculatorsFormatter",
    "arms_file_path",
    "parquet_table",
    "specforge_lines",
]

SPECULATORS_ENDPOINT = "/generate"
PARQUET_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("primary_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("partition", pa.string(), nullable=False),
        pa.field(ARM, pa.string()),
        pa.field(TEMPLATE_KWARGS, pa.string()),
        pa.field("sampling_params", pa.string(), nullable=False),
    ]
)
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


class JsonTexts:
    """Records' JSON strings (sampling params, template variables) parsed once each: the records of
    one job share a handful (one an arm and ``max_new_tokens``). None stays None."""

    def __init__(self) -> None:
        self._parsed: dict[str, Any] = {}

    def __call__(self, text: str | None) -> Any:
        if text is None:
            return None
        if text not in self._parsed:
            self._parsed[text] = orjson.loads(text)
        return self._parsed[text]


def specforge_lines(batch: pa.RecordBatch) -> Iterator[bytes]:
    rows = RowViews(batch)
    for i, row_id in enumerate(rows.ids):
        yield orjson.dumps(
            {"id": row_id, "input_ids": rows.input_ids(i), "loss_mask": rows.loss_mask(i)},
            option=_JSON_OPTIONS,
        )


class SpeculatorsFormatter:
    """speculators' regeneration rows; ``idx`` numbers rows in the order they are written."""

    def __init__(self, tokens: JobTokens) -> None:
        self.tokens = tokens
        self.idx = 0
        self._json = JsonTexts()

    def lines(self, batch: pa.RecordBatch) -> Iterator[bytes]:
        rows = RowViews(batch)
        texts = self.tokens.decode_many(
            [rows.input_ids(i) for i in range(len(rows))], skip_special_tokens=False
        )
        sample_ids = batch.column("sample_id").to_pylist()
        finishes = batch.column("finish_type").to_pylist()
        output_lens = batch.column("output_len").to_pylist()
        servers = batch.column("server").to_pylist()
        sampling = batch.column("sampling_params").to_pylist()
        arms = batch.column(ARM).to_pylist()
        kwargs = batch.column(TEMPLATE_KWARGS).to_pylist()
        for i, row_id in enumerate(rows.ids):
            metadata = {
                "idx": self.idx,
                "finish_reason": finishes[i],
                "is_tool_call": self.tokens.is_tool_call(rows.output(i)),
                "usage": {"prompt_tokens": int(rows.prompt_lens[i]), "completion_tokens": output_lens[i]},
                "endpoint": SPECULATORS_ENDPOINT,
                "sampling_params": self._json(sampling[i]),
                "server": servers[i],
                "arm": arms[i],
                "chat_template_kwargs": self._json(kwargs[i]),
            }
            self.idx += 1
            row = {
                "id": row_id,
                "primary_id": sample_ids[i],
                "input_ids": rows.input_ids(i),
                "loss_mask": rows.loss_mask(i),
                "text": texts[i],
                "metadata": metadata,
            }
            yield orjson.dumps(row, option=_JSON_OPTIONS)


def parquet_table(batch: pa.RecordBatch) -> pa.Table:
    ids = batch.column("input_ids")
    values, offsets = list_parts(ids)
    base = offsets[0]
    rebased = pa.array(offsets - base, pa.int32())
    input_ids = pa.ListArray.from_arrays(rebased, pa.array(values[base : offsets[-1]].astype(np.int64)))
    mask = pa.ListArray.from_arrays(
        rebased, pa.array(loss_mask_values(offsets, batch.column("prompt_len").to_numpy()))
    )
    columns = [
        pa.array(export_ids(batch), pa.string()),
        batch.column("sample_id"),
        input_ids,
        mask,
        batch.column("finish_type"),
        batch.column("partition"),
        batch.column(ARM),
        batch.column(TEMPLATE_KWARGS),
        batch.column("sampling_params"),
    ]
    return pa.Table.from_arrays(columns, schema=PARQUET_SCHEMA)


DEFAULT_PARQUET_SHARD_ROWS = 50_000
WRITE_BUFFER_BYTES = 1024 * 1024
SPLIT_NAME = "train"
PARQUET_COMPRESSION = "zstd"
_TMP_SUFFIX = ".tmp"


def _empty_dir(path: Path) -> Path:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"output {path} exists and is not an empty directory; remove it or choose another")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _shard_name(index: int, count: int, suffix: str) -> str:
    return f"{SPLIT_NAME}-{index:05d}-of-{count:05d}{suffix}"


class _ShardedFiles:
    """Numbered part files under temporary names, renamed to ``train-i-of-n`` names on finish."""

    def __init__(self, directory: Path, suffix: str) -> None:
        self.directory = directory
        self.suffix = suffix
        self.parts: list[Path] = []

    def next_part(self) -> Path:
        path = self.directory / f"part-{len(self.parts):05d}{self.suffix}{_TMP_SUFFIX}"
        self.parts.append(path)
        return path

    def finish(self) -> list[Path]:
        final = []
        for index, part in enumerate(self.parts):
            target = self.directory / _shard_name(index, len(self.parts), self.suffix)
            os.replace(part, target)
            final.append(target)
        return final

    def abort(self) -> None:
        for part in self.parts:
            part.unlink(missing_ok=True)


class JsonlSink:
    def __init__(self, out: Path, shard_size: int | None) -> None:
        self.out = out
        self.shard_size = shard_size
        self._rows_in_file = 0
        self._fh: BinaryIO | None = None
        self._single: Path | None = None
        self._sharded: _ShardedFiles | None = None
        try:
            if shard_size is None:
                out.parent.mkdir(parents=True, exist_ok=True)
                self._single = out.with_name(out.name + _TMP_SUFFIX)
                self._fh = open(self._single, "wb", buffering=WRITE_BUFFER_BYTES)  # noqa: SIM115
            else:
                self._sharded = _ShardedFiles(_empty_dir(out), ".jsonl")
        except OSError as exc:
            raise StorageError(f"cannot write export to {out}: {exc}") from exc

    def write(self, line: bytes) -> None:
        if self._sharded is not None and (self._fh is None or self._rows_in_file >= (self.shard_size or 0)):
            if self._fh is not None:
                self._fh.close()
            self._fh = open(self._sharded.next_part(), "wb", buffering=WRITE_BUFFER_BYTES)  # noqa: SIM115
            self._rows_in_file = 0
        assert self._fh is not None
        self._fh.write(line)
        self._rows_in_file += 1

    def finish(self) -> list[Path]:
        if self._fh is not None:
            self._fh.close()
        if self._single is not None:
            os.replace(self._single, self.out)
            return [self.out]
        assert self._sharded is not None
        return self._sharded.finish()

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._single is not None:
            self._single.unlink(missing_ok=True)
        if self._sharded is not None:
            self._sharded.abort()


class ParquetSink:
    def __init__(self, out: Path, schema: pa.Schema, shard_rows: int | None) -> None:
        self.schema = schema
        self.shard_rows = shard_rows or DEFAULT_PARQUET_SHARD_ROWS
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0
        try:
            self._files = _ShardedFiles(_empty_dir(out / "data"), ".parquet")
        except OSError as exc:
            raise StorageError(f"cannot write export to {out}: {exc}") from exc

    def write(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            if self._writer is None or self._rows_in_file >= self.shard_rows:
                if self._writer is not None:
                    self._writer.close()
                path = self._files.next_part()
                self._writer = pq.ParquetWriter(path, self.schema, compression=PARQUET_COMPRESSION)
                self._rows_in_file = 0
            take = min(table.num_rows - offset, self.shard_rows - self._rows_in_file)
            self._writer.write_table(table.slice(offset, take))
            self._rows_in_file += take
            offset += take

    def finish(self) -> list[Path]:
        if self._writer is not None:
            self._writer.close()
        if not self._files.parts:  # no rows: one empty file keeps the dataset loadable
            pq.write_table(self.schema.empty_table(), self._files.next_part())
        return self._files.finish()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._files.abort()


ARMS_FILE_SUFFIX = ".arms.jsonl"


def arms_file_path(out: Path) -> Path:
    """The arms side file of a JSONL export at ``out``, beside it: ``train.jsonl`` →
    ``train.arms.jsonl``; a sharded export's directory ``train`` → ``train.arms.jsonl`` (outside it,
    so that a loader reading the directory's files never takes it for rows)."""
    out = out if out.name else out.absolute()  # "." names no file to stand beside
    return out.with_name(out.name.removesuffix(".jsonl") + ARMS_FILE_SUFFIX)


class ArmsSink:
    """The arms side file of a ``specforge`` export: one line a written row, in the same order,
    ``{"index", "id", "sample_id", "turn", "gen", "arm", "chat_template_kwargs", "sampling_params"}``
    (``index`` counts rows from 0 over every shard; the last two as objects).

    Streamed under a temporary name. `finish` puts it in place when ``always`` or when a row had
    an arm; otherwise it removes it, and any side file of an earlier export to the same place, so
    that a side file beside an export always describes that export."""

    def __init__(self, out: Path, *, always: bool) -> None:
        self.path = arms_file_path(out)
        self.always = always
        self.rows = 0
        self.any_arm = False
        self._json = JsonTexts()
        self._tmp = self.path.with_name(self.path.name + _TMP_SUFFIX)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh: BinaryIO | None = open(self._tmp, "wb", buffering=WRITE_BUFFER_BYTES)  # noqa: SIM115
        except OSError as exc:
            raise StorageError(f"cannot write the arms file {self.path}: {exc}") from exc

    def write(self, batch: pa.RecordBatch) -> None:
        assert self._fh is not None
        keys = zip(*(batch.column(c).to_pylist() for c in ("sample_id", "turn", "gen")), strict=True)
        arms = batch.column(ARM).to_pylist()
        kwargs = batch.column(TEMPLATE_KWARGS).to_pylist()
        sampling = batch.column("sampling_params").to_pylist()
        for i, (row_id, (sample_id, turn, gen)) in enumerate(zip(export_ids(batch), keys, strict=True)):
            line = {
                "index": self.rows,
                "id": row_id,
                "sample_id": sample_id,
                "turn": turn,
                "gen": gen,
                "arm": arms[i],
                "chat_template_kwargs": self._json(kwargs[i]),
                "sampling_params": self._json(sampling[i]),
            }
            self._fh.write(orjson.dumps(line, option=_JSON_OPTIONS))
            self.rows += 1
            self.any_arm = self.any_arm or arms[i] is not None

    def finish(self) -> Path | None:
        """The side file's path where it was written, else None."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.always or self.any_arm:
            os.replace(self._tmp, self.path)
            return self.path
        self._tmp.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        return None

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._tmp.unlink(missing_ok=True)
