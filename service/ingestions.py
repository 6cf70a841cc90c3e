"""The coordinator's ingestion threads: one per job at a time, each ingesting the job's uploads in
order (`service.ingest.Ingestor`), stopped and waited for by cancel and delete, resumed on restart
and whenever Redis says a job is ingesting that no thread here ingests."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from redis import RedisError

from datagen.control.jobs import IngestFacts, JobStore
from datagen.errors import DatagenError, JobNotFoundError
from datagen.records.storage import Storage
from datagen.states import JobState
from service.committed import Committed, read_committed
from service.ingest import Ingestor

__all__ = ["JOIN_TIMEOUT_S", "IngestRuns"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _IngestRun:
    thread: threading.Thread
    stop: threading.Event


class IngestRuns:
    """Which job each ingestion thread ingests. ``lock`` is held by a submit from its checks of a
    running ingestion to the start of its own, and by a resume while it looks."""

    def __init__(self, jobs: JobStore, storage: Storage, ingestor: Ingestor) -> None:
        self._jobs = jobs
        self._storage = storage
        self._ingestor = ingestor
        self._runs: dict[str, _IngestRun] = {}
        self.lock = threading.Lock()

    def running(self, job_id: str) -> bool:
        """Whether a thread here still ingests the job (call with ``lock`` held)."""
        run = self._runs.get(job_id)
        return run is not None and run.thread.is_alive()

    def start(
        self,
        job_id: str,
        inputs: list[str],
        *,
        committed: Committed | None = None,
        fresh: bool = False,
        fence: str | None = None,
        incarnation: str | None = None,
        facts: IngestFacts | None = None,
    ) -> None:
        """Ingest ``inputs`` in order in one thread (the job's current upload first, from its
        checkpoint; ``fresh``: every upload from its first line, as a rebuild does). ``fence``: the
        value the job's ingest fence holds for this run (`service.ingest`; None: the incarnation).
        ``incarnation``: the job's, as the caller read it (None: read here); the run lands nothing
        for another (`Ingestor.run`). ``facts``: the job as a submit that made it just now knows it
        (the first upload's run starts without reading it)."""
        if incarnation is None:
            incarnation = self._jobs.incarnation(job_id)
        if incarnation is None or not inputs:
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._ingest_all,
            args=(job_id, inputs, stop, incarnation, committed, fresh, fence, facts),
            name=f"ingest-{job_id}",
            daemon=True,
        )
        self._runs[job_id] = _IngestRun(thread, stop)
        thread.start()

    def stop(self, job_id: str) -> None:
        """Stop the job's ingestion and wait until it is over (before a cancel or delete answers)."""
        with self.lock:
            run = self._runs.get(job_id)
        if run is None:
            return
        run.stop.set()
        run.thread.join(timeout=JOIN_TIMEOUT_S)
        if run.thread.is_alive():
            # Its next chunk is refused all the same: the fence was dropped with the job's state.
            log.warning("job %s: ingestion did not stop within %.0f s", job_id, JOIN_TIMEOUT_S)

    def close(self) -> None:
        for run in list(self._runs.values()):
            run.stop.set()
        for run in list(self._runs.values()):
            run.thread.join(timeout=JOIN_TIMEOUT_S)

    def resume(self) -> None:
        """Resume every job Redis says is ingesting that no thread here ingests (left half done by
        a previous coordinator, or put back to ingesting by a Redis restored from a snapshot)."""
        for job_id in self._jobs.index.iter_ids():
            try:
                progress = self._jobs.progress(job_id)
            except JobNotFoundError:
                continue
            if progress.state is not JobState.INGESTING:
                continue
            with self.lock:
                if self.running(job_id):
                    continue
            inputs = self._remaining_inputs(job_id)
            incarnation = self._jobs.incarnation(job_id)
            if not inputs or incarnation is None:
                continue
            if incarnation and not self._has_manifest(job_id, incarnation):
                # Made (its upload named with the create) by a submit that has not written its
                # manifest yet, or never will (its coordinator died): not run until a resubmit
                # writes it, so that storage can always rebuild what runs.
                log.info("job %s: no manifest of its incarnation yet; not resumed", job_id)
                continue
            # This run takes the job's ingestion: one still running elsewhere lands nothing more
            # (a job made before incarnations has no fence to take).
            fence = self._jobs.take_ingest(job_id, incarnation) if incarnation else None
            if incarnation and fence is None:
                continue  # cancelled, failed or deleted meanwhile
            committed = read_committed(self._storage, job_id) if progress.rebuilt else None
            self.start(job_id, inputs, committed=committed, fence=fence, incarnation=incarnation)

    def _has_manifest(self, job_id: str, incarnation: str) -> bool:
        """Whether the job's stored manifest is that of ``incarnation`` (or of a job from before
        manifests named incarnations); False, said in the log, when it cannot be read (the other
        jobs resume all the same)."""
        try:
            manifest = self._storage.read_manifest(job_id)
        except DatagenError as exc:
            log.warning("job %s: cannot read its manifest; not resumed: %s", job_id, exc)
            return False
        return manifest is not None and str(manifest.get("incarnation") or incarnation) == incarnation

    def _ingest_all(
        self,
        job_id: str,
        inputs: list[str],
        stop: threading.Event,
        incarnation: str,
        committed: Committed | None,
        fresh: bool,
        fence: str | None,
        facts: IngestFacts | None,
    ) -> None:
        for n, name in enumerate(inputs):
            if n > 0 or fresh:
                try:
                    if fence is not None and self._jobs.ingest_fence(job_id) != fence:
                        log.info("job %s: ingestion stopped: another run took it over", job_id)
                        return
                    self._jobs.set_ingest_input(job_id, name, None, queue=inputs[n + 1 :])
                except (RedisError, DatagenError) as exc:
                    log.warning("job %s: cannot start ingesting %s; it resumes later: %s", job_id, name, exc)
                    return
            last = n == len(inputs) - 1
            ended = self._ingestor.run(
                job_id,
                name,
                stop,
                incarnation=incarnation,
                committed=committed,
                finish=last,
                fence=fence,
                facts=facts if n == 0 and not fresh else None,
            )
            if not ended:
                return

    def input_progress(self, job_id: str) -> dict[str, Any] | None:
        """How far this coordinator's ingestion of the job read its current input: rows of the total
        where the format knows it, bytes otherwise (`datagen.prompts.inputs.RowStream.progress`);
        None when no ingestion here reads it."""
        name = self._jobs.ingest_input(job_id)
        return self._ingestor.input_progress(job_id, name) if name else None

    def _remaining_inputs(self, job_id: str) -> list[str]:
        """The upload the job was ingesting (if still stored), then those queued after it."""
        current = self._current_input(job_id)
        queued = [n for n in self._jobs.ingest_queue(job_id) if self._storage.input_exists(job_id, n)]
        return ([current] if current is not None else []) + queued

    def _current_input(self, job_id: str) -> str | None:
        """The name of the upload the job was ingesting, if it is still stored."""
        name = self._jobs.ingest_input(job_id)
        if not name:
            return None
        return name if self._storage.input_exists(job_id, name) else None
