"""Streaming ingestion: dataset file → rendered prompt ids → RQ jobs, in checkpointed chunks.

Each chunk lands in one script (`datagen.control.ingest_chunks`: only while the job's ingest fence
holds this run's value, so nothing lands for a cancelled, failed or deleted job) together with (a)
its rows added to the job's rows guard (`service.rowids`) and (b) the job's counters and the line
checkpoint. A crash anywhere leaves either the whole chunk or none of it; a resumed ingestion starts
after the checkpoint, and the rows guard (read before each chunk) keeps a resubmitted row from
being enqueued twice, since RQ itself accepts a second enqueue of the same job id. A run that starts
on a job no chunk has landed a row for (a new job) reads nothing of it before its first chunk lands
(`_NoRows`). Chunks start small and double up to the configured size (`service.admit.chunk_sizes`),
and the first one also goes out after a deadline, so warm workers start on a new job within a
fraction of a second of its submit.

Evaluation hygiene (`datagen.hygiene.screen`) judges each chunk's rows last: contaminated rows and
duplicates become rejected rows, and the kept rows' packed records are appended to the job's
``seen`` keys as the chunk lands (read back into memory whenever ingestion starts).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from redis import Redis, RedisError

from datagen.backoff import Backoff
from datagen.control.dispatch import Dispatch
from datagen.control.enqueue import EnqueueOptions
from datagen.control.ingest_chunks import ChunkWrite, IngestChunks, Landing
from datagen.control.jobs import IngestFacts, JobStore
from datagen.control.keys import Keys, prompt_key
from datagen.control.payload import PromptPayload
from datagen.control.redismemory import is_out_of_memory, out_of_memory_error
from datagen.control.servers import fleet_context_len
from datagen.errors import DatagenError, JobNotFoundError, StorageError
from datagen.hygiene.screen import Hygiene, HygieneRow, Verdicts
from datagen.prompts.dataset import Prompt
from datagen.prompts.inputs import ColumnMap, InputFormat, RowStream, format_for_name, open_upload
from datagen.prompts.special_text import special_text_reason
from datagen.prompts.tokenization import renderer_for
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import DedupMode, JobState, PromptClass
from service.admit import (
    Chunk,
    Refused,
    chunk_limit,
    chunk_sizes,
    partition_breakdown,
    rejected_breakdown,
)
from service.committed import Committed, settle_committed
from service.metrics import CoordinatorMetrics
from service.render_pool import BrokenRenderPool, RenderedRow, RenderPool
from service.rowids import (
    check_row_ids,
    counted_before,
    rejected_field,
    repeated_lines,
    reread_lines,
    upload_tag,
)

__all__ = ["IngestOptions", "Ingestor"]

log = logging.getLogger(__name__)

# The ingestion thread's backoff through a Redis or storage outage: it holds no prompt in flight,
# so it waits longer between tries than a worker does (`datagen.settings.OUTAGE_RETRY_MAX_S`).
INGEST_RETRY_FIRST_S = 1.0
INGEST_RETRY_MAX_S = 30.0
# The first chunk of an ingestion is small, and goes out after this long even if it is not full
# (slow rendering, long prompts): warm workers start on a job within a fraction of a second.
FIRST_CHUNK = 32
FIRST_CHUNK_S = 0.1


@dataclass(frozen=True)
class IngestOptions:
    chunk: int
    enqueue: EnqueueOptions
    # Backpressure: a chunk waits while the job's backlog of its class has no room for its prompts
    # within this many, so Redis holds a bounded window of a dataset of any size (the rest waits in
    # the file), and one huge job's window never holds back another job's ingestion. Chunks are cut
    # to fit the window (`service.admit.chunk_limit`), so the room they wait for can come.
    max_queued_per_class: int = 200_000
    backpressure_poll_s: float = 1.0
    # Chunks grow from this size to ``chunk`` (`service.admit.chunk_sizes`); the first one is
    # flushed after ``first_chunk_s`` with whatever prompts it holds. Neither applies when ``chunk``
    # is already this small.
    first_chunk: int = FIRST_CHUNK
    first_chunk_s: float = FIRST_CHUNK_S


class _Stopped(Exception):
    """The coordinator is shutting down; the ingestion resumes from its checkpoint later."""


class _Cancelled(Exception):
    """The job was cancelled, failed or deleted while it was ingesting (its fence is gone)."""


class _TakenOver(Exception):
    """Another ingestion run of the job took its fence (a rebuild, or a coordinator that resumed
    it): this one lands nothing more."""


class _StartOver(Exception):
    """The run's first chunk found rows landed since the run started (`Landing.STALE`): it starts
    over from the checkpoint, reading what they left."""


@dataclass
class _NoRows:
    """A run that started on a job for which no chunk has landed a row (its ``rows`` counter 0):
    nothing is in the job's rows guard or seen records, nor in its enqueued set (every entry there
    is a prompt of a row a chunk counted: an older version's ingestion, or a next turn). So the run
    reads neither the guard nor the seen records before its first chunk lands, and never the
    enqueued set; its first chunk lands only if the counter is still 0 (else it starts over,
    `_StartOver`), so nothing landed in between either."""

    landed: bool = False


class Ingestor:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        jobs: JobStore,
        storage: Storage,
        options: IngestOptions,
        *,
        metrics: CoordinatorMetrics | None = None,
        pool: RenderPool | None = None,
    ) -> None:
        self.metrics = metrics
        # Where rows are parsed and rendered (`service.render_pool`); none: in the ingestion thread.
        self.pool = pool if pool is not None else RenderPool(0)
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.storage = storage
        self.options = options
        self.dispatch = Dispatch(redis, keys)
        self.chunks = IngestChunks(redis, keys, options.enqueue)
        # The inputs being read, by (job, input name), while their streams live (`_open`).
        self._inputs: weakref.WeakValueDictionary[tuple[str, str], RowStream] = weakref.WeakValueDictionary()

    def run(
        self,
        job_id: str,
        source: str | Path,
        stop: threading.Event,
        *,
        incarnation: str | None = None,
        committed: Committed | None = None,
        finish: bool = True,
        fence: str | None = None,
        facts: IngestFacts | None = None,
    ) -> bool:
        """Ingest one uploaded file; resumable from the job's checkpoint. Never raises.

        ``source`` is the name of one of the job's stored uploads (`Storage.write_input`), or a
        local file (benchmarks). ``incarnation`` is the job's when ingestion was asked for (None:
        the job's current one): each chunk
        lands only while the job's ingest fence still holds it, so nothing of a cancelled, failed or
        deleted job (or of an earlier job of the same id) is enqueued after the fact. ``fence``:
        the exact value the fence must hold (`datagen.control.jobs.ingest_fence_value`: a rebuild's
        ingestion, or one that took the job's ingestion over, holds it to its own token, so two
        runs never both land chunks); None: the incarnation, as a submit arms it.

        While Redis is unreachable (a restart) it waits and resumes from the checkpoint: each
        chunk's enqueue and checkpoint are one script, so nothing is enqueued twice.

        ``committed`` (a job rebuilt from storage, `service.rebuild`): prompts with a committed
        record are counted done, not enqueued. ``finish`` False leaves the job ingesting at the end
        (more uploads follow). ``facts``: the job as the submit that made it just now knows it (its
        first run starts without reading it; a retry reads it). Returns whether the upload was
        ingested to its end.
        """
        backoff = Backoff(INGEST_RETRY_FIRST_S, INGEST_RETRY_MAX_S)
        storage_failed = False
        while not stop.is_set():
            # Only a first attempt starts from what the submit knew: a retry reads what landed.
            given, facts = facts, None
            try:
                ended = self._run(
                    job_id, source, stop, incarnation, committed, finish, storage_failed, fence, given
                )
                return ended
            except _Stopped:
                log.info(
                    "job %s: ingestion stopped; it resumes from its checkpoint if the job is live", job_id
                )
                return False
            except BrokenRenderPool as exc:
                # The pool starts again on next use; what was landed stays, the rest resumes.
                delay_s = backoff.next_s()
                log.warning("job %s: %s; ingestion resumes in %.0f s", job_id, exc, delay_s)
                stop.wait(delay_s)
            except (_Cancelled, JobNotFoundError):
                log.info("job %s: ingestion stopped: the job was cancelled, failed or deleted", job_id)
                return False
            except _TakenOver:
                log.info(
                    "job %s: ingestion stopped: another run (a rebuild, or a resume) took it over", job_id
                )
                return False
            except RedisError as exc:
                if is_out_of_memory(exc):  # waited out like an outage, and said as what it is
                    if self.metrics is not None:
                        self.metrics.redis_oom_refusals.inc()
                    problem = str(out_of_memory_error(self.redis, exc))
                else:
                    problem = f"Redis unreachable during ingestion ({exc})"
                delay_s = backoff.next_s()
                log.warning("job %s: %s; ingestion resumes in %.0f s", job_id, problem, delay_s)
                stop.wait(delay_s)
            except (StorageError, OSError) as exc:
                # As a worker does: a storage outage (read-only, full, unreachable) is waited out and
                # shown on the job; the ingestion resumes from its checkpoint, the job never fails.
                delay_s = backoff.next_s()
                log.warning(
                    "job %s: storage error during ingestion, resuming in %.0f s: %s", job_id, delay_s, exc
                )
                self._set_storage_error(job_id, f"ingestion: {exc}")
                storage_failed = True
                stop.wait(delay_s)
            except DatagenError as exc:
                log.error("job %s: ingestion failed: %s", job_id, exc)
                self._fail(job_id, str(exc))
                return False
            except Exception as exc:  # a bug must not kill the coordinator thread silently
                log.exception("job %s: ingestion crashed", job_id)
                self._fail(job_id, f"ingestion crashed: {exc!r}")
                return False
        return False

    def _set_storage_error(self, job_id: str, error: str | None) -> None:
        try:
            self.jobs.set_storage_error(job_id, error)
        except RedisError as exc:
            log.warning("job %s: cannot show the storage error on the job: %s", job_id, exc)

    def _fail(self, job_id: str, error: str) -> None:
        try:
            self.jobs.fail(job_id, error)
        except RedisError as exc:
            log.error("job %s: cannot mark the job failed (Redis unreachable): %s", job_id, exc)

    def _run(
        self,
        job_id: str,
        source: str | Path,
        stop: threading.Event,
        incarnation: str | None,
        committed: Committed | None,
        finish: bool,
        storage_failed: bool,
        fence: str | None = None,
        facts: IngestFacts | None = None,
    ) -> bool:
        while True:
            try:
                return self._run_once(
                    job_id, source, stop, incarnation, committed, finish, storage_failed, fence, facts
                )
            except _StartOver:
                facts = None  # read again: what landed since
                log.info("job %s: rows landed since this ingestion run started; it starts over", job_id)

    def _run_once(
        self,
        job_id: str,
        source: str | Path,
        stop: threading.Event,
        incarnation: str | None,
        committed: Committed | None,
        finish: bool,
        storage_failed: bool,
        fence: str | None = None,
        facts: IngestFacts | None = None,
    ) -> bool:
        # The job as this run starts on it, in one command (none for a job a submit made just now).
        if facts is None:
            facts = self.jobs.ingest_facts(job_id)
        if facts is None or (incarnation is not None and facts.incarnation != incarnation):
            raise _Cancelled  # deleted, or its id already reused, before ingestion began
        incarnation = facts.incarnation
        fence = incarnation if fence is None else fence
        if facts.waiting_for_room:
            # A wait for room shown by a coordinator that stopped during it is over: this run shows its own.
            self.jobs.set_waiting_for_room(job_id, None)
        spec = facts.spec
        # Built here, so a bad tokenizer or template fails the ingestion before a row is read; its
        # files' digests tell the rendering processes when a path holds other files.
        identity = renderer_for(spec).identity()
        files_key = f"{identity['tokenizer_sha256']}:{identity['chat_template_sha256']}"
        context_len = facts.context_len or spec.context_len or fleet_context_len(self.redis, self.keys)
        start_line = facts.ingest_line
        input_name = source.name if isinstance(source, Path) else source
        if start_line:
            log.info("job %s: resuming ingestion of %s after line %d", job_id, input_name, start_line)
        no_rows = _NoRows() if facts.rows == 0 else None
        hygiene = self._hygiene(job_id, spec, no_rows)
        chunk = Chunk(input_name)
        most = chunk_limit(self.options.chunk, self.options.max_queued_per_class, spec.samples)
        sizes = chunk_sizes(self.options.first_chunk, most)
        size = next(sizes)
        # Only the first chunk has a deadline; None once it is out (or when chunks are small anyway).
        deadline = time.monotonic() + self.options.first_chunk_s if size < most else None
        with self._open(job_id, source) as stream:
            for row in self.pool.rows(stream, spec, files_key, start_line, context_len, self._rendered):
                if stop.is_set():
                    log.info("job %s: ingestion paused at line %d (shutdown)", job_id, chunk.last_line)
                    return False
                chunk.line_digests[row.line] = row.digest
                self._add(chunk, row, job_id, spec, incarnation)
                full = len(chunk.prompts) + len(chunk.rejected) >= size
                if full or (deadline is not None and chunk.prompts and time.monotonic() >= deadline):
                    self._flush(job_id, spec, chunk, stop, hygiene, incarnation, committed, fence, no_rows)
                    if storage_failed:
                        self._set_storage_error(job_id, None)
                        storage_failed = False
                    chunk = Chunk(input_name)
                    size, deadline = next(sizes), None
        # The input's last chunk ends the ingestion as it lands, in the same script; with no row
        # left to land, the ingestion ends on its own.
        ending = finish and chunk.rows > 0
        self._flush(job_id, spec, chunk, stop, hygiene, incarnation, committed, fence, no_rows, ending)
        if storage_failed:
            self._set_storage_error(job_id, None)
        if finish:
            if not ending:
                self.jobs.finish_ingest(job_id)
            log.info("job %s: ingestion finished", job_id)
        return True

    def _rendered(self, where: str, rows: int, cpu_s: float) -> None:
        if self.metrics is not None:
            self.metrics.ingest_rendered_rows.labels(where).inc(rows)
            self.metrics.ingest_render_cpu.labels(where).inc(cpu_s)

    def _hygiene(self, job_id: str, spec: JobSpec, no_rows: _NoRows | None) -> Hygiene:
        """The job's decontamination index (held to the sets' digest in its manifest), and the rows
        it kept so far (from Redis; none where ``no_rows`` says no row landed)."""
        pinned = None
        if spec.decontaminate:
            manifest = self.storage.read_manifest(job_id) or {}
            pinned = (manifest.get("decontaminate") or {}).get("sha256")
        hygiene = Hygiene.for_spec(spec, pinned_sha256=pinned)
        if hygiene.dedup is not DedupMode.OFF and no_rows is None:
            for records in self.jobs.seen_records(job_id):
                hygiene.seen.load(records)
        return hygiene

    def _open(self, job_id: str, source: str | Path) -> BinaryIO:
        """The input's rows as JSONL, whatever its format (`datagen.prompts.inputs`): a stored upload
        or reference, or a local file (benchmarks; its format told by its name). The stream is
        kept while it is open, for `_located` and `input_progress`."""
        if isinstance(source, Path):
            fmt = format_for_name(source.name) or InputFormat.JSONL
            rows = open_upload(source.open("rb"), fmt, ColumnMap(), name=source.name)
        else:
            rows = self.storage.open_rows(job_id, source)
        self._inputs[(job_id, source.name if isinstance(source, Path) else source)] = rows
        return cast(BinaryIO, rows)

    def input_progress(self, job_id: str, input_name: str) -> dict[str, Any] | None:
        """How far the ingestion of ``input_name`` read it (`RowStream.progress`); None when it is
        not being read here."""
        rows = self._inputs.get((job_id, input_name))
        return None if rows is None else rows.progress()

    def _located(self, job_id: str, input_name: str, rejected: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rejected rows with the ``file`` and ``row`` (from 1, within that file) of their line, where
        the input knows them (a directory's rows are numbered across its files)."""
        rows = self._inputs.get((job_id, input_name))
        if rows is None:
            return rejected
        located = []
        for entry in rejected:
            where = rows.locate(entry["line"]) if isinstance(entry.get("line"), int) else None
            located.append(entry if where is None else {**entry, "file": where[0], "row": where[1]})
        return located

    def _add(self, chunk: Chunk, row: RenderedRow, job_id: str, spec: JobSpec, incarnation: str = "") -> None:
        """One row as the rendering judged it (`service.render_pool`): its prompts into the chunk, or
        its refusal."""
        item, conversation, verdict = row.item, row.conversation, row.verdict
        if item.line != chunk.last_line:
            chunk.rows += 1
        chunk.last_line = item.line
        if verdict is None:
            return
        if row.row_id is not None and item.line not in chunk.ids:
            chunk.ids[item.line] = row.row_id
            if found := verdict.special_text:
                reason = special_text_reason(found)
                chunk.flagged.append(
                    {"line": item.line, "sample_id": item.sample_id, "tokens": found, "reason": reason}
                )
        if isinstance(verdict, Refused):
            chunk.rejected.append({"line": item.line, "reason": verdict.reason, "sample_id": item.sample_id})
            return
        assert isinstance(item, Prompt)  # a RowError is always refused
        for gen, (arm, admitted) in enumerate(verdict.samples):
            payload = PromptPayload(
                job=job_id,
                sample_id=item.sample_id,
                turn=item.turn,
                gen=gen,
                cls=admitted.cls,
                prompt_ids=admitted.prompt_ids,
                max_new_tokens=spec.max_new_tokens(admitted.cls),
                partition=item.partition,
                conversation=conversation,
                incarnation=incarnation,
                given_prompt_len=item.prompt_len,
                arm=None if arm is None else arm.name,
            )
            chunk.prompts.append((item, payload))

    def _wait_for_class(
        self, job_id: str, cls: PromptClass, wanted: int, backlog: int, stop: threading.Event
    ) -> None:
        """Poll until the backlog of ``cls`` has room for ``wanted`` more. The job shows the wait
        (``waiting_for_room``) while it lasts, and the log says when it starts and when it ends."""
        window = self.options.max_queued_per_class
        log.info(
            "job %s: ingestion waits for room: the %s backlog holds %d prompts of a window of %d "
            "(DATAGEN_MAX_QUEUED_PER_CLASS) and the next chunk needs room for %d; it goes on as "
            "workers take prompts",
            job_id,
            cls.value,
            backlog,
            window,
            wanted,
        )
        started = time.monotonic()
        self.jobs.set_waiting_for_room(job_id, cls)
        try:
            while backlog + wanted > window:
                self._check_cancelled(job_id)
                if stop.wait(self.options.backpressure_poll_s):
                    raise _Stopped
                backlog = self.dispatch.backlog(job_id, cls)
        finally:
            self.jobs.set_waiting_for_room(job_id, None)
        log.info(
            "job %s: ingestion resumes after %.1f s: the %s backlog holds %d prompts of a window of %d",
            job_id,
            time.monotonic() - started,
            cls.value,
            backlog,
            window,
        )

    def _check_cancelled(self, job_id: str) -> None:
        if self.jobs.state(job_id) is JobState.CANCELLED:
            raise _Cancelled

    def _flush(
        self,
        job_id: str,
        spec: JobSpec,
        chunk: Chunk,
        stop: threading.Event,
        hygiene: Hygiene,
        incarnation: str = "",
        committed: Committed | None = None,
        fence: str = "",
        no_rows: _NoRows | None = None,
        finish: bool = False,
    ) -> None:
        """Land the chunk (``finish``: the input's last, which ends the ingestion as it lands)."""
        if chunk.rows == 0:
            return
        # Nothing in the rows guard before a run's first chunk lands where no row landed before it.
        guarded = no_rows is None or no_rows.landed
        new_ids, repeats, reread = self._check_ids(job_id, chunk, guarded)
        verdicts = self._judge(hygiene, chunk, repeats)
        new_rejected, reread = self._leave_out_reread(job_id, chunk, reread, guarded)
        members = [prompt_key(p.sample_id, p.turn, p.gen) for _, p in chunk.prompts]
        # A row enqueued before is in the rows hash (`repeats`: same id, same content). Jobs made
        # before rows were remembered kept one guard entry per prompt in the enqueued set instead;
        # a run that started with no row landed (`_NoRows`) finds none there.
        legacy = (
            self.redis.smismember(self.keys.job_enqueued(job_id), members)
            if members and no_rows is None
            else [False] * len(members)
        )
        fresh: list[tuple[Prompt, PromptPayload, str]] = []
        in_chunk: set[str] = set()
        for (item, payload), member, enqueued in zip(chunk.prompts, members, legacy, strict=True):
            if not enqueued and item.line not in repeats and member not in in_chunk:
                in_chunk.add(member)
                fresh.append((item, payload, member))
        if chunk.rejected or chunk.flagged:
            # Nothing is written for a job cancelled or deleted meanwhile (the landing itself is
            # fenced: a chunk that writes nothing here needs no look).
            self._check_cancelled(job_id)
        if chunk.rejected:
            # One object per chunk (object stores cannot append); a resumed chunk rewrites it.
            self.storage.write_rejected(
                job_id, chunk.input_name, self._located(job_id, chunk.input_name, chunk.rejected)
            )
        if chunk.flagged:
            self.storage.write_flagged(job_id, chunk.input_name, chunk.flagged)
        fresh_payloads = [p for _, p, _ in fresh]
        settled = settle_committed(self.storage, job_id, fresh_payloads, committed, spec)
        # Rows an earlier upload counted (a resubmission re-reads them) count nothing again.
        reread_prompts = sum(1 for item, _ in chunk.prompts if item.line in reread)
        counts = {
            "rows": chunk.rows - len(reread),
            "rejected": len(chunk.rejected),
            "accepted": len(fresh) + settled.later_turns,
            "skipped": len(chunk.prompts) - len(fresh) - reread_prompts,
            "prompt_tokens": sum(len(p.prompt_ids) for p in [*fresh_payloads, *settled.continued]),
            "flagged": len(chunk.flagged),
            "done": settled.done,
            "output_tokens": settled.output_tokens,
        }
        records = verdicts.record_bytes(hygiene.bands) if verdicts is not None else b""
        write = ChunkWrite(
            input_name=chunk.input_name,
            last_line=chunk.last_line,
            enqueue=settled.enqueue,
            continued=settled.continued,
            counts=counts,
            partitions={p.partition for p in fresh_payloads},
            partitioned=partition_breakdown(fresh_payloads, settled.turns, settled.continued),
            breakdown=rejected_breakdown(chunk),
            rows={**new_ids, **new_rejected},
            seen=records,
        )
        self._commit(job_id, spec, write, stop, incarnation, fence, no_rows, finish)
        if verdicts is not None:
            hygiene.keep(verdicts)
        if self.metrics is not None:
            for outcome in ("accepted", "rejected", "skipped"):
                self.metrics.ingested_rows.labels(outcome).inc(counts[outcome])
            for cls, prompts in Counter(p.cls.value for p in fresh_payloads).items():
                self.metrics.ingested_prompts.labels(cls).inc(prompts)

    def _commit(
        self,
        job_id: str,
        spec: JobSpec,
        write: ChunkWrite,
        stop: threading.Event,
        incarnation: str,
        fence_value: str,
        no_rows: _NoRows | None,
        finish: bool,
    ) -> None:
        """The chunk's enqueue, counters and checkpoint in one step, which lands only while the
        job's ingest fence holds ``fence_value`` (this incarnation, and this run's token if it has
        one): a cancel, failure or delete drops the fence, another run of the ingestion takes it.
        Backpressure: it waits while the job's backlog of a class has no room for the chunk's
        prompts of that class within the window (`IngestChunks.land`). A chunk fits the window
        (`service.admit.chunk_limit`) but for one row whose samples outnumber it: that one asks for
        the whole window, so it goes once the backlog is empty."""
        expect_rows = 0 if no_rows is not None and not no_rows.landed else None
        landing = self.chunks.land(
            job_id,
            write,
            priority=spec.priority,
            incarnation=incarnation,
            fence_value=fence_value,
            window=self.options.max_queued_per_class,
            wait_for_room=lambda cls, wanted, backlog: self._wait_for_class(
                job_id, cls, wanted, backlog, stop
            ),
            expect_rows=expect_rows,
            finish=finish,
        )
        if landing is Landing.TAKEN_OVER:
            raise _TakenOver
        if landing is Landing.FENCED:
            raise _Cancelled
        if landing is Landing.STALE:
            raise _StartOver
        if landing is Landing.LANDED_BEFORE and finish:
            # Landed by an earlier send, which need not have ended the ingestion (a run that read
            # more uploads after this one, or cut its chunks otherwise): end it. Safe to repeat:
            # only an ingesting job moves, and the rules apply as they would have.
            self.jobs.finish_ingest(job_id)
        if no_rows is not None:
            no_rows.landed = True

    def _check_ids(
        self, job_id: str, chunk: Chunk, guarded: bool = True
    ) -> tuple[dict[str, str], set[int], set[int]]:
        """Reject rows that reuse an earlier row's id with other content; returns the ids this chunk
        uses first, to remember, the lines that repeat an earlier row, and those of them that repeat
        an earlier upload's row (`service.rowids`). ``guarded`` False: the job's rows guard is
        known to be empty, and is not read."""
        if not chunk.ids:
            return {}, set(), set()
        keys = sorted({r.sample_key for r in chunk.ids.values()})
        stored = self.jobs.first_rows(job_id, keys) if guarded else {}
        upload = chunk.input_name.removesuffix(".jsonl")
        new, refused = check_row_ids(chunk.ids, stored, upload=upload)
        repeats = repeated_lines(chunk.ids, stored)
        reread = reread_lines(chunk.ids, stored, upload=upload)
        if refused:
            chunk.prompts = [(i, p) for i, p in chunk.prompts if i.line not in refused]
            chunk.flagged = [f for f in chunk.flagged if f["line"] not in refused]
            chunk.rejected += [
                {"line": line, "reason": reason, "sample_id": chunk.ids[line].sample_id}
                for line, reason in refused.items()
            ]
            chunk.rejected.sort(key=lambda r: r["line"])
        return new, repeats, reread

    def _leave_out_reread(
        self, job_id: str, chunk: Chunk, reread: set[int], guarded: bool = True
    ) -> tuple[dict[str, str], set[int]]:
        """Leave out of the chunk's counts and reports the rows an earlier upload counted already:
        ``reread`` (repeats of an earlier upload's row, by id) and rejected rows whose line, bytes
        and all, an earlier upload rejected. Returns the rows guard's entries for the chunk's newly
        rejected rows, and every re-read line."""
        fields = {
            r["line"]: rejected_field(r["line"], chunk.line_digests.get(r["line"], ""))
            for r in chunk.rejected
        }
        stored = self.jobs.first_rows(job_id, sorted(set(fields.values()))) if fields and guarded else {}
        before = counted_before(fields.values(), stored, upload=chunk.input_name)
        reread = reread | {line for line, name in fields.items() if name in before}
        if reread:
            chunk.rejected = [r for r in chunk.rejected if r["line"] not in reread]
            chunk.flagged = [f for f in chunk.flagged if f["line"] not in reread]
        tag = upload_tag(chunk.input_name)
        return {fields[r["line"]]: tag for r in chunk.rejected}, reread

    @staticmethod
    def _judge(hygiene: Hygiene, chunk: Chunk, repeats: set[int]) -> Verdicts | None:
        """Decontaminate and deduplicate the chunk's rows (`datagen.hygiene.screen`), after every other
        check; rejected ones leave the chunk's prompts and flagged rows."""
        if not hygiene.active:
            return None
        rows: dict[int, tuple[HygieneRow, Prompt]] = {}
        for item, payload in chunk.prompts:
            if item.line not in rows:
                whole = payload.conversation  # multi-turn `all`: the whole conversation counts
                messages = whole.messages if whole else item.messages
                tools = whole.tools if whole else item.tools
                rows[item.line] = (HygieneRow(item.line, messages, tools), item)
        verdicts = hygiene.judge([r for r, _ in rows.values()], chunk.input_name, repeats=frozenset(repeats))
        if verdicts.rejected:
            chunk.prompts = [(i, p) for i, p in chunk.prompts if i.line not in verdicts.rejected]
            chunk.flagged = [f for f in chunk.flagged if f["line"] not in verdicts.rejected]
            chunk.rejected += [
                {
                    "line": line,
                    "sample_id": rows[line][1].sample_id,
                    "partition": rows[line][1].partition,
                    **fields,
                }
                for line, fields in verdicts.rejected.items()
            ]
            chunk.rejected.sort(key=lambda r: r["line"])
        return verdicts
