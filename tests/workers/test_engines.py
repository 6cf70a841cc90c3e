"""The engine seam end to end: a worker over real Redis/RQ and simulators speaking SGLang or vLLM
over real HTTP. Detection, exact records from vLLM, vLLM's finish and error rules, a mixed fleet,
the KV controller on vLLM's metrics, and forcing the engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.errors import ConfigError
from datagen.prompts.tokenization import PromptRenderer, get_renderer
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings, load
from datagen.spec import JobSpec
from datagen.states import EngineChoice, JobState, PromptClass
from simulator import SpecialIds, expected_output, vllm_expected_output
from tests.support.ingest import ingest_rows
from tests.support.metrics import metric_value
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.wait import wait_until_async
from tests.support.workers import NOT_MET, WAIT_S, fast_worker_settings
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.engines.vllm import VllmClient
from workers.fleet.kv_control import KvControl
from workers.fleet.servers import Server, ServerSpec
from workers.metrics import WorkerMetrics
from workers.worker import Worker

NS = "eng"
SEED = 7
SPEC_DEFAULTS: dict[str, Any] = {
    "context_len": None,
    "short_max_new_tokens": 300,
    "long_max_new_tokens": 600,
    "long_threshold_tokens": 40,
    "sampling": {"sampling_seed": SEED},
}
SIM: dict[str, Any] = {"time_scale": 0.0, "context_len": 4096}


@pytest.fixture(scope="module")
def vllm_url(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(api="vllm", tokenizer_path=tokenizer_path, **SIM) as url:
        yield url


@pytest.fixture(scope="module")
def sglang_url(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(tokenizer_path=tokenizer_path, **SIM) as url:
        yield url


def _settings(redis_url: str, storage: Storage, **overrides: Any) -> WorkerSettings:
    return fast_worker_settings(
        redis_url, storage, NS, **{"short_concurrency": 8, "long_concurrency": 4, **overrides}
    )


async def _run_burst(settings: WorkerSettings, servers: list[str]) -> Worker:
    worker = Worker(settings, ServerSpec.parse_many(servers), burst=True, install_signal_handlers=False)
    await worker.main()
    return worker


def _ingest(
    redis_client: redis.Redis, storage: Storage, job_id: str, spec: JobSpec, rows: list[dict[str, Any]]
) -> None:
    ingest_rows(redis_client, storage, Keys(NS), job_id, spec, rows)


def _records(storage: Storage, job_id: str) -> dict[str, dict[str, Any]]:
    return {
        row["sample_id"]: row for batch in storage.iter_record_batches(job_id) for row in batch.to_pylist()
    }


def _rows(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        content = f"Question {i}: explain topic {i}." + (" Context sentence." * 12 if i % 5 == 0 else "")
        rows.append({"id": f"q{i}", "messages": [{"role": "user", "content": content}]})
    return rows


def _renderer(spec: JobSpec, tokenizer_path: str) -> tuple[PromptRenderer, SpecialIds]:
    renderer = get_renderer(tokenizer_path, spec.chat_template, False, "{}")
    return renderer, SpecialIds.from_tokenizer(renderer.tokenizer)


def _progress(redis_client: redis.Redis, job_id: str) -> tuple[JobState, int, int]:
    progress = JobStore(redis_client, Keys(NS)).progress(job_id)
    return progress.state, progress.done, progress.failed


# -- vLLM alone ------------------------------------------------------------------------------------


async def test_a_vllm_server_is_detected_and_its_records_are_token_exact(
    redis_client: redis.Redis, redis_url: str, storage: Storage, vllm_url: str, tokenizer_path: str
) -> None:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    rows = _rows(30)
    _ingest(redis_client, storage, "v1", spec, rows)
    worker = await _run_burst(_settings(redis_url, storage), [vllm_url])  # a bare URL: auto
    assert worker.fleet.servers[0].client.engine is EngineChoice.VLLM

    renderer, special = _renderer(spec, tokenizer_path)
    records = _records(storage, "v1")
    assert sorted(records) == sorted(r["id"] for r in rows)
    finishes = set()
    for row in rows:
        record = records[row["id"]]
        prompt_ids = renderer.render(row["messages"])
        max_new = spec.max_new_tokens(spec.classify(len(prompt_ids), None))
        expected = vllm_expected_output(prompt_ids, max_tokens=max_new, seed=SEED, special=special)
        assert record["input_ids"] == prompt_ids + expected.token_ids
        assert (record["finish_type"], record["max_new_tokens"]) == (expected.finish_reason, max_new)
        if expected.finish_reason == "stop":
            assert record["finish_matched"] == str(special.eos_id) == str(expected.token_ids[-1])
        else:
            assert record["finish_length"] == max_new == len(expected.token_ids)
        finishes.add(record["finish_type"])
    assert finishes == {"stop", "length"}
    assert _progress(redis_client, "v1") == (JobState.COMPLETED, 30, 0)


@pytest.mark.parametrize(("api", "finish"), [("vllm", "stop"), ("sglang", "length")])
async def test_an_eos_exactly_at_the_cap(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    vllm_url: str,
    sglang_url: str,
    tokenizer_path: str,
    api: str,
    finish: str,
) -> None:
    """vLLM checks the EOS before the length cap and says stop (stop_reason null): the record says
    it stopped on the EOS. SGLang says length for the same ids; both keep the EOS."""
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    renderer, special = _renderer(spec, tokenizer_path)
    row = next(
        r
        for r in _rows(40)
        if (
            out := expected_output(
                renderer.render(r["messages"]), max_new_tokens=3000, seed=SEED, special=special
            )
        ).finish_reason["type"]
        == "stop"
        and len(out.output_ids) < 600
    )
    prompt_ids = renderer.render(row["messages"])
    natural = expected_output(prompt_ids, max_new_tokens=3000, seed=SEED, special=special).output_ids
    assert natural[-1] == special.eos_id
    cap = len(natural)  # the EOS is the cap-th token
    spec = job_spec(
        SPEC_DEFAULTS,
        tokenizer=tokenizer_path,
        short_max_new_tokens=cap,
        long_max_new_tokens=cap,
    )
    _ingest(redis_client, storage, "cap", spec, [row])
    await _run_burst(_settings(redis_url, storage), [vllm_url if api == "vllm" else sglang_url])
    [record] = _records(storage, "cap").values()
    assert record["input_ids"] == prompt_ids + natural
    assert (record["finish_type"], record["max_new_tokens"]) == (finish, cap)
    if finish == "stop":
        assert record["finish_matched"] == str(special.eos_id)
        assert record["finish_length"] is None
    else:
        assert record["finish_length"] == cap


async def test_a_400_is_fatal_with_vllms_message(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    spec = job_spec(
        SPEC_DEFAULTS, tokenizer=tokenizer_path, long_threshold_tokens=10_000, short_max_new_tokens=64
    )
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "short"}]},
        {"id": "too_long", "messages": [{"role": "user", "content": "word " * 400}]},
    ]
    _ingest(redis_client, storage, "v400", spec, rows)
    with running_simulator(api="vllm", tokenizer_path=tokenizer_path, time_scale=0.0, context_len=256) as url:
        worker = Worker(
            _settings(redis_url, storage, max_attempts=3),
            [ServerSpec("small", url)],
            burst=True,
            install_signal_handlers=False,
        )
        await worker.start()
        for server in worker.fleet.servers:
            server.context_len = None  # as if unknown: the prompt goes out as is
        try:
            await worker.run()
        finally:
            await worker.drain()
            await worker.close()
    jobs = JobStore(redis_client, Keys(NS))
    assert _progress(redis_client, "v400") == (JobState.COMPLETED, 1, 1)
    [report] = jobs.outcomes.failed_reports("v400", 10)
    assert report["sample_id"] == "too_long"
    message = report["message"]
    assert "on vLLM server 'small'" in message and "got HTTP 400" in message
    assert "This model's maximum context length is 256 tokens" in message  # vLLM's own words
    assert "retrying it cannot succeed" in message
    assert "gave up" not in message  # fatal at once, not after retries


# -- a mixed fleet ---------------------------------------------------------------------------------


async def test_a_mixed_fleet_completes_a_job_with_exact_records(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    vllm_url: str,
    sglang_url: str,
    tokenizer_path: str,
) -> None:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    rows = _rows(40)
    _ingest(redis_client, storage, "mixed", spec, rows)
    worker = await _run_burst(
        _settings(redis_url, storage, short_concurrency=4), [f"sg={sglang_url}", f"vl={vllm_url}"]
    )
    engines = {s.name: s.client.engine for s in worker.fleet.servers}
    assert engines == {"sg": EngineChoice.SGLANG, "vl": EngineChoice.VLLM}
    assert _progress(redis_client, "mixed") == (JobState.COMPLETED, 40, 0)
    renderer, special = _renderer(spec, tokenizer_path)
    records = _records(storage, "mixed")
    assert {r["server"] for r in records.values()} == {"sg", "vl"}
    for row in rows:
        record = records[row["id"]]
        prompt_ids = renderer.render(row["messages"])
        max_new = spec.max_new_tokens(spec.classify(len(prompt_ids), None))
        expected = expected_output(prompt_ids, max_new_tokens=max_new, seed=SEED, special=special)
        # The same ids from either engine; only an EOS exactly at the cap would be named otherwise.
        assert record["input_ids"] == prompt_ids + expected.output_ids


async def test_a_request_given_up_is_aborted_on_the_vllm_server_at_once() -> None:
    """Cancelling a request (a cancelled job, a hard stop, a lost server) closes its connection,
    which is vLLM's abort."""
    with running_simulator(api="vllm", time_scale=1.0, decode_step_base_s=0.02) as url:
        client = VllmClient("v", url, timeouts=ClientTimeouts(), max_connections=2)
        params = {"temperature": 0.6, "sampling_seed": 1, "max_new_tokens": 2000}
        try:
            request = asyncio.create_task(client.generate([5, 6, 7], params, rid="r1"))

            async def running() -> float:
                text = (await client._control().get("/metrics")).text
                return metric_value(text, "vllm:num_requests_running")

            async def gone() -> bool:
                return await running() == 0

            await wait_until_async(running, WAIT_S, NOT_MET)
            request.cancel()
            await wait_until_async(gone, WAIT_S, NOT_MET)
        finally:
            await client.aclose()
    assert request.cancelled()


# -- the KV controller -----------------------------------------------------------------------------


async def _load(url: str, api: str, prompts: list[list[int]]) -> None:
    """Requests that outgrow a small KV pool together, sent past the worker's client."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        if api == "vllm":
            body = {"max_tokens": 40, "ignore_eos": True}
            sends = [client.post("/v1/completions", json={"prompt": p, **body}) for p in prompts]
        else:
            params = {"max_new_tokens": 40, "ignore_eos": True}
            sends = [
                client.post("/generate", json={"input_ids": p, "sampling_params": params}) for p in prompts
            ]
        for response in await asyncio.gather(*sends):
            assert response.status_code == 200, response.text


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_the_kv_controller_cuts_the_target_on_preemptions_as_on_retractions(
    redis_client: redis.Redis, api: str
) -> None:
    # A KV pool of 100 tokens and no admission reserve: six 10-token prompts growing to 50 tokens
    # each cannot all stay, so the engine retracts (vLLM: preempts) some of them.
    config = {"time_scale": 1.0, "decode_step_base_s": 0.005, "context_len": 64}
    config |= {"max_total_num_tokens": 100, "reserve_fraction": 0.0}
    with running_simulator(api=api, **config) as url:
        client_class = VllmClient if api == "vllm" else SGLangClient
        client = client_class("s", url, timeouts=ClientTimeouts(), max_connections=2)
        server = Server("s", client, max_limits={PromptClass.SHORT: 96, PromptClass.LONG: 4})
        keys = Keys(NS)
        control = KvControl(
            redis_client, keys, server, WorkerMetrics(), owner="w1", interval_s=0.5, floor_fraction=0.05
        )
        redis_client.hset(
            keys.server_control("s"),
            mapping={"target": 60, "ceiling": 100, "factor": 0.6, "phase": "steady"},
        )
        try:
            await control.step()  # the counters before
            await _load(url, api, [[i + 10] * 10 for i in range(6)])
            await control.step()
        finally:
            await client.aclose()
    state = {k.decode(): v.decode() for k, v in redis_client.hgetall(keys.server_control("s")).items()}
    assert state["target"] == "42"  # 60 cut by 30 %
    assert "retractions" in state["reason"]


# -- forcing the engine ----------------------------------------------------------------------------


class _NeitherHandler(BaseHTTPRequestHandler):
    """/health answers 200; every other path 404: a server that is neither engine."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def neither_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NeitherHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


async def _started(settings: WorkerSettings, server: str) -> tuple[EngineChoice, str | None, bool]:
    """The engine, refusal and up state of ``server`` once the worker has started."""
    worker = Worker(settings, ServerSpec.parse_many([server]), install_signal_handlers=False)
    await worker.start()
    try:
        [only] = worker.fleet.servers
        return only.client.engine, only.refused, only.up
    finally:
        await worker.drain()
        await worker.close()


async def test_a_forced_engine_is_used_and_a_wrong_one_is_refused_in_one_line(
    redis_url: str, storage: Storage, vllm_url: str, sglang_url: str
) -> None:
    forced_vllm = _settings(redis_url, storage, engine=EngineChoice.VLLM)
    assert await _started(forced_vllm, f"v={vllm_url}") == (EngineChoice.VLLM, None, True)
    # The URL's prefix wins over the worker's --engine.
    assert await _started(forced_vllm, f"s=sglang+{sglang_url}") == (EngineChoice.SGLANG, None, True)

    _, refused, up = await _started(
        _settings(redis_url, storage, engine=EngineChoice.SGLANG), f"v={vllm_url}"
    )
    assert not up
    assert refused is not None and "\n" not in refused
    assert refused.startswith(f"server v ({vllm_url}) runs vllm, but this worker was told sglang")
    assert "--engine" in refused
    _, refused, up = await _started(_settings(redis_url, storage), f"v=sglang+{vllm_url}")
    assert not up
    assert refused is not None and "runs vllm, but this worker was told sglang" in refused


async def test_a_url_that_is_neither_engine_is_refused_with_what_to_do(
    redis_url: str, storage: Storage, neither_url: str
) -> None:
    engine, refused, up = await _started(_settings(redis_url, storage), f"x={neither_url}")
    assert (engine, up) == (EngineChoice.AUTO, False)
    assert refused is not None and "\n" not in refused
    assert "is neither an SGLang nor a vLLM server" in refused
    assert "vllm+http://host:port" in refused
    # Forced, such a server (a proxy that hides the routes, say) is taken at its word.
    # Its facts are then unreadable (/v1/models is 404): it stays down, logged, as any such server.
    assert await _started(_settings(redis_url, storage), f"x=vllm+{neither_url}") == (
        EngineChoice.VLLM,
        None,
        False,
    )


def test_server_specs_name_their_engine_in_the_url_scheme() -> None:
    assert ServerSpec.parse("v=vllm+http://gpu1:8000") == ServerSpec(
        "v", "http://gpu1:8000", engine=EngineChoice.VLLM
    )
    assert ServerSpec.parse("sglang+https://gpu2/") == ServerSpec(
        "gpu2-443", "https://gpu2", engine=EngineChoice.SGLANG
    )
    assert ServerSpec.parse("http://gpu3:30000").engine is EngineChoice.AUTO
    with pytest.raises(ValueError, match="the scheme may name the engine"):
        ServerSpec.parse("tgi+http://gpu4:80")


def test_the_workers_engine_comes_from_datagen_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_ENGINE", "vllm")
    assert load(WorkerSettings).engine is EngineChoice.VLLM
    monkeypatch.setenv("DATAGEN_ENGINE", "tgi")
    with pytest.raises(
        ConfigError, match=r"DATAGEN_ENGINE='tgi': Input should be 'auto', 'sglang' or 'vllm'"
    ):
        load(WorkerSettings)
