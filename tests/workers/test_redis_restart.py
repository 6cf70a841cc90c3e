"""Redis dies (kill -9) and comes back from its AOF mid-job: the worker carries on, nothing is lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis
from rq import Queue
from rq.registry import FailedJobRegistry, StartedJobRegistry

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import default_chat_template_path
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from datagen_cli.local.redis_server import LocalRedis, free_port
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "rr"
N = 60


async def test_worker_survives_a_redis_kill_and_restart(tmp_path: Path, tokenizer_path: str) -> None:
    port, data_dir = free_port(), tmp_path / "redis"
    data_dir.mkdir()
    server = LocalRedis(port=port, appendonly=True, data_dir=str(data_dir)).start()
    client = redis.Redis.from_url(server.url)
    storage = Storage(tmp_path / "data")
    spec = JobSpec(
        tokenizer=tokenizer_path,
        chat_template=str(default_chat_template_path()),
        short_max_new_tokens=400,
        long_threshold_tokens=100_000,
    )
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(N)]
    ingest_rows(client, storage, Keys(NS), "job", spec, rows)
    time.sleep(1.2)  # appendfsync everysec: let the enqueue reach the disk before the kill
    jobs = JobStore(client, Keys(NS))
    try:
        with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.01) as url:
            settings = fast_worker_settings(server.url, storage, NS, short_concurrency=8)
            worker = Worker(settings, [ServerSpec("s", url)], install_signal_handlers=False)
            await worker.start()
            run = asyncio.create_task(worker.run())
            while jobs.progress("job").done < 10:
                await asyncio.sleep(0.1)
            assert server.process is not None
            server.process.kill()  # no shutdown, no final fsync
            server.process.wait()
            await asyncio.sleep(2.0)
            server = LocalRedis(port=port, appendonly=True, data_dir=str(data_dir)).start()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    if jobs.progress("job").state is JobState.COMPLETED:
                        break
                except redis.RedisError:
                    pass
                await asyncio.sleep(0.2)
            await worker.drain()
            await run
            await worker.close()
        progress = jobs.progress("job")
        assert (progress.state, progress.done, progress.failed, progress.in_flight) == (
            JobState.COMPLETED,
            N,
            0,
            0,
        )
        records = [r for b in storage.iter_record_batches("job") for r in b.to_pylist()]
        assert {r["sample_id"] for r in records} == {f"r{i}" for i in range(N)}
        repeated = len(records) - N  # work acknowledged in the last second before the kill may rerun
        assert repeated <= 8 + 8
        queue = Queue(Keys(NS).queue_name(PromptClass.SHORT), connection=client)
        assert StartedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0
        assert FailedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0
        assert queue.count == 0
    finally:
        client.close()
        server.stop()
