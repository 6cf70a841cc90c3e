"""A job's manifest and ending markers are held to the job whose folder holds them
(`datagen.records.belonging`): a file that names another job, ending or a newer incarnation is
refused, once in the log, and never acted on; files of the previous release are still read."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from datagen.errors import ForeignFileError
from datagen.records.schema import records_to_table
from datagen.records.storage import Storage
from tests.support.records import make_record

INC = "a" * 32
CREATED_MS = 1_000_000


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    store = Storage(tmp_path)
    store.write_manifest("j1", {"job_id": "j1", "incarnation": INC, "created_at_ms": CREATED_MS})
    return store


def _plant(storage: Storage, name: str, body: object) -> Path:
    path = Path(storage.url("j1", name))
    path.write_text(json.dumps(body) if not isinstance(body, str) else body)
    return path


def test_an_ending_names_its_job_ending_and_incarnation_and_counts_for_that_incarnation_only(
    storage: Storage,
) -> None:
    storage.write_ending("j1", "deleted", INC)
    marker = json.loads(Path(storage.url("j1", "deleted.json")).read_text())
    assert {k: marker[k] for k in ("job_id", "ending", "incarnation")} == {
        "job_id": "j1",
        "ending": "deleted",
        "incarnation": INC,
    }
    assert storage.ending("j1", "deleted", INC)
    assert not storage.ending("j1", "cancelled", INC)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (
            {"job_id": "j2", "ending": "deleted", "incarnation": INC, "at_ms": CREATED_MS + 1},
            "names job 'j2'",
        ),
        ({"job_id": "j1", "ending": "cancelled", "incarnation": INC, "at_ms": 1}, "says 'cancelled'"),
        (
            {"job_id": "j1", "ending": "deleted", "incarnation": "b" * 32, "at_ms": CREATED_MS},
            "names incarnation",
        ),
        ({"job_id": "j1", "ending": "deleted", "at_ms": CREATED_MS}, "names no incarnation"),
        ("[1, 2", "is not a JSON object"),
        (["deleted"], "is not a JSON object"),
    ],
)
def test_a_marker_that_is_not_the_jobs_is_refused_with_one_log_line(
    storage: Storage, caplog: pytest.LogCaptureFixture, body: object, problem: str
) -> None:
    caplog.set_level(logging.WARNING, logger="datagen.records.manifests")
    path = _plant(storage, "deleted.json", body)
    assert not storage.ending("j1", "deleted", INC)
    assert not storage.ending("j1", "deleted", INC)  # read again: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"{path} {problem}"), lines


def test_an_earlier_incarnations_marker_is_outdated_without_a_word(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="datagen.records.manifests")
    _plant(
        storage, "deleted.json", {"job_id": "j1", "ending": "deleted", "incarnation": "b" * 32, "at_ms": 5}
    )
    assert not storage.ending("j1", "deleted", INC)
    _plant(storage, "cancelled.json", {"incarnation": "b" * 32, "at_ms": 5})  # the previous release's
    assert not storage.ending("j1", "cancelled", INC)
    assert caplog.records == []


def test_a_marker_of_the_previous_release_counts_when_its_incarnation_is_the_manifests(
    storage: Storage,
) -> None:
    _plant(storage, "cancelled.json", {"incarnation": INC, "at_ms": 5})
    assert storage.ending("j1", "cancelled", INC)


def test_a_manifest_naming_another_job_is_refused_by_every_reader_and_its_job_left_out(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="datagen.records.manifests")
    storage.write_manifest("j2", {"job_id": "j2", "incarnation": "c" * 32})
    table = records_to_table([make_record("s", [1, 2, 3], 2)])
    storage.commit_shard("j1", "w-1", table, {"incarnation": INC})
    storage.commit_shard("j2", "w-1", table, {"incarnation": "c" * 32})
    assert storage.list_jobs() == ["j1", "j2"]
    copied = Path(storage.url("j1", "manifest.json"))
    copied.write_bytes(Path(storage.url("j2", "manifest.json")).read_bytes())
    with pytest.raises(ForeignFileError, match=rf"^{copied} names job 'j2', not j1: refused"):
        storage.read_manifest("j1")
    with pytest.raises(ForeignFileError):
        storage.list_commits("j1")  # an export of j1 says why, not j2's records
    assert storage.list_jobs() == ["j2"]
    assert [r.getMessage() for r in caplog.records] == [
        f"job j1 left alone: {copied} names job 'j2', not j1: refused, not acted on (nothing of job j1 "
        "was rebuilt from it or dropped). Put the job's own manifest.json back, or remove the file"
    ]


def test_a_manifest_that_is_not_json_is_refused_and_one_without_a_job_id_read_as_is(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.write_manifest("j1", {"v": 1})  # a tool's: names no job
    assert storage.read_manifest("j1") == {"v": 1}
    Path(storage.url("j1", "manifest.json")).write_bytes(b"\xff not json")
    with pytest.raises(ForeignFileError, match="is not a JSON object"):
        storage.read_manifest("j1")
    Path(storage.url("j3")).mkdir()  # a job with no manifest yet is listed
    assert storage.list_jobs() == ["j3"]
