"""docs/architecture.md's "One prompt" list stays true: one job runs in this process (the
coordinator's app, a worker in burst mode against the simulator over HTTP, then a SpecForge export)
with every function call traced, and the modules that ran are held to the list.

- Every module the list names exists and ran (no stale entry).
- Every module of ours that ran is named: on the path, beside it (the list's "Beside the path"
  line), or in the shared vocabulary. A new module on the path without a line fails here.
- The path's own count, rooms and reopenings are the figures issue 24 set: at most 25 modules in
  at most 8 rooms (a package, or a sub-package of datagen), none named more than twice.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from fastapi.testclient import TestClient

from datagen.export import ExportFormat, export_job
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from service.app import create_app
from tests.support.ingest import wait_ingested
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("datagen", "service", "workers")
NS = "path"
ROWS = 4
MAX_PATH_MODULES = 25
MAX_NAMINGS = 2
MAX_ROOMS = 8
_MODULE = re.compile(r"`((?:datagen|service|workers)/[\w/]+\.py)`")


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _named() -> tuple[list[list[str]], set[str], set[str]]:
    """The numbered steps' modules in order, the modules beside the path, and the vocabulary."""
    section = _section("One prompt, from `POST /jobs` to a SpecForge line")
    steps = [_MODULE.findall(line) for line in section.splitlines() if re.match(r"\d+\. ", line)]
    beside = set()
    vocabulary = set()
    for line in section.splitlines():
        if line.startswith("Beside the path:"):
            beside.update(_MODULE.findall(line))
        elif line.startswith("Shared vocabulary:"):
            vocabulary.update(_MODULE.findall(line))
    return steps, beside, vocabulary


class _Tracer:
    """Which of our modules had a function called, from any thread."""

    def __init__(self) -> None:
        self.ran: set[str] = set()
        self._by_file: dict[str, str | None] = {}

    def _module(self, filename: str) -> str | None:
        if filename not in self._by_file:
            path = Path(filename)
            name = None
            if path.suffix == ".py" and path.is_relative_to(ROOT):
                relative = path.relative_to(ROOT).as_posix()
                if relative.split("/")[0] in PACKAGES and not relative.endswith("__init__.py"):
                    name = relative
            self._by_file[filename] = name
        return self._by_file[filename]

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = self._module(frame.f_code.co_filename)
            if module is not None:
                self.ran.add(module)

    def __enter__(self) -> _Tracer:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


async def test_the_documented_path_is_the_path_one_prompt_takes(
    redis_url: str, tmp_path: Path, tokenizer_path: str
) -> None:
    steps, beside, vocabulary = _named()
    on_path = [module for step in steps for module in step]
    named = set(on_path) | beside | vocabulary
    assert steps, "docs/architecture.md has no numbered steps under 'One prompt'"
    for module in sorted(named):
        assert (ROOT / module).is_file(), f"docs/architecture.md names {module}, which does not exist"

    storage = Storage(str(tmp_path / "data"))
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage.root), namespace=NS)
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}"}) + "\n" for i in range(ROWS))
    sim = running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096)
    with sim as url, _Tracer() as tracer, TestClient(create_app(settings)) as client:
        response = client.post(
            "/jobs",
            data={"spec": json.dumps(make_spec(short_max_new_tokens=16))},
            files={"dataset": ("d.jsonl", rows.encode(), "application/jsonl")},
        )
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        wait_ingested(client, job_id)
        worker = Worker(
            fast_worker_settings(redis_url, storage, NS),
            [ServerSpec("s0", url)],
            burst=True,
            install_signal_handlers=False,
        )
        await worker.main()
        assert client.get(f"/jobs/{job_id}").json()["done"] == ROWS
        stats = export_job(storage, job_id, ExportFormat.SPECFORGE, tmp_path / "out.jsonl")
        assert stats.written == ROWS

    unnamed = sorted(tracer.ran - named)
    assert not unnamed, f"modules on the path that docs/architecture.md does not name: {unnamed}"
    stale = sorted(set(on_path) - tracer.ran)
    assert not stale, f"docs/architecture.md puts modules on the path that did not run: {stale}"
    assert len(set(on_path)) <= MAX_PATH_MODULES, f"the path opens {len(set(on_path))} modules"
    rooms = {"/".join(m.split("/")[:2]) if m.startswith("datagen/") else m.split("/")[0] for m in on_path}
    assert len(rooms) <= MAX_ROOMS, f"the path crosses {len(rooms)} rooms: {sorted(rooms)}"
    reopened = {m: on_path.count(m) for m in on_path if on_path.count(m) > MAX_NAMINGS}
    assert not reopened, f"modules named more than {MAX_NAMINGS} times on the path: {reopened}"
