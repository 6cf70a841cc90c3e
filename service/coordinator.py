"""The coordinator's resources and operations, independent of HTTP routing."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from redis import Redis, RedisError

from datagen.control.dispatch import JobShare
from datagen.control.enqueue import EnqueueOptions
from datagen.control.epoch import EpochWatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.leases import Leases
from datagen.control.servers import live_servers
from datagen.errors import (
    DatagenError,
    InvalidSpecError,
    JobNotFoundError,
    JobStateError,
    PreflightError,
    UploadTooLargeError,
)
from datagen.hygiene.decontam import BenchmarkSet, sets_sha256
from datagen.hygiene.screen import check_benchmarks
from datagen.prompts.preflight import PreflightResult, preflight_submit
from datagen.prompts.sources import SourceKind, resolve_source
from datagen.prompts.tokenization import preload_libraries, renderer_for
from datagen.records.storage import Storage, validate_job_id
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState, RebuildReason
from service.allowlist import check_allowed
from service.committed import Committed, read_committed
from service.dryrun import dry_run
from service.fleetview import FleetView
from service.ingest import IngestOptions, Ingestor
from service.lifecycle import JobControls
from service.metrics import CoordinatorMetrics
from service.rebuild import Rebuilder
from service.watch import RedisWatch

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 1024 * 1024
# What a job's manifest pins about how prompts are rendered and judged (identity field -> what it
# is); the decontamination sets' digest is `datagen.hygiene.decontam.sets_sha256`, under "decontaminate".
PINNED_IDENTITY = {
    "tokenizer_sha256": "tokenizer (files)",
    "chat_template_sha256": "chat template",
    "chat_template_kwargs": "chat_template_kwargs",
    "decontaminate_sha256": "decontamination set content",
}
JOIN_TIMEOUT_S = 10.0


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.namespace)
        self.jobs = JobStore(redis, self.keys)
        self.storage = Storage(settings.storage)
        self.fleet = FleetView(redis, self.keys)
        self.controls = JobControls(redis, self.keys, self.jobs, self.storage, stop_ingest=self.stop_ingest)
        self.metrics = CoordinatorMetrics(fleet=self.fleet, jobs=self.jobs)
        self.ingestor = Ingestor(
            redis,
            self.keys,
            self.jobs,
            self.storage,
            IngestOptions(
                chunk=settings.enqueue_chunk,
                enqueue=EnqueueOptions(
                    result_ttl_s=settings.result_ttl_s,
                    failure_ttl_s=settings.failure_ttl_s,
                    max_worker_losses=settings.max_worker_losses,
                ),
                max_queued_per_class=settings.max_queued_per_class,
            ),
            metrics=self.metrics,
        )
        self._ingests: dict[str, _IngestRun] = {}
        self._lock = threading.Lock()
        self.epoch = EpochWatch(redis, self.keys)
        self.leases = Leases(redis)
        self.rebuilder = Rebuilder(
            self.jobs,
            self.storage,
            self.controls,
            start_ingest=lambda job_id, inputs, committed, fence: self._start_ingest(
                job_id, inputs, committed=committed, fresh=True, fence=fence
            ),
            stop_ingest=self.stop_ingest,
            on_rebuilt=lambda reason: self.metrics.jobs_rebuilt.labels(reason.value).inc(),
            leases=self.leases,
        )
        # Redis's epoch, checked every second; a loss or rollback reconciled by one coordinator.
        self.watch = RedisWatch(
            self.epoch, self.leases, self.keys, self.jobs, self.rebuilder, resume=self._resume_ingesting
        )

    # Lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Claim the storage for this namespace, rebuild the jobs Redis lost or holds behind its
        storage (`service.rebuild`), resume ingestions a previous coordinator left half done, and
        start watching Redis's epoch."""
        preload_libraries()  # before ingestion threads load tokenizers (`datagen.prompts.loaders`)
        self.storage.claim_namespace(self.settings.namespace)
        if self.watch.start_up():  # False: Redis had no data and storage failed; the watch goes on
            self._resume_ingesting()
        self.watch.start()

    def close(self) -> None:
        self.watch.close()
        for run in list(self._ingests.values()):
            run.stop.set()
        for run in list(self._ingests.values()):
            run.thread.join(timeout=JOIN_TIMEOUT_S)

    def _resume_ingesting(self) -> None:
        """Resume every job Redis says is ingesting that no thread here ingests (left half done by
        a previous coordinator, or put back to ingesting by a Redis restored from a snapshot)."""
        for job_id in self.jobs.index.iter_ids():
            try:
                progress = self.jobs.progress(job_id)
            except JobNotFoundError:
                continue
            if progress.state is not JobState.INGESTING:
                continue
            with self._lock:
                run = self._ingests.get(job_id)
                if run is not None and run.thread.is_alive():
                    continue
            inputs = self._remaining_inputs(job_id)
            incarnation = self.jobs.incarnation(job_id)
            if not inputs or incarnation is None:
                continue
            # This run takes the job's ingestion: one still running elsewhere lands nothing more
            # (a job made before incarnations has no fence to take).
            fence = self.jobs.take_ingest(job_id, incarnation) if incarnation else None
            if incarnation and fence is None:
                continue  # cancelled, failed or deleted meanwhile
            committed = read_committed(self.storage, job_id) if progress.rebuilt else None
            self._start_ingest(job_id, inputs, committed=committed, fence=fence)

    def recover(self, job_id: str) -> dict[str, Any]:
        """Rebuild one job from storage on an operator's request (`datagen recover`). A rebuild of
        the job already running (on any coordinator) is joined: its result is the answer
        (``joined``), and the job is rebuilt once."""
        validate_job_id(job_id)
        note, joined = self.rebuilder.rebuild(job_id, "asked for (datagen recover)", RebuildReason.RECOVER)
        body = self.job_json(job_id)
        body["rebuilt"] = note
        body["joined"] = joined
        return body

    def stop_ingest(self, job_id: str) -> None:
        """Stop the job's ingestion and wait until it is over (before a cancel or delete answers)."""
        with self._lock:
            run = self._ingests.get(job_id)
        if run is None:
            return
        run.stop.set()
        run.thread.join(timeout=JOIN_TIMEOUT_S)
        if run.thread.is_alive():
            # Its next chunk is refused all the same: the fence was dropped with the job's state.
            log.warning("job %s: ingestion did not stop within %.0f s", job_id, JOIN_TIMEOUT_S)

    # Jobs ---------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, dataset: IO[bytes], job_id: str | None) -> tuple[str, bool]:
        """Validate, store the upload, create or extend the job, start ingesting. Returns (id, created)."""
        job_id = validate_job_id(job_id) if job_id else uuid.uuid4().hex
        check_allowed(spec, self.settings)
        spec = _pinned(spec)
        renderer = renderer_for(spec)  # fails fast with a 400 on a bad tokenizer or template
        sets = check_benchmarks(spec)  # 400 on a set over the limits or unreadable; parsed once
        servers = live_servers(self.redis, self.keys)
        preflight = preflight_submit(spec, renderer, servers)  # 409 with what to fix
        for warning in preflight.warnings:
            log.warning("job %s: %s", job_id, warning)
        with self._lock:
            running = self._ingests.get(job_id)
            if running is not None and running.thread.is_alive():
                raise JobStateError(
                    f"job {job_id} is still ingesting an earlier upload; wait until GET /jobs/{job_id} "
                    "says running, then resubmit"
                )
            existing = self._existing_spec(job_id)
            if existing is not None and self.jobs.progress(job_id).state is JobState.CANCELLED:
                raise JobStateError(f"job {job_id} was cancelled; submit under a new job id")
            if existing is not None and _pinned(existing, strict=False) != spec:
                raise InvalidSpecError(
                    f"job {job_id} exists with a different spec; submit with the same spec to append, "
                    "or use a new job id"
                )
            identity = renderer.identity()
            if existing is not None:
                pinned = {**identity, "decontaminate_sha256": sets_sha256(sets)}
                self._check_provenance(job_id, pinned, servers)
            else:
                self._check_no_leftovers(job_id)
            input_name = self._store_upload(job_id, dataset)
            created = self.jobs.create(
                job_id,
                spec,
                tokenizer_identity=f"{identity['tokenizer']}@sha256:{identity['tokenizer_sha256']}",
                stop_ids=preflight.stop_ids,
            )
            if not created:
                self.jobs.restart_ingest(job_id)
            incarnation = self.jobs.incarnation(job_id) or ""
            stored = self.storage.read_manifest(job_id) if not created else None
            if created or stored is None or str(stored.get("incarnation") or "") != incarnation:
                # This incarnation's manifest (also when the first submit's answer was lost after
                # its create); records of an earlier one (committed late, after its delete) stay
                # out of every export. Storage rebuilds the job from it if Redis loses it.
                manifest = self._manifest(job_id, spec, identity, sets, servers, preflight)
                manifest["incarnation"] = incarnation
                manifest["created_at_ms"] = self.jobs.progress(job_id).created_at_ms
                # Redis's epoch now, after the create: a coordinator starting on a Redis whose epoch
                # (the same id) counts less lacks the job because Redis went back (`service.rebuild`).
                epoch_id, epoch_seq = self.epoch.current()
                manifest["epoch"] = {"id": epoch_id, "seq": epoch_seq}
                self.storage.write_manifest(job_id, manifest)
            self.jobs.set_ingest_input(job_id, input_name, preflight.context_len)
            self.metrics.jobs_submitted.inc()
            self._start_ingest(job_id, [input_name])
        return job_id, created

    def job_json(self, job_id: str) -> dict[str, Any]:
        """A job's progress with its share of the fleet (None once it has nothing to dispatch)."""
        return _with_share(self.jobs.progress(job_id).to_json(), self.controls.dispatch.shares())

    def jobs_json(self, job_ids: list[str]) -> list[dict[str, Any]]:
        """Jobs' progress and shares, as :meth:`job_json`, for a page of jobs at once (a job
        deleted meanwhile is left out)."""
        shares = self.controls.dispatch.shares()
        found = self.jobs.progress_many(job_ids)
        return [_with_share(progress.to_json(), shares) for progress in found if progress is not None]

    def dry_run(self, spec: JobSpec, dataset: IO[bytes]) -> dict[str, Any]:
        check_allowed(spec, self.settings)
        renderer = renderer_for(spec)
        # A dry run shows what submit would refuse, and still renders the sample.
        try:
            preflight = preflight_submit(spec, renderer, live_servers(self.redis, self.keys))
        except PreflightError as exc:
            preview = dry_run(spec, renderer, dataset, spec.context_len)
            preview["preflight"] = {"refused": str(exc)}
            return preview
        preview = dry_run(spec, renderer, dataset, preflight.context_len)
        preview["preflight"] = {
            "refused": None,
            "context_len": preflight.context_len,
            "stop_ids": preflight.stop_ids,
            "vocab_size": preflight.vocab_size,
            "warnings": preflight.warnings,
        }
        return preview

    def _check_provenance(
        self, job_id: str, identity: dict[str, str], servers: dict[str, dict[str, Any]]
    ) -> None:
        """Refuse to add prompts to a job made with another tokenizer, template, model or
        decontamination set content."""
        manifest = self.storage.read_manifest(job_id)
        if manifest is None:
            return
        pinned = dict(manifest.get("tokenizer", {}))
        if "sha256" in manifest.get("decontaminate", {}):  # manifests before issue 28 pin no sets
            pinned["decontaminate_sha256"] = manifest["decontaminate"]["sha256"]
        for field, what in PINNED_IDENTITY.items():
            if field in pinned and pinned[field] != identity.get(field):
                raise InvalidSpecError(
                    f"job {job_id} was generated with another {what} ({field} {pinned[field][:16]}… in its "
                    f"manifest, {str(identity.get(field))[:16]}… now); its records would not be comparable. "
                    "Use a new job id, or restore the original files"
                )
        models_then = {
            str(s["model_path"]) for s in manifest.get("servers", {}).values() if s.get("model_path")
        }
        models_now = {str(s["model_path"]) for s in servers.values() if s.get("model_path")}
        if models_then and models_now and models_then != models_now:
            raise InvalidSpecError(
                f"job {job_id} was generated by model {sorted(models_then)} but the servers now run "
                f"{sorted(models_now)}; use a new job id for another model"
            )

    def _check_no_leftovers(self, job_id: str) -> None:
        """A new job must not adopt the stored records of an earlier job of the same id (deleted
        without its files): its exports would mix them in."""
        manifest = self.storage.read_manifest(job_id)
        if manifest is not None and self.storage.list_commits(job_id):
            raise JobStateError(
                f"job id {job_id} still has the records of an earlier, deleted job at "
                f"{self.storage.url(job_id)}; export them and remove them (datagen delete {job_id} --files), "
                "or use a new job id"
            )

    def _existing_spec(self, job_id: str) -> JobSpec | None:
        try:
            return self.jobs.spec(job_id)
        except JobNotFoundError:
            return None

    def _store_upload(self, job_id: str, dataset: IO[bytes]) -> str:
        """Stream the upload into storage in blocks; returns the input's name (nothing is left of
        an upload over the limit)."""
        written = 0

        def blocks() -> Iterator[bytes]:
            nonlocal written
            while block := dataset.read(COPY_CHUNK_BYTES):
                written += len(block)
                if written > self.settings.max_upload_bytes:
                    raise UploadTooLargeError(
                        f"dataset is larger than the limit of {self.settings.max_upload_bytes} bytes "
                        "(DATAGEN_MAX_UPLOAD_BYTES); split it and submit the parts with the same --job-id"
                    )
                yield block

        name = self.storage.write_input(job_id, blocks())
        self.metrics.upload_bytes.inc(written)
        return name

    @staticmethod
    def _manifest(
        job_id: str,
        spec: JobSpec,
        identity: dict[str, str],
        sets: list[BenchmarkSet],
        servers: dict[str, dict[str, Any]],
        preflight: PreflightResult,
    ) -> dict[str, Any]:
        return {
            "job_id": job_id,
            "spec": json.loads(spec.model_dump_json()),
            "tokenizer": identity,
            "decontaminate": {"sha256": sets_sha256(sets), "sets": [s.to_json() for s in sets]},
            "servers": servers,
            "preflight": {
                "context_len": preflight.context_len,
                "stop_ids": preflight.stop_ids,
                "vocab_size": preflight.vocab_size,
            },
        }

    def _current_input(self, job_id: str) -> str | None:
        """The name of the upload the job was ingesting, if it is still stored."""
        name = self.jobs.ingest_input(job_id)
        if not name:
            return None
        return name if self.storage.input_exists(job_id, name) else None

    def _start_ingest(
        self,
        job_id: str,
        inputs: list[str],
        *,
        committed: Committed | None = None,
        fresh: bool = False,
        fence: str | None = None,
    ) -> None:
        """Ingest ``inputs`` in order in one thread (the job's current upload first, from its
        checkpoint; ``fresh``: every upload from its first line, as a rebuild does). ``fence``: the
        value the job's ingest fence holds for this run (`service.ingest`; None: the incarnation)."""
        incarnation = self.jobs.incarnation(job_id)
        if incarnation is None or not inputs:
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._ingest_all,
            args=(job_id, inputs, stop, incarnation, committed, fresh, fence),
            name=f"ingest-{job_id}",
            daemon=True,
        )
        self._ingests[job_id] = _IngestRun(thread, stop)
        thread.start()

    def _ingest_all(
        self,
        job_id: str,
        inputs: list[str],
        stop: threading.Event,
        incarnation: str,
        committed: Committed | None,
        fresh: bool,
        fence: str | None,
    ) -> None:
        for n, name in enumerate(inputs):
            if n > 0 or fresh:
                try:
                    if fence is not None and self.jobs.ingest_fence(job_id) != fence:
                        log.info("job %s: ingestion stopped: another run took it over", job_id)
                        return
                    self.jobs.set_ingest_input(job_id, name, None, queue=inputs[n + 1 :])
                except (RedisError, DatagenError) as exc:
                    log.warning("job %s: cannot start ingesting %s; it resumes later: %s", job_id, name, exc)
                    return
            last = n == len(inputs) - 1
            ended = self.ingestor.run(
                job_id, name, stop, incarnation=incarnation, committed=committed, finish=last, fence=fence
            )
            if not ended:
                return

    def _remaining_inputs(self, job_id: str) -> list[str]:
        """The upload the job was ingesting (if still stored), then those queued after it."""
        current = self._current_input(job_id)
        queued = [n for n in self.jobs.ingest_queue(job_id) if self.storage.input_exists(job_id, n)]
        return ([current] if current is not None else []) + queued

    def rejected(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        self.jobs.progress(job_id)  # 404 for an unknown job
        # Merged over the ingestion chunks' objects, one row per upload and line.
        return list(itertools.islice(self.storage.iter_rejected(job_id), limit))

    def stopped(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """Conversations that ended before their last turn, and why (`workers.run.conversation`)."""
        self.jobs.progress(job_id)  # 404 for an unknown job
        return list(itertools.islice(self.storage.iter_stopped(job_id), limit))

    def flagged(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """Rows accepted with a warning (content that spells special tokens' text)."""
        self.jobs.progress(job_id)  # 404 for an unknown job
        return list(itertools.islice(self.storage.iter_flagged(job_id), limit))


def _pinned(spec: JobSpec, *, strict: bool = True) -> JobSpec:
    """The spec with its tokenizer and template names resolved as the allowlist check resolved them
    (an absolute real path, or the hub id), so that a worker on another host, or with another
    working directory or ``$HOME``, loads exactly what was checked. ``strict=False`` keeps a name
    that no longer resolves (an older job's, compared with a resubmission)."""
    try:
        tokenizer = resolve_source(spec.tokenizer, SourceKind.TOKENIZER).location
        template = spec.chat_template
        if template is not None:
            template = resolve_source(template, SourceKind.TEMPLATE).location
    except InvalidSpecError:
        if strict:
            raise
        return spec
    return spec.model_copy(update={"tokenizer": tokenizer, "chat_template": template})


@dataclass(frozen=True)
class _IngestRun:
    thread: threading.Thread
    stop: threading.Event


def _with_share(body: dict[str, Any], shares: dict[str, JobShare]) -> dict[str, Any]:
    share = shares.get(body["id"])
    body["share"] = None if share is None else share.to_json()
    return body
