"""Verifiable storage: every commit object seals its shard (size, sha256, row count), and exports,
the report and `datagen verify` hold each shard to it before using a row of it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from datagen.errors import CorruptShardError
from datagen.export import ExportFormat, ExportOptions, export_job
from datagen.export.shuffle import bucket_count
from datagen.records.reader import MAX_NAMED_FEATURE_PROBLEMS, verify_job
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from datagen.report import build_report
from datagen_cli import app
from tests.support.export_jobs import REASONED, Sample, build_job, read_jsonl
from tests.support.records import features_tensors, make_record, store_features, write_manifest_once

JOB = "job1"
GOOD, BAD, LAST = "w-00000001", "w-00000002", "w-00000003"


def _records(*sample_ids: str) -> list[Record]:
    return [make_record(s, [0, 128803, 42, 128804, 7, 8, 1], 4, job_id=JOB) for s in sample_ids]


def _commit(storage: Storage, shard: str, *sample_ids: str, at_ms: int) -> Path:
    storage.commit_shard(JOB, shard, records_to_table(_records(*sample_ids)), {"committed_at_ms": at_ms})
    return Path(storage.url(JOB, "records", f"{shard}.parquet"))


def _three_shards(storage: Storage) -> Path:
    """Shards of 2, 3 and 1 records, in that commit order; returns the middle one's path."""
    _commit(storage, GOOD, "a", "b", at_ms=1)
    bad = _commit(storage, BAD, "c", "d", "e", at_ms=2)
    _commit(storage, LAST, "f", at_ms=3)
    return bad


def _flip(path: Path, offset: int) -> None:
    """Invert one byte in place (flipping it again restores it)."""
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0xFF]))


def _commit_object(storage: Storage, shard: str) -> Path:
    return Path(storage.url(JOB, "commits", f"{shard}.json"))


def test_commit_object_seals_the_bytes_written(storage: Storage) -> None:
    path = _commit(storage, GOOD, "a", "b", at_ms=1)
    commit = json.loads(_commit_object(storage, GOOD).read_text())
    data = path.read_bytes()
    assert commit["records"] == 2
    assert commit["size_bytes"] == len(data)
    assert commit["sha256"] == hashlib.sha256(data).hexdigest()
    assert pq.read_metadata(path).num_rows == 2


def test_every_single_byte_change_is_caught_by_export_and_verify(storage: Storage, tmp_path: Path) -> None:
    # One shard, so that each offset costs a read and a hash (about a millisecond), not a decode.
    shard = _commit(storage, BAD, "c", "d", "e", at_ms=1)
    out = tmp_path / "out.jsonl"
    original = shard.read_bytes()
    # Parquet ends with the footer, its 4-byte length and "PAR1".
    footer_at = len(original) - 8 - int.from_bytes(original[-8:-4], "little")
    for offset in range(len(original)):
        _flip(shard, offset)
        with pytest.raises(CorruptShardError, match="datagen verify job1") as caught:
            export_job(storage, JOB, ExportFormat.SPECFORGE, out)
        assert caught.value.path == str(shard), offset
        assert not out.exists(), offset  # a stopped export leaves nothing that looks whole
        result = verify_job(storage, JOB)
        assert [(s.path, s.records) for s in result.bad] == [(str(shard), 3)], offset
        assert (result.shards, result.records) == (1, 0), offset
        if offset >= footer_at:
            # A shuffle reads the footer unchecked first, for its bucket count: whatever a change
            # does to it, that is an estimate, not a crash (so --skip-unreadable gets to skip it).
            assert bucket_count(storage, JOB) == 1, offset
        _flip(shard, offset)
    assert shard.read_bytes() == original
    stats = export_job(storage, JOB, ExportFormat.SPECFORGE, out)
    assert [row["id"] for row in read_jsonl(out)] == ["c", "d", "e"]
    assert stats.written == 3 and not stats.skipped


def test_the_error_names_job_shard_and_both_hashes(storage: Storage, tmp_path: Path) -> None:
    bad = _three_shards(storage)
    expected = json.loads(_commit_object(storage, BAD).read_text())["sha256"]
    _flip(bad, 100)
    actual = hashlib.sha256(bad.read_bytes()).hexdigest()
    with pytest.raises(CorruptShardError) as caught:
        export_job(storage, JOB, ExportFormat.PARQUET, tmp_path / "pq")
    assert str(caught.value) == (
        f"job job1: committed shard {bad} has sha256 {actual} but its commit says {expected}: the file "
        "changed after it was committed; run `datagen verify job1` to list every bad shard, or export "
        "the rest with --skip-unreadable"
    )
    assert caught.value.records == 3


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda path: path.unlink(), "is missing, though its commit object names it"),
        (lambda path: path.write_bytes(path.read_bytes()[:-10]), "bytes but its commit says"),
    ],
)
def test_missing_and_truncated_shards_are_named(
    storage: Storage, damage: Callable[[Path], object], problem: str
) -> None:
    bad = _three_shards(storage)
    damage(bad)
    result = verify_job(storage, JOB)
    assert [(s.path, s.records) for s in result.bad] == [(str(bad), 3)]
    assert problem in result.bad[0].problem
    with pytest.raises(CorruptShardError, match=problem):
        list(storage.iter_record_batches(JOB))


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        (ExportFormat.SPECFORGE, ExportOptions(skip_unreadable=True)),
        # The shuffle reads every footer first, the truncated one's included.
        (ExportFormat.PARQUET, ExportOptions(skip_unreadable=True, shuffle_seed=1)),
    ],
)
def test_skip_unreadable_exports_the_other_shards(
    storage: Storage, tmp_path: Path, fmt: ExportFormat, options: ExportOptions
) -> None:
    bad = _three_shards(storage)
    bad.write_bytes(bad.read_bytes()[:-10])
    stats = export_job(storage, JOB, fmt, tmp_path / "out", options)
    assert [s.path for s in stats.skipped] == [str(bad)]
    assert stats.summary()["skipped_shards"] == 1 and stats.summary()["skipped_records"] == 3
    if fmt is ExportFormat.PARQUET:
        ids = sorted(r["id"] for f in stats.files for r in pq.read_table(f).to_pylist())
    else:
        ids = [r["id"] for r in read_jsonl(tmp_path / "out")]
    assert ids == ["a", "b", "f"]


def _commit_as_before_checksums(storage: Storage, shard: str, *sample_ids: str, records: int) -> Path:
    """A shard and commit object as earlier versions wrote them: no page checksums, no seal."""
    path = Path(storage.url(JOB, "records", f"{shard}.parquet"))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(records_to_table(_records(*sample_ids)), path, compression="zstd")
    commit = {"shard": shard, "records": records, "path": f"records/{shard}.parquet", "worker": "w"}
    _commit_object(storage, shard).parent.mkdir(parents=True, exist_ok=True)
    _commit_object(storage, shard).write_text(json.dumps(commit))
    return path


def test_old_commit_without_checksum_stays_exportable(storage: Storage, tmp_path: Path) -> None:
    _commit_as_before_checksums(storage, "old", "a", "b", records=2)
    _commit(storage, "new", "c", at_ms=1)
    stats = export_job(storage, JOB, ExportFormat.SPECFORGE, tmp_path / "out.jsonl")
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["a", "b", "c"]
    assert stats.written == 3
    result = verify_job(storage, JOB)
    assert (result.shards, result.records, result.unsealed, result.bad) == (2, 3, 1, [])
    cli = CliRunner().invoke(app, ["verify", JOB, "--storage", str(storage.root)])
    assert cli.exit_code == 0, cli.output
    assert "1 of them not verifiable (written before checksums)" in cli.stdout


def test_old_commit_with_another_row_count_is_refused(storage: Storage) -> None:
    _commit_as_before_checksums(storage, "old", "a", "b", records=3)
    with pytest.raises(CorruptShardError, match="holds 2 rows but its commit says 3"):
        list(storage.iter_record_batches(JOB))


def test_page_checksums_catch_a_changed_page_without_the_seal(storage: Storage) -> None:
    """Page CRCs are written too: a reader of a shard whose commit lost its seal still finds a
    changed data page (the last byte of the token ids' column chunk is in its last page's body)."""
    path = _commit(storage, GOOD, "a", "b", at_ms=1)
    commit = _commit_object(storage, GOOD)
    body = json.loads(commit.read_text())
    commit.write_text(json.dumps({k: v for k, v in body.items() if k not in ("sha256", "size_bytes")}))
    metadata = pq.read_metadata(path).row_group(0)
    ids = next(
        metadata.column(i)
        for i in range(metadata.num_columns)
        if metadata.column(i).path_in_schema.startswith("input_ids")
    )
    start = ids.dictionary_page_offset or ids.data_page_offset
    _flip(path, start + ids.total_compressed_size - 1)
    with pytest.raises(CorruptShardError, match=r"cannot be decoded .*CRC checksum verification failed"):
        list(storage.iter_record_batches(JOB, columns=["input_ids"]))


def test_report_names_a_corrupt_shard(storage: Storage) -> None:
    build_job(storage, [Sample("hi", REASONED), Sample("ho", REASONED)], shards=2)
    bad = Path(storage.url(JOB, "records", "w-00000001.parquet"))
    _flip(bad, 0)
    with pytest.raises(CorruptShardError, match=r"w-00000001\.parquet has sha256"):
        build_report(storage, JOB)


def test_cli_verify_lists_bad_shards(storage: Storage) -> None:
    bad = _three_shards(storage)
    args = ["verify", JOB, "--storage", str(storage.root)]
    clean = CliRunner().invoke(app, args)
    assert clean.exit_code == 0, clean.output
    assert clean.stdout.strip() == "job job1: 3 shards, 6 rows verified; 0 bad"
    _flip(bad, 7)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    first, summary = result.stdout.strip().splitlines()
    assert first.startswith(f"bad shard {bad} (3 records): it has sha256 ")
    assert summary == "job job1: 2 shards, 3 rows verified; 1 bad"


def test_cli_export_skip_unreadable_names_what_it_skipped(storage: Storage, tmp_path: Path) -> None:
    bad = _three_shards(storage)
    _flip(bad, 7)
    out = tmp_path / "out.jsonl"
    args = ["export", JOB, "--storage", str(storage.root), "--out", str(out), "--skip-unreadable"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["written"], summary["skipped_shards"], summary["skipped_records"]) == (3, 1, 3)
    assert f"skipped shard {bad} (3 records): it has sha256" in result.stderr
    assert "skipped 1 shard(s) of job job1 (3 records)" in result.stderr
    assert [r["id"] for r in read_jsonl(out)] == ["a", "b", "f"]


def test_cli_export_stops_at_a_bad_shard_in_one_line(storage: Storage, tmp_path: Path) -> None:
    bad = _three_shards(storage)
    _flip(bad, 7)
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "datagen_cli",
        "export",
        JOB,
        "--storage",
        str(storage.root),
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert result.returncode == 3, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"committed shard {bad} has sha256" in errors[0]
    assert "Traceback" not in result.stderr and not out.exists()


# Features files: each one a committed record names is held to the record's size and sha256.


def _features_job(
    storage: Storage, scratch: Path, sample_ids: list[str], *, features: bool = True
) -> list[str]:
    """One shard: a record per sample id with its own features file, then one whose capture gave
    up (``features_error``); returns the stored files' paths, in record order."""
    write_manifest_once(
        storage, JOB, {"job_id": JOB, "spec": {"features": {"layers": [2]} if features else None}}
    )
    ids = [0, 128803, 42, 128804, 7, 8, 1]
    records, paths = [], []
    for index, sample_id in enumerate(sample_ids):
        states = np.full((len(ids), 1, 2), index, dtype=np.float32)
        name = f"{sample_id}.safetensors"
        fields = store_features(storage, JOB, name, features_tensors(ids, states), scratch)
        records.append(make_record(sample_id, ids, 4, job_id=JOB, **fields))
        paths.append(storage.feature_url(JOB, name))
    records.append(make_record("none", ids, 4, job_id=JOB, features_error="every capture try failed"))
    storage.commit_shard(JOB, GOOD, records_to_table(records), {"committed_at_ms": 1})
    return paths


def test_verify_holds_every_features_file_to_its_record(storage: Storage, tmp_path: Path) -> None:
    a, b, c = (Path(p) for p in _features_job(storage, tmp_path / "scratch", ["a", "b", "c"]))
    args = ["verify", JOB, "--storage", str(storage.root)]
    result = verify_job(storage, JOB)
    assert (result.features, result.features_missing, result.features_bad, result.features_none) == (
        3,
        0,
        0,
        1,
    )
    assert result.ok and result.feature_problems == []
    clean = CliRunner().invoke(app, args)
    assert clean.exit_code == 0, clean.output
    assert clean.stdout.strip().splitlines() == [
        "job job1: 1 shards, 4 rows verified; 0 bad",
        "job job1: 3 features files verified; 0 missing, 0 bad; 1 records without features",
    ]

    a.unlink()  # missing
    recorded_b = hashlib.sha256(b.read_bytes()).hexdigest()
    _flip(b, b.stat().st_size - 1)  # one changed byte: same size, another sha256
    c.write_bytes(c.read_bytes() + b"\0")  # another size
    result = verify_job(storage, JOB)
    assert (result.features, result.features_missing, result.features_bad) == (3, 1, 2)
    assert not result.ok and result.records == 4 and result.bad == []
    changed_b = hashlib.sha256(b.read_bytes()).hexdigest()
    size_c = c.stat().st_size
    assert result.feature_problems == [
        f"record a: features file {a} is missing",
        f"record b: features file {b} has sha256 {changed_b} but the record says {recorded_b}",
        f"record c: features file {c} has {size_c} bytes but the record says {size_c - 1}",
    ]
    damaged = CliRunner().invoke(app, args)
    assert damaged.exit_code == 1, damaged.output
    assert damaged.stdout.strip().splitlines() == [
        "job job1: 1 shards, 4 rows verified; 0 bad",
        *(f"bad features file: {problem}" for problem in result.feature_problems),
        "job job1: 0 features files verified; 1 missing, 2 bad; 1 records without features",
    ]


def test_verify_names_the_first_bad_features_files_and_counts_the_rest(
    storage: Storage, tmp_path: Path
) -> None:
    sample_ids = [f"s{i:02d}" for i in range(MAX_NAMED_FEATURE_PROBLEMS + 2)]
    for path in _features_job(storage, tmp_path / "scratch", sample_ids):
        Path(path).unlink()
    result = verify_job(storage, JOB)
    assert result.features_missing == MAX_NAMED_FEATURE_PROBLEMS + 2
    assert len(result.feature_problems) == MAX_NAMED_FEATURE_PROBLEMS
    cli = CliRunner().invoke(app, ["verify", JOB, "--storage", str(storage.root)])
    assert cli.exit_code == 1, cli.output
    assert cli.stdout.strip().splitlines()[-2:] == [
        "… and 2 more bad features files",
        "job job1: 0 features files verified; 22 missing, 0 bad; 1 records without features",
    ]


def test_verify_reads_no_features_of_a_job_without_them(storage: Storage, tmp_path: Path) -> None:
    for path in _features_job(storage, tmp_path / "scratch", ["a"], features=False):
        Path(path).unlink()  # what a record names is not read: the job's spec has no features
    result = verify_job(storage, JOB)
    assert (result.records, result.features, result.features_missing) == (2, 0, 0) and result.ok
