"""Partition labels stay bounded in length as well as in number (issue 36): a job whose rows carry
400 KB partition values keeps the coordinator's ``/metrics`` small, over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from datagen.control.jobs import MAX_PARTITION_LABEL_CHARS
from datagen.control.keys import Keys
from datagen.control.redistext import as_texts
from datagen.settings import CoordinatorSettings
from tests.support.ingest import INGEST_TIMEOUT_S
from tests.support.metrics import metric_labels, metric_value
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "lb"
HUGE_PARTITION_CHARS = 400_000
HUGE_ROWS = 30
# docs/reference/metrics.md: a job whose partitions are all over-long adds a handful of series.
METRICS_BOUND_BYTES = 32 * 1024
UPLOAD_TIMEOUT_S = 60.0


@pytest.fixture
def served(redis_url: str, tmp_path: Path) -> Iterator[str]:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)
    with serve_coordinator(settings) as url:
        yield url


def _row(sample_id: str, partition: str) -> str:
    # Content differs row to row: deduplication would drop repeats.
    message = {"role": "user", "content": f"question {sample_id}"}
    return json.dumps({"id": sample_id, "messages": [message], "partition": partition})


def _wait_ingested(http: httpx.Client, job_id: str) -> dict[str, Any]:
    def ingested() -> dict[str, Any] | None:
        job: dict[str, Any] = http.get(f"/jobs/{job_id}").json()
        return job if job["state"] != "ingesting" else None

    return wait_until(ingested, INGEST_TIMEOUT_S, f"job {job_id} to be ingested")


def test_over_long_partitions_count_as_other_and_keep_metrics_small(
    served: str, redis_client: redis.Redis
) -> None:
    # 30 distinct 400 KB partitions, then one partition exactly at the cap and one just over it.
    huge = [f"{i:02d}" + "x" * (HUGE_PARTITION_CHARS - 2) for i in range(HUGE_ROWS)]
    at_cap, over_cap = "e" * 128, "o" * 129
    assert MAX_PARTITION_LABEL_CHARS == 128
    rows = [_row(f"h{i}", p) for i, p in enumerate(huge)] + [_row("edge", at_cap), _row("over", over_cap)]
    body = ("\n".join(rows) + "\n").encode()
    with httpx.Client(base_url=served, timeout=UPLOAD_TIMEOUT_S) as http:
        response = http.post(
            "/jobs",
            data={"spec": json.dumps(make_spec()), "job_id": "huge"},
            files={"dataset": ("d.jsonl", body, "application/jsonl")},
        )
        assert response.status_code == 202, response.text
        job = _wait_ingested(http, "huge")
        assert (job["state"], job["rows"], job["total"], job["rejected"]) == ("running", 32, 32, 0)
        text = http.get("/metrics").text

    assert len(text.encode()) < METRICS_BOUND_BYTES, len(text.encode())
    prompts = "datagen_job_prompts_total"
    assert metric_value(text, prompts, job="huge", partition="other", status="accepted") == 31
    assert metric_value(text, prompts, job="huge", partition=at_cap, status="accepted") == 1
    assert {labels["partition"] for labels in metric_labels(text, prompts)} == {"other", at_cap}
    # Nothing of the over-long values reached Redis's labelled set or the breakdown's fields.
    assert as_texts(redis_client.smembers(Keys(NS).job_partitions("huge"))) == [at_cap]
    fields = as_texts(redis_client.hkeys(Keys(NS).job_breakdown("huge")))
    assert sorted(fields) == [f"accepted|{at_cap}|short", "accepted|other|short"]
