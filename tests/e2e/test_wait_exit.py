"""`datagen submit --wait` learns a job's end from a long poll (`GET /jobs/{id}?wait_s=`), not at its
next once-a-second poll: it returns within 0.5 s of the completion the last ack records
(`finished_at_ms`). Real HTTP to a coordinator, a worker in burst mode, the simulator."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import redis
from rich.console import Console

from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen_cli.client import CoordinatorClient
from datagen_cli.waiting import EXIT_ALL_DONE, wait_for_job
from tests.support.processes import serve_coordinator
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.wait import wait_until
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "waitexit"
ROWS = 30
# The bound the issue sets, from the job's completion in Redis to the command's return.
MAX_EXIT_DELAY_MS = 500


async def test_submit_wait_returns_within_half_a_second_of_the_jobs_end(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, tokenizer_path: str
) -> None:
    storage = Storage(str(tmp_path / "data"))
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage.root), namespace=NS)
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}"}) + "\n" for i in range(ROWS))
    )
    with serve_coordinator(settings) as url, CoordinatorClient(url) as client:
        job_id = client.submit(dataset, make_spec(short_max_new_tokens=16))["id"]
        wait_until(lambda: client.job(job_id)["state"] != "ingesting", 30, f"job {job_id} to be ingested")
        ended: dict[str, float] = {}

        def wait() -> None:
            with CoordinatorClient(url) as own:
                ended["code"] = wait_for_job(own, job_id, Console(file=io.StringIO()))
            ended["at_ms"] = time.time() * 1000

        waiter = threading.Thread(target=wait)
        waiter.start()
        with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as sim:
            worker = Worker(
                fast_worker_settings(redis_url, storage, NS),
                [ServerSpec("s0", sim)],
                burst=True,
                install_signal_handlers=False,
            )
            await worker.main()
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "submit --wait did not return after the job completed"

    finished_ms = int(redis_client.hget(Keys(NS).job(job_id), "finished_at_ms") or 0)
    assert ended["code"] == EXIT_ALL_DONE and finished_ms > 0
    assert ended["at_ms"] - finished_ms <= MAX_EXIT_DELAY_MS, ended["at_ms"] - finished_ms
