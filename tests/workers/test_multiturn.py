"""Multi-turn ``all`` mode (on-policy) and several samples per prompt, over real Redis and HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import get_renderer
from datagen.records.storage import Storage
from datagen.states import JobState
from simulator.model import SpecialIds, expected_output
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.run.turns import history
from workers.worker import Worker

NS = "mt"
SEED = 11
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "<think>dataset reasoning</think>DATASET ANSWER ONE"},
    {"role": "user", "content": "And another?"},
    {"role": "assistant", "content": "DATASET ANSWER TWO"},
    {"role": "user", "content": "Sum them."},
]


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def sims(request: pytest.FixtureRequest, tokenizer_path: str) -> Iterator[list[str]]:
    """Two servers of one engine: every test here runs on SGLang and on vLLM (the same token
    model; the worker detects the engine)."""
    with (
        running_simulator(api=request.param, tokenizer_path=tokenizer_path, time_scale=0.0) as a,
        running_simulator(api=request.param, tokenizer_path=tokenizer_path, time_scale=0.0) as b,
    ):
        yield [a, b]


SPEC_DEFAULTS: dict[str, Any] = {
    "context_len": None,
    "short_max_new_tokens": 2000,
    "long_threshold_tokens": 100_000,
    "sampling": {"sampling_seed": SEED},
}


async def _run(redis_url: str, storage: Storage, urls: list[str], **overrides: Any) -> None:
    settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=8, **overrides)
    servers = [ServerSpec(f"s{i}", url) for i, url in enumerate(urls)]
    await Worker(settings, servers, burst=True, install_signal_handlers=False).main()


def _records(storage: Storage, job_id: str) -> dict[tuple[str, int, int], dict[str, Any]]:
    rows = [r for b in storage.iter_record_batches(job_id) for r in b.to_pylist()]
    return {(r["sample_id"], r["turn"], r["gen"]): r for r in rows}


async def test_all_mode_renders_each_turn_from_the_regenerated_history(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sims: list[str]
) -> None:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, multi_turn="all")
    rows = [{"id": "conv", "messages": CONVERSATION}, {"id": "single", "messages": CONVERSATION[:2]}]
    ingest_rows(redis_client, storage, Keys(NS), "mt1", spec, rows)
    assert JobStore(redis_client, Keys(NS)).progress("mt1").accepted == 2  # first turns only
    await _run(redis_url, storage, sims[:1])

    renderer = get_renderer(tokenizer_path, spec.chat_template, False, "{}")
    special = SpecialIds.from_tokenizer(renderer.tokenizer)
    records = _records(storage, "mt1")
    assert sorted(records) == [("conv", 0, 0), ("conv", 1, 0), ("conv", 2, 0), ("single", 0, 0)]
    # Written out: turn k+1's history holds regenerated turns 0..k in place of the dataset's.
    cuts = [2, 4, 6]
    generated: list[str] = []
    for turn in range(3):
        record = records[("conv", turn, 0)]
        expected_prompt = renderer.render(history(CONVERSATION, cuts, generated, turn))
        prompt = record["input_ids"][: record["prompt_len"]]
        assert prompt == expected_prompt, f"turn {turn}"
        expected = expected_output(prompt, max_new_tokens=2000, seed=SEED, special=special)
        assert record["input_ids"][record["prompt_len"] :] == expected.output_ids
        assert expected.output_ids[-1] == 1  # <｜end▁of▁sentence｜>, the end of the turn: not history
        generated.append(renderer.decode(expected.output_ids[:-1]))
    turn2_text = renderer.decode(
        records[("conv", 2, 0)]["input_ids"][: records[("conv", 2, 0)]["prompt_len"]]
    )
    assert "DATASET ANSWER" not in turn2_text  # on-policy: none of the dataset's answers remain
    answer_one = generated[0].split("</think>", 1)[1]
    assert (
        f"<｜Assistant｜>{answer_one}<｜end▁of▁sentence｜>" in turn2_text
    )  # reasoning dropped by the template
    progress = JobStore(redis_client, Keys(NS)).progress("mt1")
    assert (progress.state, progress.accepted, progress.done) == (JobState.COMPLETED, 4, 4)


async def test_a_truncated_turn_ends_its_conversation(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sims: list[str]
) -> None:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, multi_turn="all", short_max_new_tokens=5)
    ingest_rows(redis_client, storage, Keys(NS), "mt2", spec, [{"id": "conv", "messages": CONVERSATION}])
    await _run(redis_url, storage, sims[:1])
    records = _records(storage, "mt2")
    assert list(records) == [("conv", 0, 0)] and records[("conv", 0, 0)]["finish_type"] == "length"
    assert JobStore(redis_client, Keys(NS)).progress("mt2").state is JobState.COMPLETED


async def test_samples_have_distinct_seeds_cycled_temperatures_and_one_server(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sims: list[str]
) -> None:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, samples=3, temperatures=[0.3, 0.9])
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    ingest_rows(redis_client, storage, Keys(NS), "mt3", spec, rows)
    # No backup requests: at the end of the backlog one may run on the other server and win, and
    # its record then names that server (backups have tests of their own).
    await _run(redis_url, storage, sims, backup_requests=False)
    records = _records(storage, "mt3")
    assert len(records) == 18
    for i in range(6):
        gens = [records[(f"q{i}", 0, g)] for g in range(3)]
        params = [json.loads(r["sampling_params"]) for r in gens]
        assert [p["sampling_seed"] for p in params] == [SEED, SEED + 1, SEED + 2]
        assert [p["temperature"] for p in params] == [0.3, 0.9, 0.3]
        assert len({tuple(r["input_ids"]) for r in gens}) == 3  # distinct seeds, distinct samples
        assert len({r["server"] for r in gens}) == 1  # one server, so its prefix cache serves them
    assert len({r["server"] for r in records.values()}) == 2  # prompts still spread over the fleet
