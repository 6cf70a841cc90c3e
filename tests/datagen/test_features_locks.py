"""Waiting for a capture server's write: a real ``flock(LOCK_EX)`` held by another thread or process,
released in time or held past the bound, and servers that make no lock."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from datagen.errors import CaptureFileError
from datagen.features.locks import lock_held, lock_path, wait_for_write

# The other process prints this once it holds the lock.
HELD = "held"
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@contextmanager
def writer_lock(file: Path) -> Iterator[int]:
    """The server's side: create ``<file>.lock`` and hold LOCK_EX on it (its own open file
    description, so it conflicts with the reader in this same process)."""
    fd = os.open(lock_path(file), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield fd
    finally:
        os.close(fd)


def _write_then_release(file: Path, after_s: float, locked: threading.Event) -> None:
    with writer_lock(file):
        locked.set()
        time.sleep(after_s)
        file.write_bytes(b"written")


async def test_returns_once_the_writer_releases_its_lock(tmp_path: Path) -> None:
    file = tmp_path / "cmpl-a-0-00000000.safetensors"
    locked = threading.Event()
    writer = threading.Thread(target=_write_then_release, args=(file, 0.2, locked))
    writer.start()
    try:
        assert locked.wait(5)
        assert lock_held(file) is True
        started = time.monotonic()
        await wait_for_write(file, timeout_s=5)
        assert time.monotonic() - started >= 0.15
        assert file.read_bytes() == b"written"
    finally:
        writer.join(timeout=5)
    assert lock_held(file) is False
    assert lock_path(file).exists()  # never deleted here


async def test_a_lock_held_past_the_bound_by_another_process_times_out(tmp_path: Path) -> None:
    file = tmp_path / "cmpl-b-0-00000000.safetensors"
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(lock_path(file)), "30", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        assert (await holder.stdout.readline()).decode().strip() == HELD
        started = time.monotonic()
        with pytest.raises(
            CaptureFileError, match=r"not written after 0.3 s: the server still held .*\.lock"
        ):
            await wait_for_write(file, timeout_s=0.3, poll_s=0.01)
        assert 0.3 <= time.monotonic() - started < 3
    finally:
        holder.kill()
        await holder.wait()
    # The process is gone, so the kernel released its lock: no file came.
    with pytest.raises(CaptureFileError, match=r"released .*lock without writing it"):
        await wait_for_write(file, timeout_s=5)


async def test_waiting_never_blocks_the_event_loop(tmp_path: Path) -> None:
    file = tmp_path / "c.safetensors"
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    try:
        with writer_lock(file), pytest.raises(CaptureFileError):
            await wait_for_write(file, timeout_s=0.3)
    finally:
        task.cancel()
    assert ticks >= 20


async def test_a_finished_file_without_a_lock_returns_at_once(tmp_path: Path) -> None:
    file = tmp_path / "d.safetensors"
    file.write_bytes(b"x")
    started = time.monotonic()
    await wait_for_write(file, timeout_s=5)
    assert time.monotonic() - started < 0.5
    assert lock_held(file) is None


async def test_without_a_lock_the_file_is_awaited(tmp_path: Path) -> None:
    # A server with use_synchronization_lock false: only the file shows that it was written.
    file = tmp_path / "e.safetensors"
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, file.write_bytes, b"x")
    await wait_for_write(file, timeout_s=5)
    assert file.exists()


async def test_without_a_lock_or_a_file_the_wait_times_out(tmp_path: Path) -> None:
    with pytest.raises(
        CaptureFileError, match=r"f\.safetensors: not written after 0\.1 s: the file did not appear"
    ):
        await wait_for_write(tmp_path / "f.safetensors", timeout_s=0.1)
