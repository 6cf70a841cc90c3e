"""The coordinator's resources and operations, independent of HTTP routing: submit (checked by
`service.submit_check`, pinned by `service.manifests`), ingestion threads (`service.ingestions`),
recovery and the epoch watch, and what the routes read."""

from __future__ import annotations

import io
import itertools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, cast

from redis import Redis, RedisError

from datagen.control.dispatch import JobShare
from datagen.control.enqueue import EnqueueOptions
from datagen.control.epoch import EpochWatch
from datagen.control.jobs import Created, IngestFacts, JobProgress, JobStore
from datagen.control.keys import Keys
from datagen.control.leases import Leases
from datagen.control.rq_format import register_queues
from datagen.control.servers import live_servers
from datagen.errors import (
    DatagenError,
    InvalidRequestError,
    InvalidSpecError,
    JobStateError,
    PreflightError,
    UploadTooLargeError,
)
from datagen.prompts.inputs import (
    ColumnMap,
    InputFormat,
    Reference,
    count_rows,
    format_for_name,
    open_reference,
    open_upload,
    parse_format,
    resolve_reference,
)
from datagen.prompts.loaders import preload_libraries
from datagen.prompts.preflight import preflight_submit
from datagen.prompts.sources import redacted_url
from datagen.records.layout import validate_job_id
from datagen.records.schema import has_features
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState, RebuildReason
from service.admit import ArmRenderers, arm_renderers
from service.allowlist import check_allowed, check_dataset_url
from service.dryrun import DryRunInput, dry_run, reading
from service.fleetview import FleetView
from service.ingest import IngestOptions, Ingestor
from service.ingestions import IngestRuns
from service.lifecycle import JobControls
from service.manifests import check_no_leftovers, check_provenance, job_manifest, recipe_difference
from service.metrics import CoordinatorMetrics
from service.rebuild import Rebuilder
from service.render_pool import shared_pool
from service.submit_check import CheckedSubmit, SubmitCheck, pinned
from service.watch import RedisWatch

__all__ = ["Coordinator", "DatasetInput", "Submitted"]

log = logging.getLogger(__name__)

# What a worker names a stored features file (`workers.run.capture`): one path segment.
_FEATURE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,180}\.safetensors")

COPY_CHUNK_BYTES = 1024 * 1024
# A column name given with --messages-column / --id-column: at most this long.
MAX_COLUMN_CHARS = 200


@dataclass(frozen=True)
class Submitted:
    """What a submit did: the job's id, whether it made the job (False: it appends to one), and
    the job's progress to answer with."""

    job_id: str
    created: bool
    progress: JobProgress


@dataclass(frozen=True)
class DatasetInput:
    """What a submit ingests: an ``upload`` (its ``filename`` as sent) or a reference (``url``, read
    from storage, `service.allowlist.check_dataset_url`); ``format`` as given (None: told by the
    name, `datagen.prompts.inputs`) and the columns a Parquet or Arrow input maps."""

    upload: IO[bytes] | None = None
    filename: str | None = None
    url: str | None = None
    format: str | None = None
    columns: ColumnMap = field(default_factory=ColumnMap)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.namespace)
        self.jobs = JobStore(redis, self.keys)
        self.storage = Storage(settings.storage)
        self.fleet = FleetView(redis, self.keys)
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
            pool=shared_pool(settings.ingest_processes),
        )
        self.ingests = IngestRuns(self.jobs, self.storage, self.ingestor)
        self.controls = JobControls(redis, self.keys, self.jobs, self.storage, stop_ingest=self.ingests.stop)
        self.check_submit = SubmitCheck(settings, redis, self.keys)
        self.epoch = EpochWatch(redis, self.keys)
        self.leases = Leases(redis)
        self.rebuilder = Rebuilder(
            self.jobs,
            self.storage,
            self.controls,
            start_ingest=lambda job_id, inputs, committed, fence: self.ingests.start(
                job_id, inputs, committed=committed, fresh=True, fence=fence
            ),
            stop_ingest=self.ingests.stop,
            on_rebuilt=lambda reason: self.metrics.jobs_rebuilt.labels(reason.value).inc(),
            leases=self.leases,
        )
        # Redis's epoch, checked every second; a loss or rollback reconciled by one coordinator.
        self.watch = RedisWatch(
            self.epoch, self.leases, self.keys, self.jobs, self.rebuilder, resume=self._carry_on
        )

    # Lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Claim the storage for this namespace, rebuild the jobs Redis lost or holds behind its
        storage (`service.rebuild`), resume ingestions a previous coordinator left half done, and
        start watching Redis's epoch."""
        preload_libraries()  # before ingestion threads load tokenizers (`datagen.prompts.loaders`)
        self.ingestor.pool.start()  # the rendering processes import their libraries meanwhile
        self.storage.claim_namespace(self.settings.namespace)
        try:
            self.controls.dispatch.keep_weights()
        except RedisError as exc:  # down, or out of memory: the first read of shares keeps them
            log.warning("cannot set up the dispatch sets' weight sums yet: %s", exc)
        if self.watch.start_up():  # False: Redis had no data and storage failed; the watch goes on
            self._carry_on()
        self.watch.start()

    def _carry_on(self) -> None:
        """After the start's reconcile, or a rebuild after Redis lost or rolled back its data:
        the queues named for RQ's tools again, and the ingestions left half done resumed."""
        try:
            register_queues(self.redis, self.keys)
        except RedisError as exc:  # RQ's tools miss the queues until the next start; nothing else reads them
            log.warning("cannot name the queues in RQ's set of queues: %s", exc)
        self.ingests.resume()

    def close(self) -> None:
        self.watch.close()
        self.ingests.close()
        self.ingestor.pool.close()  # started again on next use, should another app of this process ingest

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

    # Jobs ---------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, dataset: DatasetInput, job_id: str | None) -> Submitted:
        """Check, store the upload (or pin the reference), create or extend the job, start
        ingesting. Returns the job's id, whether it was created, and its progress."""
        checked = self.check_submit(spec, job_id)
        fmt = self._dataset_format(dataset)
        reference = None
        if dataset.url is not None:
            # Listed and pinned before the lock: it reads storage, and the first prompt waits for it.
            reference = resolve_reference(check_dataset_url(dataset.url, self.settings), fmt)
            self._check_columns(dataset.columns, reference.format)
        with self.ingests.lock:
            created = self._create_or_append(checked, dataset, fmt, reference)
        # A job made now is answered as made (nothing of it has run); a resubmission's is read.
        progress = created.progress or self.jobs.progress(checked.job_id, with_arms=True)
        return Submitted(checked.job_id, created.made, progress)

    def _create_or_append(
        self,
        checked: CheckedSubmit,
        dataset: DatasetInput,
        fmt: InputFormat | None,
        reference: Reference | None,
    ) -> Created:
        job_id = checked.job_id
        if self.ingests.running(job_id):
            raise JobStateError(
                f"job {job_id} is still ingesting an earlier upload; wait until GET /jobs/{job_id} "
                "says running, then resubmit"
            )
        # Storage first: an id whose storage holds no manifest has no job with records, and almost
        # always no job at all (the rare other: a job whose create's manifest is not written yet,
        # or never was). Such a submit looks for a job of the id only when the create finds one,
        # so a new job costs Redis no read before it is made.
        stored = self.storage.read_manifest(job_id) is not None
        if stored:
            self._refuse_conflicts(checked, self.jobs.spec_and_state(job_id))
        identity = checked.renderer.identity()
        if reference is not None:
            input_name = self.storage.write_reference(job_id, reference, dataset.columns)
        else:
            input_name = self._store_upload(job_id, dataset, fmt)
        # The upload ingestion reads, written with the create (or the restart) in one command. An
        # ingestion resumed elsewhere before the manifest below is written would start a job that
        # storage cannot rebuild: `IngestRuns.resume` waits for the manifest of its incarnation.
        ingest = self.jobs.ingest_input_fields(input_name, checked.preflight.context_len)
        created = self.jobs.create_job(
            job_id,
            checked.spec,
            tokenizer_identity=f"{identity['tokenizer']}@sha256:{identity['tokenizer_sha256']}",
            stop_ids=checked.preflight.stop_ids,
            fields=ingest,
        )
        if not created.made:
            if not stored:
                try:
                    self._refuse_conflicts(checked, self.jobs.spec_and_state(job_id))
                except DatagenError:
                    self.storage.remove_input(job_id, input_name)  # a refused submit leaves nothing
                    raise
            self.jobs.restart_ingest(job_id, ingest)
        self._write_manifest(checked, identity, created)
        self.metrics.jobs_submitted.inc()
        # A job made now is what the create wrote: its ingestion starts without reading it back
        # (the spec parsed from what was stored, as a run that reads it has it).
        facts = (
            IngestFacts(
                incarnation=created.incarnation,
                spec=JobSpec.model_validate_json(checked.spec.model_dump_json()),
                context_len=checked.preflight.context_len,
                ingest_line=0,
                waiting_for_room=False,
            )
            if created.made
            else None
        )
        self.ingests.start(job_id, [input_name], incarnation=created.incarnation, facts=facts)
        return created

    @staticmethod
    def _dataset_format(dataset: DatasetInput) -> InputFormat | None:
        """The format given, checked against the form of the input; None: told by the name later."""
        if (dataset.upload is None) == (dataset.url is None):
            raise InvalidRequestError(
                "give the dataset as an upload (`dataset`) or by reference (`dataset_url`), one of the two"
            )
        for column in (dataset.columns.messages, dataset.columns.id):
            if column is not None and not 0 < len(column) <= MAX_COLUMN_CHARS:
                raise InvalidSpecError(f"a column name is 1 to {MAX_COLUMN_CHARS} characters")
        fmt = None if not dataset.format else parse_format(dataset.format)
        if dataset.upload is not None and fmt is not None and fmt.is_directory:
            raise InvalidSpecError(
                f"a {fmt.value} dataset is a directory and cannot be uploaded: "
                "give it by reference (dataset_url)"
            )
        return fmt

    @staticmethod
    def _check_columns(columns: ColumnMap, fmt: InputFormat) -> None:
        if columns.to_json() and fmt in (InputFormat.JSONL, InputFormat.JSONL_GZ, InputFormat.JSONL_ZST):
            raise InvalidSpecError(
                "--messages-column and --id-column map Parquet and Arrow columns; this dataset is "
                f"{fmt.value}: name its fields messages and id"
            )

    def _refuse_conflicts(
        self, checked: CheckedSubmit, found: tuple[JobSpec, JobState | None] | None
    ) -> None:
        """Refuse a submit to a job (``found``: its spec and state) cancelled, of another spec or
        made with other files; or, for a new job, one whose id still holds an earlier job's records."""
        job_id = checked.job_id
        existing = found[0] if found is not None else None
        if found is not None and found[1] is JobState.CANCELLED:
            raise JobStateError(f"job {job_id} was cancelled; submit under a new job id")
        before = pinned(existing, strict=False) if existing is not None else None
        if before is not None and before != checked.spec:
            detail = ""
            if before.recipe != checked.spec.recipe:
                then, now = (
                    None if r is None else r.model_dump(mode="json")
                    for r in (before.recipe, checked.spec.recipe)
                )
                detail = f" (its recipe differs: {recipe_difference(then, now)})"
            raise InvalidSpecError(
                f"job {job_id} exists with a different spec{detail}; submit with the same spec to append, "
                "or use a new job id"
            )
        identity = checked.renderer.identity()
        if existing is not None:
            check_provenance(self.storage, checked, identity)
        else:
            check_no_leftovers(self.storage, job_id)

    def _write_manifest(self, checked: CheckedSubmit, identity: dict[str, str], created: Created) -> None:
        """This incarnation's manifest (also when the first submit's answer was lost after its
        create); records of an earlier one (committed late, after its delete) stay out of every
        export. Storage rebuilds the job from it if Redis loses it. The incarnation and creation
        time are those the create found (one script: nothing to read again)."""
        job_id = checked.job_id
        incarnation = created.incarnation
        stored = self.storage.read_manifest(job_id) if not created.made else None
        if not created.made and stored is not None and str(stored.get("incarnation") or "") == incarnation:
            return
        manifest = job_manifest(checked, identity)
        manifest["incarnation"] = incarnation
        manifest["created_at_ms"] = created.created_at_ms
        # Redis's epoch now, after the create: a coordinator starting on a Redis whose epoch
        # (the same id) counts less lacks the job because Redis went back (`service.rebuild`).
        epoch_id, epoch_seq = self.epoch.current()
        manifest["epoch"] = {"id": epoch_id, "seq": epoch_seq}
        self.storage.write_manifest(job_id, manifest)

    def job_json(self, job_id: str) -> dict[str, Any]:
        """A job's progress, with its recipe's arms' counts, and its share of the fleet (None once
        it has nothing to dispatch)."""
        progress = self.jobs.progress(job_id, with_arms=True)
        # This job's share alone: O(1) in the jobs there are (`Dispatch.page_shares`).
        body = _with_share(progress.to_json(), self.controls.dispatch.page_shares([job_id]))
        # How far ingestion read its input: rows of the total where the format knows it, else bytes.
        body["input"] = self.ingests.input_progress(job_id) if progress.state is JobState.INGESTING else None
        return body

    def jobs_json(self, job_ids: list[str]) -> list[dict[str, Any]]:
        """Jobs' progress and shares, as :meth:`job_json`, for a page of jobs at once (a job
        deleted meanwhile is left out)."""
        found = self.jobs.progress_many(job_ids, with_arms=True)
        # The page's shares only: O(page), however many jobs there are.
        shares = self.controls.dispatch.page_shares([p.job_id for p in found if p is not None])
        return [_with_share(progress.to_json(), shares) for progress in found if progress is not None]

    def dry_run(self, spec: JobSpec, dataset: DatasetInput) -> dict[str, Any]:
        """What submitting ``dataset`` would make of its first rows (`service.dryrun`): the input
        checked and opened as submit checks it, and only a sample of it read."""
        check_allowed(spec, self.settings)
        renderers = arm_renderers(spec)  # the job's own renderer built now: a 400 for a bad one
        name = (dataset.filename or "the upload") if dataset.url is None else redacted_url(dataset.url)
        with reading(name, None, dataset.url):
            opened = self._dry_run_input(dataset, name)
        with opened.rows:
            return self._dry_run_preview(spec, renderers, opened)

    def _dry_run_input(self, dataset: DatasetInput, name: str) -> DryRunInput:
        """The input opened as ingestion opens it, after the submit's checks (format, columns, the
        allowlist)."""
        fmt = self._dataset_format(dataset)
        if dataset.url is not None:
            reference = resolve_reference(check_dataset_url(dataset.url, self.settings), fmt)
            self._check_columns(dataset.columns, reference.format)
            rows = open_reference(reference, dataset.columns, fresh=True)
            return DryRunInput(rows, name, dataset.url, count_rows=lambda: count_rows(reference))
        upload = dataset.upload
        assert upload is not None
        fmt = fmt or format_for_name(dataset.filename or "") or InputFormat.JSONL
        self._check_columns(dataset.columns, fmt)
        upload.seek(0, io.SEEK_END)
        size = upload.tell()  # the upload is on the coordinator already: its size costs no read
        upload.seek(0)
        return DryRunInput(
            open_upload(cast(BinaryIO, upload), fmt, dataset.columns, name=name, size=size), name
        )

    def _dry_run_preview(
        self, spec: JobSpec, renderers: ArmRenderers, dataset: DryRunInput
    ) -> dict[str, Any]:
        # A dry run shows what submit would refuse (arms that render alike among it), and still
        # renders the sample under every arm.
        try:
            preflight = preflight_submit(spec, renderers(None), live_servers(self.redis, self.keys))
        except PreflightError as exc:
            preview = dry_run(spec, renderers, dataset, spec.context_len)
            preview["preflight"] = {"refused": str(exc)}
            return preview
        preview = dry_run(spec, renderers, dataset, preflight.context_len)
        preview["preflight"] = {
            "refused": None,
            "context_len": preflight.context_len,
            "stop_ids": preflight.stop_ids,
            "vocab_size": preflight.vocab_size,
            "warnings": preflight.warnings,
        }
        return preview

    def _store_upload(self, job_id: str, dataset: DatasetInput, fmt: InputFormat | None) -> str:
        """Stream the upload into storage in blocks, named with its format (told by its file name
        when not given; JSONL when the name does not tell either, as before formats); returns the
        input's name (nothing is left of an upload over the limit)."""
        upload = dataset.upload
        assert upload is not None
        fmt = fmt or format_for_name(dataset.filename or "") or InputFormat.JSONL
        self._check_columns(dataset.columns, fmt)
        written = 0

        def blocks() -> Iterator[bytes]:
            nonlocal written
            while block := upload.read(COPY_CHUNK_BYTES):
                written += len(block)
                if written > self.settings.max_upload_bytes:
                    raise UploadTooLargeError(
                        f"dataset is larger than the limit of {self.settings.max_upload_bytes} bytes "
                        "(DATAGEN_MAX_UPLOAD_BYTES); split it and submit the parts with the same --job-id"
                    )
                yield block

        name = self.storage.write_input(
            job_id, blocks(), fmt, columns=dataset.columns, filename=dataset.filename
        )
        self.metrics.upload_bytes.inc(written)
        return name

    def rejected(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        self.jobs.progress(job_id)  # 404 for an unknown job
        # Merged over the ingestion chunks' objects, one row per upload and line.
        return list(itertools.islice(self.storage.iter_rejected(job_id), limit))

    def stopped(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """Conversations that ended before their last turn, and why (`workers.run.conversation`)."""
        self.jobs.progress(job_id)  # 404 for an unknown job
        return list(itertools.islice(self.storage.iter_stopped(job_id), limit))

    def capture_errors(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """Committed records of a job with features whose features were not stored, and why
        (`workers.run.capture`): too long for every capture server, or every try failed."""
        self.jobs.progress(job_id)  # 404 for an unknown job
        found: list[dict[str, Any]] = []
        for commit in self.storage.list_commits(job_id):
            parquet = self.storage.read_shard(job_id, commit)
            if not has_features(parquet.schema_arrow):
                continue  # written before features existed, or without them
            for batch in parquet.iter_batches(columns=["sample_id", "turn", "gen", "features_error"]):
                for row in batch.to_pylist():
                    if row["features_error"] is not None:
                        found.append({**row, "error": row.pop("features_error")})
                        if len(found) >= limit:
                            return found
        return found

    def consume_features(self, job_id: str, names: list[str]) -> dict[str, Any]:
        """Delete feature files a pull has written out and count them off the job's budget."""
        self.jobs.progress(job_id)  # 404 for an unknown job
        for name in names:
            if not _FEATURE_NAME.fullmatch(name):
                raise InvalidRequestError(
                    f"{name[:80]!r} is not a feature file's name: send the records' features_file values"
                )
        removed = freed = 0
        for name in names:
            size = self.storage.feature_size(job_id, name)
            if size is None:
                continue  # consumed before (a retried call), or never stored
            self.storage.remove_feature(job_id, name)
            removed += 1
            freed += size
        retained = (
            self.jobs.add_retained_features(job_id, -freed) if freed else self.jobs.retained_features(job_id)
        )
        return {"removed": removed, "bytes": freed, "retained_bytes": retained or 0}

    def flagged(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """Rows accepted with a warning (content that spells special tokens' text)."""
        self.jobs.progress(job_id)  # 404 for an unknown job
        return list(itertools.islice(self.storage.iter_flagged(job_id), limit))


def _with_share(body: dict[str, Any], shares: dict[str, JobShare]) -> dict[str, Any]:
    share = shares.get(body["id"])
    body["share"] = None if share is None else share.to_json()
    return body
