"""Output files of an export, written under temporary names and renamed into place when the export
completes, so a failed export never leaves a file that looks whole.

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
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from datagen.errors import ConfigError, StorageError

__all__ = ["DEFAULT_PARQUET_SHARD_ROWS", "JsonlSink", "ParquetSink"]

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
