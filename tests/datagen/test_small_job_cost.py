"""What one small job costs Redis, counted command by command (MONITOR) over a real Redis, the
coordinator's app and a worker in this process and the simulator: its submit, creation, ingestion,
claims, its shard's ack and its completion, by the job's own commands
(`tests.support.redis_monitor.job_commands`, which `bench/tenants.py` counts by too).

Issue 41's target is 60 commands for a 3-prompt job, held here but for what the fleet's timers add
while the job runs; `MAX_COMMANDS` bounds them too (see bench/README.md, "tenants.py", for where the
60 go), so that neither can grow back.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from datagen.control.keys import Keys
from datagen.control.servers import live_servers
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from service.app import create_app
from tests.support.redis_monitor import RedisMonitor, job_commands
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.run import writer
from workers.worker import Worker

NS = "cost"
JOB = "smalljob7"
PROMPTS = 3
TARGET_COMMANDS = 60  # issue 41
# 58 alone (59 when its claim makes a new window bucket and sets the bucket's TTL; a worker
# heartbeat's ZADD, every 0.5 s, is one more when it falls inside the job), plus a margin for a
# loaded machine's heartbeats (prompts in flight for up to 4 s, and GATHER_S more). The chunk
# lands in one script, so a claim never finds half of it and a second claim script (about 20 more)
# cannot come. Issue 41 took it from 108-109: the submit reads nothing before the create of a job
# storage has no manifest of, and answers from what its create returned, the create sets the
# ingest input and fence, ingestion's start reads nothing for a job made just now; the chunk
# lands, and its last one ends the ingestion, in one script (`ingest_land.lua`: fence, checkpoint,
# labels, room and the job's counters read once and written once, the first three as fields of the
# job's hash); the counting rules read and write the job once, its partition's label with it
# (`count_and_complete` in lib.lua: the ack 23 -> 15); the claim hands out the job's run facts
# with its weight (the worker reads nothing of it first); the writer looks at the job once a
# shard; RQ's set of queues is named at the coordinator's start, not by every chunk. Before issue
# 41: about 140.
MAX_COMMANDS = 69
WAIT_S = 60.0
GATHER_S = 1.0


async def test_one_small_job_costs_redis_at_most_max_commands(
    redis_url: str, tmp_path: Path, tokenizer_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Storage(str(tmp_path / "data"))
    # The writer commits a job's first records, and a job's last, once they have gathered for
    # EARLY_GATHER_S (0.05 s). A loaded machine can finish the 3 prompts further apart than that
    # and write them as two shards: a second ack, 9 commands more (a CI run counted 67). The job
    # measured is the one the target names, one shard's ack, so they gather for longer here: the
    # early gather and the commit interval both (a batch is also due a commit interval after its
    # first record, 0.05 s in the tests' worker settings, which alone would still split them).
    monkeypatch.setattr(writer, "EARLY_GATHER_S", GATHER_S)
    # Chunks of 32 rows from the first: no first-chunk deadline (0.1 s) that a loaded machine could
    # miss, so the 3 rows are always one chunk, as on an idle coordinator.
    settings = CoordinatorSettings(
        redis_url=redis_url, storage=str(storage.root), namespace=NS, enqueue_chunk=32
    )
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}"}) + "\n" for i in range(PROMPTS))
    poller = redis.Redis.from_url(redis_url, single_connection_client=True)
    poller_addr = str(poller.client_info()["addr"])
    job_key = Keys(NS).job(JOB)
    assert poller_addr.startswith("127.0.0.1:")
    with (
        TestClient(create_app(settings)) as client,
        running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as url,
    ):
        worker = Worker(
            fast_worker_settings(redis_url, storage, NS, poll_interval_s=0.2, commit_interval_s=GATHER_S),
            [ServerSpec("s0", url)],
            install_signal_handlers=False,
        )
        running = asyncio.create_task(worker.main())
        try:
            # The pre-flight needs a live server whose context length a worker reported (a loaded
            # machine lists the server a moment before it knows its length).
            await _until(
                lambda: any(info.get("context_len") for info in live_servers(poller, Keys(NS)).values())
            )
            # A first job loads the scripts and the tokenizer: the one measured is one more job.
            await _run(client, poller, "warmup", rows)
            await asyncio.sleep(1.0)
            with RedisMonitor(redis_url) as monitor:
                await _run(client, poller, JOB, rows)
                await asyncio.sleep(0.5)  # its last replies land
            counts, timed = job_commands(monitor.lines, JOB, NS, poller_addr)
        finally:
            worker.request_stop()
            await asyncio.wait_for(running, WAIT_S)
            poller.close()
    total = sum(counts.values())
    print(
        f"one {PROMPTS}-prompt job: {total} commands, {timed} of them the fleet's timers' "
        f"(target {TARGET_COMMANDS}): {counts.most_common()}"
    )
    with redis.Redis.from_url(redis_url) as client:
        assert int(client.hget(job_key, "done") or 0) == PROMPTS
    assert total - timed <= TARGET_COMMANDS, counts.most_common()
    assert total <= MAX_COMMANDS, counts.most_common()


async def _run(client: TestClient, poller: redis.Redis, job_id: str, rows: str) -> None:
    """Submit a job and wait for it to complete (reading its state with ``poller``, not the API)."""
    response = client.post(
        "/jobs",
        data={"spec": json.dumps(make_spec(short_max_new_tokens=16, context_len=None)), "job_id": job_id},
        files={"dataset": ("d.jsonl", rows.encode(), "application/jsonl")},
    )
    assert response.status_code == 202, response.text
    await _until(lambda: poller.hget(Keys(NS).job(job_id), "state") == b"completed")


async def _until(check: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
