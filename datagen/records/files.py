"""Bytes in and out of a local directory or an fsspec file system, for `datagen.records.storage`.

Every object is written whole: on a local directory to a temporary file that is fsynced and
renamed into place (then the directory is fsynced), so it appears complete or not at all; on an
object store by one upload, which the store makes visible only when it completes. A write that
fails removes what it left. Reads and listings go through fsspec on both; a local file is read
with the built-in ``open`` (as fast as before), a remote one through a buffered reader, which
gives it ``readline(limit)``, ``seek`` and ``tell`` like a local file.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from datagen.errors import ConfigError

__all__ = ["ObjectFiles", "fsync_path", "is_url"]

TMP_SUFFIX = ".tmp"
# Sequential reads (ingestion, the report): large buffered reads.
STREAM_BUFFER_BYTES = 1024 * 1024
# Random reads (the conversations export seeks to one dataset line per record): small blocks,
# least recently used kept, so a seek costs one small ranged read instead of a large read-ahead.
RANDOM_BLOCK_BYTES = 256 * 1024
RANDOM_CACHED_BLOCKS = 64

# A tree is removed in up to this many passes, this far apart, while files still appear in it.
REMOVE_TREE_TRIES = 3
REMOVE_TREE_PAUSE_S = 0.2


def is_url(root: str) -> bool:
    return "://" in root or "::" in root


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory by its path (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ObjectFiles:
    """A storage root: ``local`` (a directory, ``file://`` included) or an fsspec file system."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        text = os.fspath(root)
        self.fs: Any
        if is_url(text):
            try:
                # No listings cache: other processes (workers) add objects all the time.
                self.fs, base = fsspec.core.url_to_fs(text, use_listings_cache=False)
            except (ImportError, ValueError) as exc:
                raise ConfigError(
                    f"cannot open storage {text!r}: {exc}; install the fsspec package for its protocol "
                    "(s3fs for s3://) or use a local directory"
                ) from exc
            self.local = isinstance(self.fs, LocalFileSystem)
            self.base = str(base).rstrip("/") or str(base)
            self.root = self.base if self.local else text.rstrip("/")
        else:
            self.fs = LocalFileSystem()
            self.local = True
            self.base = self.root = str(Path(text).expanduser().resolve())

    def under_root(self, *parts: str) -> str:
        return posixpath.join(self.base, *parts)

    def display(self, path: str) -> str:
        """Where ``path`` is, for messages: a local path or a URL (credentials never are in it)."""
        return path if self.local else str(self.fs.unstrip_protocol(path))

    # Writes -------------------------------------------------------------------------------------
    def write(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """Write one object whole with ``write(file)``; on any failure nothing is left at ``path``."""
        if self.local:
            self._write_local(path, write)
            return
        try:
            with self.fs.open(path, "wb") as fh:
                write(fh)
        except BaseException:
            # Closing a remote file uploads what it holds: remove the partial object.
            self.remove(path)
            raise

    @staticmethod
    def _write_local(path: str, write: Callable[[BinaryIO], object]) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = path + TMP_SUFFIX
        try:
            with open(tmp, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_path(directory)

    def remove_tree(self, path: str) -> bool:
        """Remove a directory (a prefix on object stores) and all under it; False if absent."""
        if not self.fs.exists(path):
            return False
        for attempt in range(REMOVE_TREE_TRIES):
            try:
                self.fs.rm(path, recursive=True)
                return True
            except OSError:
                # A writer that had not yet seen the job deleted added a file mid-walk ("directory
                # not empty"); it takes its own file back, so another pass finishes the job.
                if attempt + 1 == REMOVE_TREE_TRIES or not self.fs.exists(path):
                    raise
                time.sleep(REMOVE_TREE_PAUSE_S)
        return True

    def remove(self, path: str) -> None:
        """Best effort: the object may not exist, or the store may be unreachable."""
        with contextlib.suppress(Exception):
            self.fs.rm_file(path)

    # Reads --------------------------------------------------------------------------------------
    def open_read(self, path: str, *, random_access: bool = False) -> BinaryIO:
        if self.local:
            return open(path, "rb")
        if random_access:
            raw = self.fs.open(
                path,
                "rb",
                block_size=RANDOM_BLOCK_BYTES,
                cache_type="blockcache",
                cache_options={"maxblocks": RANDOM_CACHED_BLOCKS},
            )
            return io.BufferedReader(raw, buffer_size=io.DEFAULT_BUFFER_SIZE)
        return io.BufferedReader(self.fs.open(path, "rb"), buffer_size=STREAM_BUFFER_BYTES)

    def open_parquet(self, path: str) -> Any:
        """A file for pyarrow: a native one locally (as fast as a path), a buffered reader remotely."""
        return pa.OSFile(path, "rb") if self.local else self.open_read(path)

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def read_many(self, paths: list[str]) -> list[bytes]:
        """Whole objects, in order; concurrent requests on an object store."""
        if not paths:
            return []
        return [bytes(b) for b in self.fs.cat_ranges(paths, None, None, on_error="raise")]

    def read_present(self, paths: list[str]) -> list[bytes | None]:
        """Whole objects, in order, None for each that does not exist; concurrent requests on an
        object store."""
        if not paths:
            return []
        found = self.fs.cat_ranges(paths, None, None, on_error="return")
        out: list[bytes | None] = []
        for item in found:
            if isinstance(item, (FileNotFoundError, NotADirectoryError)):
                out.append(None)
            elif isinstance(item, BaseException):
                raise item
            else:
                out.append(bytes(item))
        return out

    # Listings -----------------------------------------------------------------------------------
    def list_names(self, directory: str, suffix: str) -> list[str]:
        """Names of the files directly under ``directory`` ending in ``suffix``, sorted."""
        try:
            entries = self.fs.ls(directory, detail=False)
        except FileNotFoundError:
            return []
        names = (posixpath.basename(str(e).rstrip("/")) for e in entries)
        return sorted(n for n in names if n.endswith(suffix))

    def modified_s(self, path: str) -> float:
        """Modification time in seconds (0 where the file system does not say)."""
        try:
            return float(self.fs.modified(path).timestamp())
        except NotImplementedError:
            return 0.0

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def is_dir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))
