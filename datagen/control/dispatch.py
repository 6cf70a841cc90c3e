"""Which job's prompt a worker runs next: priority first, then weighted fair share.

Prompts do not wait in RQ's class queue but in one backlog list per job and class. A job with
prompts to dispatch sits in a sorted set per class and priority, scored by its virtual time
(prompts dispatched divided by its weight). A worker's claim is one script that hands it up to N
prompts: those put back on RQ's queue first (handed back by a stopping worker, or a dead worker's,
requeued by the reaper), then each from the backlog of the unpaused job with the lowest virtual
time at the highest priority that has work, and starts them as RQ's worker would (started
registry, job status, heartbeat expiry), so ``rq info`` and RQ's recovery keep working. This is
stride scheduling: over any stretch where two jobs both have work, their dispatches follow their
weights (to within `TAIL_PROMPTS` at the end of a job's backlog, which goes whole), and a 10M-prompt
job cannot hold back a small urgent one.

A paused job leaves the sets (and rejoins on resume), so a claim never looks at it: its cost is
O(log jobs) plus the prompts it hands out, however many jobs wait or are paused. A prompt on RQ's
list whose job is paused (a dead worker's, reaped during the pause) is moved to the front of that
job's backlog rather than run.

A job that joins (or comes back after its backlog ran dry, or is resumed) starts at the lowest
virtual time of its set (``rejoin`` in ``datagen/control/lua/lib.lua``), so it gets its share from then
on without a catch-up burst. The scripts are in ``datagen/control/lua/``: ``claim_many``,
``backlog_add``, ``backlog_drop``, ``pause`` and ``resume``.

The scripts derive per-job keys from the prefixes in :mod:`datagen.control.keys` (no Redis Cluster).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline

from datagen.control.epoch import EpochWatch
from datagen.control.jobs import JobStore, RunFacts
from datagen.control.keys import Keys
from datagen.control.redistext import as_text, as_texts
from datagen.control.rq_format import JOB_KEY_PREFIX, QueuedJobs, rq_now
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.states import JobState, Priority, PromptClass

__all__ = [
    "MAX_CLAIM",
    "SHARE_WINDOW_S",
    "WINDOW_TOTAL",
    "Claimant",
    "Claimed",
    "Dispatch",
    "JobShare",
    "weight_units",
]

# The recent share counts dispatches over this window, in buckets of WINDOW_BUCKET_S.
SHARE_WINDOW_S = 60
WINDOW_BUCKET_S = 10
# A claim looks at this many prompts on RQ's list at most (a paused job's go back to its backlog).
RQ_LIST_SCAN = 1000
# Prompts per claim at most (the script's replies and ZADD arguments stay small).
MAX_CLAIM = 256
# A job picked with this many prompts or fewer left in its backlog gets them all in that pick (up
# to what the claim still wants), its virtual time moved by all of them: a small job's prompts go
# to one worker in one claim, so that they share a shard and an ack, and the claim's per-job
# commands are paid once, not once a prompt. A job then runs at most this many prompts ahead of
# its stride turn, once, at the end of its backlog.
TAIL_PROMPTS = 8
# What a claim with no one to tell run facts to sends as ``known`` (no job id is ``*``: ids are
# letters, digits and underscores): the script reads every job's weight alone, as if the caller
# knew every job.
_KNOWS_ALL = "*"
# Ids pushed per RPUSH inside a script (Lua's unpack has a stack limit).
PUSH_SLICE = 1000

# Undispatched prompts of a cancelled job dropped per script call.
DROP_CHUNK = 1000


# The scripts' arguments: named and ordered as the signature of datagen/control/lua/<script>.lua.
@dataclass(frozen=True)
class ClaimManyArgs(ScriptArgs):
    script = "claim_many"
    queue: str = field(metadata=KEY)
    paused: str = field(metadata=KEY)
    high: str = field(metadata=KEY)
    normal: str = field(metadata=KEY)
    low: str = field(metadata=KEY)
    window: str = field(metadata=KEY)
    started: str = field(metadata=KEY)
    epoch: str = field(metadata=KEY)
    job_prefix: str
    backlog_suffix: str
    window_ttl_s: int
    rq_list_scan: int
    rq_id_prefix: str
    rq_job_prefix: str
    want: int
    heartbeat_expiry: float
    now_rq: str
    worker_name: str
    execution_id: str
    running_suffix: str
    epoch_floor: int
    tail: int
    known: str
    skip: tuple[str, ...]


@dataclass(frozen=True)
class BacklogAddArgs(ScriptArgs):
    script = "backlog_add"
    job_key: str = field(metadata=KEY)
    backlog: str = field(metadata=KEY)
    dispatch_set: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    wake: str = field(metadata=KEY)
    paused: str = field(metadata=KEY)
    job_id: str
    slice: int
    cls: str
    cancelled_state: str
    rq_job_prefix: str
    rq_fields: str
    prompts: tuple[tuple[str, str, bytes], ...]


@dataclass(frozen=True)
class BacklogDropArgs(ScriptArgs):
    script = "backlog_drop"
    backlog: str = field(metadata=KEY)
    job_key: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    rq_job_prefix: str
    count: int
    cls: str


@dataclass(frozen=True)
class PauseArgs(ScriptArgs):
    script = "pause"
    paused: str = field(metadata=KEY)
    job_key: str = field(metadata=KEY)
    sets: tuple[str, ...] = field(metadata=KEY)
    job_id: str


@dataclass(frozen=True)
class ResumeArgs(ScriptArgs):
    script = "resume"
    paused: str = field(metadata=KEY)
    job_key: str = field(metadata=KEY)
    # Per class: the job's backlog of the class, the dispatch set of the class at its priority.
    classes: tuple[tuple[str, str], ...] = field(metadata=KEY)
    job_id: str
    now_ms: int


@dataclass(frozen=True)
class DispatchWeightsArgs(ScriptArgs):
    script = "dispatch_weights"
    mark: str = field(metadata=KEY)
    sets: tuple[str, ...] = field(metadata=KEY)
    job_prefix: str


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
        # The job hash's fields are JobStore's: dispatch asks it for priorities and weights.
        self.jobs = JobStore(redis, keys)
        # A worker's view of Redis's epoch: claims hand out nothing while Redis is older than it.
        self.epoch = epoch
        self._claim = LuaScript(redis, ClaimManyArgs)
        self._add = LuaScript(redis, BacklogAddArgs)
        self._drop = LuaScript(redis, BacklogDropArgs)
        self._pause = LuaScript(redis, PauseArgs)
        self._resume = LuaScript(redis, ResumeArgs)
        self._weights = LuaScript(redis, DispatchWeightsArgs)

    # Workers -------------------------------------------------------------------------------------
    def claim_many(
        self,
        cls: PromptClass,
        n: int,
        claimant: Claimant,
        *,
        skip: Collection[str] = (),
        known: Collection[str] = (),
        learn: Callable[[str, RunFacts], None] | None = None,
    ) -> list[Claimed]:
        """Start up to ``n`` prompts of ``cls`` for ``claimant`` (``datagen/control/lua/claim_many.lua``):
        each is in RQ's started registry and its job's running set when this returns. Jobs in
        ``skip`` are passed over as paused ones are (this worker cannot take more of them now).
        ``learn`` is told the run facts of each job it hands prompts of from a backlog unless the
        job is in ``known`` (the script reads them with the job's weight, at no command more)."""
        keys = self.keys
        bucket = int(time.time() // WINDOW_BUCKET_S)
        now = rq_now()
        args = ClaimManyArgs(
            queue=claimant.queue_key,
            paused=keys.paused_jobs(),
            high=keys.dispatch_jobs(cls, Priority.HIGH),
            normal=keys.dispatch_jobs(cls, Priority.NORMAL),
            low=keys.dispatch_jobs(cls, Priority.LOW),
            window=keys.dispatch_window(bucket),
            started=claimant.started_key,
            epoch=keys.epoch(),
            job_prefix=keys.job_key_prefix(),
            backlog_suffix=keys.backlog_suffix(cls),
            window_ttl_s=SHARE_WINDOW_S + WINDOW_BUCKET_S,
            rq_list_scan=RQ_LIST_SCAN,
            rq_id_prefix=keys.rq_id_prefix(),
            rq_job_prefix=JOB_KEY_PREFIX,
            want=max(0, min(n, MAX_CLAIM)),
            heartbeat_expiry=now.s + claimant.ttl_s,
            now_rq=now.text,
            worker_name=claimant.worker_name,
            execution_id=claimant.execution_id,
            running_suffix=keys.running_suffix(),
            epoch_floor=self.epoch.floor if self.epoch is not None else 0,
            tail=TAIL_PROMPTS,
            known=" ".join(known) if learn is not None else _KNOWS_ALL,
            skip=tuple(sorted(skip)),
        )
        prompts, told = cast(list[list[Any]], self._claim(args))
        claimed = []
        for rq_id, flat in prompts:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            claimed.append(Claimed(as_text(rq_id), fields, now.at))
        if learn is not None:
            for job_id, raw_spec, raw_identity, raw_stops, raw_incarnation in told:
                learn(as_text(job_id), RunFacts.parse(raw_spec, raw_identity, raw_stops, raw_incarnation))
        return claimed

    # Enqueueing ----------------------------------------------------------------------------------
    def add(
        self, pipe: Pipeline, job_id: str, cls: PromptClass, priority: Priority, jobs: QueuedJobs
    ) -> None:
        """Save prompts' RQ jobs and append them to the job's backlog, inside the caller's transaction."""
        if not jobs.own:
            return
        args = BacklogAddArgs(
            job_key=self.keys.job(job_id),
            backlog=self.keys.job_backlog(job_id, cls),
            dispatch_set=self.keys.dispatch_jobs(cls, priority),
            breakdown=self.keys.job_breakdown(job_id),
            wake=self.keys.wake_channel(),
            paused=self.keys.paused_jobs(),
            job_id=job_id,
            slice=PUSH_SLICE,
            cls=cls.value,
            cancelled_state=JobState.CANCELLED.value,
            rq_job_prefix=JOB_KEY_PREFIX,
            rq_fields=jobs.shared_json,
            prompts=jobs.own,
        )
        self._add(args, client=pipe)

    # Operator controls ---------------------------------------------------------------------------
    def pause(self, job_id: str) -> None:
        """The job leaves every dispatch set: claims pass over it at no cost until it resumes."""
        sets = tuple(self.keys.dispatch_jobs(cls, p) for cls in PromptClass for p in Priority)
        self._pause(
            PauseArgs(paused=self.keys.paused_jobs(), job_key=self.keys.job(job_id), sets=sets, job_id=job_id)
        )

    def resume(self, job_id: str) -> None:
        """Unpause; the job rejoins at the lowest virtual time of the jobs beside it."""
        priority = self.jobs.priority(job_id)
        classes = tuple(
            (self.keys.job_backlog(job_id, cls), self.keys.dispatch_jobs(cls, priority))
            for cls in PromptClass
        )
        self._resume(
            ResumeArgs(
                paused=self.keys.paused_jobs(),
                job_key=self.keys.job(job_id),
                classes=classes,
                job_id=job_id,
                now_ms=int(time.time() * 1000),
            )
        )
        self.wake()

    def wake(self, cls: PromptClass | None = None) -> None:
        """Tell idle workers that prompts (of ``cls``, or of every class) can be claimed."""
        for each in [cls] if cls is not None else list(PromptClass):
            self.redis.publish(self.keys.wake_channel(), each.value)

    def is_paused(self, job_id: str) -> bool:
        return bool(self.redis.sismember(self.keys.paused_jobs(), job_id))

    def withdraw(self, job_id: str) -> int:
        """Take the job out of dispatch and drop its undispatched prompts; returns how many."""
        self.jobs.leave_dispatch(job_id)
        dropped = 0
        for cls in PromptClass:
            args = BacklogDropArgs(
                backlog=self.keys.job_backlog(job_id, cls),
                job_key=self.keys.job(job_id),
                breakdown=self.keys.job_breakdown(job_id),
                rq_job_prefix=JOB_KEY_PREFIX,
                count=DROP_CHUNK,
                cls=cls.value,
            )
            while n := int(self._drop(args)):
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
        """Every job with prompts to dispatch (or dispatched lately): as :meth:`page_shares`, for
        all of them (the metrics; O(jobs), where the API reads a page's only)."""
        jobs = {job for priority in Priority for cls in PromptClass for job in self._members(cls, priority)}
        jobs |= self._paused()
        with self.redis.pipeline(transaction=False) as pipe:
            for bucket in _window_buckets(time.time()):
                pipe.hkeys(self.keys.dispatch_window(bucket))
            for names in pipe.execute():
                jobs |= {as_text(name) for name in names if as_text(name) != WINDOW_TOTAL}
        return self.page_shares(sorted(jobs))

    def page_shares(self, job_ids: Sequence[str]) -> dict[str, JobShare]:
        """The share of each of ``job_ids`` that has prompts to dispatch (or was dispatched to
        lately), in three round trips whatever the number of other jobs: O(len(job_ids)).

        ``target``: the job's weight over the running weight sum of its dispatch set (kept by the
        scripts that add and remove jobs, `weight_units` in ``lua/lib.lua``), if its priority is the
        highest that has work of that class, else 0; a job with prompts of both classes gets the
        larger. ``recent``: its part of the fleet's dispatches over the last minute, or since it was
        created or last resumed if that is later (to the 10-s bucket): what it got while it could
        run, not the pause before.
        """
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        keys = self.keys
        sets = [(cls, p) for p in Priority for cls in PromptClass]
        now_s = time.time()
        buckets = _window_buckets(now_s)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(keys.dispatch_weights_mark())
            pipe.mget([keys.dispatch_weight(cls, p) for cls, p in sets])
            for bucket in buckets:
                pipe.hmget(keys.dispatch_window(bucket), [*ids, WINDOW_TOTAL])
            pipe.smismember(keys.paused_jobs(), ids)
            replies = pipe.execute()
        kept, raw_sums = replies[0], replies[1]
        windows = cast(list[list[bytes | None]], replies[2:-1])
        paused = {job for job, flag in zip(ids, replies[-1], strict=True) if flag}
        if not kept:
            raw_sums = self._keep_weights(sets)  # once per Redis: `keep_weights` runs at start-up
        sums = {each: int(raw or 0) for each, raw in zip(sets, raw_sums, strict=True)}
        # Per class, the highest priority with a job in its set: only its jobs are entitled.
        top = {cls: next((p for p in Priority if sums[(cls, p)] > 0), None) for cls in PromptClass}
        facts = {job: f for job, f in zip(ids, self.jobs.dispatch_facts(ids), strict=True) if f is not None}
        paused_here = sorted(facts.keys() & paused)
        with self.redis.pipeline(transaction=False) as pipe:
            for job, each in facts.items():
                for cls in PromptClass:
                    pipe.zscore(keys.dispatch_jobs(cls, each.priority), job)
            for job in paused_here:
                for cls in PromptClass:
                    pipe.llen(keys.job_backlog(job, cls))
            found = iter(pipe.execute())
        member = {job: [cls for cls in PromptClass if next(found) is not None] for job in facts}
        paused_with_work = {job for job in paused_here if sum(int(next(found)) for _ in PromptClass)}
        out = {}
        for index, job in enumerate(ids):
            if (fact := facts.get(job)) is None:
                continue  # gone
            mine, total = _window_counts(windows, buckets, index, fact.since_ms)
            classes = member[job] if job not in paused else []
            if not classes and job not in paused_with_work and not mine:
                continue
            units = weight_units(fact.weight)
            target = max(
                (units / sums[(cls, fact.priority)] for cls in classes if top[cls] is fact.priority),
                default=0.0,
            )
            out[job] = JobShare(
                priority=fact.priority.value,
                weight=fact.weight,
                active=bool(classes),
                target=target,
                recent=mine / total if total else 0.0,
                dispatched=fact.dispatched,
            )
        return out

    def keep_weights(self) -> None:
        """Make sure the dispatch sets' weight sums are kept (a coordinator's start-up), so that
        reading shares never writes: a Redis out of memory refuses writes, and a progress read
        must still answer."""
        if not self.redis.exists(self.keys.dispatch_weights_mark()):
            self._keep_weights([(cls, p) for p in Priority for cls in PromptClass])

    def _keep_weights(self, sets: list[tuple[PromptClass, Priority]]) -> list[Any]:
        """Compute the sets' weight sums from their members (a Redis filled before the scripts kept
        them: once), and read them."""
        self._weights(
            DispatchWeightsArgs(
                mark=self.keys.dispatch_weights_mark(),
                sets=tuple(self.keys.dispatch_jobs(cls, p) for cls, p in sets),
                job_prefix=self.keys.job_key_prefix(),
            )
        )
        return cast(list[Any], self.redis.mget([self.keys.dispatch_weight(cls, p) for cls, p in sets]))

    def _members(self, cls: PromptClass, priority: Priority) -> list[str]:
        return as_texts(self.redis.zrange(self.keys.dispatch_jobs(cls, priority), 0, -1))

    def _paused(self) -> set[str]:
        return set(as_texts(self.redis.smembers(self.keys.paused_jobs())))


# A window bucket's field that counts every job's dispatches (no job id has a ``*``).
WINDOW_TOTAL = "*"


def weight_units(weight: float) -> int:
    """A job's weight in a dispatch set's weight sum: thousandths, at least 1 (as ``weight_units``
    in ``datagen/control/lua/lib.lua``)."""
    return max(1, math.floor((weight if weight > 0 else 1.0) * 1000 + 0.5))


def _window_counts(
    windows: list[list[bytes | None]], buckets: list[int], index: int, since_ms: int
) -> tuple[int, int]:
    """The job's (``index`` in each bucket's reply) dispatches and the fleet's (the reply's last,
    ``WINDOW_TOTAL``), over the buckets from the one that holds ``since_ms`` on."""
    start = int(since_ms // 1000 // WINDOW_BUCKET_S)
    mine = total = 0
    for bucket, counts in zip(buckets, windows, strict=True):
        if bucket >= start:
            mine += int(counts[index] or 0)
            total += int(counts[-1] or 0)
    return mine, total


def _window_buckets(now_s: float) -> list[int]:
    """The recent share's window buckets, oldest first."""
    now_bucket = int(now_s // WINDOW_BUCKET_S)
    return list(range(now_bucket - SHARE_WINDOW_S // WINDOW_BUCKET_S + 1, now_bucket + 1))
