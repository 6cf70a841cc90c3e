"""Rebuild: what a Redis that lost its data costs a job, against the job's own first ingestion.

A private Redis and a coordinator (in process, over its HTTP app) ingest a job of ``--rows`` short
prompts; then records for ``--committed`` of them are committed as a worker commits them (one shard
per 1,000), Redis is emptied (``FLUSHALL``, as a restart without persistence), and the clock runs
until the coordinator has seen the epoch gone and the rebuilt job is ``running`` again with every
uncommitted prompt back in its backlog.

Printed: the first ingestion's time (the baseline, measured in this run), the rebuild's time and
their ratio, the rebuild's time to read the committed keys alone, and the counts (which must be
exact: done = committed, queued = rows - committed).

Run: ``python bench/rebuild.py [--rows 20000] [--committed 10000]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from _common import job_spec, offline_hub, short_rows, write_jsonl
from fastapi.testclient import TestClient

from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen_cli.local.redis_server import LocalRedis
from service.app import create_app
from service.committed import read_committed

JOB = "bench"
SHARD_RECORDS = 1000
POLL_S = 0.05
TIMEOUT_S = 600.0


def _record(sample_id: str) -> Record:
    return Record(
        sample_id=sample_id,
        input_ids=[1, 2, 3, 4, 5, 6],
        prompt_len=3,
        job_id=JOB,
        turn=0,
        gen=0,
        partition="default",
        cls="short",
        finish_type="stop",
        finish_matched="1",
        finish_length=None,
        max_new_tokens=16,
        server="s",
        tokenizer="tok",
        sampling_params="{}",
        rid="r",
        worker="w",
        attempts=1,
        cached_tokens=0,
        num_retractions=0,
        e2e_latency_s=0.1,
        enqueued_at_ms=1,
        started_at_ms=2,
        finished_at_ms=3,
    )


def _wait(client: TestClient, ready: Any) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        response = client.get(f"/jobs/{JOB}")
        if response.status_code == 200 and ready(job := response.json()):
            return job  # type: ignore[no-any-return]
        time.sleep(POLL_S)
    raise SystemExit(f"the job did not get there within {TIMEOUT_S:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--committed", type=int, default=10_000)
    args = parser.parse_args()
    offline_hub()
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        dataset = Path(tmp) / "rows.jsonl"
        rows = short_rows(args.rows)
        write_jsonl(dataset, rows)
        settings = CoordinatorSettings(redis_url=server.url, storage=str(Path(tmp) / "data"), namespace="rb")
        spec = job_spec(context_len=32_768).model_dump_json()
        with TestClient(create_app(settings)) as client, open(dataset, "rb") as fh:
            started = time.perf_counter()
            response = client.post(
                "/jobs",
                data={"spec": spec, "job_id": JOB},
                files={"dataset": ("d.jsonl", fh, "application/jsonl")},
            )
            assert response.status_code == 202, response.text
            _wait(client, lambda job: job["state"] != "ingesting")
            first_s = time.perf_counter() - started

            storage = Storage(settings.storage)
            manifest = storage.read_manifest(JOB)
            assert manifest is not None
            ids = [str(r["id"]) for r in rows[: args.committed]]
            for n in range(0, len(ids), SHARD_RECORDS):
                records = [_record(i) for i in ids[n : n + SHARD_RECORDS]]
                info = {"worker": "w", "committed_at_ms": n, "incarnation": manifest["incarnation"]}
                storage.commit_shard(JOB, f"w-{n:08d}", records_to_table(records), info)
            read_started = time.perf_counter()
            read_committed(storage, JOB)
            read_s = time.perf_counter() - read_started

            redis.Redis.from_url(server.url).flushall()
            lost_at = time.perf_counter()
            job = _wait(client, lambda job: bool(job["rebuilt"]) and job["state"] != "ingesting")
            rebuild_s = time.perf_counter() - lost_at
    print(f"rows {args.rows}, committed {args.committed} ({len(ids) // SHARD_RECORDS or 1} shards)")
    print(f"first ingestion (baseline): {first_s:.2f} s")
    print(
        f"rebuild after Redis lost its data: {rebuild_s:.2f} s ({rebuild_s / first_s:.2f}x the first "
        f"ingestion; reading the committed keys alone {read_s:.2f} s, epoch checked every 1 s)"
    )
    print(
        f"rebuilt job: total {job['total']}, done {job['done']}, queued {job['queued']}, state {job['state']}"
    )
    assert (job["total"], job["done"], job["queued"]) == (
        args.rows,
        args.committed,
        args.rows - args.committed,
    )


if __name__ == "__main__":
    main()
