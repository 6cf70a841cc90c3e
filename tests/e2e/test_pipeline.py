"""End to end over real processes: Redis, the simulator, a coordinator and a worker, talking HTTP.

The dataset mixes single-turn prompts, system prompts, multi-turn histories (some ending with an
assistant turn that is regenerated), unicode, tools, prompts forced to truncate, and bad rows.
Every record is checked token for token: rendered prompt ids (recomputed, and for a handful of
rows written out by hand below) followed by the simulator's deterministic output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path, get_renderer
from datagen.records.storage import Storage
from datagen_cli.local.redis_server import LocalRedis, free_port
from simulator.model import SpecialIds, expected_output
from tests.support.processes import ProcessStack

pytestmark = pytest.mark.e2e

NS = "e2e"
SEED = 2024
SHORT_MAX_NEW = 300
LONG_MAX_NEW = 1200
LONG_THRESHOLD = 120
GENERATION_SUFFIX = [128804, 128821, 201]  # <｜Assistant｜> <think> "\n"

# Written by hand (ids read once off the DeepSeek tokenizer, strings from the template's layout):
# the test must not only recompute what the code under test computes.
HAND_WRITTEN: dict[str, tuple[list[int] | None, str]] = {
    "hand-system": (
        [0, 3476, 477, 259, 10935, 16, 128803, 20, 13, 20, 33, 128804, 128821, 201],
        "<｜begin▁of▁sentence｜>You are terse.<｜User｜>2+2?<｜Assistant｜><think>\n",
    ),
    "hand-multi": (
        [0, 128803, 23166, 128804, 19923, 3, 1, 128803, 4546, 71, 128804, 128821, 201],
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜><think>\n",
    ),
    "hand-unicode": (
        [0, 128803, 30594, 53769, 225, 128804, 128821, 201],
        "<｜begin▁of▁sentence｜><｜User｜>你好 😀<｜Assistant｜><think>\n",
    ),
    "hand-tools": (
        None,
        "<｜begin▁of▁sentence｜>## Tools\n\nYou can call the functions below. Each line is one function, "
        'as a JSON schema:\n{"type": "function", "function": {"name": "w", "parameters": {}}}'
        "<｜User｜>Weather?<｜Assistant｜><think>\n",
    ),
}
HAND_ROWS = [
    {
        "id": "hand-system",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    },
    # The trailing assistant turn is dropped and regenerated; the earlier one loses its reasoning.
    {
        "id": "hand-multi",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>greet</think>Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "old answer to regenerate"},
        ],
    },
    {"id": "hand-unicode", "messages": [{"role": "user", "content": "你好 😀"}]},
    {
        "id": "hand-tools",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
    },
]
BAD_ROWS = [
    "{broken json",
    json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
    json.dumps({"id": 5}),
]


def _dataset() -> tuple[list[str], list[dict[str, Any]]]:
    """Lines of the JSONL file and the valid rows among them."""
    valid: list[dict[str, Any]] = list(HAND_ROWS)
    for i in range(160):
        words = " ".join(f"w{j}" for j in range(i % 37 * 4))
        valid.append(
            {
                "id": f"single-{i}",
                "messages": [{"role": "user", "content": f"Task {i}: {words}"}],
                "partition": ["math", "code", "chat"][i % 3],
            }
        )
    for i in range(20):
        valid.append(
            {
                "id": f"sys-{i}",
                "messages": [
                    {"role": "system", "content": f"Persona {i}."},
                    {"role": "user", "content": f"Help with item {i}"},
                ],
            }
        )
    for i in range(20):
        turns = [
            {"role": "user", "content": f"first {i}"},
            {"role": "assistant", "content": f"<think>r{i}</think>a{i}"},
            {"role": "user", "content": f"second {i}"},
        ]
        if i % 2:
            turns.append({"role": "assistant", "content": "to be regenerated"})
        valid.append({"id": f"multi-{i}", "messages": turns})
    for i in range(10):
        valid.append(
            {"id": f"uni-{i}", "messages": [{"role": "user", "content": f"Ünïcödé {i} — 数学 🚀 مرحبا"}]}
        )
    for i in range(5):
        valid.append(
            {
                "id": f"tool-{i}",
                "messages": [{"role": "user", "content": f"call tool {i}"}],
                "tools": [
                    {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                ],
            }
        )
    valid.append({"messages": [{"role": "user", "content": "no id: hashed"}], "class": "long"})
    valid.append({"conversations": [{"from": "human", "value": "sharegpt form"}], "id": "sharegpt"})
    lines = [json.dumps(row, ensure_ascii=False) for row in valid]
    # Bad rows in the middle: line numbers 50, 100, 150 (1-based).
    for offset, bad in zip((49, 99, 149), BAD_ROWS, strict=True):
        lines.insert(offset, bad)
    return lines, valid


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("e2e")
    with LocalRedis() as redis_server:
        env = {
            "DATAGEN_REDIS_URL": redis_server.url,
            "DATAGEN_STORAGE": str(tmp / "data"),
            "DATAGEN_NAMESPACE": NS,
        }
        stack = ProcessStack(tmp, env)
        sim_port, coord_port = free_port(), free_port()
        tokenizer = bundled_tokenizer_path()
        try:
            stack.spawn(
                "sim", "sim", "--port", str(sim_port), "--tokenizer", tokenizer, "--time-scale", "0.002"
            )
            stack.wait_http(f"http://127.0.0.1:{sim_port}/health")
            stack.spawn(
                "worker",
                "worker",
                "--server",
                f"sim=http://127.0.0.1:{sim_port}",
                "--metrics-port",
                "0",
                "--short-concurrency",
                "32",
                "--long-concurrency",
                "8",
            )
            stack.spawn("coordinator", "coordinator", "--port", str(coord_port))
            coordinator = f"http://127.0.0.1:{coord_port}"
            stack.wait_http(f"{coordinator}/healthz")
            stack.wait_server_up(coordinator, "sim")
            lines, valid = _dataset()
            dataset = tmp / "dataset.jsonl"
            dataset.write_text("\n".join(lines) + "\n", encoding="utf-8")
            submit = stack.cli(
                *("submit", str(dataset), "--coordinator", coordinator, "--tokenizer", tokenizer),
                *("--chat-template", str(default_chat_template_path()), "--seed", str(SEED), "--wait"),
                *("--short-max-new-tokens", str(SHORT_MAX_NEW), "--long-max-new-tokens", str(LONG_MAX_NEW)),
                *("--long-threshold-tokens", str(LONG_THRESHOLD)),
            )
            assert submit.returncode == 0, f"{submit.stdout}\n{submit.stderr}\n{stack.logs()}"
            job_id = submit.stdout.strip().splitlines()[0]
            yield {
                "job_id": job_id,
                "valid": valid,
                "coordinator": coordinator,
                "redis_url": redis_server.url,
                "storage": Storage(tmp / "data"),
                "env": stack.env,
                "tmp": tmp,
                "tokenizer": tokenizer,
            }
        finally:
            stack.stop()


def _records(stack: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for batch in stack["storage"].iter_record_batches(stack["job_id"]) for r in batch.to_pylist()]


def test_every_record_is_exact(stack: dict[str, Any]) -> None:
    renderer = get_renderer(stack["tokenizer"], str(default_chat_template_path()), False, "{}")
    special = SpecialIds.from_tokenizer(renderer.tokenizer)
    records = {r["sample_id"]: r for r in _records(stack)}
    from datagen.prompts.dataset import sample_id_for  # the id of the row without one

    finishes: dict[str, int] = {}
    for row in stack["valid"]:
        messages = row.get("messages") or [{"role": "user", "content": row["conversations"][0]["value"]}]
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        sample_id = row.get("id") or sample_id_for(row["messages"], None)
        record = records[sample_id]
        prompt_ids = renderer.render(messages, row.get("tools"))
        assert prompt_ids[-3:] == GENERATION_SUFFIX
        cls = row.get("class") or ("long" if len(prompt_ids) >= LONG_THRESHOLD else "short")
        max_new = LONG_MAX_NEW if cls == "long" else SHORT_MAX_NEW
        expected = expected_output(prompt_ids, max_new_tokens=max_new, seed=SEED, special=special)
        assert record["input_ids"] == prompt_ids + expected.output_ids, sample_id
        assert record["prompt_len"] == len(prompt_ids)
        assert (record["class"], record["max_new_tokens"]) == (cls, max_new)
        assert record["finish_type"] == expected.finish_reason["type"]
        if record["finish_type"] == "stop":
            assert record["input_ids"][-1] == special.eos_id == 1
            assert record["finish_matched"] == "1"
        else:
            assert record["output_len"] == max_new
            assert record["finish_length"] == max_new
        assert json.loads(record["sampling_params"])["sampling_seed"] == SEED
        assert record["tokenizer"] == f"{stack['tokenizer']}@sha256:{renderer.identity()['tokenizer_sha256']}"
        finishes[record["finish_type"]] = finishes.get(record["finish_type"], 0) + 1
    assert len(records) == len(stack["valid"]) >= 200
    assert finishes.get("length", 0) >= 3 and finishes.get("stop", 0) >= 100


def test_hand_written_prompts(stack: dict[str, Any]) -> None:
    renderer = get_renderer(stack["tokenizer"], str(default_chat_template_path()), False, "{}")
    records = {r["sample_id"]: r for r in _records(stack)}
    for sample_id, (ids, text) in HAND_WRITTEN.items():
        record = records[sample_id]
        prompt = record["input_ids"][: record["prompt_len"]]
        if ids is not None:
            assert prompt == ids, sample_id
        assert renderer.decode(prompt) == text
        output = record["input_ids"][record["prompt_len"] :]
        # Reasoning starts right after the prompt's <think>; </think> (128822) closes it in the output.
        assert 128821 not in output
        assert record["finish_type"] != "stop" or 128822 in output


def test_no_record_missing_or_duplicated_and_rq_agrees(stack: dict[str, Any]) -> None:
    records = _records(stack)
    keys = [(r["sample_id"], r["turn"], r["gen"]) for r in records]
    assert len(keys) == len(set(keys)) == len(stack["valid"])
    client = redis.Redis.from_url(stack["redis_url"])
    namespace = Keys(NS)
    finished = failed = started = queued = 0
    for cls in ("short", "long"):
        queue = Queue(f"{NS}-{cls}", connection=client)
        finished += FinishedJobRegistry(queue=queue).count
        failed += FailedJobRegistry(queue=queue).count
        started += StartedJobRegistry(queue=queue).count
        queued += queue.count
    assert (finished, failed, started, queued) == (len(stack["valid"]), 0, 0, 0)
    # The rows guard: one entry per valid row's id, and one per rejected row (its line and bytes), so
    # a resubmission counts neither again.
    assert client.hlen(namespace.job_rows(stack["job_id"])) == len(stack["valid"]) + len(BAD_ROWS)
    client.close()


def test_job_status_and_bad_rows(stack: dict[str, Any]) -> None:
    job = httpx.get(f"{stack['coordinator']}/jobs/{stack['job_id']}").json()
    assert job["state"] == "completed"
    assert (job["total"], job["done"], job["failed"], job["rejected"]) == (
        len(stack["valid"]),
        len(stack["valid"]),
        0,
        3,
    )
    errors = httpx.get(f"{stack['coordinator']}/jobs/{stack['job_id']}/errors").json()["errors"]
    assert [e["line"] for e in errors] == [50, 100, 150]
    assert "robot" in errors[1]["reason"]


def test_specforge_export(stack: dict[str, Any]) -> None:
    out = stack["tmp"] / "export.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "datagen_cli",
            "export",
            stack["job_id"],
            "--format",
            "specforge",
            "--out",
            str(out),
        ],
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # Export ids: the sample id for turn 0 / gen 0, else {sample}_t{turn}_g{gen} (CONVENTIONS.md).
    records = {
        r["sample_id"] if r["turn"] == r["gen"] == 0 else f"{r['sample_id']}_t{r['turn']}_g{r['gen']}": r
        for r in _records(stack)
    }
    assert "hand-multi_t1_g0" in records and "hand-system" in records
    assert len(rows) == len(records)
    for row in rows:
        record = records[row["id"]]
        assert row["input_ids"] == record["input_ids"]
        assert row["loss_mask"] == [0] * record["prompt_len"] + [1] * record["output_len"]
        assert set(row) == {"id", "input_ids", "loss_mask"}
