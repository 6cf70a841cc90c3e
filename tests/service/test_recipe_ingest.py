"""Ingestion under a recipe, in the app over real Redis: each (row, sample) gets its arm and its arm's
rendering, and hygiene judges a row once, not once per arm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import redis
from fastapi.testclient import TestClient
from rq.job import Job

from datagen.control.keys import Keys
from datagen.control.payload import PromptPayload
from datagen.control.rq_format import SERIALIZER, payload_of
from datagen.settings import CoordinatorSettings
from datagen.states import PromptClass
from tests.support.ingest import wait_ingested
from tests.support.specs import make_spec

NS = "ri"
RECIPE = {
    "assign": "cycle",
    "arms": [
        {"name": "think"},
        {"name": "answer", "chat_template_kwargs": {"thinking": False}},
        {"name": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
    ],
}
# Written out from the tokenizer's vocabulary: the generation prompt of the user turn "Hi" under each
# arm (see tests/datagen/test_recipes.py for the tokens).
HI = {
    "think": [0, 128803, 23166, 128804, 128821, 201],
    "answer": [0, 128803, 23166, 128804, 128821, 271, 128822, 271],
    "high": [0, 77666, 288, 28, 1669, 128803, 23166, 128804, 128821, 201],
}


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _queued(redis_client: redis.Redis, job_id: str) -> list[PromptPayload]:
    backlog = cast(list[bytes], redis_client.lrange(Keys(NS).job_backlog(job_id, PromptClass.SHORT), 0, -1))
    ids = [i.decode() for i in backlog]
    payloads = []
    for rq_id in ids:
        raw = payload_of(Job.fetch(rq_id, connection=redis_client, serializer=SERIALIZER))
        payloads.append(PromptPayload.from_json(raw))
    return payloads


def test_each_sample_gets_its_arm_and_a_duplicate_row_is_rejected_once(
    client: TestClient, redis_client: redis.Redis
) -> None:
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": "b", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"id": "c", "messages": [{"role": "user", "content": "Hi"}]},  # a duplicate of a's content
        {"id": "d", "messages": [{"role": "user", "content": "Name a prime."}]},
    ]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    spec = json.dumps(make_spec(samples=2, recipe=RECIPE))
    submitted = client.post(
        "/jobs", data={"spec": spec}, files={"dataset": ("d.jsonl", body, "application/jsonl")}
    )
    assert submitted.status_code == 202, submitted.text
    job = wait_ingested(client, submitted.json()["id"])
    # Hygiene judged the duplicate row once: one row rejected, not one per arm or per sample.
    assert (job["rows"], job["rejected"], job["total"]) == (4, 1, 6)

    payloads = {(p.sample_id, p.gen): p for p in _queued(redis_client, job["id"])}
    # cycle over the file's rows, two samples each: i = row_index * 2 + gen, arm i mod 3. Row c (index
    # 2) was rejected but still counts its place: d (index 3) gets arms 6 mod 3 and 7 mod 3.
    assert {key: p.arm for key, p in payloads.items()} == {
        ("a", 0): "think",
        ("a", 1): "answer",
        ("b", 0): "high",
        ("b", 1): "think",
        ("d", 0): "think",
        ("d", 1): "answer",
    }
    assert payloads[("a", 0)].prompt_ids == HI["think"]
    assert payloads[("a", 1)].prompt_ids == HI["answer"]
