"""Tool-calling conversations in multi-turn ``all`` mode, end to end over real Redis and HTTP: the
simulator writes DeepSeek-V3 tool calls, the worker reads them through the server's own
``/parse_function_call``, and every record matches an independent rendering
(`tests.support.conversations`) token for token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from transformers import AutoTokenizer

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import default_chat_template_path
from datagen.records.storage import Storage
from datagen.report import build_report
from datagen.spec import JobSpec
from datagen.states import JobState
from tests.support.conversations import ExpectedConversation, expected_conversation, tool_rows
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "tools"
SEED = 7
MAX_NEW_TOKENS = 3000
CONVERSATIONS = 24


@pytest.fixture(scope="module")
def sim(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(
        tokenizer_path=tokenizer_path, time_scale=0.0, tool_call_format="deepseekv3"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_path: str) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_path)


SPEC_DEFAULTS: dict[str, Any] = {
    "context_len": None,
    "multi_turn": "all",
    "tool_call_parser": "deepseekv3",
    "short_max_new_tokens": MAX_NEW_TOKENS,
    "long_threshold_tokens": 100_000,
    "sampling": {"sampling_seed": SEED},
}


async def _run_job(
    redis_client: redis.Redis, redis_url: str, storage: Storage, url: str, job_id: str, spec: JobSpec
) -> tuple[dict[tuple[str, int], dict[str, Any]], dict[str, dict[str, Any]]]:
    ingest_rows(redis_client, storage, Keys(NS), job_id, spec, tool_rows(CONVERSATIONS))
    settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=CONVERSATIONS)
    await Worker(settings, [ServerSpec("s0", url)], burst=True, install_signal_handlers=False).main()
    records = {
        (r["sample_id"], r["turn"]): r for b in storage.iter_record_batches(job_id) for r in b.to_pylist()
    }
    stops = {s["sample_id"]: s for s in storage.iter_stopped(job_id)}
    return records, stops


def _expected(hf_tokenizer: Any, mismatch: str) -> dict[str, ExpectedConversation]:
    template = default_chat_template_path().read_text()
    return {
        row["id"]: expected_conversation(
            row,
            hf_tokenizer,
            template,
            seed=SEED,
            max_new_tokens=MAX_NEW_TOKENS,
            tool_call_format="deepseekv3",
            tool_mismatch=mismatch,
        )
        for row in tool_rows(CONVERSATIONS)
    }


def _check(
    records: dict[tuple[str, int], dict[str, Any]],
    stops: dict[str, dict[str, Any]],
    expected: dict[str, ExpectedConversation],
) -> None:
    assert sorted(records) == sorted(
        (sid, k) for sid, conv in expected.items() for k in range(len(conv.turns))
    )
    for sid, conv in expected.items():
        for k, turn in enumerate(conv.turns):
            record = records[(sid, k)]
            assert record["input_ids"][: record["prompt_len"]] == turn.prompt_ids, (sid, k)
            assert record["input_ids"][record["prompt_len"] :] == turn.output_ids, (sid, k)
            assert record["finish_type"] == turn.finish
    assert {sid: s["reason"] for sid, s in stops.items()} == {
        sid: conv.stop for sid, conv in expected.items() if conv.stop
    }


async def test_matched_calls_continue_and_mismatches_stop(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    tokenizer_path: str,
    sim: str,
    hf_tokenizer: Any,
) -> None:
    expected = _expected(hf_tokenizer, "stop")
    reasons = [conv.stop for conv in expected.values()]
    # The rows and seed give every path: a mismatch, a continued conversation after a matched call,
    # and conversations that reach their last turn.
    assert reasons.count("tool_mismatch") >= 3 and reasons.count(None) >= 8
    rows = {row["id"]: row for row in tool_rows(CONVERSATIONS)}
    continued_after_call = [
        sid for sid, conv in expected.items() if len(conv.turns) > 1 and "tools" in rows[sid]
    ]
    assert continued_after_call, "no conversation continued after a matched tool call"

    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    records, stops = await _run_job(redis_client, redis_url, storage, sim, "stop", spec)
    _check(records, stops, expected)
    progress = JobStore(redis_client, Keys(NS)).progress("stop")
    assert (progress.state, progress.failed) == (JobState.COMPLETED, 0)
    assert progress.done == progress.accepted == len(records)

    # Written out for one matched call: the next prompt holds the model's call (its arguments, the
    # dataset's result) and not the dataset's arguments.
    sid = continued_after_call[0]
    [call] = next(m for m in rows[sid]["messages"] if m["role"] == "assistant")["tool_calls"]
    name, [(prop, dataset_value)] = call["function"]["name"], call["function"]["arguments"].items()
    prompt = hf_tokenizer.decode(records[(sid, 1)]["input_ids"][: records[(sid, 1)]["prompt_len"]])
    assert f'<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{{"{prop}": "v' in prompt
    assert f'"{prop}": "{dataset_value}"' not in prompt  # the model's arguments, not the dataset's
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{" in prompt  # the dataset's result follows
    mismatch = next(s for s in stops.values() if s["reason"] == "tool_mismatch")
    assert "the model called" in mismatch["message"] and mismatch["turns"] > mismatch["turn"]
    # The report says the same (its manifest as the coordinator writes it).
    incarnation = JobStore(redis_client, Keys(NS)).incarnation("stop")
    storage.write_manifest("stop", {"spec": spec.model_dump(mode="json"), "incarnation": incarnation})
    report = build_report(storage, "stop").to_json()["conversations"]
    assert report["stopped"]["by_reason"] == {"tool_mismatch": reasons.count("tool_mismatch")}
    assert report["conversations"] == CONVERSATIONS
    assert report["regenerated_history_records"] == sum(len(c.turns) - 1 for c in expected.values())


async def test_keep_goes_on_after_a_mismatch(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    tokenizer_path: str,
    sim: str,
    hf_tokenizer: Any,
) -> None:
    expected = _expected(hf_tokenizer, "keep")
    assert all(conv.stop in (None, "truncated") for conv in expected.values())
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, tool_mismatch="keep")
    records, stops = await _run_job(redis_client, redis_url, storage, sim, "keep", spec)
    _check(records, stops, expected)
    assert JobStore(redis_client, Keys(NS)).progress("keep").failed == 0


async def test_a_parser_the_server_does_not_know_stops_each_conversation_after_its_commit(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sim: str
) -> None:
    # A name SGLang knows (the spec refuses any other) that this server lacks: the simulator
    # implements only some, as an older SGLang release lacks the newer ones.
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, tool_call_parser="mistral")
    records, stops = await _run_job(redis_client, redis_url, storage, sim, "badparser", spec)
    with_tools = {r["id"] for r in tool_rows(CONVERSATIONS) if r.get("tools")}
    # Each tool conversation has its first turn recorded and done, then stops with the server's word.
    assert {sid for sid, turn in records if turn == 0} >= with_tools
    assert {sid for sid, turn in records if turn > 0} & with_tools == set()
    assert set(stops) == with_tools
    errors = [s for s in stops.values() if s["reason"] != "truncated"]
    assert errors and all(s["reason"] == "error" and "mistral" in s["message"] for s in errors)
    progress = JobStore(redis_client, Keys(NS)).progress("badparser")
    assert (progress.state, progress.failed) == (JobState.COMPLETED, 0)
    assert progress.done == progress.accepted == len(records)
