"""The performance model: one asyncio scheduler loop over a KV pool counted in tokens.

Each iteration is either a prefill of newly admitted requests or one decode step that adds a
token to every running request, the way SGLang's scheduler favours prefill. Costs are simulated
seconds multiplied by ``time_scale``; the loop sleeps only when it runs ahead of that clock, so
at small scales it costs one ``asyncio.sleep(0)`` per step and never busy-waits.

Admission is FIFO and the head blocks: a request enters only when its prompt plus
``ratio * min(max_new_tokens, clip)`` fits beside what the running requests have reserved
(their tokens so far plus ``ratio`` times their remaining clipped budget). ``ratio`` starts at
``reserve_fraction``; after a retraction it jumps to 1.0 and decays back, like SGLang's
``new_token_ratio``. When a decode step would overflow the pool the most recently admitted
requests are retracted to the front of the queue and restart from scratch; a lone request that
still does not fit is aborted with SGLang's out-of-memory 500.

Outputs never depend on scheduling: every request ends with the ids it was given up front.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

from simulator.config import SimConfig
from simulator.model import SimOutput

__all__ = ["OOM_MESSAGE", "Engine", "EngineMetrics", "Outcome", "SimRequest"]

logger = logging.getLogger(__name__)

OOM_MESSAGE = (
    "Out of memory even after retracting all other requests in the decode batch. Aborting the last request."
)
# Below this the loop yields instead of sleeping: the event loop cannot sleep that precisely,
# and the next step settles the debt because the clock is cumulative.
MIN_SLEEP_S = 0.001
# SGLang averages gen_throughput over --decode-log-interval decode steps.
DECODE_LOG_INTERVAL = 40
# Steps over which the reservation ratio decays back to reserve_fraction after a retraction.
RESERVE_DECAY_STEPS = 600


class EngineMetrics(Protocol):
    """What the engine records; each front end's metrics module gives the series its server's names."""

    token_usage: Gauge
    num_used_tokens: Gauge
    num_running_reqs: Gauge
    num_queue_reqs: Gauge
    gen_throughput: Gauge
    num_retracted_requests: Counter
    queue_time_seconds: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    num_requests: Counter
    num_aborted_requests: Counter
    e2e_request_latency_seconds: Histogram
    time_to_first_token_seconds: Histogram
    inter_token_latency_seconds: Histogram

    def set_constants(self, *, max_total_num_tokens: int, context_len: int) -> None: ...


class Outcome(StrEnum):
    FINISHED = "finished"  # stop or length, with the whole planned output
    ABORTED_RUNNING = "aborted_running"  # partial output, finish_reason "Aborted"
    ABORTED_WAITING = "aborted_waiting"  # never ran, finish_reason "Abort in waiting queue"
    OUT_OF_MEMORY = "out_of_memory"  # HTTP 500 on a real server


@dataclass(eq=False)
class SimRequest:
    """One request as the scheduler sees it; ``done`` is set once ``outcome`` is final."""

    rid: str
    prompt_len: int
    max_new_tokens: int
    output: SimOutput
    # Fault injection: abort once this many tokens exist (must be below the output length).
    abort_after: int | None = None
    log_metrics: bool = True

    generated: int = 0
    num_retractions: int = 0
    outcome: Outcome | None = None
    arrived_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _running: bool = False
    _admit_seq: int = 0

    @property
    def target_len(self) -> int:
        full = len(self.output.output_ids)
        return full if self.abort_after is None else min(self.abort_after, full)

    @property
    def output_ids(self) -> list[int]:
        """The ids produced so far (all of them once finished)."""
        return self.output.output_ids[: self.generated]


class Engine:
    """Waiting queue, running batch and KV pool of one simulated server."""

    def __init__(self, config: SimConfig, metrics: EngineMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._capacity = config.max_total_num_tokens
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._by_rid: dict[str, SimRequest] = {}
        self._used_tokens = 0
        self._ratio = config.reserve_fraction
        self._admit_seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._clock = 0.0
        self._tp_tokens = 0
        self._tp_steps = 0
        self._tp_since = 0.0
        self._gen_throughput = 0.0
        metrics.set_constants(max_total_num_tokens=self._capacity, context_len=config.context_len)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="simulator-scheduler")

    async def close(self) -> None:
        """Stop the loop and release every waiter with an abort."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in list(self._by_rid.values()):
            self._finish(req, Outcome.ABORTED_RUNNING if req._running else Outcome.ABORTED_WAITING)

    # -- requests --------------------------------------------------------------------------

    def in_flight(self, rid: str) -> bool:
        return rid in self._by_rid

    def submit(self, req: SimRequest) -> None:
        if req.rid in self._by_rid:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        req.arrived_at = self._now()
        self._by_rid[req.rid] = req
        self._waiting.append(req)
        self._publish()
        self._wake.set()

    def abort(self, rid: str, *, abort_all: bool = False) -> int:
        """Abort every request whose rid starts with ``rid`` (SGLang's prefix match)."""
        if not rid and not abort_all:
            return 0
        matched = [r for r in self._by_rid.values() if abort_all or r.rid.startswith(rid)]
        for req in matched:
            self._finish(req, Outcome.ABORTED_RUNNING if req._running else Outcome.ABORTED_WAITING)
        self._publish()
        return len(matched)

    # -- gauges ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    @property
    def used_tokens(self) -> int:
        return self._used_tokens

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    @property
    def token_usage(self) -> float:
        return round(self._used_tokens / self._capacity, 2)

    @property
    def gen_throughput(self) -> float:
        return self._gen_throughput

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception:
            # A bug here must not leave HTTP handlers waiting forever.
            logger.exception("simulated scheduler crashed; aborting every request")
            for req in list(self._by_rid.values()):
                self._finish(req, Outcome.ABORTED_RUNNING if req._running else Outcome.ABORTED_WAITING)

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._go_idle()
                await self._wake.wait()
                self._wake.clear()
                self._tp_since = self._clock = self._now()  # an idle spell earns no lag
                continue
            admitted = self._admit()
            if admitted:
                self._publish()
                await self._pace(self._config.prefill_s_per_token * sum(r.prompt_len for r in admitted))
                self._after_prefill(admitted)
            else:
                self._make_room()
                if self._running:
                    batch = len(self._running)
                    step_s = self._config.decode_step_base_s + self._config.decode_step_per_req_s * batch
                    await self._pace(step_s)
                    self._after_decode()
            self._publish()

    async def _pace(self, cost_s: float) -> None:
        now = self._now()
        # Within max_lag_s of real time the clock catches up on sleeps that ended late (a GPU does
        # not wait for the host to schedule a process); beyond it a host that cannot keep up makes
        # the simulation slower rather than later steps free.
        self._clock = max(self._clock, now - self._config.max_lag_s) + cost_s * self._config.time_scale
        delay = self._clock - now
        await asyncio.sleep(delay if delay >= MIN_SLEEP_S else 0)

    def _admit(self) -> list[SimRequest]:
        if not self._waiting:
            return []
        cfg = self._config
        reserved = sum(self._reservation(r) for r in self._running)
        prefill_left = cfg.max_prefill_tokens
        admitted: list[SimRequest] = []
        while self._waiting and len(self._running) < cfg.max_running_requests:
            head = self._waiting[0]
            need = head.prompt_len + math.ceil(
                self._ratio * min(head.max_new_tokens, cfg.clip_max_new_tokens)
            )
            # An idle server always takes the head, or an oversized request would block forever;
            # the first prompt of a prefill batch may exceed the budget (chunked prefill's job).
            if self._running and reserved + need > self._capacity:
                break
            if admitted and head.prompt_len > prefill_left:
                break
            self._waiting.popleft()
            head._running = True
            head._admit_seq = next(self._admit_seq)
            self._running.append(head)
            self._used_tokens += head.prompt_len
            reserved += need
            prefill_left -= head.prompt_len
            now = self._now()
            if head.admitted_at is None:
                head.admitted_at = now
                self._metrics.queue_time_seconds.observe(now - head.arrived_at)
            admitted.append(head)
        return admitted

    def _reservation(self, req: SimRequest) -> int:
        budget = min(req.max_new_tokens, self._config.clip_max_new_tokens)
        return req.prompt_len + req.generated + math.ceil(self._ratio * max(0, budget - req.generated))

    def _after_prefill(self, admitted: list[SimRequest]) -> None:
        # Prefill samples the first output token, as SGLang's extend step does.
        now = self._now()
        for req in admitted:
            if req.outcome is not None:  # aborted while the prefill was "running"
                continue
            req.first_token_at = req.first_token_at or now
            if req.target_len > 0:
                req.generated = 1
                self._used_tokens += 1
            if req.generated >= req.target_len:
                self._complete(req)

    def _make_room(self) -> None:
        # Every running request needs one more KV slot for the coming step.
        while self._running and self._used_tokens + len(self._running) > self._capacity:
            if len(self._running) == 1:
                self._finish(self._running[0], Outcome.OUT_OF_MEMORY)
                return
            victim = max(self._running, key=lambda r: r._admit_seq)
            self._retract(victim)

    def _retract(self, req: SimRequest) -> None:
        self._running.remove(req)
        req._running = False
        self._used_tokens -= req.prompt_len + req.generated
        req.generated = 0
        req.num_retractions += 1
        self._waiting.appendleft(req)
        self._ratio = 1.0
        self._metrics.num_retracted_requests.inc()
        logger.debug("retracted %s (retraction %d)", req.rid, req.num_retractions)

    def _after_decode(self) -> None:
        batch = self._running
        for req in batch:
            req.generated += 1
        self._used_tokens += len(batch)
        self._running = [r for r in batch if r.generated < r.target_len]
        for req in batch:
            if req.generated >= req.target_len:
                self._complete(req)
        self._account_throughput(len(batch))
        floor = self._config.reserve_fraction
        if self._ratio > floor:
            self._ratio = max(floor, self._ratio - (1.0 - floor) / RESERVE_DECAY_STEPS)

    def _account_throughput(self, tokens: int) -> None:
        self._tp_tokens += tokens
        self._tp_steps += 1
        if self._tp_steps >= DECODE_LOG_INTERVAL:
            now = self._now()
            elapsed = now - self._tp_since
            if elapsed > 0:
                self._gen_throughput = self._tp_tokens / elapsed
            self._tp_tokens = 0
            self._tp_steps = 0
            self._tp_since = now

    def _complete(self, req: SimRequest) -> None:
        aborting = req.abort_after is not None and req.abort_after < len(req.output.output_ids)
        self._finish(req, Outcome.ABORTED_RUNNING if aborting else Outcome.FINISHED)

    def _finish(self, req: SimRequest, outcome: Outcome) -> None:
        if req.outcome is not None:
            return
        req.outcome = outcome
        req.finished_at = self._now()
        if req._running:
            req._running = False
            self._used_tokens -= req.prompt_len + req.generated
            if req in self._running:
                self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        self._by_rid.pop(req.rid, None)
        self._record(req)
        req.done.set()

    def _record(self, req: SimRequest) -> None:
        m = self._metrics
        if req.outcome in (Outcome.ABORTED_RUNNING, Outcome.ABORTED_WAITING):
            m.num_aborted_requests.inc()
        # SGLang does not count requests aborted in the waiting queue, nor log_metrics=false ones.
        if not req.log_metrics or req.outcome is Outcome.ABORTED_WAITING:
            return
        assert req.finished_at is not None
        m.num_requests.inc()
        m.prompt_tokens.inc(req.prompt_len)
        m.generation_tokens.inc(req.generated)
        m.e2e_request_latency_seconds.observe(req.finished_at - req.arrived_at)
        if req.first_token_at is not None:
            m.time_to_first_token_seconds.observe(req.first_token_at - req.arrived_at)
            if req.generated > 1:
                # One observation per request (its mean gap) instead of one per token keeps
                # the metrics cheap; the histogram's shape is the same for steady decoding.
                m.inter_token_latency_seconds.observe(
                    (req.finished_at - req.first_token_at) / (req.generated - 1)
                )

    def _go_idle(self) -> None:
        self._gen_throughput = 0.0
        self._tp_tokens = 0
        self._tp_steps = 0
        self._publish()

    def _publish(self) -> None:
        m = self._metrics
        m.num_running_reqs.set(len(self._running))
        m.num_queue_reqs.set(len(self._waiting))
        m.num_used_tokens.set(self._used_tokens)
        m.token_usage.set(self.token_usage)
        m.gen_throughput.set(self._gen_throughput)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()
