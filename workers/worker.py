"""The worker process: pulls prompt jobs from RQ and runs them as asyncio tasks.

Lifecycle: ``start`` (connect, register, learn the servers) → ``run`` (admit jobs while slots are
free) → ``drain`` (stop admitting, let in-flight requests finish up to a deadline) → ``close``
(commit shards, hand back anything unfinished, deregister). ``burst=True`` returns from ``run``
once the queues are empty and nothing is in flight, which is how the tests drive the real loop.
A first SIGTERM/SIGINT drains; a second hands in-flight prompts back to the queue at once.

One prompt goes through the phases claim (:mod:`workers.claim.admission`) → run
(:mod:`workers.run.prompt`, :mod:`workers.run.generate`) → record (:mod:`workers.run.finish`); this module
wires them and owns the process's lifecycle and background loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import signal
import socket
import time
from typing import Any

import redis
from prometheus_client import start_http_server

from datagen.control.dispatch import Dispatch
from datagen.control.epoch import EpochWatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.startup import claim_storage_async, connect_redis_async
from datagen.errors import ConfigError
from datagen.prompts.loaders import preload_libraries
from datagen.records.storage import Storage
from datagen.settings import DEFAULT_METRICS_PORT, WorkerSettings
from datagen.states import EngineChoice, PromptClass, ServerRole
from workers.claim.admission import Admission, Slots
from workers.claim.reaper import Reaper
from workers.claim.rqbridge import QueueIdentity, heartbeat_ttl_s
from workers.claim.wake import Wakeups
from workers.engines.detect import build_engine
from workers.engines.http import ClientTimeouts
from workers.engines.urls import shown_url
from workers.fleet.health import HealthProbe
from workers.fleet.kv_control import KvControl
from workers.fleet.servers import CAPTURE_CLASS, Fleet, Server, ServerSpec
from workers.fleet.sync import FleetSync
from workers.metrics import WorkerMetrics
from workers.run.backup import Backups
from workers.run.capture import Capturer
from workers.run.conversation import Conversations
from workers.run.finish import Acks, Finisher
from workers.run.generate import Generator
from workers.run.jobinfo import JobInfos
from workers.run.prompt import PromptRunner
from workers.run.writer import RecordWriter

__all__ = ["Worker"]

log = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 10.0
# Without an explicit --metrics-port, a worker takes the first free port of this many from 9400.
METRICS_PORTS_SCANNED = 64
MAX_PORT = 65535


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        servers: list[ServerSpec],
        *,
        capture_servers: list[ServerSpec] | None = None,
        burst: bool = False,
        install_signal_handlers: bool = True,
    ) -> None:
        if not servers:
            raise ValueError("give at least one SGLang or vLLM server (--server NAME=URL)")
        self.capture_specs = list(capture_servers or [])
        if self.capture_specs and settings.capture_dir is None:
            raise ConfigError(
                "capture servers need --capture-dir (DATAGEN_CAPTURE_DIR): the directory their files are "
                "written to (the connector's shared_storage_path) as this node sees it"
            )
        if self.capture_specs and settings.capture_dir is not None and not settings.capture_dir.is_dir():
            raise ConfigError(
                f"--capture-dir {settings.capture_dir} is not a directory: give the capture servers' "
                "shared_storage_path as this node sees it (DATAGEN_CAPTURE_DIR)"
            )
        names = [spec.name for spec in [*servers, *self.capture_specs]]
        if repeated := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigError(f"server names must be unique across --server and --capture-server: {repeated}")
        self.settings = settings
        self.server_specs = servers
        self.burst = burst
        self.install_signal_handlers = install_signal_handlers
        self.tag = secrets.token_hex(4)
        self.name = f"{socket.gethostname()[:24]}-{os.getpid()}-{self.tag}"
        self.keys = Keys(settings.namespace)
        self.metrics = WorkerMetrics()
        self.storage = Storage(settings.storage)
        self.slots = Slots()
        self._signals = 0
        self._background: list[asyncio.Task[None]] = []
        self._metrics_server: tuple[Any, Any] | None = None
        # HOST:PORT of the metrics server once it serves (published in GET /servers).
        self.metrics_address: str | None = None

    # Lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve metrics, wait for Redis and storage, register the RQ identities, probe the servers,
        start the background loops."""
        self._serve_metrics()
        try:
            await self._start()
        except BaseException:
            self._stop_metrics()
            if hasattr(self, "redis"):
                self.redis.close()
            raise

    async def _start(self) -> None:
        timeout_s = self.settings.startup_timeout_s
        # Before any thread renders a next turn: imported lazily by many threads at once, the
        # tokenizer libraries fail (`datagen.prompts.loaders`).
        preload_libraries()
        self.redis = await connect_redis_async(
            self.settings.require_redis_url(),
            timeout_s,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )
        await claim_storage_async(self.storage, self.settings.namespace, timeout_s)
        self.jobs = JobStore(self.redis, self.keys)
        self.epoch = EpochWatch(self.redis, self.keys)
        self.dispatch = Dispatch(self.redis, self.keys, epoch=self.epoch)
        self.identities = {
            cls: QueueIdentity(
                self.keys.queue_name(cls),
                self.keys.rq_worker_name(self.name, cls),
                self.redis,
                self.settings.heartbeat_interval_s,
                execution_id=f"{os.getpid()}-{self.tag}",
                wake=(self.keys.wake_channel(), cls.value),
            )
            for cls in PromptClass
        }
        self.wakeups = Wakeups(self.settings.require_redis_url(), self.keys.wake_channel())
        for identity in self.identities.values():
            identity.register()
        self.fleet = Fleet(
            [self._make_server(spec) for spec in self.server_specs]
            + [self._make_server(spec, ServerRole.CAPTURE) for spec in self.capture_specs],
            self.metrics,
        )
        self.capturer = Capturer(
            self.settings, self.fleet, self.storage, self.metrics, tag=self.tag, jobs=self.jobs
        )
        probes = [self._probe(server) for server in self.fleet.servers]
        await asyncio.gather(*(probe.probe() for probe in probes))
        self.sync = FleetSync(
            self.redis,
            self.keys,
            self.fleet,
            self.metrics,
            worker_name=self.name,
            interval_s=self.settings.control_interval_s,
            shared_factor=self.settings.kv_controller,
            metrics_address=self.metrics_address,
            epoch=self.epoch,
        )
        self.sync.sync_once()
        self._kv_controls = (
            [self._kv_control(server) for server in self.fleet.servers] if self.settings.kv_controller else []
        )
        for control in self._kv_controls:
            # Slow start holds from the first claim: the limits are the window before admission runs.
            control.prime()
        self.writer = RecordWriter(
            self.storage,
            self.metrics,
            worker_tag=self.tag,
            commit_interval_s=self.settings.commit_interval_s,
            shard_max_records=self.settings.shard_max_records,
            on_storage_error=self.jobs.set_storage_error,
            current_incarnation=self.jobs.incarnation,
            in_flight=self.slots.generating_of,
        )
        self.writer.start()
        self.admission = self._admission()
        self._start_loops(probes)
        log.info(
            "worker %s started: servers %s, queues %s, metrics %s",
            self.name,
            ", ".join(
                f"{s.name}={shown_url(s.client.base_url)} ({s.state.value})" for s in self.fleet.servers
            ),
            [i.queue.name for i in self.identities.values()],
            f"http://{self.metrics_address}/metrics" if self.metrics_address else "off",
        )

    def _serve_metrics(self) -> None:
        """Serve Prometheus metrics on the configured port. A port given explicitly (--metrics-port,
        DATAGEN_METRICS_PORT) is that port or a one-line error; the default takes the next free one
        of up to ``METRICS_PORTS_SCANNED`` (several workers per host), published in GET /servers."""
        first = self.settings.metrics_port
        if not first:
            return
        explicit = "metrics_port" in self.settings.model_fields_set
        last = first if explicit else min(first + METRICS_PORTS_SCANNED - 1, MAX_PORT)
        for port in range(first, last + 1):
            try:
                self._metrics_server = start_http_server(port, registry=self.metrics.registry)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise ConfigError(
                    f"cannot serve metrics on port {port}: {exc}; choose another --metrics-port "
                    "(DATAGEN_METRICS_PORT), or 0 for none"
                ) from exc
            self.metrics_address = f"{socket.gethostname()}:{port}"
            if port != first:
                log.info("metrics port %d is in use (another worker on this host?): using %d", first, port)
            return
        if explicit:
            raise ConfigError(
                f"metrics port {first} is in use (another worker on this host?): give each worker its own "
                f"--metrics-port (DATAGEN_METRICS_PORT), or leave it unset to take the next free port "
                f"from {DEFAULT_METRICS_PORT}"
            )
        raise ConfigError(
            f"metrics ports {first}-{last} are all in use: set --metrics-port (DATAGEN_METRICS_PORT) to "
            "a free port, or 0 for none"
        )

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            http_server, _thread = self._metrics_server
            http_server.shutdown()
            http_server.server_close()
            self._metrics_server = None

    def _admission(self) -> Admission:
        """Wire the phases of a prompt: claim → run → record."""
        job_infos = JobInfos(self.jobs)
        backups = Backups(
            self.fleet,
            self.metrics,
            enabled=self.settings.backup_requests,
            is_paused=lambda cls: cls in self.sync.paused_classes,
        )
        generator = Generator(
            self.settings,
            self.fleet,
            self.metrics,
            job_infos,
            worker_name=self.name,
            tag=self.tag,
            backups=backups,
        )
        acks = Acks(self.jobs, delay_s=self.settings.test_ack_delay_s)
        conversations = Conversations(job_infos, self.fleet.servers, self.storage, self.metrics)
        finisher = Finisher(
            self.redis,
            self.keys,
            self.jobs,
            self.dispatch,
            self.identities,
            self.metrics,
            job_infos,
            acks,
            conversations,
        )
        prompts = PromptRunner(self.slots, self.jobs, generator, self.writer, finisher, self.capturer)
        return Admission(
            self.slots,
            self.identities,
            self.dispatch,
            self.fleet,
            self.sync,
            prompts.run,
            burst=self.burst,
            poll_interval_s=self.settings.poll_interval_s,
            wakeups=self.wakeups,
            on_claim_empty=backups.on_claim_empty,
            on_claimed=backups.on_claimed,
            # Records waiting for their features count too: they are not committed yet either.
            uncommitted=lambda: self.writer.pending + self.capturer.pending,
            max_uncommitted_records=self.settings.max_uncommitted_records,
            crowded_jobs=self.writer.crowded_jobs,
            known_jobs=job_infos.known,
            learn_job=job_infos.learn,
        )

    def _probe(self, server: Server) -> HealthProbe:
        settings = self.settings
        return HealthProbe(
            self.redis,
            self.keys,
            self.fleet,
            server,
            interval_s=settings.health_interval_s,
            timeout_s=settings.health_timeout_s,
            timeouts_to_down=settings.health_timeouts_to_down,
            capture_probe=self.capturer.probe,
        )

    def _start_loops(self, probes: list[HealthProbe]) -> None:
        reaper = Reaper(
            self.redis,
            self.keys,
            self.jobs,
            [identity.queue for identity in self.identities.values()],
            owner=self.name,
            interval_s=self.settings.reaper_interval_s,
            heartbeat_ttl_s=heartbeat_ttl_s(self.settings.heartbeat_interval_s),
            metrics=self.metrics,
        )
        loops = [
            self._heartbeat_loop(),
            self._abort_loop(),
            self.wakeups.run(),
            self.sync.run(),
            reaper.run(),
            *(p.run() for p in probes),
        ]
        loops += [control.run() for control in self._kv_controls]
        if self.capturer.dir is not None:
            loops.append(self.capturer.sweep_loop())
        self._background = [asyncio.create_task(loop) for loop in loops]
        if self.install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal)

    def _make_server(self, spec: ServerSpec, role: ServerRole = ServerRole.GENERATE) -> Server:
        settings = self.settings
        timeouts = ClientTimeouts(connect_s=settings.connect_timeout_s, read_s=settings.long_read_timeout_s)
        choice = settings.engine if spec.engine is EngineChoice.AUTO else spec.engine
        if role is ServerRole.CAPTURE:
            # Only vLLM captures over HTTP; asking would accept an SGLang server the probe then refuses.
            choice = EngineChoice.VLLM if spec.engine is EngineChoice.AUTO else spec.engine
        client = build_engine(
            spec.name,
            spec.url,
            choice=choice,
            timeouts=timeouts,
            max_connections=(
                settings.capture_concurrency
                if role is ServerRole.CAPTURE
                else settings.short_concurrency + settings.long_concurrency
            ),
            api_key=spec.api_key or settings.api_key,
        )
        limits = {
            PromptClass.SHORT: settings.short_concurrency,
            PromptClass.LONG: settings.long_concurrency,
        }
        if role is ServerRole.CAPTURE:
            limits = {cls: 0 for cls in PromptClass} | {CAPTURE_CLASS: settings.capture_concurrency}
        return Server(spec.name, client, max_limits=limits, up=False, role=role)

    async def run(self) -> None:
        await self.admission.run()

    def request_stop(self) -> None:
        self.slots.stop()

    async def drain(self) -> None:
        """Wait for in-flight prompts up to the drain timeout, then hand the rest back."""
        self.request_stop()
        self.sync.draining = True
        with contextlib.suppress(redis.RedisError):
            self.sync.publish()
        tasks = self.slots.running()
        if tasks:
            log.info(
                "draining %d in-flight prompts (up to %.0f s)", len(tasks), self.settings.drain_timeout_s
            )
            _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
            self._cancel(pending)

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        committed = await self.writer.close(deadline_s=time.monotonic() + self.settings.drain_timeout_s)
        if not committed:
            log.error(
                "could not commit %d records before exit; their prompts will run again", self.writer.pending
            )
        try:
            self.sync.withdraw()
            for identity in self.identities.values():
                identity.unregister()
        except redis.RedisError as exc:
            # The reaper hands this worker's prompts back once its heartbeat has lapsed.
            log.warning("cannot deregister from Redis (%s); other workers will reap what is left", exc)
        await asyncio.gather(*(s.client.aclose() for s in self.fleet.servers))
        self._stop_metrics()
        self.redis.close()
        admission = self.admission
        log.info(
            "worker %s stopped: %d prompts started by %d claims",
            self.name,
            admission.claimed_prompts,
            admission.claims,
        )

    async def main(self) -> None:
        await self.start()
        try:
            await self.run()
        finally:
            await self.drain()
            await self.close()

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("stop requested: finishing in-flight prompts (signal again to hand them back now)")
            self.request_stop()
        else:
            log.warning("second stop signal: handing in-flight prompts back to the queue")
            self._cancel(self.slots.running())

    @staticmethod
    def _cancel(tasks: object) -> None:
        for task in tasks:  # type: ignore[attr-defined]
            task.cancel()

    # Background loops ---------------------------------------------------------------------------
    def _kv_control(self, server: Server) -> KvControl:
        return KvControl(
            self.redis,
            self.keys,
            server,
            self.metrics,
            owner=self.name,
            interval_s=self.settings.controller_interval_s,
            floor_fraction=self.settings.controller_floor,
            initial_target=self.settings.controller_initial_target,
            slow_start_interval_s=self.settings.controller_slow_start_interval_s,
        )

    async def _abort_loop(self) -> None:
        """Abort in-flight prompts of jobs cancelled with ``--abort-in-flight`` (as FleetSync last
        read them)."""
        while True:
            await asyncio.sleep(self.settings.control_interval_s)
            aborting = self.sync.aborting_jobs
            if not aborting:
                continue
            self.slots.abort_jobs(aborting)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                for identity in self.identities.values():
                    identity.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed (Redis unreachable?): %s", exc)
