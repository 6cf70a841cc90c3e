"""One ingestion chunk landed in Redis (`service.ingest`): its prompts enqueued (into the job's
backlogs), its rows added to the job's rows guard, its counters, breakdown, partition labels and kept
rows' hygiene records, and the line checkpoint, in one MULTI/EXEC.

The transaction WATCHes the job's ingest fence and lands only while the fence holds the value this
ingestion run holds it to (`datagen.control.jobs.ingest_fence_value`): a cancel, a failure or a
delete drops the fence, another run of the ingestion (a rebuild's, a resume's) takes it, and nothing
more lands. It also WATCHes and writes the job's ingest checkpoint, ``<upload>:<last line>`` of the
chunk: a chunk whose reply was lost (redis-py turns the lost connection into a WatchError) is sent
again, finds its own id there, and is known to have landed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from redis import Redis, WatchError

from datagen.control.dispatch import Dispatch
from datagen.control.enqueue import EnqueueOptions, enqueue_prompts
from datagen.control.jobs import JobStore, fence_admits
from datagen.control.keys import BreakdownField, Keys
from datagen.control.payload import PromptPayload
from datagen.control.redistext import as_text
from datagen.control.rq_format import queues
from datagen.states import Priority

__all__ = ["ChunkWrite", "IngestChunks", "Landing"]


class Landing(StrEnum):
    """What became of a chunk (`IngestChunks.land`)."""

    LANDED = "landed"
    # Its id is the job's checkpoint already: it landed, and the reply was lost.
    LANDED_BEFORE = "landed_before"
    # Another ingestion run of the same incarnation holds the fence.
    TAKEN_OVER = "taken_over"
    # The fence is gone or admits no run of this incarnation: the job was cancelled, failed or deleted.
    FENCED = "fenced"


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
    # The partitions the chunk's prompts count under, and their breakdown given each one's label
    # (`JobStore.partition_labels`, read under the fence's WATCH).
    partitions: Collection[str]
    breakdown: Callable[[dict[str, str]], Mapping[BreakdownField, int]]
    # Sample key -> ``<content digest>:<line>:<upload>`` of the rows this chunk uses first.
    rows: Mapping[str, str]
    # Packed hygiene records of the rows it kept (`datagen.hygiene.dedup`).
    seen: bytes

    @property
    def chunk_id(self) -> str:
        return f"{self.input_name}:{self.last_line}"


class IngestChunks:
    def __init__(self, redis: Redis, keys: Keys, jobs: JobStore, options: EnqueueOptions) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.options = options
        self.dispatch = Dispatch(redis, keys)
        self._queues = queues(redis, keys)

    def land(
        self, job_id: str, write: ChunkWrite, *, priority: Priority, incarnation: str, fence_value: str
    ) -> Landing:
        """Land ``write`` in one transaction while the job's ingest fence holds ``fence_value`` ('':
        the fence is not looked at); ``incarnation`` tells a fence taken over by another run of it
        from one that is gone."""
        fence = self.keys.job_ingest_fence(job_id)
        checkpoint = self.keys.job_ingest_checkpoint(job_id)
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(fence, checkpoint)
                    if fence_value:
                        held = pipe.get(fence)
                        if held is None or as_text(held) != fence_value:
                            return Landing.TAKEN_OVER if fence_admits(held, incarnation) else Landing.FENCED
                    landed = pipe.get(checkpoint)
                    if landed is not None and as_text(landed) == write.chunk_id:
                        return Landing.LANDED_BEFORE
                    labels, new_labels = self.jobs.partition_labels(job_id, set(write.partitions))
                    pipe.multi()
                    for payloads, guard in ((write.enqueue, False), (write.continued, True)):
                        enqueue_prompts(
                            pipe,
                            self._queues,
                            self.keys,
                            job_id,
                            payloads,
                            self.options,
                            dispatch=self.dispatch,
                            priority=priority,
                            guard=guard,
                        )
                    self.jobs.add_ingest_counts(pipe, job_id, dict(write.counts), write.last_line)
                    self.jobs.add_partition_labels(pipe, job_id, new_labels)
                    self.jobs.add_breakdown(pipe, job_id, dict(write.breakdown(labels)))
                    self.jobs.remember_rows(pipe, job_id, dict(write.rows))
                    # Any segment will do; spreading chunks keeps each key far below 512 MB.
                    self.jobs.add_seen(pipe, job_id, zlib.crc32(write.chunk_id.encode()), write.seen)
                    pipe.set(checkpoint, write.chunk_id)
                    pipe.execute()
                    return Landing.LANDED
                except WatchError:
                    continue  # the fence or the checkpoint moved: the next pass sees why
