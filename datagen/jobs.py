"""Job state in Redis, shared by the coordinator (which creates and ingests jobs) and the workers
(which count prompts done and failed).

A job is one hash. Counters move only in transactions: ingestion adds accepted prompts in the
same MULTI/EXEC as their RQ enqueue, and a worker counts a prompt done inside RQ's own
"job finished" transaction, so a counter never disagrees with RQ's registries after a crash.
The job turns ``completed`` in the same script that counts its last prompt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline

from datagen.errors import JobNotFoundError
from datagen.keys import Keys
from datagen.redistext import as_text, as_texts
from datagen.spec import JobSpec
from datagen.states import JobState

__all__ = ["FAILED_REPORTS_CAP", "JobProgress", "JobStore", "now_ms"]

FAILED_REPORTS_CAP = 10_000

# KEYS: job hash, the job's running set, its failure reports, its breakdown hash, its labelled
# partitions. ARGV: counter field, increment, output tokens, now ms, RQ id leaving the running set
# ("" for none), failure report ("" for none), report cap, partition, class, finish reason ("" for
# none). A prompt is counted
# only if it was still in the running set, so finishing the same prompt twice (a stalled worker
# and its rescuer) counts once.
_COUNT_AND_MAYBE_COMPLETE = """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return 0 end
if ARGV[5] ~= '' and redis.call('SREM', KEYS[2], ARGV[5]) == 0 then return -1 end
if tonumber(ARGV[2]) ~= 0 then
  redis.call('HINCRBY', key, ARGV[1], ARGV[2])
  local label = ARGV[8]
  if redis.call('SISMEMBER', KEYS[5], label) == 0 then label = 'other' end
  local suffix = '|' .. label .. '|' .. ARGV[9]
  redis.call('HINCRBY', KEYS[4], ARGV[1] .. suffix, ARGV[2])
  if tonumber(ARGV[3]) ~= 0 then redis.call('HINCRBY', KEYS[4], 'output_tokens' .. suffix, ARGV[3]) end
  if ARGV[10] ~= '' then redis.call('HINCRBY', KEYS[4], 'finish:' .. ARGV[10] .. suffix, 1) end
end
if tonumber(ARGV[3]) ~= 0 then redis.call('HINCRBY', key, 'output_tokens', ARGV[3]) end
if ARGV[6] ~= '' then
  redis.call('RPUSH', KEYS[3], ARGV[6])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[7]) - 1)
end
if redis.call('HGET', key, 'state') == 'running' then
  local done = tonumber(redis.call('HGET', key, 'done') or '0')
  local failed = tonumber(redis.call('HGET', key, 'failed') or '0')
  local cancelled = tonumber(redis.call('HGET', key, 'cancelled') or '0')
  local accepted = tonumber(redis.call('HGET', key, 'accepted') or '0')
  if done + failed + cancelled >= accepted then
    redis.call('HSET', key, 'state', 'completed', 'finished_at_ms', ARGV[4])
    redis.call('DEL', KEYS[2])
    return 2
  end
end
return 1
"""

# KEYS: job hash. ARGV: the states it may move from (space-separated), the state it moves to,
# then field/value pairs to set with it. Returns 1 if it moved.
_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
local allowed = false
for from in string.gmatch(ARGV[1], '%S+') do
  if from == state then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# Partitions beyond this many per job are counted under the label "other" (bounded label sets).
MAX_PARTITION_LABELS = 20
OTHER_PARTITION = "other"

_INT_FIELDS = (
    "rows",
    "accepted",
    "rejected",
    "skipped",
    "done",
    "failed",
    "cancelled",
    "retried",
    "prompt_tokens",
    "output_tokens",
    "created_at_ms",
    "finished_at_ms",
    "ingest_line",
)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class JobProgress:
    job_id: str
    state: JobState
    rows: int
    accepted: int
    rejected: int
    skipped: int
    done: int
    failed: int
    in_flight: int
    prompt_tokens: int
    output_tokens: int
    created_at_ms: int
    finished_at_ms: int
    error: str | None
    storage_error: str | None = None
    cancelled: int = 0
    retried: int = 0
    paused: bool = False
    priority: str = "normal"
    weight: float = 1.0

    @property
    def queued(self) -> int:
        return max(0, self.accepted - self.done - self.failed - self.cancelled - self.in_flight)

    def elapsed_s(self, at_ms: int | None = None) -> float:
        end = self.finished_at_ms or (at_ms if at_ms is not None else now_ms())
        return max(1e-3, (end - self.created_at_ms) / 1000)

    def to_json(self, at_ms: int | None = None) -> dict[str, Any]:
        elapsed_s = self.elapsed_s(at_ms)
        finished = self.done + self.failed + self.cancelled
        remaining = max(0, self.accepted - finished)
        rate = finished / elapsed_s
        eta_s = None if self.state.is_final else (remaining / rate if rate > 0 else None)
        return {
            "id": self.job_id,
            "state": self.state.value,
            "rows": self.rows,
            "total": self.accepted,
            "rejected": self.rejected,
            "skipped": self.skipped,
            "queued": self.queued if not self.state.is_final else 0,
            # A cancelled job's prompts may still be finishing (or being aborted).
            "in_flight": self.in_flight,
            "done": self.done,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "retried": self.retried,
            "paused": self.paused,
            "priority": self.priority,
            "weight": self.weight,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.output_tokens,
            "tokens_per_s": round(self.output_tokens / elapsed_s, 2),
            "elapsed_s": round(elapsed_s, 3),
            "eta_s": None if eta_s is None else round(eta_s, 1),
            "created_at_ms": self.created_at_ms,
            "finished_at_ms": self.finished_at_ms or None,
            "error": self.error,
            "storage_error": self.storage_error,
        }


class JobStore:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._count_script = redis.register_script(_COUNT_AND_MAYBE_COMPLETE)
        self._transition = redis.register_script(_TRANSITION)

    # Creation and lookup ------------------------------------------------------------------------
    def create(
        self, job_id: str, spec: JobSpec, *, tokenizer_identity: str = "", stop_ids: list[int] | None = None
    ) -> bool:
        """Create the job; False if it exists already (a resubmission appends to it).

        ``tokenizer_identity`` (name and file hash) is what workers write into each record;
        ``stop_ids`` (from the pre-flight checks) are sent with every request of the job.
        """
        key = self.keys.job(job_id)
        created = now_ms()
        if not self.redis.hsetnx(key, "created_at_ms", created):
            return False
        with self.redis.pipeline() as pipe:
            pipe.hset(
                key,
                mapping={
                    "state": JobState.INGESTING.value,
                    "spec": spec.model_dump_json(),
                    "tokenizer_identity": tokenizer_identity or spec.tokenizer,
                    # Read by the dispatch script (datagen/dispatch.py) on every claim.
                    "priority": spec.priority.value,
                    "weight": repr(spec.weight),
                    "stop_ids": json.dumps(sorted(set(stop_ids or []))),
                },
            )
            pipe.zadd(self.keys.jobs_index(), {job_id: created})
            pipe.execute()
        return True

    def state(self, job_id: str) -> JobState:
        raw = self.redis.hget(self.keys.job(job_id), "state")
        if raw is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return JobState(as_text(raw))

    def spec(self, job_id: str) -> JobSpec:
        raw = self.redis.hget(self.keys.job(job_id), "spec")
        if raw is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return JobSpec.model_validate_json(raw)

    def stop_ids(self, job_id: str) -> list[int]:
        """The stop ids the pre-flight checks resolved for the job (empty for older jobs)."""
        raw = self.redis.hget(self.keys.job(job_id), "stop_ids")
        return [int(i) for i in json.loads(raw)] if raw else []

    def tokenizer_identity(self, job_id: str) -> str:
        raw = self.redis.hget(self.keys.job(job_id), "tokenizer_identity")
        if raw is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return as_text(raw)

    def progress(self, job_id: str) -> JobProgress:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.job(job_id))
            pipe.scard(self.keys.job_running(job_id))
            pipe.sismember(self.keys.paused_jobs(), job_id)
            raw_hash, running, paused = pipe.execute()
        raw = cast(dict[bytes, bytes], raw_hash)
        if not raw or b"state" not in raw:
            raise JobNotFoundError(f"no job {job_id!r}")
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        ints = {name: int(fields.get(name, 0) or 0) for name in _INT_FIELDS}
        return JobProgress(
            job_id=job_id,
            state=JobState(fields["state"]),
            rows=ints["rows"],
            accepted=ints["accepted"],
            rejected=ints["rejected"],
            skipped=ints["skipped"],
            done=ints["done"],
            failed=ints["failed"],
            in_flight=int(running),
            prompt_tokens=ints["prompt_tokens"],
            output_tokens=ints["output_tokens"],
            created_at_ms=ints["created_at_ms"],
            finished_at_ms=ints["finished_at_ms"],
            error=fields.get("error"),
            storage_error=fields.get("storage_error"),
            cancelled=ints["cancelled"],
            retried=ints["retried"],
            paused=bool(paused),
            priority=fields.get("priority", "normal"),
            weight=float(fields.get("weight", 1.0)),
        )

    def list_ids(self, limit: int = 1000) -> list[str]:
        return as_texts(self.redis.zrevrange(self.keys.jobs_index(), 0, limit - 1))

    # Ingestion ----------------------------------------------------------------------------------
    def ingest_line(self, job_id: str) -> int:
        return int(self.redis.hget(self.keys.job(job_id), "ingest_line") or 0)

    def add_ingest_counts(self, pipe: Pipeline, job_id: str, counts: dict[str, int], line: int) -> None:
        key = self.keys.job(job_id)
        for name, value in counts.items():
            if value:
                pipe.hincrby(key, name, value)
        pipe.hset(key, "ingest_line", line)

    def add_prompt(self, pipe: Pipeline, job_id: str, prompt_tokens: int, *, label: str, cls: str) -> None:
        """A prompt a worker enqueued for the job (the next turn of multi-turn ``all`` mode)."""
        key = self.keys.job(job_id)
        pipe.hincrby(key, "accepted", 1)
        pipe.hincrby(key, "prompt_tokens", prompt_tokens)
        self.add_breakdown(pipe, job_id, {("accepted", label, cls): 1})

    def label_of(self, job_id: str, partition: str) -> str:
        labelled = self.redis.sismember(self.keys.job_partitions(job_id), partition)
        return partition if labelled else OTHER_PARTITION

    def finish_ingest(self, job_id: str) -> None:
        # Only from ingesting: a job cancelled meanwhile stays cancelled. One transaction, so that
        # a job with nothing left to run is never seen running before it is seen completed.
        with self.redis.pipeline(transaction=True) as pipe:
            self.transition(job_id, (JobState.INGESTING,), JobState.RUNNING, pipe=pipe)
            self._count_script(
                keys=self._count_keys(job_id),
                args=["done", 0, 0, now_ms(), "", "", 0, "", "", ""],
                client=pipe,
            )
            pipe.execute()

    def transition(
        self,
        job_id: str,
        sources: tuple[JobState, ...],
        target: JobState,
        fields: dict[str, str | int] | None = None,
        *,
        pipe: Pipeline | None = None,
    ) -> bool:
        """Move the job to ``target`` if it is in one of ``sources`` (atomically), setting ``fields``.

        Returns whether it moved; inside ``pipe`` that answer comes from ``pipe.execute()`` instead.
        """
        args: list[str | int] = [" ".join(s.value for s in sources), target.value]
        for name, value in (fields or {}).items():
            args += [name, value]
        return bool(self._transition(keys=[self.keys.job(job_id)], args=args, client=pipe))

    def restart_ingest(self, job_id: str) -> None:
        self.redis.hset(
            self.keys.job(job_id), mapping={"state": JobState.INGESTING.value, "finished_at_ms": 0}
        )

    def set_storage_error(self, job_id: str, error: str | None) -> None:
        """A worker cannot commit this job's records (None: it can again)."""
        key = self.keys.job(job_id)
        if error is None:
            self.redis.hdel(key, "storage_error")
        else:
            self.redis.hset(key, "storage_error", f"{error} (since {now_ms()} ms)")

    def fail(self, job_id: str, error: str) -> None:
        self.redis.hset(
            self.keys.job(job_id),
            mapping={"state": JobState.FAILED.value, "error": error, "finished_at_ms": now_ms()},
        )

    # Workers ------------------------------------------------------------------------------------
    # A set of RQ ids rather than a counter: a prompt that is handed back or reaped and then
    # started again must not be counted twice.
    def started(self, job_id: str, rq_id: str) -> None:
        self.redis.sadd(self.keys.job_running(job_id), rq_id)

    def handed_back(self, pipe: Pipeline, job_id: str, rq_id: str) -> None:
        pipe.srem(self.keys.job_running(job_id), rq_id)

    def _count_keys(self, job_id: str) -> list[str]:
        k = self.keys
        return [
            k.job(job_id),
            k.job_running(job_id),
            k.job_failed(job_id),
            k.job_breakdown(job_id),
            k.job_partitions(job_id),
        ]

    def count_done(
        self,
        pipe: Pipeline,
        job_id: str,
        rq_id: str,
        output_tokens: int,
        *,
        partition: str,
        cls: str,
        finish: str = "",
    ) -> None:
        args: list[str | int] = ["done", 1, output_tokens, now_ms(), rq_id, "", 0, partition, cls, finish]
        self._count_script(keys=self._count_keys(job_id), args=args, client=pipe)

    def count_failed(
        self, pipe: Pipeline, job_id: str, rq_id: str, report: dict[str, Any], *, partition: str, cls: str
    ) -> None:
        report_json = json.dumps(report, sort_keys=True)
        args: list[str | int] = [
            "failed",
            1,
            0,
            now_ms(),
            rq_id,
            report_json,
            FAILED_REPORTS_CAP,
            partition,
            cls,
            "",
        ]
        self._count_script(keys=self._count_keys(job_id), args=args, client=pipe)

    def count_cancelled(self, pipe: Pipeline, job_id: str, rq_id: str, *, partition: str, cls: str) -> None:
        """An in-flight prompt of a cancelled job that a worker aborted."""
        args: list[str | int] = ["cancelled", 1, 0, now_ms(), rq_id, "", 0, partition, cls, ""]
        self._count_script(keys=self._count_keys(job_id), args=args, client=pipe)

    def count_retried(self, pipe: Pipeline, job_id: str, by_where: dict[tuple[str, str], int]) -> None:
        """Failed prompts put back for another try: ``(partition label, class) -> n``."""
        n = sum(by_where.values())
        key = self.keys.job(job_id)
        pipe.hincrby(key, "failed", -n)
        pipe.hincrby(key, "retried", n)
        self.add_breakdown(pipe, job_id, {("failed", label, cls): -k for (label, cls), k in by_where.items()})

    # Breakdown by partition and class --------------------------------------------------------------
    def partition_labels(self, job_id: str, partitions: set[str]) -> dict[str, str]:
        """Label of each partition: itself for the job's first partitions, ``other`` beyond the cap."""
        key = self.keys.job_partitions(job_id)
        labelled = set(as_texts(self.redis.smembers(key)))
        for partition in sorted(partitions - labelled):
            if len(labelled) >= MAX_PARTITION_LABELS:
                break
            self.redis.sadd(key, partition)
            labelled.add(partition)
        return {p: p if p in labelled else OTHER_PARTITION for p in partitions}

    def add_breakdown(self, pipe: Pipeline, job_id: str, counts: dict[tuple[str, str, str], int]) -> None:
        """Add ``(counter, partition label, class) -> n`` to the job's breakdown."""
        key = self.keys.job_breakdown(job_id)
        for (counter, label, cls), n in counts.items():
            pipe.hincrby(key, f"{counter}|{label}|{cls}", n)

    def breakdown(self, job_id: str) -> dict[tuple[str, str, str], int]:
        raw = cast(dict[bytes, bytes], self.redis.hgetall(self.keys.job_breakdown(job_id)))
        out: dict[tuple[str, str, str], int] = {}
        for field, value in raw.items():
            counter, label, cls = as_text(field).split("|", 2)
            out[(counter, label, cls)] = int(value)
        return out

    def failed_reports(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        raw = self.redis.lrange(self.keys.job_failed(job_id), 0, limit - 1)
        return [json.loads(item) for item in raw]
