"""The record writer refuses a deleted job's records, before and after it writes their shard."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.errors import JobNotFoundError
from datagen.storage import Storage
from tests.helpers import make_record
from workers.metrics import WorkerMetrics
from workers.writer import RecordWriter


def _writer(storage: Storage, answers: list[str | None]) -> tuple[RecordWriter, list[str]]:
    """A writer whose view of the job's incarnation is ``answers``, one per look (the last repeats)."""
    looked: list[str] = []

    def current(job_id: str) -> str | None:
        looked.append(job_id)
        return answers[min(len(looked), len(answers)) - 1]

    writer = RecordWriter(
        storage,
        WorkerMetrics(),
        worker_tag="w1",
        commit_interval_s=0.01,
        shard_max_records=10,
        current_incarnation=current,
    )
    return writer, looked


async def test_records_of_a_live_incarnation_are_committed_with_it(storage: Storage) -> None:
    writer, looked = _writer(storage, ["inc1"])
    writer.start()
    await writer.commit(make_record("s1", [1, 2, 3, 4], 2), "inc1")
    assert await writer.close(deadline_s=float("inf"))
    commits = storage.list_commits("job1")  # no manifest: every commit counts
    assert [c["incarnation"] for c in commits] == ["inc1"]
    assert looked == ["job1", "job1"]  # before and after the write


@pytest.mark.parametrize(
    ("answers", "what"),
    [
        ([None], "deleted before the write"),
        (["inc2"], "its id reused before the write"),
        (["inc1", None], "deleted while the shard was written"),
        (["inc1", "inc2"], "its id reused while the shard was written"),
    ],
)
async def test_records_of_a_gone_incarnation_are_dropped(
    storage: Storage, answers: list[str | None], what: str
) -> None:
    writer, _ = _writer(storage, answers)
    writer.start()
    with pytest.raises(JobNotFoundError, match="deleted or replaced"):
        await writer.commit(make_record("s1", [1, 2, 3, 4], 2), "inc1")
    assert await writer.close(deadline_s=float("inf"))
    assert storage.list_commits("job1") == [], what
    assert not list(Path(storage.root).glob("jobs/job1/records/*.parquet")), what
    assert writer.pending == 0
