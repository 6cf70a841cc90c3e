"""Rendering an upload's rows in a pool of processes, in file order: ingestion at more than one
core's speed.

Ingestion spends most of its time per row on work that needs nothing but the row and the job's
spec: parsing the line, rendering the prompt under each arm its samples use (the chat template and
the tokenizer), looking for special-token text, and the row's content digest. `render_batch` does
exactly that for a batch of lines, the same function whether it runs in a pool process or in the
ingestion thread (``processes`` 0), so the two cannot drift: it applies ingestion's own rule
(`service.admit.admit_row`). What needs the job's state stays in the ingestion thread: row ids
against the rows guard, hygiene against the rows kept so far, chunks and their transactions.

`RenderPool.rows` reads the upload (line digests taken as each line is read, `service.rowids`),
sends batches ahead to the pool, at most a few per process so memory stays flat whatever the
file's size, and yields each row's result in file order; while the oldest batch sent is not back,
the ingestion thread renders the next one itself rather than wait (`_Ahead`). A pool process keeps
each job's renderers (the tokenizer is loaded once per process and job files, not per batch); a
changed tokenizer or template file (another digest) is loaded again. Pool processes are started
with ``spawn``: the coordinator runs threads, which ``fork`` would copy half-way.

A process that dies (killed, out of memory) breaks the pool: `BrokenRenderPool` is raised, the
pool is started again on next use, and the ingestion resumes from its checkpoint like after any
outage (`service.ingest`), so no row is lost or enqueued twice.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import BinaryIO, cast

from datagen.control.payload import Conversation
from datagen.errors import RetryableError
from datagen.heap import collect_less_often, freeze_start_up
from datagen.prompts import tokenization
from datagen.prompts.dataset import (
    DEFAULT_MAX_LINE_BYTES,
    Prompt,
    RowError,
    line_is_blank,
    line_items,
    read_lines,
)
from datagen.spec import JobSpec
from datagen.states import MultiTurnMode
from service.admit import AdmittedRow, ArmRenderers, Refused, admit_row, arm_renderers
from service.rowids import LineDigests, RowId, row_id

__all__ = [
    "PROCESS",
    "THREAD",
    "BrokenRenderPool",
    "LineBatch",
    "RenderPool",
    "RenderedRow",
    "render_batch",
    "shared_pool",
]

log = logging.getLogger(__name__)

# Lines per batch: small first, so the first chunk of a job is rendered (and enqueued) within a
# fraction of a second of its submit, then larger, so pickling and scheduling cost little per row.
FIRST_BATCH_LINES = 8
MAX_BATCH_LINES = 256
# Batches a job's ingestion renders in its own thread before the pool's (8 + 16 + 32 lines).
IN_THREAD_BATCHES = 3
# Batches in flight per pool process: enough to keep each process busy while the ingestion thread
# lands chunks, few enough that memory stays flat.
BATCHES_PER_PROCESS = 4
# Jobs whose renderers a pool process keeps.
JOBS_KEPT = 8
# How often a pool process looks whether its coordinator is still there.
PARENT_CHECK_S = 1.0
# A pool process's niceness: rendering is background work, so on a coordinator with few cores the
# API's thread and Redis get the CPU first when they need it (a 2-core machine answered GET /jobs
# in 134-154 ms at p99 with the pool at the default niceness, under 100 ms with it).
NICENESS = 10


# Where a batch is rendered: `RenderPool.rows` tells its caller (for the metrics) where each batch
# was rendered, its rows and the CPU seconds rendering it took there.
THREAD = "thread"
PROCESS = "process"
Counted = Callable[[str, int, float], None]


class BrokenRenderPool(RetryableError):
    """A rendering process died; the pool starts again and the ingestion resumes from its
    checkpoint."""


@dataclass(frozen=True)
class RowLine:
    line: int
    # None: the line is over the length cap (its rest was skipped).
    raw: bytes | None
    row_index: int
    digest: str


@dataclass(frozen=True)
class LineBatch:
    spec_json: str
    # The tokenizer files' and template's digests: the same paths with other contents are loaded
    # again, not taken from a process's cache.
    files_key: str
    context_len: int | None
    lines: tuple[RowLine, ...]


@dataclass(frozen=True)
class RenderedRow:
    """One row as ingestion's rule judged it: its first prompt (or why it is no row), the
    conversation in multi-turn ``all`` mode, the verdict (None: outside the spec's partitions), and
    its id for the rows guard (None where ingestion keeps none: not rendered)."""

    line: int
    digest: str
    item: Prompt | RowError
    conversation: Conversation | None
    verdict: AdmittedRow | Refused | None
    row_id: RowId | None


# -- the work, in whichever process runs it ----------------------------------------------------------

_jobs: collections.OrderedDict[tuple[str, str], tuple[JobSpec, ArmRenderers]] = collections.OrderedDict()
_files: dict[tuple[str, str | None], str] = {}
_jobs_lock = threading.Lock()


def _job(spec_json: str, files_key: str) -> tuple[JobSpec, ArmRenderers]:
    """The job's spec and renderers, kept per process (loading a tokenizer takes about a second)."""
    key = (spec_json, files_key)
    with _jobs_lock:
        found = _jobs.get(key)
        if found is not None:
            _jobs.move_to_end(key)
            return found
        spec = JobSpec.model_validate_json(spec_json)
        paths = (spec.tokenizer, spec.chat_template)
        if _files.get(paths, files_key) != files_key:
            # The same paths hold other files now: the process's renderers of them are stale.
            tokenization.forget_renderers()
        _files[paths] = files_key
        made = (spec, arm_renderers(spec))
        _jobs[key] = made
        while len(_jobs) > JOBS_KEPT:
            _jobs.popitem(last=False)
        return made


def _first_and_conversation(
    items: list[Prompt | RowError], mode: MultiTurnMode
) -> tuple[Prompt | RowError, Conversation | None]:
    """A line's first prompt and, in multi-turn ``all`` mode, its whole conversation
    (`service.admit.chunk_items` does the same for a stream)."""
    first, last = items[0], items[-1]
    if mode is MultiTurnMode.LAST or isinstance(first, RowError) or isinstance(last, RowError):
        return first, None
    cuts = [len(t.messages) for t in items if isinstance(t, Prompt)]
    return first, Conversation(last.messages, last.tools, cuts, generated=[], row_class=first.cls)


def render_batch(batch: LineBatch) -> list[RenderedRow]:
    """Parse, render and admit each line of ``batch`` by ingestion's rule (`service.admit.admit_row`).

    Each step runs over the whole batch before the next (every line parsed, then every row
    judged, then the ids): rows are independent, and a loop that runs one step's code stays in the
    CPU's caches, where one that runs every step per row does not (`python bench/render_batch.py`:
    150-178 µs a row against 165-229 one row at a time, less in 4 of 5 runs)."""
    spec, renderers = _job(batch.spec_json, batch.files_key)
    token_rows = spec.features is not None and spec.features.capture_only
    parsed = [
        _first_and_conversation(_line_items(row, spec.multi_turn, token_rows), spec.multi_turn)
        for row in batch.lines
    ]
    verdicts = [admit_row(first, spec, renderers, batch.context_len) for first, _ in parsed]
    ids = [
        row_id(first) if isinstance(first, Prompt) and _rendered(verdict) else None
        for (first, _), verdict in zip(parsed, verdicts, strict=True)
    ]
    return [
        RenderedRow(
            row.line,
            row.digest,
            _without_original(first) if isinstance(first, Prompt) else first,
            conversation,
            verdict,
            ident,
        )
        for row, (first, conversation), verdict, ident in zip(batch.lines, parsed, verdicts, ids, strict=True)
    ]


def _line_items(row: RowLine, mode: MultiTurnMode, token_rows: bool) -> list[Prompt | RowError]:
    if row.raw is None:
        return [RowError(row.line, f"line is longer than {DEFAULT_MAX_LINE_BYTES} bytes; skipped")]
    return line_items(row.raw, row.line, mode, token_rows=token_rows, row_index=row.row_index)


def _rendered(verdict: AdmittedRow | Refused | None) -> bool:
    """Whether the row rendered: admitted, or refused only for its length."""
    return isinstance(verdict, AdmittedRow) or (isinstance(verdict, Refused) and verdict.rendered)


def _without_original(item: Prompt) -> Prompt:
    """The prompt less its row as parsed, which went into its id: only what ingestion reads goes
    back (built field by field: ``dataclasses.replace`` costs half as much again)."""
    return Prompt(
        line=item.line,
        sample_id=item.sample_id,
        turn=item.turn,
        messages=item.messages,
        tools=item.tools,
        partition=item.partition,
        cls=item.cls,
        original={},
        token_ids=item.token_ids,
        prompt_len=item.prompt_len,
        row_index=item.row_index,
    )


_Timed = tuple[list[RenderedRow], float]


def _timed_render(batch: LineBatch) -> _Timed:
    """`render_batch` in a pool process, with the CPU seconds it took."""
    started = time.thread_time()
    rows = render_batch(batch)
    return rows, time.thread_time() - started


def _rendered_here(batch: LineBatch, counted: Counted) -> list[RenderedRow]:
    """`render_batch` in the calling thread, counted."""
    rows, cpu_s = _timed_render(batch)
    counted(THREAD, len(rows), cpu_s)
    return rows


def _warm(parent_pid: int | None = None) -> None:
    """A pool process's start: the heavy imports, before the first batch waits on them; and a watch
    that ends the process when its coordinator is gone (killed with no chance to stop its pool), so
    no rendering process outlives it."""
    if parent_pid is not None:
        threading.Thread(target=_exit_with, args=(parent_pid,), name="parent-watch", daemon=True).start()
        with contextlib.suppress(OSError):
            os.nice(NICENESS)
    import transformers  # noqa: F401

    # A batch's rows stay alive until they are sent back: as in the coordinator, fewer collections.
    collect_less_often()
    # Not after a job's renderers load: the process's cache lets them go, and a frozen object in
    # a reference cycle is never collected (a tokenizer adds a tenth of what the imports hold).
    freeze_start_up()


def _exit_with(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _load_job(spec_json: str, files_key: str) -> None:
    """Load a job's renderers in a pool process while the job's first rows render elsewhere."""
    _job(spec_json, files_key)


# -- the pool ----------------------------------------------------------------------------------------


class RenderPool:
    """``processes`` rendering processes (0: render in the calling thread), shared by every
    ingestion of the coordinator."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(
                    max_workers=self.processes,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_warm,
                    initargs=(os.getpid(),),
                )
            return self._executor

    def start(self) -> None:
        """Start the processes now (the coordinator's start-up), not on the first submit."""
        if self.processes:
            pool = self._pool()
            for _ in range(self.processes):
                pool.submit(_warm)

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def _broken(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def rows(
        self,
        stream: BinaryIO,
        spec: JobSpec,
        files_key: str,
        start_line: int,
        context_len: int | None,
        counted: Counted = lambda where, rows, cpu_s: None,
    ) -> Iterator[RenderedRow]:
        """Each row of ``stream`` after line ``start_line``, rendered and judged, in file order;
        ``counted(where, rows, cpu_s)`` is told where each batch was rendered (`THREAD`,
        `PROCESS`) and the CPU it took."""
        spec_json = spec.model_dump_json()
        batches = iter(_batches(stream, spec_json, files_key, start_line, context_len))
        if not self.processes:
            for batch in batches:
                yield from _rendered_here(batch, counted)
            return
        pool = self._pool()
        ahead = _Ahead(pool, batches, self.processes * BATCHES_PER_PROCESS, counted)
        try:
            # The pool's processes load the job's tokenizer (about a second) while its first rows
            # render here, with the renderer the submit loaded: the first prompts go out at once.
            for _ in range(self.processes):
                pool.submit(_load_job, spec_json, files_key)
            for batch in itertools.islice(batches, IN_THREAD_BATCHES):
                yield from _rendered_here(batch, counted)
            while (rows := ahead.next_rows()) is not None:
                yield from rows
        except BrokenProcessPool as exc:
            self._broken()
            raise BrokenRenderPool(f"a rendering process died ({exc}); the pool starts again") from exc
        finally:
            ahead.cancel()


class _Ahead:
    """An ingestion's batches ahead of it, in file order: ``window`` in the pool's processes, and
    while the oldest of those is not back, more rendered in the ingestion's own thread rather than
    waited for (it waits only while it is the one behind). With one process on two cores this
    thread's idle time renders too; when the thread is what bounds ingestion, its batches are
    always back, and it renders none."""

    def __init__(
        self, pool: ProcessPoolExecutor, batches: Iterator[LineBatch], window: int, counted: Counted
    ) -> None:
        self._pool = pool
        self._batches = batches
        self._window = window
        self._counted = counted
        self._pending: collections.deque[Future[_Timed] | list[RenderedRow]] = collections.deque()
        self._in_flight = 0
        self._more = True

    def _next_batch(self) -> LineBatch | None:
        batch = next(self._batches, None) if self._more else None
        self._more = batch is not None
        return batch

    def next_rows(self) -> list[RenderedRow] | None:
        """The next batch's rows, in file order; None after the last."""
        while True:
            while self._in_flight < self._window and (batch := self._next_batch()) is not None:
                self._pending.append(self._pool.submit(_timed_render, batch))
                self._in_flight += 1
            if not self._pending:
                return None
            head = self._pending[0]
            behind = isinstance(head, Future) and not head.done()
            if behind and len(self._pending) < 2 * self._window and (batch := self._next_batch()) is not None:
                self._pending.append(_rendered_here(batch, self._counted))
                continue
            self._pending.popleft()
            if isinstance(head, Future):
                self._in_flight -= 1
                rows, cpu_s = head.result()
                self._counted(PROCESS, len(rows), cpu_s)
                return rows
            return head

    def cancel(self) -> None:
        for item in self._pending:
            if isinstance(item, Future):
                item.cancel()


def _batches(
    stream: BinaryIO, spec_json: str, files_key: str, start_line: int, context_len: int | None
) -> Iterator[LineBatch]:
    """The stream's non-blank lines after ``start_line`` in batches, each line with its row index
    (counting every non-blank line from the file's start) and its bytes' digest."""
    lines = LineDigests(stream)
    size, batch = FIRST_BATCH_LINES, []
    row_index = 0
    for line, raw in read_lines(cast(BinaryIO, lines), DEFAULT_MAX_LINE_BYTES):
        if raw is not None and line_is_blank(raw, line):
            continue
        index, row_index = row_index, row_index + 1
        if line <= start_line:
            continue
        batch.append(RowLine(line, raw, index, lines.digest(line)))
        if len(batch) >= size:
            yield LineBatch(spec_json, files_key, context_len, tuple(batch))
            size, batch = min(MAX_BATCH_LINES, size * 2), []
    if batch:
        yield LineBatch(spec_json, files_key, context_len, tuple(batch))


_shared: dict[int, RenderPool] = {}
_shared_lock = threading.Lock()


def shared_pool(processes: int) -> RenderPool:
    """The process's pool of ``processes`` rendering processes, made on first use: every coordinator
    app in one process (tests run many) shares one set of processes and their loaded tokenizers."""
    with _shared_lock:
        pool = _shared.get(processes)
        if pool is None:
            pool = _shared[processes] = RenderPool(processes)
            if processes:
                atexit.register(pool.close)
        return pool
