"""A record's hidden states, for a job with ``features``: captured on a vLLM capture server once the
record is generated, checked, stored, and named in the record before it is committed.

One capture: a slot on a capture server that fits the job (its probe's file had the job's layer
count; a bf16 job never goes to a server writing FP8; the sequence fits its context) → ``POST
/v1/completions`` with the record's whole sequence and ``max_tokens: 1`` (`workers.engines.base.
HiddenStateCapture`) → the lock on the file it names is awaited with a bound → the file is checked
and copied (`datagen.features.capture_file`: ids, rows, layers, finite values; FP8 conversion) into
a spool beside it → storage adopts the copy under a new name → the server's file and lock are
deleted. A file that fails a check is never stored: the capture is tried again on another capture
server where there is one, and after ``max_attempts`` tries the record is committed without
features, ``features_error`` saying why. So is a sequence no capture server's context holds.

The record is committed only after its file is stored, so a committed record's features exist;
a worker killed in between leaves a stored file no record names (deleted with its job) and a
prompt the reaper runs again.

The capture directory is swept by age (`datagen.features.capture_dir`): a request given up (a
timeout, a cancelled task, a slow writer past the bound) still gets its file written later, and
the server never deletes it. While the directory holds more than its byte cap, no capture is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import secrets
import time
from pathlib import Path

from datagen.control.jobs import JobStore
from datagen.errors import (
    CaptureFileError,
    CaptureMismatchError,
    ConfigError,
    DatagenError,
    FatalError,
    JobNotFoundError,
    RetryableError,
    StorageError,
)
from datagen.features.capture_dir import CaptureDir
from datagen.features.capture_file import check_and_store
from datagen.features.locks import lock_path, wait_for_write
from datagen.features.safetensors_file import read_header
from datagen.records.schema import Record
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings
from datagen.spec import FeatureDtype, FeaturesSpec
from datagen.states import ServerRole
from workers.engines.base import HiddenStateCapture
from workers.fleet.servers import CAPTURE_CLASS, CaptureShape, Fleet, Server
from workers.metrics import WorkerMetrics
from workers.run.generate import SERVER_FAULT_TRIES_PER_ATTEMPT, unless_lost
from workers.run.redisretry import while_redis_down

__all__ = ["Capturer"]

log = logging.getLogger(__name__)

FP8_FILE_DTYPE = "F8_E4M3"
# A probe's prompt: ids every vocabulary has, enough rows for the file to show its shape.
PROBE_IDS = (0, 1, 2, 3)
SPOOL_DIR = ".datagen-spool"
SWEEP_INTERVAL_S = 30.0
# What a record keeps of the last failure of a capture that gave up.
MAX_ERROR_CHARS = 1000
# How often a capture waiting for its job's features budget (a pull to consume) looks again.
BUDGET_POLL_S = 1.0


class Capturer:
    def __init__(
        self,
        settings: WorkerSettings,
        fleet: Fleet,
        storage: Storage,
        metrics: WorkerMetrics,
        *,
        tag: str,
        jobs: JobStore | None = None,
    ) -> None:
        self.settings = settings
        # The budget's counter (`features.retain_bytes`); None: no budget is kept (benchmarks).
        self.jobs = jobs
        # Records generated and waiting for their features (counted with the uncommitted ones, so a
        # slow capture or a full budget stops the worker claiming instead of piling records up).
        self.pending = 0
        self.fleet = fleet
        self.storage = storage
        self.metrics = metrics
        self.tag = tag
        root = settings.capture_dir
        self.dir = (
            None
            if root is None
            else CaptureDir(
                Path(root),
                max_bytes=settings.capture_dir_max_bytes or None,
                orphan_age_s=settings.capture_orphan_age_s,
            )
        )
        # Files of the server that a capture of this worker waits for: the sweep leaves them.
        self._in_use: set[str] = set()
        # Clear while the capture directory is over its byte cap (set by the sweep).
        self._room = asyncio.Event()
        self._room.set()

    # The start-up probe -------------------------------------------------------------------------
    async def probe(self, server: Server) -> str | None:
        """Prove ``server`` captures into the capture directory and learn what its files hold
        (`workers.fleet.health.HealthProbe`); None when it does, else why the worker keeps off it."""
        client = server.client.current()
        if not isinstance(client, HiddenStateCapture):
            return (
                f"capture server {server.name} is not a vLLM server ({client.engine.value}); capture "
                "needs vLLM launched with extract_hidden_states (docs/user/features.md)"
            )
        if self.dir is None:
            return f"capture server {server.name} needs --capture-dir, the directory its files are written to"
        rid = f"datagen-probe-{self.tag}-{secrets.token_hex(4)}"
        try:
            reply = await client.capture(
                PROBE_IDS, rid=rid, read_timeout_s=self.settings.capture_read_timeout_s
            )
            file = self.dir.resolve(reply.hidden_states_path)
        except ConfigError as exc:
            return str(exc)
        except RetryableError as exc:
            return f"capture server {server.name} failed its probe capture: {exc}"
        try:
            # The server takes the file's lock before it answers: neither here means another folder.
            if not lock_path(file).exists() and not file.exists():
                return (
                    f"capture server {server.name} writes {reply.hidden_states_path}, which is not in "
                    f"--capture-dir {self.dir.root}; give the directory of its "
                    "kv_connector_extra_config.shared_storage_path as this node sees it"
                )
            await wait_for_write(file, timeout_s=self.settings.capture_lock_timeout_s)
            shape = await asyncio.to_thread(_shape_of, file)
            declared = self.settings.capture_layer_ids()
            if declared is not None and len(declared) != shape.layers:
                return (
                    f"capture server {server.name} writes {shape.layers} layers but --capture-layers "
                    f"declares {len(declared)} ({','.join(map(str, declared))}); give the ids it was "
                    "launched with"
                )
            version = await client.engine_version()
            shape = dataclasses.replace(shape, engine_version=version, layer_ids=declared)
        except (RetryableError, OSError) as exc:
            return f"capture server {server.name}'s probe file is unusable: {exc}"
        finally:
            await asyncio.to_thread(self.dir.remove, file)
        server.capture = shape
        log.info(
            "capture server %s writes %d layers of %d (%s) into %s",
            server.name,
            shape.layers,
            shape.hidden_size,
            shape.dtype,
            self.dir.root,
        )
        return None

    # One record ---------------------------------------------------------------------------------
    async def capture(self, record: Record, features: FeaturesSpec, *, rq_id: str) -> Record:
        """``record`` naming its stored features, or saying in ``features_error`` why it has none."""
        if self.dir is None or not self.fleet.capturers:
            raise FatalError(
                f"job {record.job_id} asks for features but this worker has no capture server; start every "
                "worker of the fleet with --capture-server NAME=URL --capture-dir DIR"
            )
        ids = record.input_ids
        unfit = self._unfit(len(ids), features)
        if unfit is not None:
            self.metrics.captures.labels("", "unfit").inc()
            return dataclasses.replace(record, features_error=unfit)
        self.pending += 1
        reserved = 0
        try:
            if features.retain_bytes is not None and self.jobs is not None:
                reserved = await self._reserve(
                    record.job_id, self._estimate(len(ids), features), features.retain_bytes
                )
            captured = await self._tries(record, features, rq_id=rq_id)
            if reserved and captured.features_bytes is not None:
                # The reservation was an estimate: count what was stored.
                await self._add_retained(record.job_id, captured.features_bytes - reserved)
                reserved = 0
            return captured
        finally:
            self.pending -= 1
            if reserved:
                await self._add_retained(record.job_id, -reserved)

    async def _tries(self, record: Record, features: FeaturesSpec, *, rq_id: str) -> Record:
        """Tries as a prompt's generation has them (`workers.run.generate`): a server fault (down,
        unreachable) sends the capture elsewhere, or waits for the server's return, without charging
        an attempt; any other failure charges one and keeps the capture off that server."""
        ids = record.input_ids
        failed_on: set[str] = set()
        attempts = tries = 0
        while True:
            tries += 1
            await self._under_cap()
            server = await self.fleet.acquire(
                CAPTURE_CLASS,
                role=ServerRole.CAPTURE,
                avoid=frozenset(failed_on),
                fits=lambda s: self._fits(s, len(ids), features),
            )
            try:
                stored = await self._once(server, record, features, rid=f"{rq_id}.c{tries}.{self.tag}")
            except StorageError as exc:  # storing the copy failed: not the server's doing
                error: DatagenError = exc
                attempts += 1
            except RetryableError as exc:
                error = exc
                if exc.server_fault:
                    await self.fleet.mark_down(server, str(exc))
                else:
                    attempts += 1
                    failed_on.add(server.name)
            except (ConfigError, CaptureMismatchError) as exc:
                # It answers without a file, or writes other layers or another dtype than its probe
                # learnt: restarted with other flags. Its next probe learns what it does now.
                await self.fleet.refuse(server, str(exc))
                error = exc
                attempts += 1
            except FatalError as exc:
                # The server refuses this sequence (a 400): no other try can capture it, and the
                # record is kept without features rather than lost with its prompt.
                self.metrics.captures.labels(server.name, "refused").inc()
                return dataclasses.replace(record, features_error=f"capture refused: {exc}"[:MAX_ERROR_CHARS])
            else:
                self.metrics.captures.labels(server.name, "stored").inc()
                self.metrics.captured_tokens.labels(server.name).inc(len(ids))
                self.metrics.feature_bytes.labels(server.name).inc(stored.features_bytes or 0)
                return stored
            self.metrics.captures.labels(server.name, "retried").inc()
            limit = self.settings.max_attempts
            log.info("capture of %s failed (attempt %d of %d): %s", rq_id, attempts + 1, limit, error)
            if attempts >= limit or tries >= limit * SERVER_FAULT_TRIES_PER_ATTEMPT:
                self.metrics.captures.labels(server.name, "gave_up").inc()
                return dataclasses.replace(
                    record, features_error=f"capture failed after {tries} tries: {error}"[:MAX_ERROR_CHARS]
                )
            ceiling = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (tries - 1))
            await asyncio.sleep(random.uniform(ceiling / 2, ceiling))

    async def _once(self, server: Server, record: Record, features: FeaturesSpec, *, rid: str) -> Record:
        """One try on ``server``: the record naming its stored file, or a RetryableError."""
        assert self.dir is not None
        client = server.client.current()
        if not isinstance(client, HiddenStateCapture):
            raise ConfigError(f"capture server {server.name} can no longer capture")
        ids = record.input_ids
        started = time.perf_counter()
        try:
            request = client.capture(ids, rid=rid, read_timeout_s=self.settings.capture_read_timeout_s)
            reply = await unless_lost(server, request)
        finally:
            await self.fleet.release(server, CAPTURE_CLASS)
        file = self.dir.resolve(reply.hidden_states_path)
        name = f"{self.tag}-{secrets.token_hex(10)}.safetensors"
        spool = self.dir.root / SPOOL_DIR
        part = spool / name
        self._in_use.add(file.name)
        try:
            await wait_for_write(file, timeout_s=self.settings.capture_lock_timeout_s)
            await asyncio.to_thread(spool.mkdir, exist_ok=True)
            stored = await asyncio.to_thread(
                check_and_store,
                file,
                part,
                sent_ids=ids,
                layer_count=len(features.layers),
                dtype=features.dtype.value,
            )
            await asyncio.to_thread(self.storage.adopt_feature, record.job_id, name, part)
        finally:
            self._in_use.discard(file.name)
            await asyncio.to_thread(self._clean, file, part)
        server.observe(time.perf_counter() - started, len(ids))
        return dataclasses.replace(
            record, features_file=name, features_bytes=stored.bytes, features_sha256=stored.sha256
        )

    def _clean(self, file: Path, part: Path) -> None:
        assert self.dir is not None
        self.dir.remove(file)
        part.unlink(missing_ok=True)

    # The budget ---------------------------------------------------------------------------------
    async def _reserve(self, job_id: str, estimate: int, budget: int) -> int:
        """Count ``estimate`` bytes against the job's budget before capturing, waiting while that
        would pass it: reserved first, so that captures running at once cannot all pass a check
        made before any of them stored. A record larger than the budget alone still goes through
        once nothing else is retained. Returns the bytes reserved."""
        waiting = False
        try:
            while True:
                total = await self._add_retained(job_id, estimate)
                if total is None:
                    raise JobNotFoundError(f"job {job_id} was deleted")
                if total <= budget or total == estimate:
                    return estimate
                await self._add_retained(job_id, -estimate)
                if not waiting:
                    waiting = True
                    self.metrics.capture_waiting.inc()
                    log.info(
                        "job %s holds its features budget of %d bytes: capture waits for a pull",
                        job_id,
                        budget,
                    )
                await asyncio.sleep(BUDGET_POLL_S)
        finally:
            if waiting:
                self.metrics.capture_waiting.dec()

    async def _add_retained(self, job_id: str, delta_bytes: int) -> int | None:
        assert self.jobs is not None
        return await while_redis_down(functools.partial(self.jobs.add_retained_features, job_id, delta_bytes))

    def _estimate(self, length: int, features: FeaturesSpec) -> int:
        """The stored size of a sequence's features, from the capture servers' hidden size."""
        hidden = max(
            (s.capture.hidden_size for s in self.fleet.capturers if s.capture is not None), default=0
        )
        per_value = 1 if features.dtype is FeatureDtype.FP8 else 2
        # Values, the token ids, FP8's per-token scale; the header is a few hundred bytes.
        return length * (len(features.layers) * hidden * per_value + 8 + (4 if per_value == 1 else 0)) + 512

    # Fitting ------------------------------------------------------------------------------------
    @staticmethod
    def _fits(server: Server, length: int, features: FeaturesSpec) -> bool:
        shape = server.capture
        if shape is None or shape.layers != len(features.layers):
            return False
        if shape.layer_ids is not None and shape.layer_ids != tuple(features.layers):
            return False
        if features.dtype is FeatureDtype.BF16 and shape.dtype == FP8_FILE_DTYPE:
            return False
        # max_tokens 1: the sequence and one sampled token must fit the context.
        return server.context_len is None or length + 1 <= server.context_len

    def _unfit(self, length: int, features: FeaturesSpec) -> str | None:
        """Why no capture server of this worker will ever take this capture, from what their probes
        learnt (servers not probed yet may still fit: then None, and the capture waits for one)."""
        shaped = [s for s in self.fleet.capturers if s.capture is not None]
        if not shaped or len(shaped) < len(self.fleet.capturers):
            return None
        right = [s for s in shaped if self._fits(s, 0, features)]
        if not right:
            seen = ", ".join(
                f"{s.name} {s.capture.layers} layers {s.capture.dtype}" for s in shaped if s.capture
            )
            return (
                f"no capture server writes {len(features.layers)} layers in a dtype a {features.dtype.value} "
                f"job can store ({seen})"
            )
        if any(self._fits(s, length, features) for s in right):
            return None
        longest = max(s.context_len or 0 for s in right)
        return (
            f"the sequence has {length} tokens; the longest capture server context is {longest} "
            "(prompt + 1 sampled token must fit)"
        )

    # The capture directory ----------------------------------------------------------------------
    async def _under_cap(self) -> None:
        if self._room.is_set():
            return
        self.metrics.capture_waiting.inc()
        try:
            await self._room.wait()
        finally:
            self.metrics.capture_waiting.dec()

    async def sweep_loop(self) -> None:
        """Delete orphans by age and watch the byte cap, every ``SWEEP_INTERVAL_S``."""
        while True:
            await self.sweep_once()
            await asyncio.sleep(min(SWEEP_INTERVAL_S, self.settings.capture_orphan_age_s))

    async def sweep_once(self) -> None:
        if self.dir is None:
            return
        try:
            result = await asyncio.to_thread(self.dir.sweep, in_use=set(self._in_use))
        except OSError as exc:
            log.warning("cannot sweep the capture directory %s: %s", self.dir.root, exc)
            return
        if result.files_removed:
            log.info(
                "removed %d orphan files (%d bytes) from the capture directory %s",
                result.files_removed,
                result.bytes_removed,
                self.dir.root,
            )
            self.metrics.capture_orphans_removed.inc(result.files_removed)
        self.metrics.capture_dir_bytes.set(result.bytes_left)
        cap = self.dir.max_bytes
        over = cap is not None and result.bytes_left > cap
        if over and self._room.is_set():
            log.warning(
                "the capture directory %s holds %d bytes, over its cap of %d: no capture is sent until it "
                "shrinks (DATAGEN_CAPTURE_DIR_MAX_BYTES)",
                self.dir.root,
                result.bytes_left,
                cap,
            )
        if over:
            self._room.clear()
        else:
            self._room.set()


def _shape_of(file: Path) -> CaptureShape:
    """What a capture server's file holds per token: ``hidden_states`` is [T, layers, hidden]."""
    with file.open("rb") as fh:
        header = read_header(fh, label=file.name)
    hidden = header.get("hidden_states")
    if hidden is None or len(hidden.shape) != 3:
        raise CaptureFileError(f"{file.name}: no hidden_states tensor of shape [tokens, layers, hidden]")
    return CaptureShape(layers=hidden.shape[1], hidden_size=hidden.shape[2], dtype=hidden.dtype)


def _described(shape: CaptureShape) -> str:
    layers = f"layers {list(shape.layer_ids)}" if shape.layer_ids is not None else f"{shape.layers} layers"
    return f"{layers} {shape.dtype}"
