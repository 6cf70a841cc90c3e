"""One ingestion chunk landed in Redis (`service.ingest`): its prompts enqueued (into the job's
backlogs), its rows added to the job's rows guard, its counters, breakdown, partition labels and kept
rows' hygiene records, and the line checkpoint, in one script (``lua/ingest_land.lua``), so all of
it or none of it.

The script lands the chunk only while the job's ingest fence holds the value this ingestion run
holds it to (`datagen.control.jobs.ingest_fence_value`): a cancel, a failure or a delete drops the
fence, another run of the ingestion (a rebuild's, a resume's) takes it, and nothing more lands; nor
for a job that is gone or cancelled. It also writes the job's ingest checkpoint,
``<upload>:<last line>`` of the chunk, and answers "landed before" when it finds the chunk's own id
there: a chunk whose reply was lost and that a retrying client sends again is known to have
landed; the services' clients do not resend, and an ingestion whose call failed resumes after the
line checkpoint, which the same script wrote. The input's last chunk also ends the ingestion
(`finish`), in the same step. It waits for room in the job's backlogs (backpressure) by
answering which class has none, and it checks the job's ``rows`` counter where the run assumed one
(`Landing.STALE`).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from redis import Redis

from datagen.clock import now_ms
from datagen.control.dispatch import PUSH_SLICE
from datagen.control.enqueue import EnqueueOptions, queued_jobs
from datagen.control.jobs import MAX_PARTITION_LABEL_CHARS, MAX_PARTITION_LABELS, fence_admits
from datagen.control.keys import SEEN_SEGMENTS, BreakdownField, Keys, prompt_key
from datagen.control.payload import PromptPayload
from datagen.control.redistext import as_text
from datagen.control.rq_format import JOB_KEY_PREFIX, queues, rq_now
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.states import JobState, Priority, PromptClass

__all__ = ["ChunkWrite", "IngestChunks", "Landing", "WaitForRoom"]


class Landing(StrEnum):
    """What became of a chunk (`IngestChunks.land`); the values are what ``ingest_land.lua`` answers."""

    LANDED = "landed"
    # Its id is the job's checkpoint already: it landed, and the reply was lost.
    LANDED_BEFORE = "landed_before"
    # Another ingestion run of the same incarnation holds the fence.
    TAKEN_OVER = "taken_over"
    # The fence is gone or admits no run of this incarnation, or the job is gone or cancelled.
    FENCED = "fenced"
    # The job's ``rows`` counter is not the one the run expected: another run landed rows since it
    # started; nothing landed, and the run starts over from its checkpoint.
    STALE = "stale"


# The script's other answers: the fence holds another value (which it says), or a class's backlog
# has no room (which, and how many it holds).
_FENCE = "fence"
_NO_ROOM = "no_room"

# Called when the job's backlog of a class has no room for the chunk's prompts of that class:
# (class, prompts wanted, prompts the backlog holds); returns once there may be room (or raises).
WaitForRoom = Callable[[PromptClass, int, int], None]


@dataclass(frozen=True)
class IngestLandArgs(ScriptArgs):
    script = "ingest_land"
    job_key: str = field(metadata=KEY)
    partitions: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    rows_guard: str = field(metadata=KEY)
    seen: str = field(metadata=KEY)
    enqueued: str = field(metadata=KEY)
    paused: str = field(metadata=KEY)
    wake: str = field(metadata=KEY)
    running: str = field(metadata=KEY)
    backlogs: tuple[tuple[str, str], ...] = field(metadata=KEY)
    job_id: str
    fence_value: str
    chunk_id: str
    last_line: int
    expect_rows: str
    window: int
    cancelled_state: str
    rq_job_prefix: str
    slice: int
    max_labels: int
    max_label_chars: int
    chunk_json: str
    seen_records: bytes
    finish: str
    now_ms: int
    ingesting_state: str
    running_state: str
    completed_state: str
    prompts: tuple[tuple[str, str, bytes], ...]


@dataclass(frozen=True)
class ChunkWrite:
    """What one chunk writes."""

    input_name: str
    last_line: int
    # New prompts, guarded by the rows guard (``rows``, written with them), not the enqueued set.
    enqueue: Sequence[PromptPayload]
    # A rebuilt job's conversations going on at their next turns, guarded as workers guard the next
    # turns they enqueue (the enqueued set, `ack_next_turn.lua`).
    continued: Sequence[PromptPayload]
    # The job's counters to add to (``rows``, ``accepted``, ...); the checkpoint line is ``last_line``.
    counts: Mapping[str, int]
    # The partitions the chunk's prompts count under; its breakdown by partition (each field's
    # label is the partition, which the landing labels as the job does), and the fields whose label
    # is no partition (rejected rows).
    partitions: Collection[str]
    partitioned: Mapping[BreakdownField, int]
    breakdown: Mapping[BreakdownField, int]
    # Sample key -> ``<content digest>:<line>:<upload>`` of the rows this chunk uses first.
    rows: Mapping[str, str]
    # Packed hygiene records of the rows it kept (`datagen.hygiene.dedup`).
    seen: bytes

    @property
    def chunk_id(self) -> str:
        return f"{self.input_name}:{self.last_line}"


class IngestChunks:
    def __init__(self, redis: Redis, keys: Keys, options: EnqueueOptions) -> None:
        self.redis = redis
        self.keys = keys
        self.options = options
        self._queues = queues(redis, keys)
        self._land = LuaScript(redis, IngestLandArgs)

    def land(
        self,
        job_id: str,
        write: ChunkWrite,
        *,
        priority: Priority,
        incarnation: str,
        fence_value: str,
        window: int,
        wait_for_room: WaitForRoom,
        expect_rows: int | None = None,
        finish: bool = False,
    ) -> Landing:
        """Land ``write`` in one step while the job's ingest fence holds ``fence_value`` ('': the
        fence is not looked at); ``incarnation`` tells a fence taken over by another run of it from
        one that is gone. Each class's backlog must have room for the chunk's prompts of the class
        within ``window`` (one class's prompts that outnumber it ask for all of it): else
        ``wait_for_room`` waits, and the chunk is sent again. ``expect_rows``: the job's ``rows``
        counter the run assumed (None: none); `Landing.STALE` if it is not. ``finish``: the input's
        last chunk, which ends the job's ingestion as `JobStore.finish_ingest` does, in the same
        step (no second script after it)."""
        payloads = [*write.enqueue, *write.continued]
        wanted = {cls: min(window, n) for cls, n in Counter(p.cls for p in payloads).items()}
        args = self._args(job_id, write, priority, fence_value, window, wanted, expect_rows, finish)
        while True:
            # Now as it is sent (a wait for room may come between two sends): a finish's times.
            reply = list(self._land(replace(args, now_ms=now_ms())))
            answer = as_text(reply[0])
            if answer == _NO_ROOM:
                cls = PromptClass(as_text(reply[1]))
                wait_for_room(cls, wanted[cls], int(reply[2]))
                continue
            if answer == _FENCE:
                return Landing.TAKEN_OVER if fence_admits(reply[1], incarnation) else Landing.FENCED
            return Landing(answer)

    def _args(
        self,
        job_id: str,
        write: ChunkWrite,
        priority: Priority,
        fence_value: str,
        window: int,
        wanted: Mapping[PromptClass, int],
        expect_rows: int | None,
        finish: bool,
    ) -> IngestLandArgs:
        at = rq_now().text
        payloads = [*write.enqueue, *write.continued]
        classes: list[list[str | int]] = []
        backlogs: list[tuple[str, str]] = []
        prompts: list[tuple[str, str, bytes]] = []
        for cls, queue in self._queues.items():
            mine = [p for p in payloads if p.cls is cls]
            if not mine:
                continue
            jobs = queued_jobs(queue, self.keys, mine, self.options, at)
            classes.append([cls.value, wanted[cls], len(mine), jobs.shared_json])
            backlogs.append((self.keys.job_backlog(job_id, cls), self.keys.dispatch_jobs(cls, priority)))
            prompts += jobs.own
        chunk = {
            "counts": {name: n for name, n in write.counts.items() if n},
            "partitions": sorted(write.partitions),
            "partitioned": [[f.counter, f.label, f.cls, n] for f, n in write.partitioned.items() if n],
            "breakdown": {f.encode(): n for f, n in write.breakdown.items() if n},
            "rows": [text for pair in write.rows.items() for text in pair],
            "guard": [prompt_key(p.sample_id, p.turn, p.gen) for p in write.continued],
            "classes": classes,
        }
        # Any segment will do; spreading chunks keeps each key far below 512 MB.
        segment = zlib.crc32(write.chunk_id.encode()) % SEEN_SEGMENTS
        return IngestLandArgs(
            job_key=self.keys.job(job_id),
            partitions=self.keys.job_partitions(job_id),
            breakdown=self.keys.job_breakdown(job_id),
            rows_guard=self.keys.job_rows(job_id),
            seen=self.keys.job_seen(job_id, segment),
            enqueued=self.keys.job_enqueued(job_id),
            paused=self.keys.paused_jobs(),
            wake=self.keys.wake_channel(),
            running=self.keys.job_running(job_id),
            backlogs=tuple(backlogs),
            job_id=job_id,
            fence_value=fence_value,
            chunk_id=write.chunk_id,
            last_line=write.last_line,
            expect_rows="" if expect_rows is None else str(expect_rows),
            window=window,
            cancelled_state=JobState.CANCELLED.value,
            rq_job_prefix=JOB_KEY_PREFIX,
            slice=PUSH_SLICE,
            max_labels=MAX_PARTITION_LABELS,
            max_label_chars=MAX_PARTITION_LABEL_CHARS,
            chunk_json=json.dumps(chunk, ensure_ascii=False),
            seen_records=write.seen,
            finish="1" if finish else "",
            now_ms=now_ms(),
            ingesting_state=JobState.INGESTING.value,
            running_state=JobState.RUNNING.value,
            completed_state=JobState.COMPLETED.value,
            prompts=tuple(prompts),
        )
