"""Which job's prompt a worker runs next: priority first, then weighted fair share.

Prompts do not wait in RQ's class queue but in one backlog list per job and class. A job with
prompts to dispatch sits in a sorted set per class and priority, scored by its virtual time
(prompts dispatched divided by its weight). A worker's claim is one script that hands it up to N
prompts: those put back on RQ's queue first (handed back by a stopping worker, or a dead worker's,
requeued by the reaper), then each from the backlog of the unpaused job with the lowest virtual
time at the highest priority that has work, and starts them as RQ's worker would (started
registry, job status, heartbeat expiry), so ``rq info`` and RQ's recovery keep working. This is
stride scheduling: over any stretch where two jobs both have work, their dispatches follow their
weights, and a 10M-prompt job cannot hold back a small urgent one.

A paused job leaves the sets (and rejoins on resume), so a claim never looks at it: its cost is
O(log jobs) plus the prompts it hands out, however many jobs wait or are paused. A prompt on RQ's
list whose job is paused (a dead worker's, reaped during the pause) is moved to the front of that
job's backlog rather than run.

A job that joins (or comes back after its backlog ran dry, or is resumed) starts at the lowest
virtual time of its set (`datagen.control._dispatch_scripts.REJOIN`), so it gets its share from then on
without a catch-up burst.

The scripts derive per-job keys from the prefixes in :mod:`datagen.control.keys` (no Redis Cluster).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline
from rq.job import Job
from rq.utils import now as rq_now
from rq.utils import utcformat

from datagen.control._dispatch_scripts import CLAIM_MANY, PAUSE, REJOIN, RESUME
from datagen.control.epoch import EpochWatch
from datagen.control.jobs import LUA_COUNT_CANCELLED_QUEUED
from datagen.control.keys import Keys
from datagen.control.redistext import as_text, as_texts
from datagen.states import JobState, Priority, PromptClass

__all__ = ["SHARE_WINDOW_S", "Claimant", "Claimed", "Dispatch", "JobShare"]

# The recent share counts dispatches over this window, in buckets of WINDOW_BUCKET_S.
SHARE_WINDOW_S = 60
WINDOW_BUCKET_S = 10
# A claim looks at this many prompts on RQ's list at most (a paused job's go back to its backlog).
RQ_LIST_SCAN = 1000
# Prompts per claim at most (the script's replies and ZADD arguments stay small).
MAX_CLAIM = 256
# Ids pushed per RPUSH inside a script (Lua's unpack has a stack limit).
PUSH_SLICE = 1000
RQ_JOB_PREFIX = Job.redis_job_namespace_prefix

# KEYS: job hash, backlog, the job's set for this class and priority, the job's breakdown, the wake
# channel (idle workers learn of the prompts at once, `workers.wake`), the paused jobs. ARGV:
# job id, slice size, class, the cancelled state, RQ ids... A cancelled job takes no more prompts:
# they are counted cancelled instead (a worker may enqueue a multi-turn conversation's next turn as
# the cancel lands); a deleted job takes none and counts nothing (its keys must not come back).
_ADD = (
    LUA_COUNT_CANCELLED_QUEUED
    + REJOIN
    + """
local n = #ARGV - 4
if n <= 0 then return 0 end
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state == ARGV[4] then
  count_cancelled_queued(KEYS[1], KEYS[4], ARGV[3], n)
  return 0
end
local slice = tonumber(ARGV[2])
for i = 5, #ARGV, slice do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + slice - 1, #ARGV)))
end
rejoin(KEYS[3], KEYS[6], ARGV[1])
redis.call('PUBLISH', KEYS[5], ARGV[3])
return n
"""
)

# KEYS: backlog, job hash, the job's breakdown. ARGV: RQ job key prefix, how many, class. Drops up
# to that many undispatched prompts of a cancelled job (their RQ job hashes too) and counts them
# cancelled.
_DROP = (
    LUA_COUNT_CANCELLED_QUEUED
    + """
local ids = redis.call('LPOP', KEYS[1], tonumber(ARGV[2]))
if not ids then return 0 end
for _, id in ipairs(ids) do redis.call('UNLINK', ARGV[1] .. id) end
count_cancelled_queued(KEYS[2], KEYS[3], ARGV[3], #ids)
return #ids
"""
)

DROP_CHUNK = 1000


@dataclass(frozen=True)
class Claimant:
    """Who claims: the RQ queue of the class, its started registry, the worker's RQ name, the
    execution id of its started-registry members, and how long they live without a heartbeat."""

    queue_key: str
    started_key: str
    worker_name: str
    execution_id: str
    ttl_s: int


@dataclass(frozen=True)
class Claimed:
    """A started prompt: its RQ id, its RQ job hash as it was when claimed, and when it started."""

    rq_id: str
    fields: dict[bytes, bytes]
    started_at: datetime


@dataclass(frozen=True)
class JobShare:
    """A job's place in the fleet: what its weight entitles it to, and what it got lately."""

    priority: str
    weight: float
    active: bool
    target: float
    recent: float
    dispatched: int

    def to_json(self) -> dict[str, Any]:
        return {
            "priority": self.priority,
            "weight": self.weight,
            "active": self.active,
            "target": round(self.target, 4),
            "recent": round(self.recent, 4),
            "dispatched": self.dispatched,
        }


class Dispatch:
    def __init__(self, redis: Redis, keys: Keys, *, epoch: EpochWatch | None = None) -> None:
        self.redis = redis
        self.keys = keys
        # A worker's view of Redis's epoch: claims hand out nothing while Redis is older than it.
        self.epoch = epoch
        self._claim = redis.register_script(CLAIM_MANY)
        self._add = redis.register_script(_ADD)
        self._drop = redis.register_script(_DROP)
        self._pause = redis.register_script(PAUSE)
        self._resume = redis.register_script(RESUME)

    # Workers -------------------------------------------------------------------------------------
    def claim_many(
        self, cls: PromptClass, n: int, claimant: Claimant, *, skip: Collection[str] = ()
    ) -> list[Claimed]:
        """Start up to ``n`` prompts of ``cls`` for ``claimant`` (see `datagen.control._dispatch_scripts`):
        each is in RQ's started registry and its job's running set when this returns. Jobs in
        ``skip`` are passed over as paused ones are (this worker cannot take more of them now)."""
        keys = self.keys
        bucket = int(time.time() // WINDOW_BUCKET_S)
        now = rq_now()
        replies = self._claim(
            keys=[
                claimant.queue_key,
                keys.paused_jobs(),
                *(keys.dispatch_jobs(cls, p) for p in Priority),
                keys.dispatch_window(bucket),
                claimant.started_key,
                keys.epoch(),
            ],
            args=[
                keys.job_key_prefix(),
                keys.backlog_suffix(cls),
                SHARE_WINDOW_S + WINDOW_BUCKET_S,
                RQ_LIST_SCAN,
                keys.rq_id_prefix(),
                RQ_JOB_PREFIX,
                max(0, min(n, MAX_CLAIM)),
                now.timestamp() + claimant.ttl_s,
                utcformat(now),
                claimant.worker_name,
                claimant.execution_id,
                keys.running_suffix(),
                self.epoch.floor if self.epoch is not None else 0,
                *sorted(skip),
            ],
        )
        claimed = []
        for rq_id, flat in cast(list[list[Any]], replies):
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            claimed.append(Claimed(as_text(rq_id), fields, now))
        return claimed

    # Enqueueing ----------------------------------------------------------------------------------
    def add(
        self, pipe: Pipeline, job_id: str, cls: PromptClass, priority: Priority, rq_ids: Sequence[str]
    ) -> None:
        """Append prompts to the job's backlog inside the caller's transaction."""
        if not rq_ids:
            return
        keys = [
            self.keys.job(job_id),
            self.keys.job_backlog(job_id, cls),
            self.keys.dispatch_jobs(cls, priority),
            self.keys.job_breakdown(job_id),
            self.keys.wake_channel(),
            self.keys.paused_jobs(),
        ]
        args = [job_id, PUSH_SLICE, cls.value, JobState.CANCELLED.value, *rq_ids]
        self._add(keys=keys, args=args, client=pipe)

    # Operator controls ---------------------------------------------------------------------------
    def pause(self, job_id: str) -> None:
        """The job leaves every dispatch set: claims pass over it at no cost until it resumes."""
        sets = [self.keys.dispatch_jobs(cls, p) for cls in PromptClass for p in Priority]
        self._pause(keys=[self.keys.paused_jobs(), *sets], args=[job_id])

    def resume(self, job_id: str) -> None:
        """Unpause; the job rejoins at the lowest virtual time of the jobs beside it."""
        raw = self.redis.hget(self.keys.job(job_id), "priority")
        priority = Priority(as_text(raw)) if raw else Priority.NORMAL
        keys = [self.keys.paused_jobs()]
        for cls in PromptClass:
            keys += [self.keys.job_backlog(job_id, cls), self.keys.dispatch_jobs(cls, priority)]
        self._resume(keys=keys, args=[job_id])
        self.wake()

    def wake(self, cls: PromptClass | None = None) -> None:
        """Tell idle workers that prompts (of ``cls``, or of every class) can be claimed."""
        for each in [cls] if cls is not None else list(PromptClass):
            self.redis.publish(self.keys.wake_channel(), each.value)

    def is_paused(self, job_id: str) -> bool:
        return bool(self.redis.sismember(self.keys.paused_jobs(), job_id))

    def withdraw(self, job_id: str) -> int:
        """Take the job out of dispatch and drop its undispatched prompts; returns how many."""
        with self.redis.pipeline() as pipe:
            for cls in PromptClass:
                for priority in Priority:
                    pipe.zrem(self.keys.dispatch_jobs(cls, priority), job_id)
            pipe.execute()
        dropped = 0
        for cls in PromptClass:
            while n := int(
                self._drop(
                    keys=[
                        self.keys.job_backlog(job_id, cls),
                        self.keys.job(job_id),
                        self.keys.job_breakdown(job_id),
                    ],
                    args=[RQ_JOB_PREFIX, DROP_CHUNK, cls.value],
                )
            ):
                dropped += n
        return dropped

    # Reading -------------------------------------------------------------------------------------
    def backlog(self, job_id: str, cls: PromptClass) -> int:
        return int(self.redis.llen(self.keys.job_backlog(job_id, cls)))

    def depth(self, cls: PromptClass) -> int:
        """Prompts of ``cls`` waiting in every job's backlog (paused jobs included)."""
        jobs = {job for priority in Priority for job in self._members(cls, priority)}
        jobs |= self._paused()
        if not jobs:
            return 0
        with self.redis.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.llen(self.keys.job_backlog(job, cls))
            return sum(int(n) for n in pipe.execute())

    def has_work(self, cls: PromptClass) -> bool:
        """Whether some unpaused job still has prompts of ``cls`` to dispatch."""
        for priority in Priority:
            for job in self._members(cls, priority):
                if self.redis.llen(self.keys.job_backlog(job, cls)):
                    return True
        return False

    def shares(self) -> dict[str, JobShare]:
        """Every job with prompts to dispatch (or dispatched recently): target and recent share.

        The target is the weight over the sum of weights of the unpaused jobs at the highest
        priority that has work (zero below it); the recent share is the job's part of the last
        minute's dispatches of the whole fleet.
        """
        paused = self._paused()
        ranks: dict[str, Priority] = {}
        for priority in Priority:
            for cls in PromptClass:
                members = self._members(cls, priority)
                with self.redis.pipeline(transaction=False) as pipe:
                    for job in members:
                        pipe.llen(self.keys.job_backlog(job, cls))
                    lengths = pipe.execute()
                for job, length in zip(members, lengths, strict=True):
                    if length:  # a job whose backlog ran dry leaves its set at the next claim
                        ranks.setdefault(job, priority)
        ranks.update(self._paused_ranks(paused))
        recent = self._recent()
        jobs = set(ranks) | set(recent)
        if not jobs:
            return {}
        with self.redis.pipeline(transaction=False) as pipe:
            for job in sorted(jobs):
                pipe.hmget(self.keys.job(job), ["weight", "priority", "dispatched"])
            rows = dict(zip(sorted(jobs), pipe.execute(), strict=True))
        weights = {job: _float(rows[job][0], 1.0) for job in jobs}
        active = {job for job in ranks if job not in paused}
        top = min((ranks[job].rank for job in active), default=None)
        entitled = [job for job in active if ranks[job].rank == top]
        total_weight = sum(weights[job] for job in entitled)
        total_recent = sum(recent.values())
        out = {}
        for job in jobs:
            weight = weights[job]
            out[job] = JobShare(
                priority=as_text(rows[job][1]) if rows[job][1] else Priority.NORMAL.value,
                weight=weight,
                active=job in active,
                target=weight / total_weight if job in entitled and total_weight else 0.0,
                recent=recent.get(job, 0) / total_recent if total_recent else 0.0,
                dispatched=int(rows[job][2] or 0),
            )
        return out

    def _members(self, cls: PromptClass, priority: Priority) -> list[str]:
        return as_texts(self.redis.zrange(self.keys.dispatch_jobs(cls, priority), 0, -1))

    def _paused(self) -> set[str]:
        return set(as_texts(self.redis.smembers(self.keys.paused_jobs())))

    def _paused_ranks(self, paused: set[str]) -> dict[str, Priority]:
        """The priority of each paused job with prompts left (paused jobs are in no dispatch set)."""
        jobs = sorted(paused)
        with self.redis.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.hget(self.keys.job(job), "priority")
                for cls in PromptClass:
                    pipe.llen(self.keys.job_backlog(job, cls))
            replies = pipe.execute()
        step = 1 + len(PromptClass)
        ranks = {}
        for i, job in enumerate(jobs):
            raw, *lengths = replies[i * step : (i + 1) * step]
            if any(lengths):
                ranks[job] = Priority(as_text(raw)) if raw else Priority.NORMAL
        return ranks

    def _recent(self) -> dict[str, int]:
        now_bucket = int(time.time() // WINDOW_BUCKET_S)
        buckets = range(now_bucket - SHARE_WINDOW_S // WINDOW_BUCKET_S + 1, now_bucket + 1)
        with self.redis.pipeline(transaction=False) as pipe:
            for bucket in buckets:
                pipe.hgetall(self.keys.dispatch_window(bucket))
            counts: dict[str, int] = {}
            for raw in pipe.execute():
                for job, n in cast(dict[bytes, bytes], raw).items():
                    counts[as_text(job)] = counts.get(as_text(job), 0) + int(n)
        return counts


def _float(raw: bytes | None, default: float) -> float:
    try:
        return float(raw) if raw is not None else default
    except ValueError:
        return default
