"""Everything a submit checks before it touches a job, behind one call: `SubmitCheck`.

In order, each refusing with what to fix: the job id (400), the names the spec may load
(`service.allowlist`, 400), the names pinned as resolved, the tokenizer and template loaded
(`renderer_for`, 400), the decontamination sets within their limits and parsed once
(`check_benchmarks`, 400), and the pre-flight checks, a recipe's arms rendering apart among them,
against the servers workers publish (`preflight_submit`, 409; what could not be checked is logged as
a warning). The servers read for a submit that passed serve the submits of the next second too
(`SERVERS_REUSE_S`): a burst of small jobs reads the fleet about once a second, not twice a job; a
refused submit's read serves no other, so a fleet that was not ready is looked at afresh.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from redis import Redis

from datagen.control.keys import Keys
from datagen.control.servers import live_servers
from datagen.errors import InvalidSpecError
from datagen.hygiene.benchmark_sets import BenchmarkSet
from datagen.hygiene.screen import check_benchmarks
from datagen.prompts.preflight import PreflightResult, preflight_submit
from datagen.prompts.sources import SourceKind, resolve_source
from datagen.prompts.tokenization import PromptRenderer, renderer_for
from datagen.records.layout import validate_job_id
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from service.allowlist import check_allowed

__all__ = ["CheckedSubmit", "SubmitCheck", "pinned"]

log = logging.getLogger(__name__)

# How long the servers read for a submit that passed serve later submits (seconds): about the
# interval at which workers publish them.
SERVERS_REUSE_S = 1.0


@dataclass(frozen=True)
class CheckedSubmit:
    """A submit that passed every check: its job id, the spec with its names pinned, and what the
    checks found (the renderer, the decontamination sets, the servers' entries, the pre-flight)."""

    job_id: str
    spec: JobSpec
    renderer: PromptRenderer
    sets: list[BenchmarkSet]
    servers: dict[str, dict[str, Any]]
    preflight: PreflightResult


class SubmitCheck:
    def __init__(self, settings: CoordinatorSettings, redis: Redis, keys: Keys) -> None:
        self._settings = settings
        self._redis = redis
        self._keys = keys
        # (when read, monotonic; the servers) of the last read a submit passed with. Submits run
        # in the API's threads.
        self._passed: tuple[float, dict[str, dict[str, Any]]] | None = None
        self._lock = threading.Lock()

    def __call__(self, spec: JobSpec, job_id: str | None) -> CheckedSubmit:
        """Check a submit of ``spec`` (to ``job_id``, or to a new id); raises what a check refused."""
        job_id = validate_job_id(job_id) if job_id else uuid.uuid4().hex
        check_allowed(spec, self._settings)
        spec = pinned(spec)
        renderer = renderer_for(spec)  # fails fast with a 400 on a bad tokenizer or template
        sets = check_benchmarks(spec)  # 400 on a set over the limits or unreadable; parsed once
        read_at, servers = self._servers()
        preflight = preflight_submit(spec, renderer, servers)  # 409 with what to fix
        with self._lock:
            if self._passed is None or self._passed[0] < read_at:
                self._passed = (read_at, servers)
        for warning in preflight.warnings:
            log.warning("job %s: %s", job_id, warning)
        return CheckedSubmit(job_id, spec, renderer, sets, servers, preflight)

    def _servers(self) -> tuple[float, dict[str, dict[str, Any]]]:
        """The live servers, as a submit that passed read them within `SERVERS_REUSE_S`, or read now."""
        with self._lock:
            passed = self._passed
        if passed is not None and time.monotonic() - passed[0] < SERVERS_REUSE_S:
            return passed
        return time.monotonic(), live_servers(self._redis, self._keys)


def pinned(spec: JobSpec, *, strict: bool = True) -> JobSpec:
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
