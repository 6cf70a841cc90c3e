"""A job with a recipe keeps every sample's arm through a Redis loss and a resubmit.

Over real processes (Redis, a simulator, a coordinator, a worker): a ``cycle`` recipe of three arms
(thinking on, thinking off, high effort) over 300 rows. Redis is SIGKILLed and restarted empty
mid-job; the coordinator rebuilds the job from storage and ingests the rows again. Every row ends
with one record, under arm ``row mod 3`` exactly (a rebuild that counted rows from the checkpoint
instead of the file would shift them), rendered with that arm's template variables. The same file
submitted again as a new job assigns the same arms.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from tests.support.faults import POLL_S, FaultStack, all_records, rows_for
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

ROWS = 300
MAX_NEW_TOKENS = 200
# cycle: row i runs under ARMS[i % 3].
ARMS: list[tuple[str, dict[str, Any]]] = [
    ("think", {}),
    ("answer", {"thinking": False}),
    ("high", {"reasoning_effort": "high"}),
]
RECIPE = {
    "assign": "cycle",
    "arms": [{"name": name, "chat_template_kwargs": kwargs} for name, kwargs in ARMS],
}
COMPLETE_TIMEOUT_S = 240.0


def _expected(rows: list[dict[str, Any]]) -> dict[str, tuple[str, list[int]]]:
    """Sample id -> (its arm, its prompt ids as transformers renders them with the arm's kwargs)."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    template = default_chat_template_path().read_text()
    out = {}
    for i, row in enumerate(rows):
        name, kwargs = ARMS[i % len(ARMS)]
        ids = tokenizer.apply_chat_template(
            row["messages"],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            chat_template=template,
            **kwargs,
        )
        out[row["id"]] = (name, list(ids))
    return out


def _check(records: list[dict[str, Any]], expected: dict[str, tuple[str, list[int]]]) -> None:
    assert {r["sample_id"] for r in records} == set(expected)
    for record in records:
        name, prompt = expected[record["sample_id"]]
        assert record["arm"] == name, record["sample_id"]
        assert record["input_ids"][: record["prompt_len"]] == prompt, record["sample_id"]


def _job_or_none(stack: FaultStack, job_id: str) -> dict[str, Any] | None:
    try:
        return stack.job(job_id)
    except Exception:  # the coordinator answers 404, or nothing, until the rebuild
        return None


def test_arms_hold_through_a_redis_loss_and_a_resubmit(make_stack: Callable[..., FaultStack]) -> None:
    stack = make_stack("arms")
    stack.add_sim("a", time_scale=0.02)
    stack.start_coordinator()
    stack.start_worker("worker", ["a"], concurrency=16)
    rows = rows_for(ROWS)
    expected = _expected(rows)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS, job_id="mix", recipe=RECIPE)
    wait_until(lambda: stack.job(job_id)["done"] >= ROWS // 4, 120, "a quarter of the job", interval_s=POLL_S)

    stack.kill_redis()
    stack.restart_redis()  # empty: the job is rebuilt from storage
    wait_until(
        lambda: _job_or_none(stack, job_id) is not None,
        60,
        "the job to be rebuilt",
        interval_s=POLL_S,
        on_timeout=stack.logs,
    )
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)
    job = stack.job(job_id)
    assert job["rebuilt"] is not None and job["rebuilt"]["reason"] == "Redis lost its data"

    records = all_records(stack.storage, job_id)
    _check(records, expected)
    # Exact shares: a record generated twice (in flight at the loss) has the same arm both times.
    shares = Counter(r["arm"] for r in {r["sample_id"]: r for r in records}.values())
    assert shares == {"think": 100, "answer": 100, "high": 100}
    # The job counts done per arm, the records committed before the loss included.
    assert {name: arm["done"] for name, arm in job["arms"].items()} == shares

    again = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS, job_id="again", recipe=RECIPE)
    stack.wait_completed(again, COMPLETE_TIMEOUT_S)
    _check(all_records(stack.storage, again), expected)
    print(f"  rebuilt job: {json.dumps(job['rebuilt'])}; resubmitted job: {stack.job(again)['done']} done")
