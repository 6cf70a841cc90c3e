"""One prompt's generation: pick a server, send the request, retry with backoff, build the record.

Retryable errors are retried inside the task (attempts in ``job.meta``). A server fault (the
server is down or unreachable) sends the prompt elsewhere without charging an attempt; any other
retryable error charges one and keeps the prompt off that server. :class:`FatalError` ends it.
A request in flight on a server that its health probe finds hung or unreachable is abandoned
(cancelled, its connection closed) and counts as a server fault, instead of waiting for its read
timeout (`workers.fleet.servers.Fleet.mark_down`).

At the end of a run a request may race a backup on a faster idle server (`workers.run.backup`): the
first answer makes the record (its ``server`` and ``rid``, which ends ``b.<tag>`` for a backup),
the other request is cancelled. One prompt gets at most one backup.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rq.job import Job

from datagen.clock import now_ms
from datagen.control.payload import PromptPayload
from datagen.control.rq_format import ATTEMPTS
from datagen.errors import ConfigError, FatalError, RetryableError, ServerUnavailableError
from datagen.records.schema import GIVEN_FINISH, Record
from datagen.settings import WorkerSettings
from datagen.states import PromptClass
from workers.engines.base import GenerateResult
from workers.fleet.health import API_KEY_HINT
from workers.fleet.servers import Fleet, Server
from workers.metrics import WorkerMetrics
from workers.run.backup import Backups, Straggler
from workers.run.jobinfo import JobInfos
from workers.run.redisretry import while_redis_down

__all__ = ["Generator", "max_new_tokens", "unless_lost"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A prompt may wait out server outages without using attempts, but not forever: a server that
# answers /health yet drops every request would otherwise loop.
SERVER_FAULT_TRIES_PER_ATTEMPT = 25


class Generator:
    def __init__(
        self,
        settings: WorkerSettings,
        fleet: Fleet,
        metrics: WorkerMetrics,
        job_infos: JobInfos,
        *,
        worker_name: str,
        tag: str,
        backups: Backups | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.metrics = metrics
        self.job_infos = job_infos
        self.worker_name = worker_name
        self.tag = tag
        self.backups = backups

    async def generate(self, job: Job, payload: PromptPayload, cls: PromptClass) -> Record:
        job_info = self.job_infos.get(payload.job, payload.incarnation)
        spec = job_info.spec
        arm = spec.arm_named(payload.arm)
        # Samples of one prompt prefer one server, whose prefix cache then serves them.
        affinity = f"{payload.job}/{payload.sample_id}/{payload.turn}" if spec.samples > 1 else None
        attempts = int(job.meta.get(ATTEMPTS, 0))
        started_at_ms = now_ms()
        tries = 0
        failed_on: set[str] = set()  # servers where this prompt timed out, got a 5xx or was aborted
        backed_up = False
        while True:
            tries += 1
            server = await self.fleet.acquire(cls, affinity=affinity, avoid=frozenset(failed_on))
            straggler: Straggler | None = None
            try:
                max_new = max_new_tokens(payload, server)
                params = spec.sampling_for(payload.gen, max_new, arm)
                if job_info.stop_ids:
                    # The tokenizer's and generation_config.json's, so that a server started with
                    # another generation config still stops where the model does.
                    extra = params.get("stop_token_ids") or []
                    params["stop_token_ids"] = sorted(set(job_info.stop_ids) | set(extra))
                rid = f"{job.id}.a{tries}.{self.tag}"
                if self.backups is not None and self.backups.enabled and not backed_up:
                    fits = _same_max_new(payload, max_new)
                    avoid = frozenset(failed_on)
                    straggler = self.backups.track(server, cls, max_new=max_new, fits=fits, avoid=avoid)
                    answered, rid, result = await self._race(
                        self.backups, straggler, payload, params, rq_id=job.id, tries=tries
                    )
                else:
                    answered, result = server, await self._call(server, cls, payload, params, rid)
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
                kwargs_json = spec.template_kwargs_json(arm)
                return self._record(
                    payload,
                    job_info.tokenizer,
                    result,
                    answered,
                    rid,
                    attempts + 1,
                    timing,
                    (max_new, params, kwargs_json),
                )
            finally:
                await self.fleet.release(server, cls)
                if self.backups is not None:
                    backed_up = backed_up or (straggler is not None and straggler.backup_server is not None)
                    self.backups.freed(cls)
            if not error.server_fault:
                failed_on.add(server.name)
            attempts = await self._after_retryable(job, server, error, attempts, tries)
            await asyncio.sleep(self._backoff_s(tries))

    def given(self, job: Job, payload: PromptPayload, tokenizer: str) -> Record:
        """A capture-only job's record: the row's sequence as it came, nothing generated (its
        features are what the job captures)."""
        assert payload.given_prompt_len is not None
        enqueued_at_ms = int(job.enqueued_at.timestamp() * 1000) if job.enqueued_at else None
        started_at_ms = now_ms()
        return Record(
            job_id=payload.job,
            sample_id=payload.sample_id,
            turn=payload.turn,
            gen=payload.gen,
            partition=payload.partition,
            cls=payload.cls.value,
            input_ids=list(payload.prompt_ids),
            prompt_len=payload.given_prompt_len,
            finish_type=GIVEN_FINISH,
            finish_matched=None,
            finish_length=None,
            max_new_tokens=0,
            server="",
            tokenizer=tokenizer,
            sampling_params="{}",
            rid=f"{job.id}.given.{self.tag}",
            worker=self.worker_name,
            attempts=1,
            cached_tokens=0,
            num_retractions=0,
            e2e_latency_s=None,
            enqueued_at_ms=enqueued_at_ms,
            started_at_ms=started_at_ms,
            finished_at_ms=started_at_ms,
        )

    async def _race(
        self,
        backups: Backups,
        straggler: Straggler,
        payload: PromptPayload,
        params: dict[str, object],
        *,
        rq_id: str,
        tries: int,
    ) -> tuple[Server, str, GenerateResult]:
        """The request, raced against a backup if one is offered; the server and rid that answered."""
        server, cls = straggler.server, straggler.cls
        rid, backup_rid = f"{rq_id}.a{tries}.{self.tag}", f"{rq_id}.a{tries}b.{self.tag}"
        backup = functools.partial(self._call, cls=cls, payload=payload, params=params, rid=backup_rid)
        primary = self._call(server, cls, payload, params, rid)
        answered, result = await backups.race(straggler, primary, backup, name=rq_id)
        return answered, (rid if answered is server else backup_rid), result

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
        job.meta[ATTEMPTS] = attempts
        await while_redis_down(job.save_meta)
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
            request = server.client.generate(
                payload.prompt_ids, params, rid=rid, read_timeout_s=read_timeout_s
            )
            result = await unless_lost(server, request)
        except RetryableError:
            self.metrics.requests.labels(*labels, "retryable").inc()
            raise
        except FatalError:
            self.metrics.requests.labels(*labels, "fatal").inc()
            raise
        latency_s = time.perf_counter() - started
        server.observe(latency_s, len(result.output_ids))
        self.metrics.request_latency.labels(*labels).observe(latency_s)
        self.metrics.requests.labels(*labels, "ok").inc()
        self.metrics.prompt_tokens.labels(*labels).inc(len(payload.prompt_ids))
        self.metrics.generated_tokens.labels(*labels).inc(len(result.output_ids))
        return result

    def _record(
        self,
        payload: PromptPayload,
        tokenizer: str,
        result: GenerateResult,
        server: Server,
        rid: str,
        attempts: int,
        timing: tuple[int | None, int],
        sent: tuple[int, dict[str, object], str],
    ) -> Record:
        """``sent``: the max_new_tokens, sampling params and template variables (JSON) the record was
        made with."""
        max_new, params, kwargs_json = sent
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
            worker=self.worker_name,
            attempts=attempts,
            cached_tokens=result.cached_tokens,
            num_retractions=result.num_retractions,
            e2e_latency_s=result.e2e_latency_s,
            enqueued_at_ms=timing[0],
            started_at_ms=timing[1],
            finished_at_ms=now_ms(),
            arm=payload.arm,
            chat_template_kwargs=kwargs_json,
        )


async def unless_lost(server: Server, request: Coroutine[Any, Any, T]) -> T:
    """``request``'s answer, unless a probe finds ``server`` hung or unreachable first: then the
    request is cancelled (its connection closed) and the prompt goes elsewhere with no attempt
    charged, instead of waiting for the read timeout."""
    answer = asyncio.ensure_future(request)
    lost = asyncio.ensure_future(server.lost().wait())
    try:
        await asyncio.wait({answer, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not answer.done():
            answer.cancel()
            # Shielded: a second cancel must not leave the request open.
            await asyncio.shield(asyncio.gather(answer, return_exceptions=True))
    if answer.cancelled():
        raise ServerUnavailableError(
            f"server {server.name} stopped answering its health probes with this request in flight"
        )
    return answer.result()


def _same_max_new(payload: PromptPayload, max_new: int) -> Callable[[Server], bool]:
    """Whether a backup on a server would get the same ``max_new_tokens`` (its context may be
    shorter): only then is it the same request."""

    def fits(server: Server) -> bool:
        try:
            return max_new_tokens(payload, server) == max_new
        except FatalError:
            return False

    return fits


def max_new_tokens(payload: PromptPayload, server: Server) -> int:
    """The prompt's ``max_new_tokens``, capped so that it fits in ``server``'s context."""
    if server.context_len is None:
        return payload.max_new_tokens
    # SGLang refuses prompt + max_new_tokens that reach the context length, so keep one token clear;
    # vLLM would lower max_tokens to fit instead, silently, which this sizing keeps from happening.
    room = server.context_len - len(payload.prompt_ids) - 1
    if room < 1:
        raise FatalError(
            f"prompt has {len(payload.prompt_ids)} tokens and leaves no room to generate within "
            f"server {server.name}'s context length of {server.context_len} tokens"
        )
    return min(payload.max_new_tokens, room)
