"""The worker loop over real Redis/RQ and a simulator over real HTTP, driven in burst mode."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from rq import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import get_renderer
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from simulator import SpecialIds, expected_output, vllm_expected_output
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "w"
SEED = 7


@pytest.fixture(scope="module")
def simulator_url(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as url:
        yield url


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def engine_sim(request: pytest.FixtureRequest, tokenizer_path: str) -> Iterator[tuple[str, str]]:
    """A simulator speaking SGLang or vLLM, and which: the worker detects it."""
    with running_simulator(
        api=request.param, tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096
    ) as url:
        yield request.param, url


SPEC_DEFAULTS: dict[str, Any] = {
    "context_len": None,
    "short_max_new_tokens": 300,
    "long_max_new_tokens": 600,
    "long_threshold_tokens": 40,
    "sampling": {"sampling_seed": SEED},
}


def _ingest(
    redis_client: redis.Redis, storage: Storage, job_id: str, spec: JobSpec, rows: list[dict[str, Any]]
) -> None:
    ingest_rows(redis_client, storage, Keys(NS), job_id, spec, rows)


def _settings(redis_url: str, storage: Storage, **overrides: Any) -> WorkerSettings:
    return fast_worker_settings(
        redis_url, storage, NS, **{"short_concurrency": 8, "long_concurrency": 4, **overrides}
    )


async def _run_burst(settings: WorkerSettings, urls: list[str]) -> Worker:
    servers = ServerSpec.parse_many([f"s{i}={u}" for i, u in enumerate(urls)])
    worker = Worker(settings, servers, burst=True, install_signal_handlers=False)
    await worker.main()
    return worker


def _records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [row for batch in storage.iter_record_batches(job_id) for row in batch.to_pylist()]


def _rows(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        content = f"Question {i}: explain topic {i}." + (" Context sentence." * 12 if i % 5 == 0 else "")
        rows.append(
            {"id": f"q{i}", "messages": [{"role": "user", "content": content}], "partition": f"p{i % 3}"}
        )
    return rows


async def test_records_are_prompt_ids_plus_exact_simulated_output(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    engine_sim: tuple[str, str],
    tokenizer_path: str,
) -> None:
    api, url = engine_sim
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    rows = _rows(30)
    _ingest(redis_client, storage, "job1", spec, rows)
    worker = await _run_burst(_settings(redis_url, storage), [url])
    assert worker.fleet.servers[0].client.engine == api

    renderer = get_renderer(tokenizer_path, spec.chat_template, False, "{}")
    special = SpecialIds.from_tokenizer(renderer.tokenizer)
    records = {r["sample_id"]: r for r in _records(storage, "job1")}
    assert sorted(records) == sorted(r["id"] for r in rows)
    finishes = set()
    for row in rows:
        record = records[row["id"]]
        prompt_ids = renderer.render(row["messages"])
        max_new = spec.max_new_tokens(spec.classify(len(prompt_ids), None))
        if api == "vllm":
            by_vllm = vllm_expected_output(prompt_ids, max_tokens=max_new, seed=SEED, special=special)
            output_ids, finish = by_vllm.token_ids, str(by_vllm.finish_reason)
        else:
            expected = expected_output(prompt_ids, max_new_tokens=max_new, seed=SEED, special=special)
            output_ids, finish = expected.output_ids, expected.finish_reason["type"]
        assert record["input_ids"] == prompt_ids + output_ids
        assert record["prompt_len"] == len(prompt_ids)
        assert record["finish_type"] == finish
        assert record["max_new_tokens"] == max_new
        assert record["class"] == ("long" if len(prompt_ids) >= 40 else "short")
        assert record["partition"] == row["partition"]
        finishes.add(record["finish_type"])
    assert finishes == {"stop", "length"}  # the 300-token short limit cuts the long tail

    keys = Keys(NS)
    for cls in PromptClass:
        queue = Queue(keys.queue_name(cls), connection=redis_client, serializer=JSONSerializer)
        assert queue.count == 0
        assert StartedJobRegistry(queue=queue).count == 0
        assert FailedJobRegistry(queue=queue).count == 0
    finished = sum(
        FinishedJobRegistry(queue=Queue(keys.queue_name(c), connection=redis_client)).count
        for c in PromptClass
    )
    assert finished == 30
    progress = JobStore(redis_client, keys).progress("job1")
    assert (progress.state, progress.done, progress.failed, progress.in_flight) == (
        JobState.COMPLETED,
        30,
        0,
        0,
    )
    assert progress.output_tokens == sum(r["output_len"] for r in records.values())


async def test_faults_are_retried_and_the_job_completes(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    # The faults hang on rids, which carry the worker's random tag: 150 prompts make about 210 requests,
    # so each kind of fault is met with near certainty (0.9**210 < 1e-9 to miss one), and 20 attempts
    # leave no prompt failed (0.3**20 each). 40 prompts missed every 503 in one CI run.
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    _ingest(redis_client, storage, "job2", spec, _rows(150))
    with running_simulator(
        tokenizer_path=tokenizer_path, time_scale=0.0, fail_503_rate=0.1, fail_500_rate=0.1, abort_rate=0.1
    ) as flaky:
        worker = await _run_burst(_settings(redis_url, storage, max_attempts=20), [flaky])
    progress = JobStore(redis_client, Keys(NS)).progress("job2")
    assert (progress.state, progress.done, progress.failed) == (JobState.COMPLETED, 150, 0)
    records = _records(storage, "job2")
    assert len({r["sample_id"] for r in records}) == 150
    retried = {
        s.labels["reason"]: s.value
        for m in worker.metrics.retries.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert retried.get("ServerError", 0) > 0 and retried.get("GenerationAbortedError", 0) > 0
    assert retried.get("ServerUnavailableError", 0) > 0


async def test_a_fatal_400_fails_the_prompt_with_the_servers_message(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    # The job spec does not know the context; the server's 400 is what stops the long prompt.
    spec = job_spec(
        SPEC_DEFAULTS, tokenizer=tokenizer_path, long_threshold_tokens=10_000, short_max_new_tokens=64
    )
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "short"}]},
        {"id": "too_long", "messages": [{"role": "user", "content": "word " * 400}]},
    ]
    _ingest(redis_client, storage, "job3", spec, rows)
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=256) as small:
        # A worker that has not learned the context length sends the prompt as is.
        settings = _settings(redis_url, storage)
        worker = Worker(settings, [ServerSpec("small", small)], burst=True, install_signal_handlers=False)
        await worker.start()
        for server in worker.fleet.servers:
            server.context_len = None
        try:
            await worker.run()
        finally:
            await worker.drain()
            await worker.close()
    jobs = JobStore(redis_client, Keys(NS))
    progress = jobs.progress("job3")
    assert (progress.state, progress.done, progress.failed) == (JobState.COMPLETED, 1, 1)
    [report] = jobs.outcomes.failed_reports("job3", 10)
    assert report["sample_id"] == "too_long"
    assert "context length" in report["message"]
    failed = FailedJobRegistry(queue=Queue(Keys(NS).queue_name(PromptClass.SHORT), connection=redis_client))
    assert failed.get_job_ids() == [Keys(NS).rq_job_id("job3", "too_long", 0, 0)]


async def test_an_unreachable_server_gets_nothing_and_costs_no_attempt(
    redis_client: redis.Redis, redis_url: str, storage: Storage, simulator_url: str, tokenizer_path: str
) -> None:
    _ingest(redis_client, storage, "job4", job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path), _rows(12))
    await _run_burst(_settings(redis_url, storage, max_attempts=1), ["http://127.0.0.1:9", simulator_url])
    records = _records(storage, "job4")
    assert len(records) == 12
    assert {r["server"] for r in records} == {"s1"}
    assert {r["attempts"] for r in records} == {1}


async def test_hard_stop_hands_prompts_back_to_the_queue(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    _ingest(redis_client, storage, "job5", job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path), _rows(10))
    # Realistic speed: requests take seconds, so the drain deadline of 0 s catches them in flight.
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=1.0) as slow:
        settings = _settings(redis_url, storage, drain_timeout_s=0)
        worker = Worker(settings, [ServerSpec("slow", slow)], install_signal_handlers=False)
        await worker.start()
        run = asyncio.create_task(worker.run())
        while not any(worker.slots.tasks.values()):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await worker.drain()
        await run
        await worker.close()
    keys = Keys(NS)
    queue = Queue(keys.queue_name(PromptClass.SHORT), connection=redis_client, serializer=JSONSerializer)
    long = Queue(keys.queue_name(PromptClass.LONG), connection=redis_client, serializer=JSONSerializer)
    # Every prompt is queued again (handed back onto RQ's queue, or never dispatched), none lost.
    waiting = Dispatch(redis_client, keys)
    assert queue.count + long.count + waiting.depth(PromptClass.SHORT) + waiting.depth(PromptClass.LONG) == 10
    assert StartedJobRegistry(queue=queue).count == 0
    assert FailedJobRegistry(queue=queue).count == 0
    progress = JobStore(redis_client, keys).progress("job5")
    assert (progress.in_flight, progress.failed, progress.done) == (0, 0, 0)
