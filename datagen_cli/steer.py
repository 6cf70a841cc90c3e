"""Commands that watch and steer the coordinator's jobs, queues and servers:
``status``, ``pause``, ``resume``, ``cancel``, ``retry``, ``recover`` and ``delete``."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from datagen.errors import ConfigError
from datagen.settings import DEFAULT_COORDINATOR_URL, ClientSettings, load
from datagen.states import JobState, Priority
from datagen_cli._app import app, console, examples

# Jobs `datagen status` shows, newest first.
STATUS_JOBS = 100


def _client() -> Any:
    from datagen_cli.client import CoordinatorClient

    settings = load(ClientSettings)
    return CoordinatorClient(settings.coordinator_url, api_token=settings.api_token)


@app.command(
    epilog=examples(
        "datagen status",
        "datagen status --state running --state ingesting",
        "datagen status --priority high --limit 10",
    )
)
def status(
    coordinator: Annotated[
        str | None,
        typer.Option(help=f"coordinator URL (DATAGEN_COORDINATOR_URL, default {DEFAULT_COORDINATOR_URL})"),
    ] = None,
    state: Annotated[
        list[JobState] | None, typer.Option(help="only jobs in this state (repeat for more)")
    ] = None,
    priority: Annotated[
        list[Priority] | None, typer.Option(help="only jobs at this priority (repeat for more)")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="show at most this many jobs, newest first")] = (
        STATUS_JOBS
    ),
) -> None:
    """Show jobs, queues, servers and Redis's memory.

    Redis's memory problems are shown in red: an operator must act on them.
    """
    from datagen_cli.client import CoordinatorClient

    settings = load(ClientSettings, coordinator_url=coordinator)
    states = [s.value for s in state or ()]
    priorities = [p.value for p in priority or ()]
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        jobs, more, total = _select_jobs(client, limit, states, priorities)
        queues, servers = client.queues(), client.servers()
        redis_memory = client.health().get("redis")
    out = Console()
    _print_redis(out, redis_memory)
    which = " ".join(
        part
        for part in ("/".join(states), "/".join(priorities) and f"at {'/'.join(priorities)} priority")
        if part
    )
    if more:
        out.print(
            f"the newest {len(jobs)} {which + ' ' if which else ''}jobs of {total} "
            "(--limit shows more; GET /jobs pages through all)",
            markup=False,
        )
    jobs_table = Table(
        "job",
        "state",
        "priority",
        "share now/target",
        "total",
        "done",
        "failed",
        "rejected",
        "in flight",
        "tok/s",
        "ETA s",
        "1st record s",
        "tail s",
        title="jobs",
    )
    for job in jobs:
        eta = "" if job["eta_s"] is None else f"{job['eta_s']:.0f}"
        cells = [job[k] for k in ("total", "done", "failed", "rejected", "in_flight")]
        shown_state = job["state"] + (" (paused)" if job.get("paused") else "")
        timing = [_seconds(job.get("time_to_first_record_s")), _seconds(job.get("tail_s"))]
        jobs_table.add_row(
            job["id"],
            shown_state,
            _priority(job),
            _share(job),
            *map(str, cells),
            f"{job['tokens_per_s']:.0f}",
            eta,
            *timing,
        )
    queues_table = Table("queue", "paused", "queued", "started", "failed", title="queues")
    for queue in queues:
        queues_table.add_row(
            queue["name"],
            "yes" if queue["paused"] else "",
            *(str(queue[k]) for k in ("queued", "started", "failed")),
        )
    servers_table = Table(
        "server", "state", "in flight s/l", "limits s/l", "target", "KV usage", "waiting", title="servers"
    )
    for server in servers:
        kv = server.get("kv") or {}
        usage = kv.get("token_usage")
        servers_table.add_row(
            server["name"],
            server["state"],
            "{short}/{long}".format(**server["in_flight"]),
            "{short}/{long}".format(**server["limits"]),
            "" if server["target"] is None else str(server["target"]),
            "" if usage is None else f"{usage:.0%}",
            "" if not kv else f"{kv.get('num_queue_reqs', 0):.0f}",
        )
    for table in (jobs_table, queues_table, servers_table, _workers_table(servers)):
        out.print(table)
    for job in jobs:
        _print_job_notes(out, job)


def _select_jobs(
    client: Any, limit: int, states: list[str], priorities: list[str]
) -> tuple[list[dict[str, Any]], bool, int]:
    """Up to ``limit`` jobs matching the filters, newest first, and whether there are more. A
    filtered page may come back short with a cursor (the coordinator bounds its scan per call)."""
    jobs: list[dict[str, Any]] = []
    cursor: str | None = None
    total = 0
    while len(jobs) < limit:
        page = client.jobs_page(limit - len(jobs), cursor, states=states, priorities=priorities)
        jobs += page["jobs"]
        total, cursor = page.get("count", len(jobs)), page.get("next")
        if cursor is None:
            return jobs, False, total
    return jobs, True, total


def _print_job_notes(out: Console, job: dict[str, Any]) -> None:
    """What the jobs table cannot show: a storage outage now, and a rebuild from storage (when,
    why, what it kept)."""
    if job.get("storage_error"):
        out.print(f"job {job['id']}: storage error: {job['storage_error']}", style="red", markup=False)
    rebuilt = job.get("rebuilt")
    if rebuilt:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rebuilt["at_ms"] / 1000))
        unreadable = rebuilt.get("unreadable_shards") or 0
        out.print(
            f"job {job['id']}: rebuilt from storage at {at} ({rebuilt['reason']}): "
            f"{rebuilt['committed']} prompts kept their committed records, the other "
            f"{max(0, job['total'] - rebuilt['committed'])} run again"
            + (
                f"; {unreadable} unreadable shards left out (datagen verify {job['id']})"
                if unreadable
                else ""
            ),
            style="yellow",
            markup=False,
            highlight=False,
        )


def _print_redis(out: Console, memory: dict[str, Any] | None) -> None:
    """One line of Redis's memory, then each problem an operator must fix (out of memory, an
    evicting policy) in red. Nothing from a coordinator that does not say (older, or no INFO)."""
    if not memory:
        return
    used, limit = memory["used_memory_bytes"] / MIB, memory["maxmemory_bytes"] / MIB
    share = (
        f"{used:.1f} MiB of maxmemory {limit:.1f} MiB ({used / limit:.0%})" if limit else f"{used:.1f} MiB"
    )
    limits = f", maxmemory-policy {memory['maxmemory_policy']}" if limit else ", no maxmemory"
    out.print(f"redis: {share} used{limits}", markup=False, highlight=False)
    for problem in memory.get("problems", []):
        out.print(problem, style="bold red", markup=False, highlight=False)


def _workers_table(servers: list[dict[str, Any]]) -> Table:
    """The live workers, the servers each uses and where Prometheus scrapes it."""
    workers: dict[str, tuple[list[str], str]] = {}
    for server in servers:
        for view in server.get("workers", []):
            if view.get("stale"):
                continue
            names, _ = workers.setdefault(view["worker"], ([], view.get("metrics") or "off"))
            names.append(server["name"])
    table = Table("worker", "servers", "metrics", title="workers")
    for name, (names, metrics) in sorted(workers.items()):
        table.add_row(name, ", ".join(names), metrics)
    return table


QUEUE_NAMES = ("short", "long")
MIB = 1024 * 1024


def _priority(job: dict[str, Any]) -> str:
    weight = job.get("weight", 1.0)
    return f"{job.get('priority', 'normal')}" + ("" if weight == 1.0 else f" ×{weight:g}")


def _share(job: dict[str, Any]) -> str:
    share = job.get("share")
    return "" if not share else f"{share['recent']:.0%} / {share['target']:.0%}"


def _seconds(value: float | None) -> str:
    """A time to first record or a tail: blank until the job has one (an older coordinator: never)."""
    return "" if value is None else f"{value:.1f}"


def _pause(paused: bool, target: str | None, server: str | None, job: str | None) -> None:
    if target is not None and target not in QUEUE_NAMES:
        target, job = None, job or target  # anything but a queue name is a job id
    if sum(x is not None for x in (target, server, job)) != 1:
        raise ConfigError("name one queue (short or long), one job (JOB or --job JOB) or one --server NAME")
    with _client() as client:
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
) -> None:
    """Pause a queue, a job or a server.

    Dispatch from the queue or job, or to the server, stops within 2 s; requests in flight finish.
    `datagen resume` undoes it.
    """
    _pause(True, target, server, job)


@app.command(epilog=examples("datagen resume short", "datagen resume JOB_ID", "datagen resume --server gpu0"))
def resume(
    target: Annotated[
        str | None, typer.Argument(help="a queue (short or long) or a job id; or give --server or --job")
    ] = None,
    server: Annotated[
        str | None, typer.Option(help="resume this server (its name in `datagen status`) instead")
    ] = None,
    job: Annotated[str | None, typer.Option(help="resume this job")] = None,
) -> None:
    """Undo a pause of a queue, a job or a server."""
    _pause(False, target, server, job)


@app.command(epilog=examples("datagen cancel JOB_ID", "datagen cancel JOB_ID --abort-in-flight"))
def cancel(
    job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")],
    abort_in_flight: Annotated[
        bool,
        typer.Option(show_default=False, help="abort prompts in flight too, instead of letting them finish"),
    ] = False,
) -> None:
    """Cancel a job; its committed records are kept.

    Its queued prompts are dropped; those in flight finish (or are aborted: --abort-in-flight).
    """
    with _client() as client:
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
) -> None:
    """Re-enqueue a job's failed prompts with fresh attempts."""
    with _client() as client:
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
def recover(job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")]) -> None:
    """Rebuild a job from storage after Redis lost it.

    Prompts with committed records count as done; the rest run again. The coordinator does this
    by itself when it sees Redis lose or roll back its data; use this for a job that Redis lost
    while no coordinator was watching.
    """
    with _client() as client:
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
) -> None:
    """Delete a finished or cancelled job.

    Its state in Redis goes; with --files its stored inputs and records too.
    """
    with _client() as client:
        result = client.delete(job_id, files=files)
    kept = "" if result["files_deleted"] else f"; its files are kept at {result['files']}"
    console.print(f"job {job_id}: deleted ({result['rq_jobs']} RQ jobs removed){kept}")
