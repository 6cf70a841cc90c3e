"""Rendering in a pool of processes (`service.render_pool`) gives what rendering in the ingestion
thread gives, row for row, and a dead rendering process costs a pause, never a row."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.dataset import Prompt, line_items
from datagen.prompts.tokenization import renderer_for
from datagen.records.storage import Storage
from datagen.states import JobState, PromptClass
from service.admit import AdmittedRow, Refused, admit_row, arm_renderers
from service.ingest import IngestOptions, Ingestor
from service.render_pool import LineBatch, RenderedRow, RenderPool, RowLine, _without_original, render_batch
from service.rowids import row_id
from tests.support.specs import job_spec
from tests.support.wait import wait_until

RECIPE = {
    "assign": "cycle",
    "arms": [
        {"name": "think"},
        {"name": "answer", "chat_template_kwargs": {"thinking": False}},
        {"name": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
    ],
}


def _lines() -> bytes:
    rows = [
        json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]})
        for i in range(300)
    ]
    rows[3] = "{broken"
    rows[7] = ""  # a blank line: no row, no row index
    rows[11] = json.dumps(
        {
            "id": "conv",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
            ],
        }
    )
    return ("\n".join(rows) + "\n").encode()


@pytest.fixture(scope="module")
def pool() -> Iterator[RenderPool]:
    pool = RenderPool(2)
    yield pool
    pool.close()


def _rows(pool: RenderPool, start_line: int = 0, **spec_fields: object) -> list[RenderedRow]:
    spec = job_spec(samples=2, recipe=RECIPE, multi_turn="all", **spec_fields)
    identity = renderer_for(spec).identity()
    key = f"{identity['tokenizer_sha256']}:{identity['chat_template_sha256']}"
    return list(pool.rows(io.BytesIO(_lines()), spec, key, start_line, 4096))


def test_the_pool_renders_every_row_as_the_ingestion_thread_does(pool: RenderPool) -> None:
    here, there = _rows(RenderPool(0)), _rows(pool)
    assert there == here
    assert [r.line for r in there[:4]] == [1, 2, 3, 4]
    assert len(there) == 299  # the blank line is no row
    # Written out: line 4 is broken; cycle over 3 arms, 2 samples: i = row index * 2 + gen.
    broken = there[3]
    assert isinstance(broken.verdict, Refused) and broken.verdict.reason.startswith("invalid JSON")
    second = there[1].verdict
    assert isinstance(second, AdmittedRow)
    assert [arm.name for arm, _ in second.samples if arm] == ["high", "think"]  # row index 1: i = 2, 3
    # Line 10 is row index 8, not 9: line 8 is blank. i = 16, 17.
    after_blank = next(r for r in there if r.line == 10).verdict
    assert isinstance(after_blank, AdmittedRow)
    assert [arm.name for arm, _ in after_blank.samples if arm] == ["answer", "high"]
    conversation = next(r for r in there if r.line == 12).conversation
    assert conversation is not None and conversation.cuts == [1, 3]


def test_a_rendered_row_keeps_every_field_of_its_prompt_but_the_parsed_row() -> None:
    # Every field set to a value other than its default, so a field the copy forgot shows.
    values: dict[str, object] = {
        "line": 7,
        "sample_id": "s",
        "turn": 2,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function"}],
        "partition": "math",
        "cls": PromptClass.LONG,
        "original": {"id": "s"},
        "token_ids": [1, 2],
        "prompt_len": 1,
        "row_index": 5,
    }
    assert set(values) == {f.name for f in dataclasses.fields(Prompt)}
    shipped = _without_original(Prompt(**values))  # type: ignore[arg-type]
    assert shipped == Prompt(**{**values, "original": {}})  # type: ignore[arg-type]


def test_a_batch_steps_through_its_rows_as_one_row_at_a_time_would() -> None:
    # render_batch parses every line, then judges every row, then takes the ids: each row must
    # still get its own verdict, conversation and id, as the steps run one row at a time give.
    spec = job_spec(samples=2, recipe=RECIPE, multi_turn="all")
    renderers = arm_renderers(spec)
    raws = [line.encode() for line in _lines().decode().split("\n")[:14]]
    rows = [RowLine(i + 1, raw or None, i, f"d{i}") for i, raw in enumerate(raws) if raw]
    rows.append(RowLine(40, None, 13, "long"))  # a line over the length cap
    batch = LineBatch(spec.model_dump_json(), "k", 4096, tuple(rows))
    expected = []
    for row in rows[:-1]:
        assert row.raw is not None
        first = line_items(row.raw, row.line, spec.multi_turn, row_index=row.row_index)[0]
        verdict = admit_row(first, spec, renderers, 4096)
        admitted = isinstance(verdict, AdmittedRow) and isinstance(first, Prompt)
        expected.append((row.line, row.digest, verdict, row_id(first) if admitted else None))
    got = render_batch(batch)
    assert [(r.line, r.digest, r.verdict, r.row_id) for r in got[:-1]] == expected
    assert got[-1].line == 40 and isinstance(got[-1].verdict, Refused)
    assert "longer than" in got[-1].verdict.reason
    # Written out: line 4 is broken, line 8 blank (no row), line 12 the conversation of two user turns.
    by_line = {r.line: r for r in got}
    assert 8 not in by_line
    assert isinstance(by_line[4].verdict, Refused) and by_line[4].row_id is None
    conversation = by_line[12].conversation
    assert conversation is not None and conversation.cuts == [1, 3]
    assert [r.line for r in got if r.conversation is not None] == [1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14]


def test_a_resumed_read_starts_after_its_checkpoint_with_the_rows_own_indexes(pool: RenderPool) -> None:
    assert _rows(pool, start_line=100) == [r for r in _rows(RenderPool(0)) if r.line > 100]


def test_the_thread_renders_while_the_processes_are_behind_and_order_holds() -> None:
    # A new pool's process imports transformers and loads the tokenizer (seconds) before its first
    # batch: meanwhile the ingestion thread renders the batches after the first three itself.
    spec = job_spec(samples=2, recipe=RECIPE, multi_turn="all")
    identity = renderer_for(spec).identity()
    key = f"{identity['tokenizer_sha256']}:{identity['chat_template_sha256']}"
    where: dict[str, int] = {}

    def counted(place: str, rows: int, cpu_s: float) -> None:
        assert cpu_s > 0
        where[place] = where.get(place, 0) + rows

    # Enough rows that batches are left once the process has its window (4 batches) in hand.
    lines = _lines() * 10
    slow = RenderPool(1)
    try:
        rows = list(slow.rows(io.BytesIO(lines), spec, key, 0, 4096, counted))
    finally:
        slow.close()
    assert rows == list(RenderPool(0).rows(io.BytesIO(lines), spec, key, 0, 4096))
    assert [r.line for r in rows] == sorted(r.line for r in rows)
    assert sum(where.values()) == 2990
    first_three = 8 + 16 + 32
    assert where["thread"] > first_three, where


def test_a_killed_rendering_process_costs_a_pause_not_a_row(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys("rp")
    jobs = JobStore(redis_client, keys)
    storage = Storage(str(tmp_path / "data"))
    spec = job_spec()
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"k{i}", "prompt": f"Tell me about item {i} in some detail."}) + "\n"
            for i in range(3000)
        )
    )
    jobs.create("killed", spec)
    pool = RenderPool(2)
    options = IngestOptions(
        chunk=100, enqueue=EnqueueOptions(result_ttl_s=60, failure_ttl_s=60, max_worker_losses=1)
    )
    ingestor = Ingestor(redis_client, keys, jobs, storage, options, pool=pool)
    ended: list[bool] = []
    thread = threading.Thread(target=lambda: ended.append(ingestor.run("killed", source, threading.Event())))
    try:
        thread.start()
        wait_until(lambda: jobs.progress("killed").accepted >= 200, 60, "some rows ingested")
        executor = pool._executor
        assert executor is not None
        victim = next(iter(executor._processes))
        os.kill(victim, signal.SIGKILL)
        thread.join(timeout=120)
        assert ended == [True]
    finally:
        pool.close()
    progress = jobs.progress("killed")
    assert (progress.state, progress.rows, progress.accepted) == (JobState.RUNNING, 3000, 3000)
