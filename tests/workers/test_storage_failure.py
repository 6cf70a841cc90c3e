"""Storage that fails for real (a path made into a file; tests run as root, so chmod proves
nothing): the worker keeps the RQ jobs open, reports the error, and resumes when storage does."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis
from rq import Queue
from rq.registry import FinishedJobRegistry, StartedJobRegistry

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import default_chat_template_path
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "sf"
N = 12


async def test_commits_wait_for_storage_and_nothing_is_acknowledged_meanwhile(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    spec = JobSpec(
        tokenizer=tokenizer_path,
        chat_template=str(default_chat_template_path()),
        short_max_new_tokens=200,
        long_threshold_tokens=100_000,
    )
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(N)]
    ingest_rows(redis_client, storage, Keys(NS), "job", spec, rows)
    records_dir = Path(storage.url("job", "records"))
    records_dir.parent.mkdir(parents=True, exist_ok=True)
    records_dir.write_text("not a directory")  # every shard commit now fails with an OSError
    queue = Queue(Keys(NS).queue_name(PromptClass.SHORT), connection=redis_client)
    jobs = JobStore(redis_client, Keys(NS))
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        worker = Worker(
            fast_worker_settings(redis_url, storage, NS, short_concurrency=N),
            [ServerSpec("s", url)],
            install_signal_handlers=False,
        )
        await worker.start()
        run = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 20
        while jobs.progress("job").storage_error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        progress = jobs.progress("job")
        assert progress.storage_error is not None and "cannot commit shard" in progress.storage_error
        assert progress.done == 0  # generated, but not one RQ job finished without its record
        assert StartedJobRegistry(queue=queue).get_job_count(cleanup=False) == N
        assert FinishedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0
        errors = next(s.value for m in worker.metrics.commit_errors.collect() for s in m.samples)
        assert errors >= 1
        records_dir.unlink()  # storage recovers
        while jobs.progress("job").state is not JobState.COMPLETED and time.monotonic() < deadline + 30:
            await asyncio.sleep(0.1)
        await worker.drain()
        await run
        await worker.close()
    progress = jobs.progress("job")
    assert (progress.state, progress.done, progress.storage_error) == (JobState.COMPLETED, N, None)
    assert len([r for b in storage.iter_record_batches("job") for r in b.to_pylist()]) == N
