"""Hidden-state feature files, for `datagen.records.storage`: one safetensors file per record of a job
with ``features``, under ``jobs/<job>/features/<name>.safetensors``.

A worker writes the file to a local path first, then hands it over (`FeatureFiles.adopt_feature`)
before it commits the record that names it, so a committed record's file always exists; a file
whose record was never committed (a worker killed in between) is an unreferenced leftover, which no
export reads. The file appears whole or not at all: on a local root it is renamed into place (or,
from another file system, copied to a temporary name, fsynced and renamed); on an object store it
is one upload, which the store makes visible only when it completes. Names are the caller's, one
per file: adopting a name again replaces the file under it.

The record holds the file's size and sha256 (`datagen.records.schema`): `datagen verify` and the
``speculators-offline`` export hold the stored bytes to them.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import BinaryIO

from datagen.errors import StorageError
from datagen.records.files import fsync_path
from datagen.records.layout import FEATURE_SUFFIX, FEATURES_FOLDER, JobFolders, translated

__all__ = ["FeatureFiles"]

COPY_BUFFER_BYTES = 1024 * 1024


class FeatureFiles(JobFolders):
    def _feature_path(self, job_id: str, name: str) -> str:
        if not name.endswith(FEATURE_SUFFIX):
            raise StorageError(f"bad features file name {name!r}: it must end in {FEATURE_SUFFIX}")
        return self._path(job_id, FEATURES_FOLDER, name)

    def adopt_feature(self, job_id: str, name: str, local_path: Path) -> str:
        """Move the finished file at ``local_path`` into the job's features folder as ``name``; returns
        where it is. On success ``local_path`` is gone; on failure it stays and nothing is left
        under ``name`` that looks whole."""
        path = self._feature_path(job_id, name)
        where = self._files.display(path)
        with translated(f"cannot store the features file {where}"):
            if self.is_local:
                self._adopt_local(Path(local_path), path)
            else:
                try:
                    self._files.fs.put_file(os.fspath(local_path), path)
                except BaseException:
                    self._files.remove(path)
                    raise
                os.unlink(local_path)
        return where

    def _adopt_local(self, source: Path, path: str) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fsync_path(source)  # its bytes on disk before its name is
        try:
            os.replace(source, path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            # Another file system: a copy, fsynced and renamed into place (`ObjectFiles.write`).
            with source.open("rb") as fh:
                self._files.write(path, lambda out: shutil.copyfileobj(fh, out, COPY_BUFFER_BYTES))
            source.unlink()
            return
        fsync_path(directory)

    def open_feature(self, job_id: str, name: str) -> BinaryIO:
        """A stored features file for reading, in one pass; `StorageError` when it is missing."""
        path = self._feature_path(job_id, name)
        with translated(f"cannot open the features file {self._files.display(path)}"):
            return self._files.open_read(path)

    def feature_size(self, job_id: str, name: str) -> int | None:
        """The stored file's size in bytes; None when there is no such file."""
        path = self._feature_path(job_id, name)
        with translated(f"cannot look for the features file {self._files.display(path)}"):
            try:
                return int(self._files.fs.size(path))
            except FileNotFoundError:
                return None

    def feature_url(self, job_id: str, name: str) -> str:
        """Where the file is, for messages and tools: a local path or a URL."""
        return self._files.display(self._feature_path(job_id, name))

    def remove_feature(self, job_id: str, name: str) -> None:
        """Best effort: take back a file whose record will not be committed."""
        self._files.remove(self._feature_path(job_id, name))

    def list_features(self, job_id: str) -> list[str]:
        """The names of the job's stored features files, sorted (leftovers included)."""
        directory = self._path(job_id, FEATURES_FOLDER)
        with translated(f"cannot list {self._files.display(directory)}"):
            return self._files.list_names(directory, FEATURE_SUFFIX)
