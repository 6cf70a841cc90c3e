"""The dry run and ingestion admit rows by one rule (`service.admit`): the same dataset under the same
spec gives the same number of prompts in both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from datagen.settings import CoordinatorSettings
from tests.support.ingest import wait_ingested
from tests.support.specs import make_spec

NS = "t"


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _row(sample_id: str, partition: str | None, text: str = "Hi") -> str:
    row: dict[str, object] = {
        "id": sample_id,
        "messages": [{"role": "user", "content": f"{text} {sample_id}"}],
    }
    if partition is not None:
        row["partition"] = partition
    return json.dumps(row)


def _dry_run_and_ingest(client: TestClient, rows: list[str], spec: str) -> tuple[Any, Any]:
    body = ("\n".join(rows) + "\n").encode()
    files = {"dataset": ("d.jsonl", body, "application/jsonl")}
    preview = client.post("/jobs/dry-run", data={"spec": spec}, files=files)
    assert preview.status_code == 200, preview.text
    submitted = client.post("/jobs", data={"spec": spec}, files=files)
    assert submitted.status_code == 202, submitted.text
    return preview.json(), wait_ingested(client, submitted.json()["id"])


def test_a_partition_filter_admits_as_many_rows_in_the_dry_run_as_in_ingestion(client: TestClient) -> None:
    rows = [
        _row("a", "math"),
        _row("b", "chat"),
        _row("c", "math"),
        _row("d", None),  # the default partition
        _row("e", "code"),
        "{broken",
    ]
    preview, job = _dry_run_and_ingest(client, rows, json.dumps(make_spec(partitions=["math", "code"])))
    # Written by hand: rows a, c (math) and e (code); b and d are outside the filter, line 6 is broken.
    assert preview["prompts"] == 3
    assert job["total"] == 3
    assert [r["line"] for r in preview["rejected"]] == [6] and job["rejected"] == 1


def test_a_reused_id_and_an_exact_repeat_count_alike_in_the_dry_run_and_in_ingestion(
    client: TestClient,
) -> None:
    rows = [_row("a", None), _row("a", None), _row("a", None, text="Bye"), _row("b", None)]
    preview, job = _dry_run_and_ingest(client, rows, json.dumps(make_spec()))
    # Written by hand: lines 1 and 4 become prompts; line 2 repeats line 1 (skipped, not rejected);
    # line 3 reuses id "a" with other content (rejected).
    assert preview["prompts"] == 2
    assert job["total"] == 2
    assert [r["line"] for r in preview["rejected"]] == [3] and job["rejected"] == 1
