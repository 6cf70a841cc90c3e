"""Commands that watch the coordinator's jobs: ``status`` (jobs, queues, servers, workers and
Redis's memory, as tables that fit the terminal) and ``wait`` (one job's progress until it ends)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from datagen.settings import ClientSettings, load
from datagen.states import JobState, Priority
from datagen_cli._app import app, console, examples
from datagen_cli._options import CoordinatorOption, ProgressEverySOption
from datagen_cli._tables import ALWAYS, Column, fitted_table, widen

# Jobs `datagen status` shows, newest first.
STATUS_JOBS = 100
MIB = 1024 * 1024

# The jobs table's columns; the lowest `keep` drops out first where the terminal is narrow.
JOB_COLUMNS = (
    Column("job", ALWAYS),
    Column("state", ALWAYS),
    Column("priority", 40),
    Column("share now/target", 30),
    Column("total", 95),
    Column("done", 100),
    Column("failed", 90),
    Column("rejected", 50),
    Column("in flight", 60),
    Column("tok/s", 70),
    Column("ETA s", 80),
    Column("1st record s", 10),
    Column("tail s", 20),
)
QUEUE_COLUMNS = (
    Column("queue", ALWAYS),
    Column("paused", 90),
    Column("queued", 100),
    *(Column(name, keep) for name, keep in (("started", 80), ("failed", 70))),
)
SERVER_COLUMNS = (
    Column("server", ALWAYS),
    Column("state", ALWAYS),
    Column("in flight s/l", 100),
    Column("limits s/l", 60),
    Column("target", 50),
    Column("KV usage", 90),
    Column("waiting", 80),
)
WORKER_COLUMNS = (Column("worker", ALWAYS), Column("servers", 100), Column("metrics", 50))


@app.command(
    epilog=examples(
        "datagen status",
        "datagen status --state running --state ingesting",
        "datagen status --priority high --limit 10",
        "datagen status --wide",
        "datagen status --json",
    )
)
def status(
    coordinator: CoordinatorOption = None,
    state: Annotated[
        list[JobState] | None, typer.Option(help="only jobs in this state (repeat for more)")
    ] = None,
    priority: Annotated[
        list[Priority] | None, typer.Option(help="only jobs at this priority (repeat for more)")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="show at most this many jobs, newest first")] = (
        STATUS_JOBS
    ),
    wide: Annotated[
        bool,
        typer.Option(
            show_default=False, help="every column, even where the tables are wider than the terminal"
        ),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", show_default=False, help="print the coordinator's answers as one JSON object instead"
        ),
    ] = False,
) -> None:
    """Show jobs, queues, servers and Redis's memory.

    Each job's whole id and its state are always shown; where the terminal is narrow, lesser
    columns drop out (--wide shows them all). Redis's memory problems are shown in red: an operator
    must act on them.
    """
    from datagen_cli.client import CoordinatorClient

    settings = load(ClientSettings, coordinator_url=coordinator)
    states = [s.value for s in state or ()]
    priorities = [p.value for p in priority or ()]
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        jobs, more, total = _select_jobs(client, limit, states, priorities)
        queues, servers = client.queues(), client.servers()
        redis_memory = client.health().get("redis")
    if as_json:
        body = {"jobs": jobs, "more": more, "count": total, "queues": queues, "servers": servers}
        typer.echo(json.dumps({**body, "redis": redis_memory}, indent=2))
        return
    out = Console()
    tables = [
        fitted_table(out, "jobs", JOB_COLUMNS, [_job_row(job) for job in jobs], wide=wide),
        fitted_table(out, "queues", QUEUE_COLUMNS, [_queue_row(queue) for queue in queues], wide=wide),
        fitted_table(out, "servers", SERVER_COLUMNS, [_server_row(server) for server in servers], wide=wide),
        fitted_table(out, "workers", WORKER_COLUMNS, _worker_rows(servers), wide=wide),
    ]
    if wide:
        widen(out, tables)
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
    for table in tables:
        out.print(table)
    for job in jobs:
        _print_job_notes(out, job)


def _job_row(job: dict[str, Any]) -> list[str]:
    eta = "" if job["eta_s"] is None else f"{job['eta_s']:.0f}"
    cells = [job[k] for k in ("total", "done", "failed", "rejected", "in_flight")]
    shown_state = job["state"] + (" (paused)" if job.get("paused") else "")
    timing = [_seconds(job.get("time_to_first_record_s")), _seconds(job.get("tail_s"))]
    return [
        job["id"],
        shown_state,
        _priority(job),
        _share(job),
        *map(str, cells),
        f"{job['tokens_per_s']:.0f}",
        eta,
        *timing,
    ]


def _queue_row(queue: dict[str, Any]) -> list[str]:
    paused = "yes" if queue["paused"] else ""
    return [queue["name"], paused, *(str(queue[k]) for k in ("queued", "started", "failed"))]


def _server_row(server: dict[str, Any]) -> list[str]:
    kv = server.get("kv") or {}
    usage = kv.get("token_usage")
    return [
        server["name"],
        server["state"],
        "{short}/{long}".format(**server["in_flight"]),
        "{short}/{long}".format(**server["limits"]),
        "" if server["target"] is None else str(server["target"]),
        "" if usage is None else f"{usage:.0%}",
        "" if not kv else f"{kv.get('num_queue_reqs', 0):.0f}",
    ]


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


def _worker_rows(servers: list[dict[str, Any]]) -> list[list[str]]:
    """The live workers, the servers each uses and where Prometheus scrapes it."""
    workers: dict[str, tuple[list[str], str]] = {}
    for server in servers:
        for view in server.get("workers", []):
            if view.get("stale"):
                continue
            names, _ = workers.setdefault(view["worker"], ([], view.get("metrics") or "off"))
            names.append(server["name"])
    return [[name, ", ".join(names), metrics] for name, (names, metrics) in sorted(workers.items())]


def _priority(job: dict[str, Any]) -> str:
    weight = job.get("weight", 1.0)
    return f"{job.get('priority', 'normal')}" + ("" if weight == 1.0 else f" ×{weight:g}")


def _share(job: dict[str, Any]) -> str:
    share = job.get("share")
    return "" if not share else f"{share['recent']:.0%} / {share['target']:.0%}"


def _seconds(value: float | None) -> str:
    """A time to first record or a tail: blank until the job has one (an older coordinator: never)."""
    return "" if value is None else f"{value:.1f}"


@app.command(
    epilog=examples(
        "datagen wait JOB_ID",
        "datagen wait JOB_ID --progress-every-s 60 2>> wait.log",
    )
)
def wait(
    job_id: Annotated[str, typer.Argument(help="the job's id, as submit printed it")],
    coordinator: CoordinatorOption = None,
    progress_every_s: ProgressEverySOption = None,
) -> None:
    """Watch a job until it ends, without submitting it again.

    The job may be running or ended already. The progress line and exit codes of `submit --wait`:
    exit 0 when all prompts are done, 1 if some failed, 2 if the job failed or was cancelled.
    """
    from datagen_cli.client import CoordinatorClient
    from datagen_cli.waiting import wait_for_job_exit

    settings = load(ClientSettings, coordinator_url=coordinator, progress_interval_s=progress_every_s)
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        code = wait_for_job_exit(
            client,
            job_id,
            console,
            coordinator_url=settings.coordinator_url,
            progress_every_s=settings.progress_interval_s,
        )
    raise typer.Exit(code)
