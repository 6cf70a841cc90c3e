"""Multi-turn ``all`` accounting over real Redis, HTTP and storage: a committed turn is done whatever
its next turn meets; counts, records and stops agree on every path; a retry generates nothing twice.
And the history text keeps think delimiters with a tokenizer that marks them special."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.payload import Conversation, PromptPayload
from datagen.prompts.tokenization import PromptRenderer, default_chat_template_path
from datagen.records.schema import Record
from datagen.records.storage import Storage
from datagen.states import JobState, PromptClass, StopReason
from service.lifecycle import JobControls
from tests.support.ingest import ingest_rows
from tests.support.records import make_record
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.workers import fast_worker_settings
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.fleet.servers import Server, ServerSpec
from workers.metrics import WorkerMetrics
from workers.run.conversation import NEXT_TURN_ATTEMPTS, Conversations, ConversationStop
from workers.run.jobinfo import JobInfos
from workers.run.turns import history_text
from workers.worker import Worker

NS = "conv"
TWO_TURNS = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "DATASET ANSWER"},
    {"role": "user", "content": "And another?"},
]


@pytest.fixture(scope="module")
def sim(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        yield url


# This module's jobs: multi-turn, every prompt short, outputs reproducible, the context length
# left to the server.
SPEC_DEFAULTS: dict[str, Any] = {
    "context_len": None,
    "multi_turn": "all",
    "short_max_new_tokens": 4000,
    "long_threshold_tokens": 100_000,
    "sampling": {"sampling_seed": 5},
}


async def _run(redis_url: str, storage: Storage, url: str, **settings: Any) -> None:
    worker_settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=8, **settings)
    await Worker(worker_settings, [ServerSpec("s0", url)], burst=True, install_signal_handlers=False).main()


def _turns(storage: Storage, job_id: str) -> list[tuple[str, int]]:
    return sorted(
        (r["sample_id"], r["turn"]) for b in storage.iter_record_batches(job_id) for r in b.to_pylist()
    )


def _counts(redis_client: redis.Redis, job_id: str) -> tuple[JobState, int, int, int]:
    progress = JobStore(redis_client, Keys(NS)).progress(job_id)
    return progress.state, progress.accepted, progress.done, progress.failed


async def test_a_next_turn_the_template_refuses_stops_the_conversation_not_the_turn(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sim: str, tmp_path: Path
) -> None:
    # A template that accepts only the dataset's answers in history: turn 0 renders (no assistant
    # turn before it), turn 1 (the model's text in its history) cannot.
    template = tmp_path / "strict.jinja"
    template.write_text(
        default_chat_template_path()
        .read_text()
        .replace(
            "{%- elif role == 'assistant' -%}",
            "{%- elif role == 'assistant' and 'DATASET' not in message['content'] -%}"
            "{{- raise_exception('history answers must come from the dataset') -}}\n"
            "{%- elif role == 'assistant' -%}",
        )
    )
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, chat_template=str(template))
    ingest_rows(redis_client, storage, Keys(NS), "render", spec, [{"id": "a", "messages": TWO_TURNS}])
    await _run(redis_url, storage, sim)

    assert _turns(storage, "render") == [("a", 0)]
    assert _counts(redis_client, "render") == (JobState.COMPLETED, 1, 1, 0)
    [stop] = list(storage.iter_stopped("render"))
    assert (stop["sample_id"], stop["turn"], stop["turns"], stop["reason"]) == ("a", 1, 2, "error")
    assert "history answers must come from the dataset" in stop["message"]
    # Nothing failed, so a retry has nothing to run again.
    controls = JobControls(redis_client, Keys(NS), JobStore(redis_client, Keys(NS)), storage)
    assert controls.retry("render")["retried_now"] == 0
    await _run(redis_url, storage, sim)
    assert _turns(storage, "render") == [("a", 0)]


async def test_a_turn_that_fails_before_its_commit_fails_and_a_retry_runs_each_turn_once(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sim: str
) -> None:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path)
    rows = [{"id": "a", "messages": TWO_TURNS}, {"id": "b", "messages": TWO_TURNS[:1]}]
    ingest_rows(redis_client, storage, Keys(NS), "before", spec, rows)
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, fail_500_rate=1.0) as broken:
        await _run(redis_url, storage, broken, max_attempts=2)
    assert _turns(storage, "before") == []
    assert _counts(redis_client, "before") == (JobState.COMPLETED, 2, 0, 2)
    assert list(storage.iter_stopped("before")) == []
    failed = JobStore(redis_client, Keys(NS)).outcomes.failed_reports("before", 10)
    assert sorted(f["sample_id"] for f in failed) == ["a", "b"]

    controls = JobControls(redis_client, Keys(NS), JobStore(redis_client, Keys(NS)), storage)
    assert controls.retry("before")["retried_now"] == 2
    await _run(redis_url, storage, sim)
    assert _turns(storage, "before") == [("a", 0), ("a", 1), ("b", 0)]  # each turn once
    assert _counts(redis_client, "before") == (JobState.COMPLETED, 3, 3, 0)


def _think_special_tokenizer(source: str, into: Path) -> str:
    """The bundled tokenizer with <think> and </think> marked special, as some models ship them."""
    shutil.copytree(source, into)
    path = into / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        if token["content"] in ("<think>", "</think>"):
            token["special"] = True
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return str(into)


def test_history_text_keeps_a_special_think_end_and_drops_only_the_stop_id(
    tokenizer_path: str, tmp_path: Path
) -> None:
    special = _think_special_tokenizer(tokenizer_path, tmp_path / "tok")
    renderer = PromptRenderer(special, chat_template_path=str(default_chat_template_path()))
    # "abc", </think>, "x", <｜end▁of▁sentence｜> (hand-checked ids of the DeepSeek vocabulary).
    ids = [32372, 128822, 90, 1]
    assert renderer.decode(ids, skip_special_tokens=True) == "abcx"  # what history used to hold
    assert history_text(renderer, ids, {1}) == "abc</think>x"
    assert history_text(renderer, [*ids[:-1], 2], {1}) == "abc</think>x<｜▁pad▁｜>"  # not a stop id


async def test_with_a_special_think_end_the_next_turn_holds_no_reasoning(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, tmp_path: Path
) -> None:
    special = _think_special_tokenizer(tokenizer_path, tmp_path / "tok")
    spec = job_spec(SPEC_DEFAULTS, tokenizer=special)
    ingest_rows(redis_client, storage, Keys(NS), "think", spec, [{"id": "a", "messages": TWO_TURNS}])
    with running_simulator(tokenizer_path=special, time_scale=0.0) as url:
        await _run(redis_url, storage, url)
    records = {r["turn"]: r for b in storage.iter_record_batches("think") for r in b.to_pylist()}
    assert sorted(records) == [0, 1]
    renderer = PromptRenderer(special, chat_template_path=str(default_chat_template_path()))
    first = records[0]["input_ids"][records[0]["prompt_len"] :]
    think_end = first.index(128822)
    reasoning = renderer.decode(first[:think_end])
    answer = renderer.decode(first[think_end + 1 : -1])
    second_prompt = renderer.decode(records[1]["input_ids"][: records[1]["prompt_len"]])
    assert reasoning and reasoning not in second_prompt  # the template dropped it
    assert second_prompt.endswith(
        f"<｜Assistant｜>{answer}<｜end▁of▁sentence｜><｜User｜>And another?<｜Assistant｜><think>\n"
    )


# -- the next-turn step's retries, against SGLang's /parse_function_call over a mock transport ----

TOOL_TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _conversations(
    redis_client: redis.Redis, storage: Storage, tokenizer_path: str, replies: list[httpx.Response]
) -> tuple[Conversations, PromptPayload, Record, list[dict[str, Any]]]:
    spec = job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path, tool_call_parser="qwen25")
    jobs = JobStore(redis_client, Keys(NS))
    jobs.create("retry", spec)
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return replies.pop(0)

    client = SGLangClient(
        "s0",
        "http://sim.test",
        timeouts=ClientTimeouts(),
        max_connections=1,
        transport=httpx.MockTransport(handler),
    )
    server = Server("s0", client, dict.fromkeys(PromptClass, 4))
    conversations = Conversations(JobInfos(jobs), [server], storage, WorkerMetrics(), backoff_s=(0.01,))
    renderer = PromptRenderer(tokenizer_path, chat_template_path=str(default_chat_template_path()))
    prompt = renderer.render(TOOL_TURNS[:1], TOOLS)
    # "abc", </think>, "x", <｜end▁of▁sentence｜>
    record = make_record("t", [*prompt, 32372, 128822, 90, 1], len(prompt), job_id="retry", server="s0")
    conversation = Conversation(TOOL_TURNS, TOOLS, cuts=[1, 3], generated=[])
    payload = PromptPayload(
        job="retry",
        sample_id="t",
        turn=0,
        gen=0,
        cls=PromptClass.SHORT,
        prompt_ids=prompt,
        max_new_tokens=100,
        partition="default",
        conversation=conversation,
        incarnation=jobs.incarnation("retry") or "",
    )
    return conversations, payload, record, seen


async def test_the_next_turn_is_retried_while_the_parser_is_unavailable(
    redis_client: redis.Redis, storage: Storage, tokenizer_path: str
) -> None:
    call = {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Oslo"}'}
    replies = [
        httpx.Response(503, text="starting"),
        httpx.Response(503, text="starting"),
        httpx.Response(200, json={"normal_text": "abc</think>x", "calls": [call]}),
    ]
    conversations, payload, record, seen = _conversations(redis_client, storage, tokenizer_path, replies)
    following = await conversations.after(payload, record)
    await conversations.servers[0].client.aclose()
    assert isinstance(following, PromptPayload) and following.turn == 1
    assert (
        seen[0] == {"text": "abc</think>x", "tool_call_parser": "qwen25", "tools": TOOLS} and len(seen) == 3
    )
    [regenerated] = following.conversation.generated if following.conversation else []
    assert regenerated == {
        "content": "abc</think>x",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                "id": "c1",
            }
        ],
    }


async def test_a_parser_that_stays_down_stops_the_conversation_with_its_last_error(
    redis_client: redis.Redis, storage: Storage, tokenizer_path: str
) -> None:
    replies = [httpx.Response(503, text="still starting") for _ in range(NEXT_TURN_ATTEMPTS)]
    conversations, payload, record, seen = _conversations(redis_client, storage, tokenizer_path, replies)
    stop = await conversations.after(payload, record)
    await conversations.servers[0].client.aclose()
    assert isinstance(stop, ConversationStop) and len(seen) == NEXT_TURN_ATTEMPTS
    assert (stop.turn, stop.turns, stop.reason) == (1, 2, StopReason.ERROR)
    assert f"failed {NEXT_TURN_ATTEMPTS} times: ServerUnavailableError" in stop.message
    assert "still starting" in stop.message
