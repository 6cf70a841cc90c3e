"""Multi-turn ``all`` mode under a recipe: a conversation keeps its arm for every turn, each turn
rendered with the arm's template variables and sent with its sampling, over real Redis and HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from datagen.control.keys import Keys
from datagen.prompts.tokenization import renderer_for
from datagen.records.storage import Storage
from simulator.model import SpecialIds, expected_output
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.run.turns import history
from workers.worker import Worker

NS = "rt"
SEED = 11
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "DATASET ANSWER ONE"},
    {"role": "user", "content": "And another?"},
]
CUTS = [2, 4]
RECIPE = {
    "assign": "cycle",
    "arms": [
        {"name": "think", "sampling": {"temperature": 0.3}},
        {
            "name": "high",
            "chat_template_kwargs": {"reasoning_effort": "high"},
            "sampling": {"temperature": 0.9},
        },
    ],
}


@pytest.fixture(scope="module")
def sim(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(api="sglang", tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        yield url


async def test_a_conversation_keeps_its_arm_for_every_turn(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sim: str
) -> None:
    spec = job_spec(
        tokenizer=tokenizer_path,
        context_len=None,
        multi_turn="all",
        samples=2,
        short_max_new_tokens=2000,
        long_threshold_tokens=100_000,
        sampling={"sampling_seed": SEED},
        recipe=RECIPE,
    )
    ingest_rows(redis_client, storage, Keys(NS), "rt1", spec, [{"id": "conv", "messages": CONVERSATION}])
    settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=4)
    await Worker(settings, [ServerSpec("s0", sim)], burst=True, install_signal_handlers=False).main()

    rows = [r for b in storage.iter_record_batches("rt1") for r in b.to_pylist()]
    records: dict[tuple[int, int], dict[str, Any]] = {(r["turn"], r["gen"]): r for r in rows}
    assert sorted(records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # cycle, two samples, two arms: gen 0 runs under "think" and gen 1 under "high", every turn.
    assert {key: r["arm"] for key, r in records.items()} == {
        (0, 0): "think",
        (1, 0): "think",
        (0, 1): "high",
        (1, 1): "high",
    }
    for gen, (name, effort, temperature) in enumerate([("think", None, 0.3), ("high", "high", 0.9)]):
        arm = spec.arm_named(name)
        renderer = renderer_for(spec, arm)
        special = SpecialIds.from_tokenizer(renderer.tokenizer)
        generated: list[str] = []
        for turn in range(2):
            record = records[(turn, gen)]
            prompt = record["input_ids"][: record["prompt_len"]]
            assert prompt == renderer.render(history(CONVERSATION, CUTS, generated, turn)), (gen, turn)
            text = renderer.decode(prompt)
            # Written out: the high arm's system prompt ends with its effort on every turn.
            assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\nReasoning: high<｜User｜>") == (
                effort == "high"
            )
            sent = json.loads(record["sampling_params"])
            assert (sent["temperature"], sent["sampling_seed"]) == (temperature, SEED + gen)
            assert record["chat_template_kwargs"] == ('{"reasoning_effort":"high"}' if effort else "{}")
            output = expected_output(prompt, max_new_tokens=2000, seed=SEED + gen, special=special)
            assert record["input_ids"][record["prompt_len"] :] == output.output_ids
            generated.append(renderer.decode(output.output_ids[:-1]))
