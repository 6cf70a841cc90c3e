"""Wait until a capture server has finished writing a hidden-states file.

vLLM's file connector creates ``<file>.lock`` and holds ``flock(LOCK_EX)`` on it before it answers;
it writes the file after the answer and then closes the lock, which releases it. So the file is
complete once a shared lock on ``<file>.lock`` can be taken. We try ``LOCK_SH | LOCK_NB`` every
``poll_s`` (it never blocks) and let go at once; unlike speculators' client we never delete the
lock here (`datagen.features.capture_dir` removes it with the file).

A server started with ``use_synchronization_lock: false`` makes no lock; then, or once someone
has removed it, we wait until the file exists. Without a lock a file can be seen half written:
:func:`datagen.features.capture_file.check_and_store` then refuses it as truncated.
"""

from __future__ import annotations

import asyncio
import enum
import fcntl
import os
import time
from pathlib import Path

from datagen.errors import CaptureFileError

__all__ = ["DEFAULT_POLL_S", "LOCK_SUFFIX", "lock_held", "lock_path", "wait_for_write"]

LOCK_SUFFIX = ".lock"
# A capture is written within milliseconds to seconds of its answer; 20 ms keeps the added latency
# small at a cost of two system calls per poll.
DEFAULT_POLL_S = 0.02


class _State(enum.Enum):
    WRITING = "writing"  # the lock is held
    WRITTEN = "written"  # the lock was released, or there is none, and the file exists
    NO_FILE_YET = "no file yet"  # no lock, no file
    WRITER_GONE = "writer gone"  # the lock was released and no file came


def lock_path(file: Path) -> Path:
    return file.with_name(file.name + LOCK_SUFFIX)


def lock_held(file: Path) -> bool | None:
    """Whether a writer holds ``file``'s lock now; ``None`` when there is no lock."""
    try:
        fd = os.open(lock_path(file), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        # Closing the descriptor also drops the shared lock if it was taken.
        os.close(fd)
    return False


def _probe(file: Path) -> _State:
    held = lock_held(file)
    if held:
        return _State.WRITING
    if file.exists():
        return _State.WRITTEN
    return _State.NO_FILE_YET if held is None else _State.WRITER_GONE


async def wait_for_write(file: Path, *, timeout_s: float, poll_s: float = DEFAULT_POLL_S) -> None:
    """Return once ``file`` is written; raise :class:`~datagen.errors.CaptureFileError` when its
    writer released the lock without writing it, or when ``timeout_s`` passes first (a slow writer:
    the file, if it comes, is an orphan for the sweep)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        state = _probe(file)
        if state is _State.WRITTEN:
            return
        if state is _State.WRITER_GONE:
            raise CaptureFileError(
                f"capture file {file.name}: its writer released {lock_path(file).name} without writing it"
                " (a failed write or a server crash)"
            )
        if time.monotonic() >= deadline_s:
            raise CaptureFileError(_timeout_message(file, state, timeout_s))
        await asyncio.sleep(poll_s)


def _timeout_message(file: Path, state: _State, timeout_s: float) -> str:
    if state is _State.WRITING:
        waited = f"the server still held {lock_path(file).name} (a writer slower than the bound)"
    else:
        waited = "the file did not appear and there is no lock (use_synchronization_lock off?)"
    return f"capture file {file.name}: not written after {timeout_s:g} s: {waited}"
