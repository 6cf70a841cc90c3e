"""Operator controls over one job: cancel, pause, resume, retry failed prompts, delete.

Every operation is safe to repeat (a retried HTTP call or CLI command does no harm) and says
what it did in numbers. Records already committed are never touched, except by ``delete`` with
``files``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from redis import Redis

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.rq_jobs import RqJobs
from datagen.errors import JobNotFoundError, JobStateError, StorageError
from datagen.records.storage import Storage
from datagen.states import JobState, Priority

__all__ = ["ENDING_CANCELLED", "ENDING_DELETED", "JobControls"]

log = logging.getLogger(__name__)

LIVE = (JobState.INGESTING, JobState.RUNNING)
# The endings storage remembers of a job (`Storage.write_ending`), read by `service.rebuild`.
ENDING_DELETED = "deleted"
ENDING_CANCELLED = "cancelled"
# Failed prompts re-enqueued per transaction.
RETRY_CHUNK = 500


class JobControls:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        jobs: JobStore,
        storage: Storage,
        *,
        stop_ingest: Callable[[str], None] | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.storage = storage
        # Stops the job's ingestion and waits for it (the coordinator owns ingestion threads).
        self.stop_ingest: Callable[[str], None] = stop_ingest or (lambda job_id: None)
        self.dispatch = Dispatch(redis, keys)
        # The job's prompts in RQ's own keys: failed, waiting on RQ's queues, or all of them.
        self.rq_jobs = RqJobs(redis, keys, jobs)

    # Cancel ---------------------------------------------------------------------------------------
    def cancel(self, job_id: str, *, abort_in_flight: bool = False) -> dict[str, Any]:
        """Stop dispatching the job and drop its queued prompts; in-flight prompts finish (and
        their records are kept), or are aborted with ``abort_in_flight``."""
        state = self.jobs.state(job_id)
        if state in (JobState.COMPLETED, JobState.FAILED):
            raise JobStateError(f"job {job_id} is already {state.value}; there is nothing to cancel")
        # A job that completes at this very moment stays completed: only a live job moves. The
        # move drops the ingest fence, so no chunk of ingestion can land after it.
        moved = self.jobs.cancel(job_id)
        if not moved and self.jobs.state(job_id) is not JobState.CANCELLED:
            raise JobStateError(f"job {job_id} finished before it could be cancelled")
        self._mark_cancelled(job_id)
        self.stop_ingest(job_id)
        if abort_in_flight:
            self.redis.sadd(self.keys.aborting_jobs(), job_id)
        dropped = self.dispatch.withdraw(job_id) + self.rq_jobs.drop_queued(job_id)
        self.redis.srem(self.keys.paused_jobs(), job_id)
        progress = self.jobs.progress(job_id)
        log.info(
            "job %s cancelled: %d queued prompts dropped, %d in flight %s",
            job_id,
            dropped,
            progress.in_flight,
            "aborted" if abort_in_flight else "left to finish",
        )
        body = progress.to_json()
        body.update(dropped=dropped, in_flight=progress.in_flight, abort_in_flight=abort_in_flight)
        return body

    def _mark_cancelled(self, job_id: str) -> None:
        """Tell storage too: a job that Redis forgets later is rebuilt cancelled, not run again."""
        incarnation = self.jobs.incarnation(job_id)
        if incarnation is None:
            return
        try:
            self.storage.write_ending(job_id, ENDING_CANCELLED, incarnation)
        except StorageError as exc:
            log.warning("job %s: cancelled, but storage could not record it: %s", job_id, exc)

    # Pause and resume ------------------------------------------------------------------------------
    def pause(self, job_id: str) -> dict[str, Any]:
        state = self.jobs.state(job_id)
        if state not in LIVE:
            raise JobStateError(
                f"job {job_id} is {state.value}; only an ingesting or running job can be paused"
            )
        self.dispatch.pause(job_id)
        log.info("job %s paused: no new prompts are dispatched; in-flight ones finish", job_id)
        return self.jobs.progress(job_id).to_json()

    def resume(self, job_id: str) -> dict[str, Any]:
        self.jobs.state(job_id)  # 404 for an unknown job
        self.dispatch.resume(job_id)
        log.info("job %s resumed", job_id)
        return self.jobs.progress(job_id).to_json()

    # Retry -----------------------------------------------------------------------------------------
    def retry(self, job_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Put the job's failed prompts (those failed with ``reason``, or all) back in its backlog
        with fresh attempts."""
        progress = self.jobs.progress(job_id)
        if progress.state is JobState.CANCELLED:
            raise JobStateError(f"job {job_id} was cancelled; submit its dataset again under a new job id")
        # One retry per job at a time; each prompt moves only if this retry takes it out of the
        # failed registry (`JobStore.requeue_failed`), so even a retry on another coordinator cannot
        # double it.
        token = self.jobs.outcomes.acquire_retry(job_id)
        # Running again from the start, not once the failed prompts are read (seconds for many):
        # meanwhile a cancel stops the job, and the retry ends at its next slice (cancel wins).
        reopened = self.jobs.reopen(job_id)
        moved: list[str] = []
        try:
            failed = self.rq_jobs.failed(job_id)
            missing = max(0, progress.failed - len(failed))  # their failure TTL ran out
            reasons = Counter(f.reason for f in failed)
            chosen = [f for f in failed if reason is None or f.reason == reason]
            for start in range(0, len(chosen), RETRY_CHUNK):
                moved += self.rq_jobs.requeue(
                    job_id, chosen[start : start + RETRY_CHUNK], Priority(progress.priority)
                )
        except JobStateError:
            if self.jobs.state(job_id) is not JobState.CANCELLED:
                raise
            log.info("job %s: cancelled during its retry, which stops here", job_id)
        finally:
            if moved:
                self.jobs.outcomes.forget_failure_reports(job_id, moved)
            if reopened and not moved:
                self.jobs.complete_if_ended(job_id)  # nothing went back: completed again
            self.jobs.outcomes.release_retry(job_id, token)
        log.info("job %s: %d failed prompts re-enqueued (reason filter %s)", job_id, len(moved), reason)
        body = self.jobs.progress(job_id).to_json()
        body.update(
            retried_now=len(moved),
            reason=reason,
            failed_by_reason=dict(sorted(reasons.items())),
            not_retryable=missing,
        )
        return body

    # Delete ----------------------------------------------------------------------------------------
    def delete(self, job_id: str, *, files: bool = False) -> dict[str, Any]:
        """Remove the job's Redis keys and RQ jobs; with ``files``, its stored data as well."""
        try:
            state = self.jobs.state(job_id)
        except JobNotFoundError:
            if files and self.storage.job_exists(job_id):
                # Redis lost the job (or it was deleted without its files): only its files are left.
                return self._delete_files_only(job_id)
            raise
        if state in LIVE:
            raise JobStateError(
                f"job {job_id} is {state.value}; cancel it first (POST /jobs/{job_id}/cancel, "
                f"datagen cancel {job_id})"
            )
        # A cancelled job's ingestion may still be between chunks: it must be over before the keys
        # go, or it would write them again.
        self.stop_ingest(job_id)
        incarnation = self.jobs.incarnation(job_id)
        if not files and incarnation is not None and self.storage.job_exists(job_id):
            # Before the keys go: a Redis that loses its data later must not rebuild the job.
            self.storage.write_ending(job_id, ENDING_DELETED, incarnation)
        rq_jobs = self.forget(job_id)
        removed_files = self.storage.delete_job(job_id) if files else False
        log.info(
            "job %s deleted: %d RQ jobs, files %s", job_id, rq_jobs, "removed" if removed_files else "kept"
        )
        return {
            "id": job_id,
            "deleted": True,
            "rq_jobs": rq_jobs,
            "files_deleted": removed_files,
            "files": None if removed_files else self.storage.url(job_id),
        }

    def _delete_files_only(self, job_id: str) -> dict[str, Any]:
        removed = self.storage.delete_job(job_id)
        log.info("job %s: only its files were left; %s", job_id, "removed" if removed else "none found")
        return {"id": job_id, "deleted": True, "rq_jobs": 0, "files_deleted": removed, "files": None}

    def forget(self, job_id: str, *, keep_hash: bool = False) -> int:
        """Remove everything Redis holds of the job (its keys, RQ jobs, places in dispatch); its
        stored data stays. Returns how many RQ jobs went. Used by delete and by a rebuild, which
        keeps the hash (``keep_hash``) and replaces it in one step, so the job is never missing."""
        return self.rq_jobs.forget(job_id, keep_hash=keep_hash)
