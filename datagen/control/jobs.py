"""Job state in Redis, shared by the coordinator (which creates and ingests jobs) and the workers
(which count prompts done and failed).

A job is one hash. Counters move only in atomic steps: ingestion adds accepted prompts in the
same script as their RQ enqueue (`datagen.control.ingest_chunks`), and a worker counts a prompt
done in the same script that finishes it in RQ, so a counter never disagrees with RQ's registries
after a crash.
The job turns ``completed`` in the same script that counts its last prompt.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline

from datagen.clock import now_ms
from datagen.control.job_index import JobIndex
from datagen.control.job_outcomes import (
    FAILED_REPORTS_CAP,
    AckItem,
    AckTarget,
    JobOutcomes,
    RequeueItem,
)
from datagen.control.keys import SEEN_SEGMENTS, BreakdownField, Keys
from datagen.control.leases import Fencing, LeaseLostError
from datagen.control.progress import RETAINED_FEATURES, JobProgress, arm_counts, progress_from_hash
from datagen.control.redistext import as_text
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.errors import JobNotFoundError, JobStateError
from datagen.spec import JobSpec
from datagen.states import JobState, Priority, PromptClass

__all__ = [
    "FAILED_REPORTS_CAP",
    "AckItem",
    "AckTarget",
    "Created",
    "IngestFacts",
    "JobProgress",
    "JobStore",
    "RequeueItem",
    "RunFacts",
]


# Partitions beyond this many per job are counted under the label OTHER_LABEL (bounded label sets).
MAX_PARTITION_LABELS = 20
# A partition longer than this (characters) is never labelled: it counts under OTHER_LABEL, so a
# dataset's partition values cannot grow a metric label or a breakdown field past this.
MAX_PARTITION_LABEL_CHARS = 128


# Seen records are read back in pieces of this size (a Redis reply stays small).
SEEN_READ_BYTES = 8 * 1024 * 1024

# What create.lua answers when a rebuild's lease no longer holds its token.
CREATE_REFUSED = -1
# Between the incarnation and an ingestion run's token in a job's ingest fence.
FENCE_SEPARATOR = "/"
# A job hash's field: what a completed job was when a resubmission reopened it (`restart_ingest`;
# read by `count_and_complete` in lua/lib.lua).
COMPLETED_BEFORE = "completed_before"
# The job's ingest fence, a field of its hash ('' or absent: no ingestion may enqueue), as the
# scripts name it; its ingest checkpoint is `ingest_at` beside it (`ingest_land.lua`).
INGEST_FENCE = "ingest_fence"


@dataclass(frozen=True)
class RunFacts:
    """What a worker reads of a job once (`workers.run.jobinfo`): its spec, the tokenizer identity
    for its records, the stop ids the pre-flight checks resolved (empty for older jobs), and the
    incarnation they are of; read by `JobStore.run_facts`, or handed out with a claim."""

    spec: JobSpec
    tokenizer: str
    stop_ids: tuple[int, ...]
    incarnation: str

    @classmethod
    def parse(
        cls,
        raw_spec: bytes | str,
        raw_identity: bytes | str,
        raw_stops: bytes | str | None,
        raw_incarnation: bytes | str | None,
    ) -> RunFacts:
        """From the job hash's ``spec``, ``tokenizer_identity``, ``stop_ids`` and ``incarnation``."""
        stops = tuple(int(i) for i in json.loads(raw_stops)) if raw_stops else ()
        incarnation = as_text(raw_incarnation) if raw_incarnation is not None else ""
        return cls(JobSpec.model_validate_json(raw_spec), as_text(raw_identity), stops, incarnation)


def ingest_fence_value(incarnation: str, token: str) -> str:
    """What a job's ingest fence holds: the incarnation ingestion may enqueue for, and the token of
    the one ingestion run that may (a rebuild's, or one that took the job's ingestion over);
    the bare incarnation for the run a submit starts. Written the same way by ingest_take.lua."""
    return f"{incarnation}{FENCE_SEPARATOR}{token}" if token else incarnation


def fence_admits(held: bytes | str | None, incarnation: str) -> bool:
    """Whether an ingest fence's value admits a run of ``incarnation`` (any run's: the bare
    incarnation, or it with a run's token); as ingest_take.lua reads it."""
    if held is None or not incarnation:
        return False
    value = as_text(held)
    return value == incarnation or value.startswith(f"{incarnation}{FENCE_SEPARATOR}")


# The scripts' arguments: named and ordered as the signature of datagen/control/lua/<script>.lua.
@dataclass(frozen=True)
class CreateArgs(ScriptArgs):
    script = "create"
    job_key: str = field(metadata=KEY)
    index: str = field(metadata=KEY)
    legacy_fence: str = field(metadata=KEY)
    lease: str = field(metadata=KEY)
    job_id: str
    created_at_ms: int
    incarnation: str
    fence_value: str
    mode: str
    lease_token: str
    fields: tuple[tuple[str, str | int], ...]


@dataclass(frozen=True)
class FinishIngestArgs(ScriptArgs):
    script = "finish_ingest"
    job_key: str = field(metadata=KEY)
    running: str = field(metadata=KEY)
    token: str
    now_ms: int
    ingesting_state: str
    running_state: str
    completed_state: str


@dataclass(frozen=True)
class IngestTakeArgs(ScriptArgs):
    script = "ingest_take"
    job_key: str = field(metadata=KEY)
    legacy_fence: str = field(metadata=KEY)
    incarnation: str
    token: str


@dataclass(frozen=True)
class TransitionArgs(ScriptArgs):
    script = "transition"
    job_key: str = field(metadata=KEY)
    legacy_fence: str = field(metadata=KEY)
    sources: str
    target: str
    fence_op: str
    token: str
    fields: tuple[tuple[str, str | int], ...]


@dataclass(frozen=True)
class SetIfExistsArgs(ScriptArgs):
    script = "set_if_exists"
    hash_key: str = field(metadata=KEY)
    field_name: str
    value: str


@dataclass(frozen=True)
class IncrIfExistsArgs(ScriptArgs):
    script = "incr_if_exists"
    hash_key: str = field(metadata=KEY)
    field_name: str
    delta: int


@dataclass(frozen=True)
class DispatchLeaveArgs(ScriptArgs):
    script = "dispatch_leave"
    job_key: str = field(metadata=KEY)
    sets: tuple[str, ...] = field(metadata=KEY)
    job_id: str


@dataclass(frozen=True)
class Created:
    """What :meth:`JobStore.create_job` found: whether it made the job (False: a job of the id
    exists, and a resubmission appends to it), that job's incarnation ('' for one made before
    incarnations) and creation time; and, for a new job it made (not a rebuild's ``replace``), its
    progress as made (no read needed: nothing of it has run)."""

    made: bool
    incarnation: str
    created_at_ms: int
    progress: JobProgress | None = None


@dataclass(frozen=True)
class IngestFacts:
    """What an ingestion run reads of its job as it starts, in one command
    (:meth:`JobStore.ingest_facts`)."""

    incarnation: str
    spec: JobSpec
    # The context length checked at submit (None: the spec's, or the fleet's).
    context_len: int | None
    # The checkpoint: the last line of the current input whose chunk landed.
    ingest_line: int
    # Whether the job shows a wait for room (left by a run that stopped during one).
    waiting_for_room: bool
    # Rows counted so far (0: no chunk has landed a row: its rows guard and seen records are empty).
    rows: int = 0


class JobStore:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._create = LuaScript(redis, CreateArgs)
        self._dispatch_leave = LuaScript(redis, DispatchLeaveArgs)
        self._transition = LuaScript(redis, TransitionArgs)
        self._set_if_exists = LuaScript(redis, SetIfExistsArgs)
        self._incr_if_exists = LuaScript(redis, IncrIfExistsArgs)
        self._ingest_take = LuaScript(redis, IngestTakeArgs)
        self._finish_ingest = LuaScript(redis, FinishIngestArgs)
        # How the job's prompts end: a part of its own, on the same hash and keys.
        self.outcomes = JobOutcomes(redis, keys)
        # Which jobs exist, a page at a time (the index is a key of its own; states are read here).
        self.index = JobIndex(redis, keys, self)

    # Creation and lookup ------------------------------------------------------------------------
    def create(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        tokenizer_identity: str = "",
        stop_ids: list[int] | None = None,
        incarnation: str | None = None,
        created_at_ms: int | None = None,
        state: JobState = JobState.INGESTING,
        fields: dict[str, str | int] | None = None,
        replace: bool = False,
        rebuild: Fencing | None = None,
    ) -> bool:
        """Create the job; False if it exists already (a resubmission appends to it). As
        :meth:`create_job`, which says more."""
        return self.create_job(
            job_id,
            spec,
            tokenizer_identity=tokenizer_identity,
            stop_ids=stop_ids,
            incarnation=incarnation,
            created_at_ms=created_at_ms,
            state=state,
            fields=fields,
            replace=replace,
            rebuild=rebuild,
        ).made

    def create_job(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        tokenizer_identity: str = "",
        stop_ids: list[int] | None = None,
        incarnation: str | None = None,
        created_at_ms: int | None = None,
        state: JobState = JobState.INGESTING,
        fields: dict[str, str | int] | None = None,
        replace: bool = False,
        rebuild: Fencing | None = None,
    ) -> Created:
        """Create the job, or find the one of the id that exists (a resubmission appends to it).

        ``tokenizer_identity`` (name and file hash) is what workers write into each record;
        ``stop_ids`` (from the pre-flight checks) are sent with every request of the job;
        ``fields``: more of the hash, written with it (a submit's ingest input,
        :meth:`ingest_input_fields`). A job rebuilt from storage (`service.rebuild`) passes the
        incarnation, creation time, state and fields it had, and ``replace`` (whatever hash is
        there is replaced in the same step), and ``rebuild``, its lease: nothing is written unless
        the lease still holds its token (`LeaseLostError` otherwise), the hash keeps the token
        (``rebuild_token``) and the ingest fence admits only the ingestion this rebuild starts
        (:func:`ingest_fence_value`). One script: sent again after a lost reply, it answers as the
        first time.
        """
        # A new incarnation on every create: whatever an earlier job of this id (deleted) still
        # has in flight carries the old one, and is refused by the counters, the writer and exports.
        incarnation = incarnation or uuid.uuid4().hex[:16]
        mapping: dict[str, str | int] = {
            "state": state.value,
            "spec": spec.model_dump_json(),
            "tokenizer_identity": tokenizer_identity or spec.tokenizer,
            # Read by the dispatch script (datagen/control/dispatch.py) on every claim.
            "priority": spec.priority.value,
            "weight": repr(spec.weight),
            "stop_ids": json.dumps(sorted(set(stop_ids or []))),
            # How many partitions it labelled: its labels are kept in the hash too (`label_field`
            # in lib.lua), so that counting a prompt looks its label up with the job's one read.
            "labels": 0,
            **(fields or {}),
        }
        if rebuild is not None:
            mapping["rebuild_token"] = rebuild.token
        fence_value = ingest_fence_value(incarnation, rebuild.token if rebuild is not None else "")
        args = CreateArgs(
            job_key=self.keys.job(job_id),
            index=self.keys.jobs_index(),
            legacy_fence=self.keys.job_ingest_fence(job_id),
            lease=self.keys.job_rebuild_lease(job_id),
            job_id=job_id,
            created_at_ms=created_at_ms or now_ms(),
            incarnation=incarnation,
            fence_value=fence_value if state is JobState.INGESTING else "",
            mode="replace" if replace else "",
            lease_token=rebuild.token if rebuild is not None else "",
            fields=tuple(mapping.items()),
        )
        reply = cast(list[Any], self._create(args))
        if int(reply[0]) == CREATE_REFUSED:
            raise LeaseLostError(
                f"job {job_id}: this rebuild lost its lease (it expired, or another rebuild holds it) "
                f"before it could make the job again; nothing was written. GET /jobs/{job_id} shows the "
                "other rebuild's result"
            )
        made, found, at_ms = bool(int(reply[0])), as_text(reply[1]), int(reply[2])
        if not made or replace:  # a rebuild reads the job it made again if it needs to
            return Created(made, found, at_ms)
        # The hash as the script wrote it: its progress needs no read (nothing of it ran, nothing
        # is paused or running).
        made_hash = {**mapping, "created_at_ms": at_ms, "incarnation": found}
        raw = {name.encode(): str(value).encode() for name, value in made_hash.items()}
        progress = progress_from_hash(job_id, raw, 0, False)
        if progress.recipe_arms:
            progress = dataclasses.replace(progress, arms=arm_counts(progress.recipe_arms, {}))
        return Created(True, found, at_ms, progress)

    def rebuild_token(self, job_id: str) -> str | None:
        """The lease token of the rebuild that made the job's hash (None: not rebuilt)."""
        raw = self.redis.hget(self.keys.job(job_id), "rebuild_token")
        return as_text(raw) if raw is not None else None

    def ingest_fence(self, job_id: str) -> str | None:
        """What the job's ingest fence admits now (None: no ingestion may enqueue)."""
        raw = self.redis.hget(self.keys.job(job_id), INGEST_FENCE)
        return as_text(raw) if raw else None

    def take_ingest(self, job_id: str, incarnation: str) -> str | None:
        """Hand the job's ingestion to a new run: if the fence admits ``incarnation`` (the job is
        ingesting it), it admits only the new run's token from now on (an ingestion still running
        elsewhere lands nothing more). Returns the value the new run holds the fence to, or None
        when the job is not ingesting that incarnation."""
        args = IngestTakeArgs(
            job_key=self.keys.job(job_id),
            legacy_fence=self.keys.job_ingest_fence(job_id),
            incarnation=incarnation,
            token=secrets.token_hex(8),
        )
        taken = self._ingest_take(args)
        return as_text(taken) if taken else None

    def incarnation(self, job_id: str) -> str | None:
        """The job's current incarnation ("" for a job made before incarnations); None if it is gone.
        A hash with neither an incarnation nor a state is no job (as for ``create.lua`` and the
        counting rules in ``lib.lua``): a remnant an older worker's late next-turn count wrote after
        Redis lost the job, which a rebuild makes anew rather than taking for another incarnation."""
        raw, state = self.redis.hmget(self.keys.job(job_id), ["incarnation", "state"])
        if raw is not None:
            return as_text(raw)
        return "" if state is not None else None

    def set_ingest_input(
        self, job_id: str, input_name: str, context_len: int | None, *, queue: list[str] | None = None
    ) -> None:
        """Set :meth:`ingest_input_fields` on the job (a submit passes them to its create or its
        restart instead, in the same command)."""
        fields = self.ingest_input_fields(input_name, context_len, queue=queue)
        self.redis.hset(self.keys.job(job_id), mapping=cast(dict[Any, Any], fields))

    @staticmethod
    def ingest_input_fields(
        input_name: str, context_len: int | None, *, queue: list[str] | None = None
    ) -> dict[str, str | int]:
        """The job's fields that name the upload ingestion reads next, from its first line, and the
        context length that was checked at submit (ingestion rejects over-long prompts by it);
        ``queue``: the uploads a rebuilt job ingests after it (a coordinator that restarts
        meanwhile goes on with them)."""
        fields: dict[str, str | int] = {"ingest_input": input_name, "ingest_line": 0}
        fields["ingest_queue"] = json.dumps(queue or [])
        if context_len is not None:
            fields["context_len"] = context_len
        return fields

    def ingest_facts(self, job_id: str) -> IngestFacts | None:
        """What an ingestion run reads of its job as it starts, in one command; None for a job that
        is gone (a hash with neither incarnation nor state is none, as for :meth:`incarnation`)."""
        raw = self.redis.hmget(
            self.keys.job(job_id),
            ["incarnation", "state", "spec", "context_len", "ingest_line", "waiting_for_room", "rows"],
        )
        incarnation, state, spec, context_len, line, waiting, rows = raw
        if spec is None or (incarnation is None and state is None):
            return None
        return IngestFacts(
            incarnation=as_text(incarnation) if incarnation is not None else "",
            spec=JobSpec.model_validate_json(spec),
            context_len=int(context_len) if context_len else None,
            ingest_line=int(line or 0),
            waiting_for_room=bool(waiting),
            rows=int(rows or 0),
        )

    def ingest_queue(self, job_id: str) -> list[str]:
        raw = self.redis.hget(self.keys.job(job_id), "ingest_queue")
        return [str(name) for name in json.loads(raw)] if raw else []

    def ingest_input(self, job_id: str) -> str | None:
        raw = self.redis.hget(self.keys.job(job_id), "ingest_input")
        return as_text(raw) if raw else None

    def context_len(self, job_id: str) -> int | None:
        raw = self.redis.hget(self.keys.job(job_id), "context_len")
        return int(raw) if raw else None

    def state(self, job_id: str) -> JobState:
        raw = self.redis.hget(self.keys.job(job_id), "state")
        if raw is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return JobState(as_text(raw))

    def priority(self, job_id: str) -> Priority:
        """The job's priority (normal for a job that is gone: nothing of it is dispatched)."""
        return _priority(self.redis.hget(self.keys.job(job_id), "priority"))

    def states(self, job_ids: Sequence[str]) -> list[tuple[str, str] | None]:
        """Each job's state and priority (None: no such job), in order, in one round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self.keys.job(job_id), ["state", "priority"])
            rows = pipe.execute()
        return [
            None if state is None else (as_text(state), _priority(priority).value) for state, priority in rows
        ]

    def dispatch_facts(self, job_ids: Sequence[str]) -> list[DispatchFacts | None]:
        """What fair-share dispatch reports of each job (None: no such job), in order, in one round
        trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(
                    self.keys.job(job_id),
                    ["weight", "priority", "dispatched", "created_at_ms", "resumed_at_ms"],
                )
            rows = pipe.execute()
        return [
            None
            if not any(row)
            else DispatchFacts(
                _float(row[0], 1.0),
                _priority(row[1]),
                int(_float(row[2], 0)),
                int(max(_float(row[3], 0), _float(row[4], 0))),
            )
            for row in rows
        ]

    def spec_and_state(self, job_id: str) -> tuple[JobSpec, JobState | None] | None:
        """The job's spec and state in one command (None: no job of the id; a state None: a hash
        half made by an older version)."""
        raw_spec, raw_state = self.redis.hmget(self.keys.job(job_id), ["spec", "state"])
        if raw_spec is None:
            return None
        state = JobState(as_text(raw_state)) if raw_state is not None else None
        return JobSpec.model_validate_json(raw_spec), state

    def spec(self, job_id: str) -> JobSpec:
        raw = self.redis.hget(self.keys.job(job_id), "spec")
        if raw is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return JobSpec.model_validate_json(raw)

    def run_facts(self, job_id: str) -> RunFacts:
        """What a worker needs once per job, in one command (`RunFacts`; a claim hands them out with
        a job's first prompts to a worker that lacks them, `datagen.control.dispatch`)."""
        raw_spec, raw_identity, raw_stops, raw_incarnation = self.redis.hmget(
            self.keys.job(job_id), ["spec", "tokenizer_identity", "stop_ids", "incarnation"]
        )
        if raw_spec is None or raw_identity is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return RunFacts.parse(raw_spec, raw_identity, raw_stops, raw_incarnation)

    def progress(self, job_id: str, *, with_arms: bool = False) -> JobProgress:
        found = self.progress_many([job_id], with_arms=with_arms)[0]
        if found is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return found

    def progress_many(self, job_ids: Sequence[str], *, with_arms: bool = False) -> list[JobProgress | None]:
        """Each job's progress (None: no such job), in one round trip: a page of ``GET /jobs``
        costs one, not one per job. ``with_arms``: a job with a recipe also gets its arms' counts
        from its breakdown (`JobProgress.arms`), one more round trip for the page if it has any."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
                pipe.scard(self.keys.job_running(job_id))
                pipe.sismember(self.keys.paused_jobs(), job_id)
            replies = pipe.execute()
        out = []
        for i, job_id in enumerate(job_ids):
            raw_hash, running, paused = replies[3 * i : 3 * i + 3]
            raw = cast(dict[bytes, bytes], raw_hash)
            out.append(
                progress_from_hash(job_id, raw, int(running), bool(paused)) if b"state" in raw else None
            )
        return self._with_arms(out) if with_arms else out

    def _with_arms(self, found: list[JobProgress | None]) -> list[JobProgress | None]:
        """``found`` with each recipe job's arm counts, its breakdowns read in one round trip."""
        recipes = [(i, progress) for i, progress in enumerate(found) if progress and progress.recipe_arms]
        if not recipes:
            return found
        with self.redis.pipeline(transaction=False) as pipe:
            for _, progress in recipes:
                pipe.hgetall(self.keys.job_breakdown(progress.job_id))
            replies = pipe.execute()
        out = list(found)
        for (i, progress), raw in zip(recipes, replies, strict=True):
            out[i] = dataclasses.replace(
                progress, arms=arm_counts(progress.recipe_arms, _decode_breakdown(raw))
            )
        return out

    # Ingestion ----------------------------------------------------------------------------------
    def ingest_line(self, job_id: str) -> int:
        return int(self.redis.hget(self.keys.job(job_id), "ingest_line") or 0)

    def first_rows(self, job_id: str, sample_keys: list[str]) -> dict[str, str]:
        """What ingestion's chunks stored (`datagen.control.ingest_chunks`) for these sample keys:
        ``<content digest>:<line>:<upload>`` of the row that first used the id; or for rejected
        rows' fields (`service.rowids.rejected_field`), their upload (absent: no row used them yet)."""
        raw = self.redis.hmget(self.keys.job_rows(job_id), sample_keys)
        return {k: as_text(v) for k, v in zip(sample_keys, raw, strict=True) if v is not None}

    def seen_records(self, job_id: str) -> Iterator[bytes]:
        """Each segment of the packed records ingestion's chunks appended for the job
        (`datagen.control.ingest_chunks`, `datagen.hygiene.dedup`)."""
        keys = [self.keys.job_seen(job_id, segment) for segment in range(SEEN_SEGMENTS)]
        if not self.redis.exists(*keys):
            return  # a new job (most of them): one command, not one per segment
        for key in keys:
            pieces: list[bytes] = []
            while piece := self.redis.getrange(
                key, len(pieces) * SEEN_READ_BYTES, (len(pieces) + 1) * SEEN_READ_BYTES - 1
            ):
                pieces.append(cast(bytes, piece))
                if len(piece) < SEEN_READ_BYTES:
                    break
            if pieces:
                yield b"".join(pieces)

    def finish_ingest(self, job_id: str) -> None:
        """Ingestion ended: an ingesting job runs (its fence dropped) and completes at once if
        nothing is left to run; only from ingesting (a job cancelled meanwhile stays cancelled).
        One script (``lua/finish_ingest.lua``), so that a job with nothing left to run is never
        seen running before it is seen completed, and safe to send again after a lost reply."""
        args = FinishIngestArgs(
            job_key=self.keys.job(job_id),
            running=self.keys.job_running(job_id),
            token=uuid.uuid4().hex[:12],
            now_ms=now_ms(),
            ingesting_state=JobState.INGESTING.value,
            running_state=JobState.RUNNING.value,
            completed_state=JobState.COMPLETED.value,
        )
        self._finish_ingest(args)

    def reopen(self, job_id: str) -> bool:
        """A completed job runs again (a retry is about to put prompts back): from now on a cancel
        can stop it. Returns whether it moved."""
        return self.transition(job_id, (JobState.COMPLETED,), JobState.RUNNING, {"finished_at_ms": 0})

    def complete_if_ended(self, job_id: str) -> None:
        """A running job whose prompts have all ended completes (a retry that put none back)."""
        with self.redis.pipeline(transaction=True) as pipe:
            self._complete_if_ended(job_id, pipe)
            pipe.execute()

    def _complete_if_ended(self, job_id: str, pipe: Pipeline) -> None:
        # The count script with nothing to count: it only applies the completion rule.
        self.outcomes.count(pipe, job_id, "done", increment=0)

    def transition(
        self,
        job_id: str,
        sources: tuple[JobState, ...],
        target: JobState,
        fields: dict[str, str | int] | None = None,
        *,
        pipe: Pipeline | None = None,
        fence: str = "",
    ) -> bool:
        """Move the job to ``target`` if it is in one of ``sources`` (atomically), setting ``fields``;
        ``fence`` "drop" stops ingestion from enqueueing more, "arm" lets it enqueue again.

        Returns whether it moved; inside ``pipe`` that answer comes from ``pipe.execute()`` instead.
        """
        args = TransitionArgs(
            job_key=self.keys.job(job_id),
            legacy_fence=self.keys.job_ingest_fence(job_id),
            sources=" ".join(s.value for s in sources),
            target=target.value,
            fence_op=fence,
            token=uuid.uuid4().hex[:12],
            fields=tuple((fields or {}).items()),
        )
        return bool(self._transition(args, client=pipe))

    def restart_ingest(self, job_id: str, fields: dict[str, str | int] | None = None) -> None:
        """A resubmission to the job: it ingests again (not a cancelled job: that stays cancelled),
        ``fields`` set in the same step (its new upload, :meth:`ingest_input_fields`).

        A completed job keeps what it was at its completion in ``completed_before`` (``<finished_at_ms>
        <accepted> <output_tokens>``): if it completes again with nothing new run, it keeps that
        completion time (`count_and_complete` in lib.lua), so re-attaching to a job by resubmitting its
        dataset moves none of its rates or its tail."""
        key = self.keys.job(job_id)
        state, finished, accepted, tokens = self.redis.hmget(
            key, ["state", "finished_at_ms", "accepted", "output_tokens"]
        )
        target = JobState.INGESTING
        reopened: dict[str, str | int] = {**(fields or {}), "finished_at_ms": 0}
        if state is not None and as_text(state) == JobState.COMPLETED and int(finished or 0):
            before = f"{int(finished or 0)} {int(accepted or 0)} {int(tokens or 0)}"
            completed = (JobState.COMPLETED,)
            if self.transition(
                job_id, completed, target, {**reopened, COMPLETED_BEFORE: before}, fence="arm"
            ):
                return
        sources = (JobState.INGESTING, JobState.RUNNING, JobState.COMPLETED, JobState.FAILED)
        if not self.transition(job_id, sources, target, {**reopened, COMPLETED_BEFORE: ""}, fence="arm"):
            raise JobStateError(f"job {job_id} was cancelled or deleted meanwhile; submit under a new job id")

    def cancel(self, job_id: str) -> bool:
        """Move a live job to cancelled; ingestion enqueues nothing more. False if it was not live."""
        at = now_ms()
        return self.transition(
            job_id,
            (JobState.INGESTING, JobState.RUNNING),
            JobState.CANCELLED,
            {"finished_at_ms": at, "cancelled_at_ms": at},
            fence="drop",
        )

    def forget_keys(self, job_id: str, *, keep_hash: bool = False) -> None:
        """Remove the job's own keys, and the job from the index, the paused and aborting sets and
        every dispatch set (`datagen.control.rq_jobs.RqJobs.forget` removes its RQ jobs around
        this); ``keep_hash``: its hash stays, and its place in the index."""
        keys = self.keys.job_keys(job_id)
        if keep_hash:
            keys.remove(self.keys.job(job_id))
        with self.redis.pipeline() as pipe:
            # Out of the dispatch sets first: their weight sums read the job's weight from its hash.
            self.leave_dispatch(job_id, client=pipe)
            pipe.unlink(*keys)
            if not keep_hash:
                pipe.zrem(self.keys.jobs_index(), job_id)
            pipe.srem(self.keys.paused_jobs(), job_id)
            pipe.srem(self.keys.aborting_jobs(), job_id)
            pipe.execute()

    def leave_dispatch(self, job_id: str, *, client: Redis | Pipeline | None = None) -> None:
        """Take the job out of every dispatch set and its weight out of their sums
        (``datagen/control/lua/dispatch_leave.lua``)."""
        sets = tuple(self.keys.dispatch_jobs(cls, p) for cls in PromptClass for p in Priority)
        self._dispatch_leave(
            DispatchLeaveArgs(job_key=self.keys.job(job_id), sets=sets, job_id=job_id), client=client
        )

    def set_storage_error(self, job_id: str, error: str | None) -> None:
        """A worker cannot commit this job's records (None: it can again)."""
        key = self.keys.job(job_id)
        if error is None:
            self.redis.hdel(key, "storage_error")
        else:
            # Only on a job that exists: a commit that failed because the job was deleted under it
            # must not bring the job's hash back.
            message = f"{error} (since {now_ms()} ms)"
            self._set_if_exists(SetIfExistsArgs(hash_key=key, field_name="storage_error", value=message))

    def add_retained_features(self, job_id: str, delta_bytes: int) -> int | None:
        """Count ``delta_bytes`` more (or fewer) feature bytes stored and not yet consumed; the new
        total, or None for a job that no longer exists (never brought back)."""
        args = IncrIfExistsArgs(
            hash_key=self.keys.job(job_id), field_name=RETAINED_FEATURES, delta=delta_bytes
        )
        value = int(cast(int, self._incr_if_exists(args)))
        return None if value < 0 else value

    def retained_features(self, job_id: str) -> int:
        return int(self.redis.hget(self.keys.job(job_id), RETAINED_FEATURES) or 0)

    def set_waiting_for_room(self, job_id: str, cls: PromptClass | None) -> None:
        """Ingestion waits for room in the job's backlog of ``cls`` (None: it does not wait)."""
        key = self.keys.job(job_id)
        if cls is None:
            self.redis.hdel(key, "waiting_for_room")
        else:  # only on a job that exists: a job deleted meanwhile must not come back
            self._set_if_exists(SetIfExistsArgs(hash_key=key, field_name="waiting_for_room", value=cls.value))

    def fail(self, job_id: str, error: str) -> bool:
        """Ingestion failed: an ingesting job fails. A job cancelled or deleted meanwhile is left
        as it is (never recreated). Returns whether it moved."""
        fields: dict[str, str | int] = {"error": error, "finished_at_ms": now_ms()}
        return self.transition(job_id, (JobState.INGESTING,), JobState.FAILED, fields, fence="drop")

    # Breakdown by partition and class --------------------------------------------------------------
    # Ingestion labels a job's partitions as its chunks land (``lua/ingest_land.lua``): its first
    # ``MAX_PARTITION_LABELS`` of at most ``MAX_PARTITION_LABEL_CHARS`` characters; the rest count
    # under OTHER_LABEL.
    def breakdown(self, job_id: str) -> dict[BreakdownField, int]:
        return _decode_breakdown(self.redis.hgetall(self.keys.job_breakdown(job_id)))


@dataclass(frozen=True)
class DispatchFacts:
    weight: float
    priority: Priority
    dispatched: int
    # Since when the job could run: its creation, or its last resume (`resume.lua`).
    since_ms: int


def _decode_breakdown(reply: Any) -> dict[BreakdownField, int]:
    raw = cast(dict[bytes, bytes], reply)
    return {BreakdownField.decode(as_text(name)): int(value) for name, value in raw.items()}


def _priority(raw: bytes | str | None) -> Priority:
    return Priority(as_text(raw)) if raw else Priority.NORMAL


def _float(raw: bytes | None, default: float) -> float:
    try:
        return float(raw) if raw is not None else default
    except ValueError:
        return default
