"""The worker process: pulls prompt jobs from RQ and runs them as asyncio tasks.

Lifecycle: ``start`` (connect, register, learn the servers) → ``run`` (admit jobs while slots are
free) → ``drain`` (stop admitting, let in-flight requests finish up to a deadline) → ``close``
(commit shards, hand back anything unfinished, deregister). ``burst=True`` returns from ``run``
once the queues are empty and nothing is in flight, which is how the tests drive the real loop.
A first SIGTERM/SIGINT drains; a second hands in-flight prompts back to the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import secrets
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis
from prometheus_client import start_http_server
from redis.client import Pipeline
from rq.job import Job, JobStatus

from datagen.dispatch import Dispatch
from datagen.enqueue import EnqueueOptions, enqueue_prompts
from datagen.errors import ConfigError, FatalError, RetryableError, ServerUnavailableError
from datagen.jobs import JobStore, now_ms
from datagen.keys import Keys, prompt_key
from datagen.payload import PromptPayload
from datagen.records import Record
from datagen.settings import (
    DEFAULT_FAILURE_TTL_S,
    DEFAULT_MAX_WORKER_LOSSES,
    DEFAULT_RESULT_TTL_S,
    WorkerSettings,
)
from datagen.spec import JobSpec
from datagen.states import PromptClass
from datagen.storage import Storage
from datagen.tokenization import renderer_for
from workers.control import API_KEY_HINT, FleetSync, HealthProbe, KvControl
from workers.fleet import Fleet, Server, ServerSpec
from workers.metrics import WorkerMetrics
from workers.reaper import Reaper
from workers.rqbridge import InFlight, QueueIdentity, payload_of
from workers.sglang import ClientTimeouts, GenerateResult, SGLangClient
from workers.turns import next_turn
from workers.writer import RecordWriter

__all__ = ["Worker"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A prompt may wait out server outages without using attempts, but not forever: a server that
# answers /health yet drops every request would otherwise loop.
SERVER_FAULT_TRIES_PER_ATTEMPT = 25
REDIS_RETRY_MIN_S = 0.5
REDIS_RETRY_MAX_S = 5.0
UNKNOWN = "unknown"
REDIS_SOCKET_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _JobInfo:
    """What a worker reads once per job: its spec and the tokenizer identity for records."""

    spec: JobSpec
    tokenizer: str
    stop_ids: tuple[int, ...] = ()


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        servers: list[ServerSpec],
        *,
        burst: bool = False,
        install_signal_handlers: bool = True,
    ) -> None:
        if not servers:
            raise ValueError("give at least one SGLang server (--server NAME=URL)")
        self.settings = settings
        self.server_specs = servers
        self.burst = burst
        self.install_signal_handlers = install_signal_handlers
        self.tag = secrets.token_hex(4)
        self.name = f"{socket.gethostname()[:24]}-{os.getpid()}-{self.tag}"
        self.keys = Keys(settings.namespace)
        self.metrics = WorkerMetrics()
        self.storage = Storage(settings.storage)
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._tasks: dict[PromptClass, set[asyncio.Task[None]]] = {cls: set() for cls in PromptClass}
        self._generating: dict[PromptClass, int] = dict.fromkeys(PromptClass, 0)
        self._jobs_seen: dict[str, _JobInfo] = {}
        # Job id of each running prompt task, and the tasks cancelled because their job was
        # cancelled with abort (those finish as cancelled instead of being handed back).
        self._task_jobs: dict[asyncio.Task[None], str] = {}
        self._aborted: set[asyncio.Task[None]] = set()
        self._signals = 0
        self._background: list[asyncio.Task[None]] = []
        self._metrics_server: tuple[Any, Any] | None = None

    # Lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, register the RQ identities, probe the servers, start the background loops."""
        self.redis = redis.Redis.from_url(
            self.settings.require_redis_url(), socket_timeout=REDIS_SOCKET_TIMEOUT_S, health_check_interval=30
        )
        self.jobs = JobStore(self.redis, self.keys)
        self.dispatch = Dispatch(self.redis, self.keys)
        self.identities = {
            cls: QueueIdentity(
                self.keys.queue_name(cls),
                self.keys.rq_worker_name(self.name, cls),
                self.redis,
                self.settings.heartbeat_interval_s,
            )
            for cls in PromptClass
        }
        for identity in self.identities.values():
            identity.register()
        self.fleet = Fleet([self._make_server(spec) for spec in self.server_specs], self.metrics)
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
        )
        self.sync.sync_once()
        self.writer = RecordWriter(
            self.storage,
            self.metrics,
            worker_tag=self.tag,
            commit_interval_s=self.settings.commit_interval_s,
            shard_max_records=self.settings.shard_max_records,
            on_storage_error=self.jobs.set_storage_error,
        )
        self.writer.start()
        self._start_loops(probes)
        log.info(
            "worker %s started: servers up %s, queues %s",
            self.name,
            [s.name for s in self.fleet.servers if s.up],
            [i.queue.name for i in self.identities.values()],
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
        )

    def _start_loops(self, probes: list[HealthProbe]) -> None:
        reaper = Reaper(
            self.redis,
            self.keys,
            self.jobs,
            [identity.queue for identity in self.identities.values()],
            owner=self.name,
            interval_s=self.settings.reaper_interval_s,
            metrics=self.metrics,
        )
        loops = [
            self._heartbeat_loop(),
            self._abort_loop(),
            self.sync.run(),
            reaper.run(),
            *(p.run() for p in probes),
        ]
        if self.settings.kv_controller:
            loops += [self._kv_control(server).run() for server in self.fleet.servers]
        self._background = [asyncio.create_task(loop) for loop in loops]
        if self.settings.metrics_port:
            self._metrics_server = start_http_server(
                self.settings.metrics_port, registry=self.metrics.registry
            )
        if self.install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal)

    def _make_server(self, spec: ServerSpec) -> Server:
        client = SGLangClient(
            spec.name,
            spec.url,
            timeouts=ClientTimeouts(
                connect_s=self.settings.connect_timeout_s, read_s=self.settings.long_read_timeout_s
            ),
            max_connections=self.settings.short_concurrency + self.settings.long_concurrency,
            api_key=spec.api_key or self.settings.api_key,
        )
        limits = {
            PromptClass.SHORT: self.settings.short_concurrency,
            PromptClass.LONG: self.settings.long_concurrency,
        }
        return Server(spec.name, client, max_limits=limits, up=False)

    async def run(self) -> None:
        await asyncio.gather(*(self._admit(cls) for cls in PromptClass))

    def request_stop(self) -> None:
        self._stopping.set()
        self._slot_freed.set()

    async def drain(self) -> None:
        """Wait for in-flight prompts up to the drain timeout, then hand the rest back."""
        self.request_stop()
        self.sync.draining = True
        with contextlib.suppress(redis.RedisError):
            self.sync.publish()
        tasks = [t for group in self._tasks.values() for t in group]
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
        with contextlib.suppress(redis.RedisError):
            self.sync.withdraw()
        for identity in self.identities.values():
            identity.unregister()
        await asyncio.gather(*(s.client.aclose() for s in self.fleet.servers))
        if self._metrics_server is not None:
            http_server, _thread = self._metrics_server
            http_server.shutdown()
        self.redis.close()
        log.info("worker %s stopped", self.name)

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
            self._cancel([t for group in self._tasks.values() for t in group])

    @staticmethod
    def _cancel(tasks: object) -> None:
        for task in tasks:  # type: ignore[attr-defined]
            task.cancel()

    # Admission ----------------------------------------------------------------------------------
    async def _admit(self, cls: PromptClass) -> None:
        identity = self.identities[cls]
        tasks = self._tasks[cls]
        poll_s = self.settings.poll_interval_s
        outage_s = 0.0
        while not self._stopping.is_set():
            if self.burst and self._burst_done():
                return
            # Prompts waiting only for their shard commit no longer use a server slot.
            if cls in self.sync.paused_classes or self._generating[cls] >= self.fleet.capacity(cls):
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), timeout=poll_s)
                continue
            try:
                item = identity.claim(self.dispatch, cls)
                outage_s = 0.0
            except redis.RedisError as exc:
                if not outage_s:
                    log.warning("cannot claim %s prompts (Redis unreachable?): %s", cls.value, exc)
                outage_s = min(REDIS_RETRY_MAX_S, max(REDIS_RETRY_MIN_S, outage_s * 2))
                await asyncio.sleep(outage_s)
                continue
            if item is None:
                await asyncio.sleep(poll_s)
                continue
            self._generating[cls] += 1
            task = asyncio.create_task(self._process(identity, item, cls), name=item.job.id)
            tasks.add(task)
            self._task_jobs[task] = str((payload_of(item.job) or {}).get("job", ""))
            task.add_done_callback(tasks.discard)
            task.add_done_callback(self._task_done)

    def _burst_done(self) -> bool:
        """Burst mode ends when nothing runs here and no unpaused job has prompts to dispatch."""
        if any(self._tasks.values()):
            return False
        try:
            return all(
                identity.queue.count == 0 and not self.dispatch.has_work(cls)
                for cls, identity in self.identities.items()
            )
        except redis.RedisError:
            return False

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._task_jobs.pop(task, None)
        self._aborted.discard(task)
        self._slot_freed.set()

    # One prompt ---------------------------------------------------------------------------------
    async def _process(self, identity: QueueIdentity, item: InFlight, cls: PromptClass) -> None:
        job_id = (payload_of(item.job) or {}).get("job")
        try:
            if job_id is not None:
                await self._while_redis_down(lambda: self.jobs.started(job_id, item.job.id))
            finish = await self._outcome(identity, item, cls, job_id)
            await self._while_redis_down(finish, already_done=lambda: _is_final(item.job))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task in self._aborted and job_id is not None:
                # Its job was cancelled with abort: closing the request made SGLang abort it.
                await self._while_redis_down(functools.partial(self._cancelled, identity, item, job_id))
                return
            try:
                hook = (lambda pipe: self.jobs.handed_back(pipe, job_id, item.job.id)) if job_id else None
                identity.hand_back(item, hook)
            except redis.RedisError as exc:
                log.error("cannot hand %s back (Redis unreachable): the reaper will: %s", item.job.id, exc)
            raise
        finally:
            # Whatever happened, this worker no longer runs the job: stop heartbeating it, so that
            # if it was not finished the reaper hands it out again.
            identity.in_flight.discard(item)

    async def _outcome(
        self, identity: QueueIdentity, item: InFlight, cls: PromptClass, job_id: str | None
    ) -> Callable[[], None]:
        """Run the prompt; return the RQ transition that records how it ended."""
        try:
            try:
                payload = PromptPayload.from_json(item.job.args[0])
                record = await self._generate(item.job, payload, cls)
            finally:
                self._generating[cls] -= 1
                self._slot_freed.set()
            await self.writer.commit(record)
            following = await self._following_turn(payload, record)
        except FatalError as exc:
            return functools.partial(self._fail, identity, item, job_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must fail one prompt, not the worker
            log.exception("prompt %s crashed the task", item.job.id)
            return functools.partial(self._fail, identity, item, job_id, exc)
        return functools.partial(self._succeed, identity, item, record, following)

    async def _while_redis_down(
        self, step: Callable[[], T], *, already_done: Callable[[], bool] | None = None
    ) -> T:
        """Run a Redis step, retrying while Redis is unreachable (a restart must not lose work).

        ``already_done`` tells whether an earlier try went through although its reply was lost.
        """
        delay_s = REDIS_RETRY_MIN_S
        tried = False
        while True:
            try:
                if tried and already_done is not None and already_done():
                    return cast(T, None)
                tried = True
                return step()
            except redis.RedisError as exc:
                log.warning("Redis unreachable, retrying in %.1f s: %s", delay_s, exc)
                await asyncio.sleep(delay_s)
                delay_s = min(REDIS_RETRY_MAX_S, delay_s * 2)

    async def _following_turn(self, payload: PromptPayload, record: Record) -> PromptPayload | None:
        """Multi-turn ``all`` mode: the next turn to enqueue, unless it was enqueued before."""
        if payload.conversation is None:
            return None
        spec = self._job(payload.job).spec
        renderer = await asyncio.to_thread(renderer_for, spec)
        following = await asyncio.to_thread(next_turn, payload, record, spec, renderer)
        if following is None:
            return None
        member = prompt_key(following.sample_id, following.turn, following.gen)
        key = self.keys.job_enqueued(payload.job)
        if await self._while_redis_down(lambda: bool(self.redis.sismember(key, member))):
            return None
        return following

    def _succeed(
        self, identity: QueueIdentity, item: InFlight, record: Record, following: PromptPayload | None
    ) -> None:
        label = self.jobs.label_of(record.job_id, record.partition) if following is not None else ""

        def hook(pipe: Pipeline) -> None:
            self.jobs.count_done(
                pipe,
                record.job_id,
                item.job.id,
                record.output_len,
                partition=record.partition,
                cls=record.cls,
                finish=record.finish_type,
            )
            if following is not None:
                # In the same transaction as the done count: the job cannot complete in between.
                queues = {cls: identity.queue for cls, identity in self.identities.items()}
                options = _enqueue_options(item.job)
                enqueue_prompts(
                    pipe,
                    queues,
                    self.keys,
                    record.job_id,
                    [following],
                    options,
                    dispatch=self.dispatch,
                    priority=self._job(record.job_id).spec.priority,
                )
                self.jobs.add_prompt(
                    pipe, record.job_id, len(following.prompt_ids), label=label, cls=following.cls.value
                )

        identity.finish_success(item, hook)
        self._observe(record)
        log.info(
            "done %s server=%s class=%s prompt=%d output=%d finish=%s attempts=%d %.2fs",
            item.job.id,
            record.server,
            record.cls,
            record.prompt_len,
            record.output_len,
            record.finish_type,
            record.attempts,
            (record.finished_at_ms - record.started_at_ms) / 1000,
        )

    def _observe(self, record: Record) -> None:
        metrics = self.metrics
        metrics.finishes.labels(record.cls, record.finish_type).inc()
        metrics.output_length.labels(record.cls).observe(record.output_len)
        metrics.prompt_length.labels(record.cls).observe(record.prompt_len)
        if record.enqueued_at_ms is not None:
            metrics.time_to_result.labels(record.cls).observe(
                max(0.0, (now_ms() - record.enqueued_at_ms) / 1000)
            )

    def _fail(self, identity: QueueIdentity, item: InFlight, job_id: str | None, exc: BaseException) -> None:
        reason = type(exc).__name__
        if isinstance(exc.__cause__, RetryableError):
            # Retries ran out: the cause says why (timeouts, 5xx, aborts), not the FatalError wrapper.
            reason = f"gave_up_{type(exc.__cause__).__name__}"
        message = str(exc) or reason
        self.metrics.failures.labels(reason).inc()
        log.warning("failed %s: %s", item.job.id, message)
        report = {"rq_id": item.job.id, "reason": reason, "message": message, "at_ms": now_ms()}
        payload = payload_of(item.job) or {}
        report.update(sample_id=payload.get("sample_id"), turn=payload.get("turn"))
        where = {"partition": str(payload.get("partition", UNKNOWN)), "cls": str(payload.get("cls", UNKNOWN))}
        item.job.meta["failure_reason"] = reason  # what `datagen retry --reason` filters on

        def hook(pipe: Pipeline) -> None:
            pipe.hset(item.job.key, "meta", item.job.serializer.dumps(item.job.meta))
            if job_id is not None:
                self.jobs.count_failed(pipe, job_id, item.job.id, report, **where)

        identity.finish_failure(item, message, hook)

    def _cancelled(self, identity: QueueIdentity, item: InFlight, job_id: str) -> None:
        payload = payload_of(item.job) or {}
        where = {"partition": str(payload.get("partition", UNKNOWN)), "cls": str(payload.get("cls", UNKNOWN))}

        def hook(pipe: Pipeline) -> None:
            self.jobs.count_cancelled(pipe, job_id, item.job.id, **where)

        identity.finish_cancelled(item, hook)
        self.metrics.aborted.inc()
        log.info("aborted %s: its job %s was cancelled", item.job.id, job_id)

    def _job(self, job_id: str) -> _JobInfo:
        info = self._jobs_seen.get(job_id)
        if info is None:
            info = _JobInfo(
                self.jobs.spec(job_id),
                self.jobs.tokenizer_identity(job_id),
                tuple(self.jobs.stop_ids(job_id)),
            )
            self._jobs_seen[job_id] = info
        return info

    async def _generate(self, job: Job, payload: PromptPayload, cls: PromptClass) -> Record:
        job_info = self._job(payload.job)
        spec = job_info.spec
        # Samples of one prompt prefer one server, whose prefix cache then serves them.
        affinity = f"{payload.job}/{payload.sample_id}/{payload.turn}" if spec.samples > 1 else None
        attempts = int(job.meta.get("attempts", 0))
        started_at_ms = now_ms()
        tries = 0
        failed_on: set[str] = set()  # servers where this prompt timed out, got a 5xx or was aborted
        while True:
            tries += 1
            server = await self.fleet.acquire(cls, affinity=affinity, avoid=frozenset(failed_on))
            try:
                max_new = self._max_new_tokens(payload, server)
                params = spec.sampling_for(payload.gen, max_new)
                if job_info.stop_ids:
                    # The tokenizer's and generation_config.json's, so that a server started with
                    # another generation config still stops where the model does.
                    extra = params.get("stop_token_ids") or []
                    params["stop_token_ids"] = sorted(set(job_info.stop_ids) | set(extra))
                rid = f"{job.id}.a{tries}.{self.tag}"
                result = await self._call(server, cls, payload, params, rid)
            except RetryableError as exc:
                error: RetryableError = exc
            except ConfigError as exc:
                # 401/403 mid-run (the server was restarted with another key): keep off it, like
                # its probe would, and run the prompt elsewhere without charging an attempt.
                await self.fleet.refuse(server, f"{exc}. {API_KEY_HINT.format(name=server.name)}")
                error = ServerUnavailableError(str(exc))
            else:
                enqueued_at_ms = int(job.enqueued_at.timestamp() * 1000) if job.enqueued_at else None
                timing = (enqueued_at_ms, started_at_ms)
                return self._record(
                    payload, job_info.tokenizer, result, server, rid, attempts + 1, timing, max_new, params
                )
            finally:
                await self.fleet.release(server, cls)
            if not error.server_fault:
                failed_on.add(server.name)
            attempts = await self._after_retryable(job, server, error, attempts, tries)
            await asyncio.sleep(self._backoff_s(tries))

    async def _after_retryable(
        self, job: Job, server: Server, error: RetryableError, attempts: int, tries: int
    ) -> int:
        """Decide whether to try again; returns the attempts charged so far or raises FatalError."""
        self.metrics.retries.labels(type(error).__name__).inc()
        if error.server_fault:
            await self.fleet.mark_down(server, str(error))
            if tries >= self.settings.max_attempts * SERVER_FAULT_TRIES_PER_ATTEMPT:
                raise FatalError(
                    f"gave up after {tries} requests to servers that kept failing: {error}"
                ) from error
            log.info("retrying %s elsewhere (server %s down): %s", job.id, server.name, error)
            return attempts
        attempts += 1
        job.meta["attempts"] = attempts
        await self._while_redis_down(job.save_meta)
        if attempts >= self.settings.max_attempts:
            raise FatalError(f"gave up after {attempts} attempts: {error}") from error
        log.info(
            "retrying %s (attempt %d of %d): %s", job.id, attempts + 1, self.settings.max_attempts, error
        )
        return attempts

    def _backoff_s(self, tries: int) -> float:
        ceiling = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (tries - 1))
        return random.uniform(ceiling / 2, ceiling)

    async def _call(
        self, server: Server, cls: PromptClass, payload: PromptPayload, params: dict[str, object], rid: str
    ) -> GenerateResult:
        read_timeout_s = (
            self.settings.short_read_timeout_s
            if cls is PromptClass.SHORT
            else self.settings.long_read_timeout_s
        )
        labels = (server.name, cls.value)
        started = time.perf_counter()
        try:
            result = await server.client.generate(
                payload.prompt_ids, params, rid=rid, read_timeout_s=read_timeout_s
            )
        except RetryableError:
            self.metrics.requests.labels(*labels, "retryable").inc()
            raise
        except FatalError:
            self.metrics.requests.labels(*labels, "fatal").inc()
            raise
        self.metrics.request_latency.labels(*labels).observe(time.perf_counter() - started)
        self.metrics.requests.labels(*labels, "ok").inc()
        self.metrics.prompt_tokens.labels(*labels).inc(len(payload.prompt_ids))
        self.metrics.generated_tokens.labels(*labels).inc(len(result.output_ids))
        return result

    @staticmethod
    def _max_new_tokens(payload: PromptPayload, server: Server) -> int:
        if server.context_len is None:
            return payload.max_new_tokens
        # SGLang refuses prompt + max_new_tokens that reach the context length, so keep one token clear.
        room = server.context_len - len(payload.prompt_ids) - 1
        if room < 1:
            raise FatalError(
                f"prompt has {len(payload.prompt_ids)} tokens and leaves no room to generate within "
                f"server {server.name}'s context length of {server.context_len} tokens"
            )
        return min(payload.max_new_tokens, room)

    def _record(
        self,
        payload: PromptPayload,
        tokenizer: str,
        result: GenerateResult,
        server: Server,
        rid: str,
        attempts: int,
        timing: tuple[int | None, int],
        max_new: int,
        params: dict[str, object],
    ) -> Record:
        finish = result.finish
        return Record(
            job_id=payload.job,
            sample_id=payload.sample_id,
            turn=payload.turn,
            gen=payload.gen,
            partition=payload.partition,
            cls=payload.cls.value,
            input_ids=payload.prompt_ids + result.output_ids,
            prompt_len=len(payload.prompt_ids),
            finish_type=finish.type.value,
            finish_matched=None if finish.matched is None else str(finish.matched),
            finish_length=finish.length,
            max_new_tokens=max_new,
            server=server.name,
            tokenizer=tokenizer,
            sampling_params=json.dumps(params, sort_keys=True),
            rid=rid,
            worker=self.name,
            attempts=attempts,
            cached_tokens=result.cached_tokens,
            num_retractions=result.num_retractions,
            e2e_latency_s=result.e2e_latency_s,
            enqueued_at_ms=timing[0],
            started_at_ms=timing[1],
            finished_at_ms=now_ms(),
        )

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
        )

    async def _abort_loop(self) -> None:
        """Abort in-flight prompts of jobs cancelled with ``--abort-in-flight`` (as FleetSync last
        read them)."""
        while True:
            await asyncio.sleep(self.settings.control_interval_s)
            aborting = self.sync.aborting_jobs
            if not aborting:
                continue
            for task, job_id in list(self._task_jobs.items()):
                if job_id in aborting and task not in self._aborted and not task.done():
                    self._aborted.add(task)
                    task.cancel()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                for identity in self.identities.values():
                    identity.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed (Redis unreachable?): %s", exc)


def _enqueue_options(job: Job) -> EnqueueOptions:
    """The coordinator's enqueue settings, as stored on the job that precedes the new one."""
    stored = job.meta.get("enqueue") or {}
    return EnqueueOptions(
        result_ttl_s=int(stored.get("result_ttl_s", job.result_ttl or DEFAULT_RESULT_TTL_S)),
        failure_ttl_s=int(stored.get("failure_ttl_s", job.failure_ttl or DEFAULT_FAILURE_TTL_S)),
        max_worker_losses=int(stored.get("max_worker_losses", DEFAULT_MAX_WORKER_LOSSES)),
    )


def _is_final(job: Job) -> bool:
    """Whether RQ already has the job finished or failed (a retried transition that went through)."""
    return job.get_status(refresh=True) in (JobStatus.FINISHED, JobStatus.FAILED)
