"""Re-attaching to a job by resubmitting its dataset (same job id, same rows) changes none of its
counters: rows of the re-read upload are not counted again, bad rows included, and a completed job's
rates and tail stay those of its completion. Run end to end: coordinator API, a worker, the simulator."""

from __future__ import annotations

import hashlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from service.app import create_app
from service.rowids import LineDigests
from tests.support.ingest import wait_ingested
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "reattach"
JOB = "reattach_job"
MAX_NEW_TOKENS = 16
SPEC = json.dumps(make_spec(short_max_new_tokens=MAX_NEW_TOKENS, context_len=64))
# A later read waits this long: a rate or tail computed against the clock would move meanwhile.
LATER_S = 1.5


def _row(sample_id: str, content: str) -> str:
    return json.dumps({"id": sample_id, "messages": [{"role": "user", "content": content}]})


# Written by hand: lines 1, 2, 5 and 8 become prompts (4); line 6 repeats line 1 exactly (skipped);
# rejected are line 3 (invalid JSON), line 4 (no messages), line 7 (reuses r1's id with other
# content) and line 9 (cannot fit the context of 64 tokens): 4.
ROWS = [
    _row("r0", "question zero"),
    _row("r1", "question one"),
    "{not json",
    json.dumps({"id": "nm", "nothing": 1}),
    _row("r2", "question two"),
    _row("r0", "question zero"),
    _row("r1", "another question"),
    _row("r3", "question three"),
    _row("big", "word " * 100),
]
EXPECTED = {"rows": 9, "total": 4, "rejected": 4, "skipped": 1, "flagged": 0, "done": 4, "failed": 0}
REJECTED_LINES = [3, 4, 7, 9]
# Everything the job JSON says about its counters, rates and timing.
COUNTERS = (
    "state",
    "rows",
    "total",
    "rejected",
    "skipped",
    "flagged",
    "queued",
    "in_flight",
    "done",
    "failed",
    "cancelled",
    "retried",
    "prompt_tokens",
    "generated_tokens",
    "tokens_per_s",
    "elapsed_s",
    "eta_s",
    "created_at_ms",
    "finished_at_ms",
    "time_to_first_record_s",
    "tail_s",
)


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _submit(client: TestClient, rows: list[str] = ROWS) -> Any:
    body = ("\n".join(rows) + "\n").encode()
    response = client.post(
        "/jobs",
        data={"spec": SPEC, "job_id": JOB},
        files={"dataset": ("d.jsonl", body, "application/jsonl")},
    )
    assert response.status_code == 202, response.text
    return response.json()


def _counters(client: TestClient) -> dict[str, Any]:
    job = client.get(f"/jobs/{JOB}").json()
    return {name: job[name] for name in COUNTERS}


def _rejected_lines(client: TestClient) -> list[int]:
    errors = client.get(f"/jobs/{JOB}/errors", params={"kind": "rejected"}).json()["errors"]
    return sorted(e["line"] for e in errors)


def _counts(job: dict[str, Any]) -> tuple[int, int, int, int]:
    return job["rows"], job["total"], job["rejected"], job["skipped"]


async def test_resubmitting_a_completed_job_changes_no_counter(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, tokenizer_path: str
) -> None:
    storage = Storage(str(tmp_path / "data"))
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage.root), namespace=NS)
    with TestClient(create_app(settings)) as client:
        assert _submit(client)["created"] is True
        wait_ingested(client, JOB)
        with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as url:
            worker = Worker(
                fast_worker_settings(redis_url, storage, NS),
                [ServerSpec("s0", url)],
                burst=True,
                install_signal_handlers=False,
            )
            await worker.main()
        before = _counters(client)
        assert before["state"] == "completed"
        assert {name: before[name] for name in EXPECTED} == EXPECTED
        assert _rejected_lines(client) == REJECTED_LINES

        time.sleep(LATER_S)
        assert _submit(client)["created"] is False
        wait_ingested(client, JOB)
        after = _counters(client)
        time.sleep(LATER_S)
        later = _counters(client)
        rejected_after = _rejected_lines(client)

    assert after == before
    assert later == before
    # The re-read upload's bad rows are not reported again either.
    assert rejected_after == REJECTED_LINES


def test_a_resubmission_counts_only_the_rows_it_adds(client: TestClient) -> None:
    _submit(client)
    assert _counts(wait_ingested(client, JOB)) == (9, 4, 4, 1)
    # The same rows again, then a new good row (line 10) and two new bad ones (lines 11 and 12).
    more = [*ROWS, _row("r4", "question four"), "{still not json", json.dumps({"id": "nm2", "nothing": 2})]
    _submit(client, more)
    assert _counts(wait_ingested(client, JOB)) == (12, 5, 6, 1)
    # Another file whose line 3 is bad too, but another line than the first upload's line 3: counted.
    other = [_row("s0", "first of another part"), _row("s1", "second of another part"), "{other bad line"]
    _submit(client, other)
    assert _counts(wait_ingested(client, JOB)) == (15, 7, 7, 1)
    errors = client.get(f"/jobs/{JOB}/errors", params={"kind": "rejected"}).json()["errors"]
    assert sorted(e["line"] for e in errors) == [3, 3, 4, 7, 9, 11, 12]


def test_line_digests_follow_lines_read_in_pieces() -> None:
    data = b"one\n" + b"x" * 10 + b"\nlast"
    lines = LineDigests(io.BytesIO(data))
    # As `iter_prompts` reads a line over its cap: in pieces, until the newline.
    pieces = [lines.readline(5) for _ in range(5)]
    assert pieces == [b"one\n", b"xxxxx", b"xxxxx", b"\n", b"last"]
    assert lines.readline(5) == b""
    expected = [hashlib.sha1(line).hexdigest()[:16] for line in (b"one\n", b"x" * 10 + b"\n", b"last")]
    assert [lines.digest(line) for line in (1, 2, 3)] == expected
    assert lines.digest(4) == ""
