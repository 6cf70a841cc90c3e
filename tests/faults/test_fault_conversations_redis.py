"""Issue 36: conversations survive Redis. Over real processes (Redis, a simulator writing
DeepSeek-V3 tool calls, a coordinator, a worker), a multi-turn ``all`` job whose tool-calling
turns enter the history as the server's own parse:

1. Redis SIGKILLed and restarted **empty** mid-run. Workers finishing their turns after the restart
   write no job hash back (the ack that would enqueue a next turn counts nothing in a job Redis
   lost), the coordinator rebuilds the job from storage, and every conversation whose last
   committed turn is not its last goes on at its next turn, built from the history stored with
   that turn's record: none stops ``lost``.
2. ``recover`` of a **healthy** running job: it stops nothing, and completes with done equal to
   its records.

Each ends with every turn of every conversation recorded once or more, every record token-exact
against an independent rendering (`tests.support.conversations`), the stops the oracle gives, no
turn whose record was committed before the fault generated again, and RQ drained.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from rq.registry import FailedJobRegistry, StartedJobRegistry
from transformers import AutoTokenizer

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from tests.support.conversations import ExpectedConversation, expected_conversation, tool_rows
from tests.support.faults import HTTP_TIMEOUT_S, POLL_S, FaultStack, all_records
from tests.support.specs import make_spec
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

CONVERSATIONS = 90
MAX_NEW_TOKENS = 1000
CONCURRENCY = 16
SEED = 7
# With "keep", a turn whose calls differ from the dataset's goes on (its own calls in the history):
# most conversations have later turns.
SPEC = {
    "multi_turn": "all",
    "tool_call_parser": "deepseekv3",
    "tool_mismatch": "keep",
    "short_max_new_tokens": MAX_NEW_TOKENS,
    "long_threshold_tokens": 100_000,
    "sampling": {"sampling_seed": SEED},
}
COMPLETE_TIMEOUT_S = 90.0

Key = tuple[str, int, int]


def _expected(rows: list[dict[str, Any]]) -> dict[str, ExpectedConversation]:
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    template = default_chat_template_path().read_text()
    return {
        row["id"]: expected_conversation(
            row,
            tokenizer,
            template,
            seed=SEED,
            max_new_tokens=MAX_NEW_TOKENS,
            tool_call_format="deepseekv3",
            tool_mismatch="keep",
        )
        for row in rows
    }


def _start(make_stack: Callable[..., FaultStack], namespace: str) -> tuple[FaultStack, str]:
    stack = make_stack(namespace)
    stack.add_sim("a", time_scale=0.02, tool_call_format="deepseekv3")  # type: ignore[arg-type]
    stack.start_coordinator()
    stack.start_worker("worker", ["a"], concurrency=CONCURRENCY)
    dataset = stack.tmp / "conversations.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in tool_rows(CONVERSATIONS)))

    def submitted() -> str | None:  # refused (409) until the worker has published its server
        with open(dataset, "rb") as fh:
            response = httpx.post(
                f"{stack.coordinator_url}/jobs",
                data={"spec": json.dumps(make_spec(SPEC))},
                files={"dataset": ("conversations.jsonl", fh, "application/jsonl")},
                timeout=120,
            )
        assert response.status_code in (202, 409), response.text
        return str(response.json()["id"]) if response.status_code == 202 else None

    return stack, wait_until(submitted, 30, "the job to be accepted", interval_s=0.2)


def _keys(stack: FaultStack, job_id: str) -> Counter[Key]:
    return Counter((r["sample_id"], r["turn"], r["gen"]) for r in all_records(stack.storage, job_id))


def _job_or_none(stack: FaultStack, job_id: str) -> dict[str, Any] | None:
    try:
        response = httpx.get(f"{stack.coordinator_url}/jobs/{job_id}", timeout=HTTP_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None  # type: ignore[no-any-return]


def _waiting_next_turns(before: Counter[Key], expected: dict[str, ExpectedConversation]) -> int:
    """Conversations whose last committed turn, when the fault came, was not their last."""
    reached = Counter[str]()
    for sample_id, turn, _ in before:
        reached[sample_id] = max(reached[sample_id], turn + 1)
    return sum(1 for sid, n in reached.items() if n < len(expected[sid].turns))


def _check(
    stack: FaultStack,
    job_id: str,
    expected: dict[str, ExpectedConversation],
    before: Counter[Key],
    label: str,
) -> dict[str, Any]:
    """The end state; returns the job."""
    job = stack.job(job_id)
    records = all_records(stack.storage, job_id)
    after = Counter((r["sample_id"], r["turn"], r["gen"]) for r in records)
    stops = {s["sample_id"]: s for s in stack.storage.iter_stopped(job_id)}
    print(
        f"\n[{label}] conversations={len(expected)} state={job['state']} done={job['done']} "
        f"total={job['total']} records={len(records)} unique={len(after)} "
        f"wasted generations={len(records) - len(after)} stops={Counter(s['reason'] for s in stops.values())}"
    )
    assert job["state"] == "completed" and job["failed"] == 0, job
    wanted = {(sid, k, 0) for sid, conv in expected.items() for k in range(len(conv.turns))}
    assert set(after) == wanted, (
        f"missing {sorted(wanted - set(after))[:5]}, extra {sorted(set(after) - wanted)[:5]}"
    )
    assert job["done"] == len(after), f"done {job['done']} but {len(after)} turns recorded"
    for record in records:  # duplicates included
        turn = expected[record["sample_id"]].turns[record["turn"]]
        assert record["input_ids"] == turn.prompt_ids + turn.output_ids, (record["sample_id"], record["turn"])
        assert record["finish_type"] == turn.finish
    assert not [s for s in stops.values() if s["reason"] == "lost"], "a conversation stopped as lost"
    assert {sid: s["reason"] for sid, s in stops.items()} == {
        sid: conv.stop for sid, conv in expected.items() if conv.stop
    }
    again = [key for key in before if after[key] > before[key]]
    assert not again, f"{len(again)} turns with a committed record ran again: {again[:5]}"
    for queue in stack.queues():
        assert StartedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0, queue.name
        assert FailedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0, queue.name
        assert queue.count == 0, queue.name
    return job


def test_conversations_go_on_after_redis_restarts_empty(make_stack: Callable[..., FaultStack]) -> None:
    expected = _expected(tool_rows(CONVERSATIONS))
    stack, job_id = _start(make_stack, "convlost")
    turns = sum(len(conv.turns) for conv in expected.values())
    wait_until(lambda: stack.job(job_id)["done"] >= turns // 2, 60, "half of the turns", interval_s=POLL_S)

    stack.kill_redis()
    lost_at = time.monotonic()
    before = _keys(stack, job_id)
    stack.restart_redis()  # no AOF, no snapshot: empty
    wait_until(lambda: _job_or_none(stack, job_id), 30, "the job to be rebuilt", interval_s=POLL_S)
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)

    job = _check(stack, job_id, expected, before, "redis lost during an all job")
    waiting = _waiting_next_turns(before, expected)
    print(
        f"  {len(before)} turns committed at the loss, {waiting} conversations waiting for their next "
        f"turn; rebuilt ({job['rebuilt']['committed']} committed); completed "
        f"{time.monotonic() - lost_at:.1f} s after the loss"
    )
    assert job["rebuilt"]["reason"] == "Redis lost its data"
    assert waiting > 0, "the loss came when no conversation waited for a next turn"


def test_recover_of_a_healthy_all_job_stops_nothing(make_stack: Callable[..., FaultStack]) -> None:
    expected = _expected(tool_rows(CONVERSATIONS))
    stack, job_id = _start(make_stack, "convrecover")
    turns = sum(len(conv.turns) for conv in expected.values())
    wait_until(lambda: stack.job(job_id)["done"] >= turns // 2, 60, "half of the turns", interval_s=POLL_S)

    before = _keys(stack, job_id)
    response = httpx.post(f"{stack.coordinator_url}/jobs/{job_id}/recover", timeout=HTTP_TIMEOUT_S * 3)
    assert response.status_code == 200, response.text
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)

    job = _check(stack, job_id, expected, before, "recover of a healthy all job")
    assert job["rebuilt"] is not None
    assert _waiting_next_turns(before, expected) > 0, "recovered when no conversation waited"
