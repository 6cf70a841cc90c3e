"""Issue 5, case 6: the coordinator, then Redis, killed with SIGKILL in the middle of an ingestion.

20,000 short prompts are ingested in chunks of 100 (``DATAGEN_ENQUEUE_CHUNK``), so an ingestion
takes seconds and a kill lands between chunks or inside one. Each chunk's enqueue, its keys in the
job's ``enqueued`` set and the line checkpoint are one MULTI/EXEC, so after any kill:

- the job's backlog, the job's ``accepted`` counter and the ``enqueued`` set agree (also at the moment of
  the kill, read straight from Redis);
- the resumed ingestion starts from the checkpoint (no row is read twice: ``skipped`` stays 0,
  where a restart from line 1 behind the guard would skip every prompt already enqueued) and
  ends with exactly the 20,000 expected RQ ids in the job's backlog, none twice, each with its job hash.

Redis runs with AOF (``appendfsync everysec``) and is killed without a shutdown. A killed process
loses no AOF write it made, so a second run also cuts the last ten chunks off the AOF before the
restart, as a machine crash would lose up to a second of writes: those chunks are lost with their
checkpoint, and the coordinator, which saw them acknowledged, must enqueue them again. No
worker runs: a worker would need minutes for 20,000 prompts on 2 cores, and the end-to-end
path from queue to export is what the other cases check.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from datagen.states import PromptClass
from tests.support.faults import POLL_S, FaultStack, rows_for
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

PROMPTS = 20_000
CHUNK = 100
KILL_AFTER = 4_000  # accepted prompts before the kill
REDIS_DOWN_S = 1.0


def _job_hash(stack: FaultStack, job_id: str) -> dict[str, str] | None:
    try:
        raw = stack.redis.hgetall(stack.keys.job(job_id))
    except redis.RedisError:
        return None
    return {k.decode(): v.decode() for k, v in raw.items()}


def _counter(stack: FaultStack, job_id: str, name: str) -> int:
    job = _job_hash(stack, job_id)
    return int(job.get(name, 0)) if job else -1


def _check_consistent(stack: FaultStack, job_id: str) -> dict[str, Any]:
    """Backlog, counters and the rows guard agree (read in one transaction); returns what was read.

    Enqueued prompts wait in the job's backlog (datagen/control/dispatch.py) until a worker claims them.
    """
    short, long = (stack.keys.job_backlog(job_id, cls) for cls in PromptClass)
    with stack.redis.pipeline(transaction=True) as pipe:
        pipe.hgetall(stack.keys.job(job_id))
        pipe.lrange(short, 0, -1)
        pipe.llen(long)
        pipe.hlen(stack.keys.job_rows(job_id))  # the guard: one entry per enqueued row
        raw_job, raw_ids, long_count, enqueued = pipe.execute()
    job = {k.decode(): v.decode() for k, v in raw_job.items()}
    ids = [i.decode() for i in raw_ids]
    assert len(ids) == len(set(ids)), "a prompt was enqueued twice"
    assert len(ids) == int(job["accepted"]) == enqueued, (len(ids), job["accepted"], enqueued)
    assert long_count == 0  # every prompt is short
    return {"job": job, "ids": ids}


def _check_complete(stack: FaultStack, job_id: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    seen = _check_consistent(stack, job_id)
    job = seen["job"]
    assert job["state"] == "running", job  # ingestion finished; no worker runs
    assert (int(job["rows"]), int(job.get("skipped", 0)), int(job.get("rejected", 0))) == (PROMPTS, 0, 0)
    expected = {stack.keys.rq_job_id(job_id, row["id"], 0, 0) for row in rows}
    assert set(seen["ids"]) == expected
    hashes = sum(1 for _ in stack.redis.scan_iter(match=f"rq:job:{stack.namespace}-*", count=5000))
    assert hashes == PROMPTS, f"{hashes} RQ job hashes for {PROMPTS} prompts"
    return seen


def _start_ingesting(stack: FaultStack) -> tuple[str, list[dict[str, Any]]]:
    stack.start_coordinator()
    rows = rows_for(PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=100)
    wait_until(
        lambda: _counter(stack, job_id, "accepted") >= KILL_AFTER,
        60,
        "ingestion to get going",
        interval_s=POLL_S,
    )
    return job_id, rows


@pytest.mark.timeout(120)
def test_a_coordinator_killed_mid_ingestion_resumes_from_its_checkpoint(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack = make_stack("ingkill", {"DATAGEN_ENQUEUE_CHUNK": str(CHUNK)})
    job_id, rows = _start_ingesting(stack)
    stack.kill(stack.procs.procs["coordinator"])
    at_kill = _check_consistent(stack, job_id)["job"]
    assert at_kill["state"] == "ingesting" and int(at_kill["accepted"]) < PROMPTS, at_kill
    restarted = time.monotonic()
    stack.start_coordinator()
    resuming_since = time.monotonic()
    wait_until(
        lambda: _counter(stack, job_id, "accepted") > int(at_kill["accepted"]),
        60,
        "resume",
        interval_s=POLL_S,
    )
    resume_s = time.monotonic() - resuming_since
    wait_until(
        lambda: (_job_hash(stack, job_id) or {}).get("state") == "running",
        60,
        "ingestion to finish",
        interval_s=POLL_S,
    )
    finish_s = time.monotonic() - restarted
    _check_complete(stack, job_id, rows)
    print(
        f"\n[case 6: coordinator kill -9] killed at accepted={at_kill['accepted']} (checkpoint line "
        f"{at_kill['ingest_line']}); the restarted coordinator resumed within {resume_s:.1f} s of "
        f"starting and finished {PROMPTS} prompts {finish_s:.1f} s after the restart; no duplicate"
    )


def _truncate_aof(data_dir: Path, transactions: int) -> None:
    """Cut the last ``transactions`` MULTI/EXEC blocks off the AOF, as an OS crash would lose them.

    A SIGKILLed Redis loses nothing it already wrote (the kernel keeps the page cache); with
    ``appendfsync everysec`` a machine crash loses up to a second of writes, always at the tail.
    """
    nested = sorted((data_dir / "appendonlydir").glob("*.incr.aof"))  # Redis 7: multi-part AOF
    path = nested[-1] if nested else data_dir / "appendonly.aof"
    data = path.read_bytes()
    starts = [m.start() for m in re.finditer(re.escape(b"*1\r\n$5\r\nMULTI\r\n"), data)]
    assert len(starts) > transactions, f"only {len(starts)} transactions in {path}"
    with open(path, "r+b") as fh:
        fh.truncate(starts[-transactions])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lost_chunks", [0, 10], ids=["aof-intact", "last-10-chunks-lost"])
def test_redis_killed_mid_ingestion_loses_and_duplicates_nothing(
    make_stack: Callable[..., FaultStack], lost_chunks: int
) -> None:
    stack = make_stack("ingredis", {"DATAGEN_ENQUEUE_CHUNK": str(CHUNK)}, redis_aof=True)
    job_id, rows = _start_ingesting(stack)
    stack.kill_redis()
    killed_at = time.monotonic()
    if lost_chunks:
        _truncate_aof(stack.redis_dir, lost_chunks)
    time.sleep(REDIS_DOWN_S)
    stack.restart_redis()
    kept = _check_consistent(stack, job_id)["job"]  # what the AOF kept
    wait_until(
        lambda: (_job_hash(stack, job_id) or {}).get("state") == "running",
        90,
        "ingestion to finish",
        interval_s=POLL_S,
    )
    finish_s = time.monotonic() - killed_at
    _check_complete(stack, job_id, rows)
    print(
        f"\n[case 6: Redis kill -9, {lost_chunks} chunks cut off the AOF] Redis came back with "
        f"accepted={kept['accepted']} (checkpoint line {kept['ingest_line']}); all {PROMPTS} prompts "
        f"enqueued exactly once {finish_s:.1f} s after the kill"
    )
    assert stack.procs.procs["coordinator"].poll() is None, "the coordinator died with Redis"
