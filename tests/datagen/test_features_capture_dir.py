"""The capture server's folder: names the server answers, removal, the orphan sweep by age, the cap."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

from datagen.errors import CaptureFileError
from datagen.features.capture_dir import CaptureDir, SweepResult

ORPHAN_AGE_S = 600.0
NOW_S = 1_800_000_000.0


def put(root: Path, name: str, size: int, age_s: float) -> Path:
    path = root / name
    path.write_bytes(b"\0" * size)
    os.utime(path, (NOW_S - age_s, NOW_S - age_s))
    return path


def test_a_path_counts_by_its_name_under_our_mount(tmp_path: Path) -> None:
    captures = CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S)
    assert captures.resolve("/srv/hidden/cmpl-af224c9ea1b4c618-0-85b9157b.safetensors") == (
        tmp_path / "cmpl-af224c9ea1b4c618-0-85b9157b.safetensors"
    )
    assert captures.resolve("chatcmpl-x-1.safetensors") == tmp_path / "chatcmpl-x-1.safetensors"


@pytest.mark.parametrize(
    "answered",
    [
        "",
        "/srv/hidden/",
        "/srv/hidden/.safetensors",
        "/srv/x.bin",
        "/srv/x.safetensors.lock",
        "/srv/..",
        "a\\b.safetensors",
        "/srv/x.safetensors/",
    ],
)
def test_a_name_that_is_not_a_plain_capture_file_is_refused(tmp_path: Path, answered: str) -> None:
    captures = CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S)
    with pytest.raises(CaptureFileError, match=r"not a plain .*safetensors file name"):
        captures.resolve(answered)


def test_remove_deletes_the_file_and_its_lock_and_minds_neither_gone(tmp_path: Path) -> None:
    captures = CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S)
    file = put(tmp_path, "a.safetensors", 10, 0)
    put(tmp_path, "a.safetensors.lock", 0, 0)
    captures.remove(file)
    assert list(tmp_path.iterdir()) == []
    captures.remove(file)
    put(tmp_path, "b.safetensors.lock", 0, 0)
    captures.remove(tmp_path / "b.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_removes_old_orphans_only(tmp_path: Path) -> None:
    captures = CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S)
    put(tmp_path, "old.safetensors", 100, ORPHAN_AGE_S + 1)
    put(tmp_path, "old.safetensors.lock", 0, ORPHAN_AGE_S + 1)
    put(tmp_path, "lockless.safetensors", 50, 3600)
    put(tmp_path, "young.safetensors", 30, ORPHAN_AGE_S - 1)
    put(tmp_path, "young.safetensors.lock", 0, ORPHAN_AGE_S - 1)
    put(tmp_path, "busy.safetensors", 20, 3600)  # its record is being stored
    put(tmp_path, "busy.safetensors.lock", 0, 3600)
    put(tmp_path, "notes.txt", 7, 3600)  # not ours
    result = captures.sweep(in_use={"busy.safetensors"}, now_s=NOW_S)
    assert result == SweepResult(files_removed=2, locks_removed=1, bytes_removed=150, bytes_left=50)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "busy.safetensors",
        "busy.safetensors.lock",
        "notes.txt",
        "young.safetensors",
        "young.safetensors.lock",
    ]


def test_the_sweep_goes_by_the_wall_clock(tmp_path: Path) -> None:
    captures = CaptureDir(tmp_path, max_bytes=None, orphan_age_s=1.0)
    (tmp_path / "new.safetensors").write_bytes(b"x")
    assert captures.sweep(in_use=set()).files_removed == 0
    stale_s = time.time() - 5
    os.utime(tmp_path / "new.safetensors", (stale_s, stale_s))
    assert captures.sweep(in_use=set()).files_removed == 1


def test_the_sweep_leaves_a_file_whose_writer_still_holds_the_lock(tmp_path: Path) -> None:
    captures = CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S)
    put(tmp_path, "slow.safetensors", 40, 3600)
    lock = put(tmp_path, "slow.safetensors.lock", 0, 3600)
    fd = os.open(lock, os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert captures.sweep(in_use=set(), now_s=NOW_S) == SweepResult(0, 0, 0, 40)
    finally:
        os.close(fd)
    assert captures.sweep(in_use=set(), now_s=NOW_S) == SweepResult(1, 1, 40, 0)


def test_used_bytes_and_the_cap(tmp_path: Path) -> None:
    put(tmp_path, "a.safetensors", 600, 0)
    put(tmp_path, "a.safetensors.lock", 0, 0)
    put(tmp_path, "b.safetensors", 500, 0)
    put(tmp_path, "big.bin", 10_000, 0)  # not a capture: not counted
    assert CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S).used_bytes() == 1100
    assert not CaptureDir(tmp_path, max_bytes=None, orphan_age_s=ORPHAN_AGE_S).over_cap()
    assert not CaptureDir(tmp_path, max_bytes=1100, orphan_age_s=ORPHAN_AGE_S).over_cap()
    assert CaptureDir(tmp_path, max_bytes=1099, orphan_age_s=ORPHAN_AGE_S).over_cap()
