"""The modules one prompt runs through, from ``POST /jobs`` to an exported line, measured (issue 37).

One job of one row goes through the system in this process: the coordinator's app, a worker against
the simulator over HTTP, then ``datagen export`` to SpecForge lines. Start-up is over, and a first
job has warmed the process-wide caches (tokenizer, template, benchmark sets), before the trace
starts; it ends after the export. Every call in every thread is traced (``tests/support/calltrace``).

The path is every module of ours (``datagen``, ``datagen_cli``, ``service``, ``workers``) that had a
function run meanwhile, less ``VOCABULARY``, ``ENTRY_POINTS`` and what ``TIMERS`` run. A room is a
module's folder (``service``, ``datagen/control``, ``workers/run``); a room crossing is a pair of
rooms between which a call passed, either way, counted once. A task's, thread's or pool item's first
call counts as made from where it was created, started or submitted.

- The path has at most ``MAX_MODULES`` modules and ``MAX_CROSSINGS`` crossings.
- docs/architecture.md's "One prompt" section lists the path, each module under its room, and its
  figures and crossings: all as measured (a failure prints the section's list as measured). It
  names each module of ``VOCABULARY`` and ``ENTRY_POINTS``, and each of those still exists.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from types import CodeType

import pytest
import redis
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.states import JobState
from datagen_cli import app as cli
from service import submit_check
from service.app import create_app
from tests.support.calltrace import CallTrace
from tests.support.sim import running_simulator
from tests.support.specs import spec_json
from tests.support.wait import wait_until_async
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## One prompt, from `POST /jobs` to a SpecForge line"
PACKAGES = ("datagen", "datagen_cli", "service", "workers")
NS = "path"
JOB_TIMEOUT_S = 30.0

# Today's figures: a module or crossing more fails here. Issue 37's target is at most 30 modules and
# 10 crossings; lower these as the path shrinks.
# Issue 41 added two (the rendering pool's batches, the input adapter that reads any format as JSONL
# lines) and a crossing (storage's inputs open the adapter).
MAX_MODULES = 62
MAX_CROSSINGS = 15

# Every step uses these, and none carries a prompt's data: the shared vocabulary.
VOCABULARY = (
    "datagen/errors.py",  # the exception tree
    "datagen/settings.py",  # the settings models
    "datagen/states.py",  # the StrEnums
    "datagen/spec.py",  # the job's spec: one per job, read by every step of its prompts
    "datagen/backoff.py",  # the one retry backoff
    "datagen/clock.py",  # the clock
    "datagen/control/keys.py",  # the names of Redis's keys
    "datagen/control/redistext.py",  # redis-py's replies as text
    "service/metrics.py",  # the coordinator's metric declarations
    "workers/metrics.py",  # the worker's metric declarations
)
# What starts and wires a process: the worker's lifecycle and the CLI's `main()`.
ENTRY_POINTS = ("workers/worker.py", "datagen_cli/_app.py")
# The processes' own timer loops run with or without a prompt: nothing that runs under them counts.
TIMERS = (
    "service.watch:RedisWatch._run",  # the coordinator's look at Redis's epoch
    "workers.fleet.sync:FleetSync.run",  # pauses, shared factors, the worker's published view
    "workers.fleet.health:HealthProbe.run",  # each server's health
    "workers.fleet.kv_control:KvControl.run",  # each server's KV cache controller
    "workers.claim.reaper:Reaper.run",  # dead workers' prompts
    "workers.worker:Worker._heartbeat_loop",
    "workers.worker:Worker._abort_loop",  # jobs cancelled with --abort-in-flight
)

_ROOM = re.compile(r"^- `([\w/]+)`")
_MODULE = re.compile(r"^  - `([\w/]+\.py)`")
_FIGURES = re.compile(r"\*\*(\d+)\s+modules\s+in\s+(\d+)\s+rooms,\s+(\d+)\s+room\s+crossings\.\*\*")
_CROSSING = re.compile(r"`([\w/]+)` ↔ `([\w/]+)`")
_CROSSINGS = "Room crossings: "


def _code(name: str) -> CodeType:
    """The code of ``module:qualname``."""
    module, qualname = name.split(":")
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    code: CodeType = target.__code__
    return code


def _counts(module: str) -> bool:
    return module not in VOCABULARY and module not in ENTRY_POINTS


def _room(module: str) -> str:
    return module.rsplit("/", 1)[0]


def _crossings(calls: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Each pair of rooms a call passed between, in name order."""
    rooms = ((_room(a), _room(b)) for a, b in calls)
    return {(min(a, b), max(a, b)) for a, b in rooms if a != b}


def _figures(modules: Iterable[str], crossings: set[tuple[str, str]]) -> tuple[int, int, int]:
    """Modules, rooms, crossings."""
    unique = set(modules)
    return len(unique), len({_room(m) for m in unique}), len(crossings)


def _section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _listed(section: str) -> tuple[dict[str, str], tuple[int, ...] | None, set[tuple[str, str]]]:
    """The section's modules (each with the room it is listed under), figures and crossings."""
    modules: dict[str, str] = {}
    crossings: set[tuple[str, str]] = set()
    room = ""
    in_crossings = False
    for line in section.splitlines():
        in_crossings = line.startswith(_CROSSINGS) or (in_crossings and line != "")
        if in_crossings:
            crossings |= {(min(a, b), max(a, b)) for a, b in _CROSSING.findall(line)}
        elif match := _ROOM.match(line):
            room = match[1]
        elif match := _MODULE.match(line):
            modules[match[1]] = room
    figures = _FIGURES.search(section)
    return modules, tuple(int(n) for n in figures.groups()) if figures else None, crossings


def _as_listed(trace: CallTrace, crossings: set[tuple[str, str]]) -> str:
    """The section's list as measured: rooms and modules in the order they first ran, each module
    with the functions of it that ran, for its line's text."""
    rooms: dict[str, list[str]] = {}
    for module in trace.ran:
        rooms.setdefault(_room(module), []).append(module)
    modules, n_rooms, n_crossings = _figures(trace.ran, crossings)
    lines = [f"**{modules} modules in {n_rooms} rooms, {n_crossings} room crossings.**", ""]
    for room, members in rooms.items():
        lines.append(f"- `{room}`")
        lines += [f"  - `{m}` — … (ran: {', '.join(trace.functions[m])})" for m in members]
    pairs = ", ".join(f"`{a}` ↔ `{b}`" for a, b in sorted(crossings))
    return "\n".join([*lines, "", f"{_CROSSINGS}{pairs}."])


async def _one_job(client: TestClient, jobs: JobStore, trace: CallTrace, spec: str, row_id: str) -> str:
    """Submit a job of one row and wait until it is completed; the id."""
    row = json.dumps({"id": row_id, "prompt": f"question {row_id}"}) + "\n"
    response = client.post(
        "/jobs", data={"spec": spec}, files={"dataset": ("d.jsonl", row.encode(), "application/jsonl")}
    )
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]

    def completed() -> bool:
        with trace.paused():
            return jobs.progress(job_id).state is JobState.COMPLETED

    await wait_until_async(completed, JOB_TIMEOUT_S, f"job {job_id} to complete")
    return job_id


async def test_the_listed_path_is_what_one_prompt_runs(
    redis_url: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    tokenizer_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The traced job's submit reads the fleet, as a submit alone does: the warm-up's read, less
    # than a second old, would serve it (`SERVERS_REUSE_S`, for bursts of submits).
    monkeypatch.setattr(submit_check, "SERVERS_REUSE_S", 0.0)
    section = _section()
    for module in (*VOCABULARY, *ENTRY_POINTS):
        assert (ROOT / module).is_file(), f"{module} is gone: update VOCABULARY or ENTRY_POINTS"
        assert f"`{module}`" in section, f"docs/architecture.md does not say the path leaves out {module}"
    storage = Storage(str(tmp_path / "data"))
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage.root), namespace=NS)
    spec = spec_json(short_max_new_tokens=16)
    jobs = JobStore(redis_client, Keys(NS))
    out = tmp_path / "out.jsonl"
    trace = CallTrace(ROOT, PACKAGES, counts=_counts, ignored=[_code(name) for name in TIMERS])
    sim = running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0)
    with sim as url, trace, TestClient(create_app(settings)) as client:
        worker = Worker(
            fast_worker_settings(redis_url, storage, NS),
            [ServerSpec("s0", url)],
            install_signal_handlers=False,
        )
        await worker.start()
        run = asyncio.create_task(worker.run())
        try:
            await _one_job(client, jobs, trace, spec, "warm-up")
            with trace.recording():
                job_id = await _one_job(client, jobs, trace, spec, "traced")
                export = ["export", job_id, "--out", str(out), "--storage", str(storage.root)]
                result = CliRunner().invoke(cli, export)
        finally:
            await worker.drain()
            await run
            await worker.close()
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["traced"]

    crossings = _crossings(trace.calls)
    measured = _as_listed(trace, crossings)
    assert len(trace.ran) <= MAX_MODULES, f"the path runs {len(trace.ran)} modules:\n{measured}"
    assert len(crossings) <= MAX_CROSSINGS, f"the path makes {len(crossings)} room crossings:\n{measured}"
    modules, figures, listed_crossings = _listed(section)
    assert modules == {m: _room(m) for m in trace.ran}, (
        f"the section lists another path; as measured:\n{measured}"
    )
    assert figures == _figures(trace.ran, crossings), (
        f"the section's figures differ; as measured:\n{measured}"
    )
    assert listed_crossings == crossings, f"the section lists other crossings; as measured:\n{measured}"
