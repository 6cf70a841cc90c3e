from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from datagen.errors import InvalidSpecError, StorageError
from datagen.export import ExportFormat, export_id, export_job
from datagen.records.schema import RECORD_SCHEMA, SCHEMA_VERSION, Record, loss_mask, records_to_table
from datagen.records.storage import Storage
from tests.support.records import make_record, write_manifest_once


def _record(
    sample_id: str, turn: int = 0, gen: int = 0, ids: list[int] | None = None, prompt_len: int = 3
) -> Record:
    ids = ids if ids is not None else [0, 128803, 128804, 42, 1]
    return make_record(sample_id, ids, prompt_len, turn=turn, gen=gen, partition="p", server="sim")


def test_table_matches_schema_with_uint32_ids() -> None:
    table = records_to_table([_record("a", ids=[0, 2**32 - 1, 7], prompt_len=1)])
    assert table.schema == RECORD_SCHEMA
    row = table.to_pylist()[0]
    assert row["input_ids"] == [0, 2**32 - 1, 7]
    assert row["output_len"] == 2
    assert row["schema_version"] == SCHEMA_VERSION
    assert row["class"] == "short"


def test_commit_is_visible_only_with_its_commit_file(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.commit_shard(
        "job1", "w-00000001", records_to_table([_record("a"), _record("b")]), {"worker": "w"}
    )
    # An orphan shard without a commit file (a crash between the two steps) is not data.
    orphan = Path(storage.url("job1", "records", "w-00000002.parquet"))
    pq.write_table(records_to_table([_record("zzz")]), orphan)
    rows = [r for batch in storage.iter_record_batches("job1") for r in batch.to_pylist()]
    assert [r["sample_id"] for r in rows] == ["a", "b"]
    assert storage.list_commits("job1")[0]["records"] == 2
    assert not list(orphan.parent.glob("*.tmp"))


def test_commit_failure_is_a_storage_error(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    # A file where the job directory should be: writes fail for real, even as root.
    (tmp_path / "jobs").write_text("not a directory")
    with pytest.raises(StorageError, match="cannot commit shard"):
        storage.commit_shard("job1", "s1", records_to_table([_record("a")]), {})


def test_job_ids_cannot_escape_the_root(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="invalid job id"):
        Storage(tmp_path).url("../etc")


def test_manifest_is_written_once(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    assert write_manifest_once(storage, "j", {"v": 1}) == {"v": 1}
    assert write_manifest_once(storage, "j", {"v": 2}) == {"v": 1}
    assert storage.read_manifest("j") == {"v": 1}


def test_specforge_export_dedupes_and_masks(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.commit_shard("job1", "s1", records_to_table([_record("a"), _record("b", turn=1)]), {})
    # The same prompt committed again by a second worker after a crash: dropped.
    storage.commit_shard("job1", "s2", records_to_table([_record("a", ids=[9, 9, 9, 9])]), {})
    out = tmp_path / "job1.jsonl"
    stats = export_job(storage, "job1", ExportFormat.SPECFORGE, out)
    lines = [json.loads(line) for line in out.read_text("utf-8").splitlines()]
    assert (stats.records, stats.duplicates, stats.written) == (3, 1, 2)
    assert lines[0] == {"id": "a", "input_ids": [0, 128803, 128804, 42, 1], "loss_mask": [0, 0, 0, 1, 1]}
    assert lines[1]["id"] == "b_t1_g0"


def test_export_id_and_loss_mask() -> None:
    assert export_id("x", 0, 0) == "x"
    assert export_id("x", 0, 2) == "x_t0_g2"
    assert loss_mask(4, 1) == [0, 1, 1, 1]
