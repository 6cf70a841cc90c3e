"""Commands that steer the coordinator's jobs, queues and servers: ``pause``, ``resume``,
``cancel``, ``retry``, ``recover`` and ``delete``."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from datagen.errors import ConfigError
from datagen.settings import ClientSettings, load
from datagen_cli._app import app, console, examples
from datagen_cli._options import CoordinatorOption

QUEUE_NAMES = ("short", "long")


def _client(coordinator: str | None) -> Any:
    from datagen_cli.client import CoordinatorClient

    settings = load(ClientSettings, coordinator_url=coordinator)
    return CoordinatorClient(settings.coordinator_url, api_token=settings.api_token)


def _pause(
    paused: bool, target: str | None, server: str | None, job: str | None, coordinator: str | None
) -> None:
    if target is not None and target not in QUEUE_NAMES:
        target, job = None, job or target  # anything but a queue name is a job id
    if sum(x is not None for x in (target, server, job)) != 1:
        raise ConfigError("name one queue (short or long), one job (JOB or --job JOB) or one --server NAME")
    with _client(coordinator) as client:
        if target is not None:
            state = client.set_queue_paused(target, paused)
            word = "paused" if state["paused"] else "running"
            console.print(f"queue {state['name']}: {word}, {state['queued']} queued")
        elif server is not None:
            state = client.set_server_paused(server, paused)
            console.print(f"server {state['name']}: {state.get('state', 'resumed')}")
        else:
            state = client.set_job_paused(str(job), paused)
            word = "paused" if state["paused"] else state["state"]
            console.print(
                f"job {state['id']}: {word}, {state['queued']} queued, {state['in_flight']} in flight"
            )


@app.command(epilog=examples("datagen pause short", "datagen pause JOB_ID", "datagen pause --server gpu0"))
def pause(
    target: Annotated[
        str | None, typer.Argument(help="a queue (short or long) or a job id; or give --server or --job")
    ] = None,
    server: Annotated[
        str | None, typer.Option(help="pause this server (its name in `datagen status`) instead")
    ] = None,
    job: Annotated[str | None, typer.Option(help="pause this job (its prompts wait; others go on)")] = None,
    coordinator: CoordinatorOption = None,
) -> None:
    """Pause a queue, a job or a server.

    Dispatch from the queue or job, or to the server, stops within 2 s; requests in flight finish.
    `datagen resume` undoes it.
    """
    _pause(True, target, server, job, coordinator)


@app.command(epilog=examples("datagen resume short", "datagen resume JOB_ID", "datagen resume --server gpu0"))
def resume(
    target: Annotated[
        str | None, typer.Argument(help="a queue (short or long) or a job id; or give --server or --job")
    ] = None,
    server: Annotated[
        str | None, typer.Option(help="resume this server (its name in `datagen status`) instead")
    ] = None,
    job: Annotated[str | None, typer.Option(help="resume this job")] = None,
    coordinator: CoordinatorOption = None,
) -> None:
    """Undo a pause of a queue, a job or a server."""
    _pause(False, target, server, job, coordinator)


@app.command(epilog=examples("datagen cancel JOB_ID", "datagen cancel JOB_ID --abort-in-flight"))
def cancel(
    job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")],
    abort_in_flight: Annotated[
        bool,
        typer.Option(show_default=False, help="abort prompts in flight too, instead of letting them finish"),
    ] = False,
    coordinator: CoordinatorOption = None,
) -> None:
    """Cancel a job; its committed records are kept.

    Its queued prompts are dropped; those in flight finish (or are aborted: --abort-in-flight).
    """
    with _client(coordinator) as client:
        state = client.cancel(job_id, abort_in_flight=abort_in_flight)
    fate = "being aborted" if abort_in_flight else "left to finish"
    console.print(
        f"job {job_id}: cancelled; {state['dropped']} queued prompts dropped, "
        f"{state['in_flight']} in flight {fate}; {state['done']} done are kept"
    )


@app.command(epilog=examples("datagen retry JOB_ID", "datagen retry JOB_ID --reason WorkerLost"))
def retry(
    job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")],
    reason: Annotated[
        str | None,
        typer.Option(
            help="only prompts failed with this reason, e.g. WorkerLost (see GET "
            "/jobs/ID/errors?kind=failed; default: all)"
        ),
    ] = None,
    coordinator: CoordinatorOption = None,
) -> None:
    """Re-enqueue a job's failed prompts with fresh attempts."""
    with _client(coordinator) as client:
        state = client.retry(job_id, reason=reason)
    reasons = ", ".join(f"{k} {v}" for k, v in state["failed_by_reason"].items()) or "none"
    console.print(
        f"job {job_id}: {state['retried_now']} failed prompts re-enqueued (failed by reason: {reasons})"
    )
    if state["not_retryable"]:
        console.print(
            f"[yellow]{state['not_retryable']} failures are no longer in RQ's failed registry "
            "(older than DATAGEN_FAILURE_TTL_S) and cannot be retried"
        )


@app.command(epilog=examples("datagen recover JOB_ID"))
def recover(
    job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")],
    coordinator: CoordinatorOption = None,
) -> None:
    """Rebuild a job from storage after Redis lost it.

    Prompts with committed records count as done; the rest run again. The coordinator does this
    by itself when it sees Redis lose or roll back its data; use this for a job that Redis lost
    while no coordinator was watching.
    """
    with _client(coordinator) as client:
        state = client.recover(job_id)
    note = state["rebuilt"]
    unreadable = f", {note['unreadable_shards']} shards unreadable" if note["unreadable_shards"] else ""
    console.print(
        f"job {job_id}: rebuilt from storage: {note['committed']} prompts have committed records"
        f"{unreadable}; now {state['state']}"
    )


@app.command(epilog=examples("datagen delete JOB_ID", "datagen delete JOB_ID --files"))
def delete(
    job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")],
    files: Annotated[
        bool,
        typer.Option(
            show_default=False, help="also delete the job's stored inputs and records (default: keep them)"
        ),
    ] = False,
    coordinator: CoordinatorOption = None,
) -> None:
    """Delete a finished or cancelled job.

    Its state in Redis goes; with --files its stored inputs and records too.
    """
    with _client(coordinator) as client:
        result = client.delete(job_id, files=files)
    kept = "" if result["files_deleted"] else f"; its files are kept at {result['files']}"
    console.print(f"job {job_id}: deleted ({result['rq_jobs']} RQ jobs removed){kept}")
