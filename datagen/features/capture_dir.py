"""The capture server's output folder, as a worker sees it: names, removal, the orphan sweep, the cap.

The server never deletes what it writes, and a request aborted after it was scheduled still
writes a file whose path nobody learns (contract 1.7, 1.8). So the worker removes each file (and
its lock) once stored, sweeps what is left by age, and stops sending captures while the folder
holds more than ``max_bytes``.

Only ``*.safetensors`` and ``*.safetensors.lock`` directly in the folder are ever removed; other
names are left alone, so the folder may be shared. Age is wall-clock ``time.time()`` against the
file's mtime (speculators' sidecar compares a monotonic clock with mtimes, which never agree, so it
never deletes anything). On a shared file system mtimes come from the server's clock: keep
``orphan_age_s`` well above the clock skew plus the longest capture.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from datagen.errors import CaptureFileError
from datagen.features.locks import LOCK_SUFFIX, lock_held, lock_path

__all__ = ["CAPTURE_SUFFIX", "CaptureDir", "SweepResult"]

CAPTURE_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class SweepResult:
    files_removed: int
    locks_removed: int
    bytes_removed: int
    bytes_left: int


class CaptureDir:
    """The folder ``root`` where this worker reads a capture server's files.

    The server may mount it elsewhere, so a path it answers counts only by its name.
    """

    def __init__(self, root: Path, *, max_bytes: int | None, orphan_age_s: float) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.orphan_age_s = orphan_age_s

    def resolve(self, hidden_states_path: str) -> Path:
        """``root`` / the name of the path a server answered; refuses a name that is not a plain
        ``*.safetensors`` file name (so nothing outside ``root`` is ever read or removed)."""
        name = PurePosixPath(hidden_states_path).name
        if (
            not name.endswith(CAPTURE_SUFFIX)
            or name.startswith(".")
            or any(c in name for c in ("\\", "\0"))
            or hidden_states_path.endswith("/")
        ):
            raise CaptureFileError(
                f"the capture server answered hidden_states_path {hidden_states_path!r}, whose name is not"
                f" a plain *{CAPTURE_SUFFIX} file name: check its connector"
            )
        return self.root / name

    def remove(self, file: Path) -> None:
        """Delete a capture file and its lock; either may be gone already."""
        for path in (file, lock_path(file)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def sweep(self, *, in_use: set[str], now_s: float | None = None) -> SweepResult:
        """Remove capture files and locks older than ``orphan_age_s`` (by mtime, against ``now_s``,
        default ``time.time()``) unless their capture's name is in ``in_use`` or a writer still
        holds their lock."""
        now_s = time.time() if now_s is None else now_s
        files = locks = removed_bytes = left_bytes = 0
        for entry, stat in self._entries():
            capture = entry.name.removesuffix(LOCK_SUFFIX)
            old = now_s - stat.st_mtime > self.orphan_age_s
            if not old or capture in in_use or entry.name in in_use or lock_held(self.root / capture):
                left_bytes += stat.st_size
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed_bytes += stat.st_size
            if entry.name.endswith(LOCK_SUFFIX):
                locks += 1
            else:
                files += 1
        return SweepResult(
            files_removed=files, locks_removed=locks, bytes_removed=removed_bytes, bytes_left=left_bytes
        )

    def used_bytes(self) -> int:
        """The bytes the folder's capture files and locks take (a scan of the folder)."""
        return sum(stat.st_size for _, stat in self._entries())

    def over_cap(self) -> bool:
        """Whether the folder holds more than ``max_bytes`` (never, without a cap)."""
        return self.max_bytes is not None and self.used_bytes() > self.max_bytes

    def _entries(self) -> list[tuple[os.DirEntry[str], os.stat_result]]:
        found = []
        with os.scandir(self.root) as it:
            for entry in it:
                if not entry.name.endswith((CAPTURE_SUFFIX, CAPTURE_SUFFIX + LOCK_SUFFIX)):
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    found.append((entry, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:  # removed since the listing
                    continue
        return found
