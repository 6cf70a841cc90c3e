"""``submit --wait`` (and the demo): a progress bar until a job ends, and the exit code it ends with."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from datagen.states import JobState

if TYPE_CHECKING:
    from datagen.client import CoordinatorClient

__all__ = ["EXIT_ALL_DONE", "EXIT_JOB_FAILED", "EXIT_SOME_FAILED", "wait_for_job"]

EXIT_ALL_DONE = 0
EXIT_SOME_FAILED = 1
EXIT_JOB_FAILED = 2
WAIT_POLL_S = 1.0


def wait_for_job(client: CoordinatorClient, job_id: str, console: Console) -> int:
    """Show a progress bar until the job ends; return the exit code of ``submit --wait``."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"job {job_id[:12]}", total=None, detail="")
        while True:
            job = client.job(job_id)
            total = job["total"] if job["state"] != JobState.INGESTING else None
            detail = (
                f"{job['state']} · failed {job['failed']} · rejected {job['rejected']} · "
                f"{job['tokens_per_s']:.0f} tok/s"
                + (f" · ETA {job['eta_s']:.0f}s" if job.get("eta_s") else "")
            )
            finished = job["done"] + job["failed"] + job.get("cancelled", 0)
            progress.update(task, completed=finished, total=total, detail=detail)
            if job["state"] in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
                break
            time.sleep(WAIT_POLL_S)
    if job["state"] != JobState.COMPLETED:
        console.print(f"[red]job {job_id} {job['state']}: {job.get('error') or ''}")
        return EXIT_JOB_FAILED
    if job["failed"]:
        console.print(f"[yellow]{job['failed']} prompts failed; see GET /jobs/{job_id}/errors?kind=failed")
        return EXIT_SOME_FAILED
    return EXIT_ALL_DONE
