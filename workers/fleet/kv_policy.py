"""The KV-pressure controller's policy, as pure functions: keep "just enough" in flight on each server.

:mod:`workers.fleet.kv_control` runs it against Redis and the server; this module only decides.

SGLang admits a request only when its prompt plus a reserve for its ``max_new_tokens`` fits in
the KV pool; what is sent beyond that waits in the *server's* queue, where it cannot move to a
server that frees up, dies with a restart and ignores a paused queue. So the controller moves a
server's in-flight target (a total over both classes, shared by every worker that lists the
server) between a floor and the configured maximum.

It starts small, in *slow start* (like TCP's): a new server, or one that restarted, gets a window
of a few requests (``controller_initial_target``) that grows by half at each sample while the
window is in use, no more than the setpoint (below) waits in the server's queue and KV usage has
headroom (the growth is also capped where the current usage per running request says the pool
would be full). The first sign of the server's limit (a queue beyond the setpoint, retractions, a
full pool) or the ceiling ends slow start, and the steady rules take over.

The steady rules hold a small queue at the server, the *setpoint* (four requests, or 3 % of those
running): a KV-bound server frees room whenever a request ends, and a long one frees room for
several new ones at once, so what waits there is what it admits at once instead of idling until
the worker's next requests arrive; more only parks work where it cannot move.

- retractions since the last sample: the pool overflowed during decode, cut the target by 30 %;
- more than the setpoint waiting in the server's queue: cut the target by the excess, and to what
  the server holds plus the setpoint if that is less, so the queue comes back to the setpoint;
- less than the setpoint waiting, the target in use (running + waiting near it) and KV usage with
  headroom: grow by the shortfall or 5 %, whichever is more.

Measured on the project's simulator (``bench/README.md``, "Fourth pass" and "Fifth pass"), whose
pool turns over in about a second: the first rules (a queue of one at most, cut to what runs) ran
24.5 to 25.0 requests where 27 fit, and the user's whole run came to 0.90 of a plain client's. With
a floor of four for the setpoint, not two, the steady state came to 0.958 of a fixed limit's in the
same runs, not 0.937 (the whole run, 1.7 % behind that fixed limit's, did not move; against a plain
client it came to 0.94-0.98, mean 0.959); the server queue p95 stays 0.27 to 0.47 of the running
requests.

It reads the server's ``/metrics`` in either name form (``sglang:`` or ``sglang_``; for vLLM
``vllm:kv_cache_usage_perc``, ``num_requests_running``, ``num_requests_waiting`` and
``num_preemptions_total``, a preemption counting as a retraction), summing over data-parallel
ranks. A counter that went down (requests served, retractions) means the server
restarted, which starts slow start again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "VLLM_PREFIXES",
    "VLLM_SIGNALS",
    "Decision",
    "KvSignals",
    "decide",
    "parse_kv_signals",
    "restarted",
]

RETRACTION_BACKOFF = 0.7
GROWTH = 0.05
# About what one long answer's end frees room for on a small pool (five new requests on the simulator's).
QUEUE_SETPOINT_MIN = 4
QUEUE_SETPOINT_FRACTION = 0.03
USAGE_HIGH = 0.9
BINDING_FRACTION = 0.9
# Slow start's growth per sample: 1.5 rather than TCP's 2, so that the step that finds the
# server's limit parks at most a third of what runs in its queue.
SLOW_START_GROWTH = 1.5

# Metric name (without prefix and ``_total``) -> KvSignals field, per engine.
SGLANG_SIGNALS = {
    "token_usage": "token_usage",
    "num_queue_reqs": "num_queue_reqs",
    "num_running_reqs": "num_running_reqs",
    "num_retracted_requests": "retracted_total",
    "max_total_num_tokens": "max_total_num_tokens",
    "num_requests": "requests_total",
}
# vLLM's preemption is SGLang's retraction (the request loses its KV blocks and recomputes them
# later); requests served are summed over ``finished_reason``. vLLM has no KV capacity gauge.
VLLM_SIGNALS = {
    "kv_cache_usage_perc": "token_usage",
    "num_requests_waiting": "num_queue_reqs",
    "num_requests_running": "num_running_reqs",
    "num_preemptions": "retracted_total",
    "request_success": "requests_total",
}
SGLANG_PREFIXES = ("sglang:", "sglang_")
VLLM_PREFIXES = ("vllm:", "vllm_")


@dataclass(frozen=True)
class KvSignals:
    token_usage: float | None = None
    num_queue_reqs: float = 0.0
    num_running_reqs: float = 0.0
    retracted_total: float | None = None
    max_total_num_tokens: float | None = None
    requests_total: float | None = None  # requests the server has served since it started

    def to_json(self) -> dict[str, float | None]:
        return {
            "token_usage": self.token_usage,
            "num_queue_reqs": self.num_queue_reqs,
            "num_running_reqs": self.num_running_reqs,
            "retracted_total": self.retracted_total,
            "max_total_num_tokens": self.max_total_num_tokens,
            "requests_total": self.requests_total,
        }

    @classmethod
    def from_json(cls, values: dict[str, float | None]) -> KvSignals:
        """The inverse of :meth:`to_json`; unknown keys (an older or newer worker) are ignored."""
        return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})  # type: ignore[arg-type]


def _signal_name(family: str, prefixes: tuple[str, ...], signals: Mapping[str, str]) -> str | None:
    for prefix in prefixes:
        if family.startswith(prefix):
            name = family[len(prefix) :]
            return signals.get(name.removesuffix("_total"))
    return None


def parse_kv_signals(
    text: str,
    *,
    prefixes: tuple[str, ...] = SGLANG_PREFIXES,
    signals: Mapping[str, str] = SGLANG_SIGNALS,
) -> KvSignals:
    """The controller's inputs from a Prometheus text page; absent signals stay None/0.

    Counts are summed over data-parallel ranks (SGLang's ``dp_rank``, vLLM's ``engine`` label);
    KV usage, a fraction per rank, is the fullest rank's.
    """
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        field = _signal_name(family.name, prefixes, signals)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            values.setdefault(field, []).append(float(sample.value))
    usage = values.get("token_usage")
    retracted = values.get("retracted_total")
    capacity = values.get("max_total_num_tokens")
    requests = values.get("requests_total")
    return KvSignals(
        token_usage=max(usage) if usage else None,
        num_queue_reqs=sum(values.get("num_queue_reqs", [0.0])),
        num_running_reqs=sum(values.get("num_running_reqs", [0.0])),
        retracted_total=sum(retracted) if retracted else None,
        max_total_num_tokens=sum(capacity) if capacity else None,
        requests_total=sum(requests) if requests else None,
    )


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str | None  # None: unchanged
    slow_start: bool = False  # still in slow start after this decision


def decide(
    target: int,
    previous: KvSignals | None,
    current: KvSignals,
    *,
    floor: int,
    ceiling: int,
    slow_start: bool = False,
    usable: int | None = None,
) -> Decision:
    """The next in-flight target for one server.

    ``usable``: how much of the target the prompt classes that have work can use (the target is
    a total over both classes; a job of long prompts alone uses only the long share of it). The
    target counts as in use when the server runs or queues nearly that many. None: all of it.
    """
    used = target if usable is None else max(1, min(target, usable))
    in_use = current.num_running_reqs + current.num_queue_reqs >= BINDING_FRACTION * used
    if slow_start:
        grown = _slow_start_growth(target, current, used)
        return _slow_start(
            target, previous, current, floor=floor, ceiling=ceiling, in_use=in_use, grown=grown
        )
    return _steady(target, previous, current, floor=floor, ceiling=ceiling, in_use=in_use)


def _slow_start_growth(target: int, current: KvSignals, used: int) -> int:
    grown = max(target + 1, math.floor(target * SLOW_START_GROWTH))
    usage, running = current.token_usage, current.num_running_reqs
    if usage and running:
        # What the pool holds at the current usage per running request (a low estimate while the
        # running requests are young, so slow start never stops on it, only grows slower), in
        # units of the target, of which the classes with work use ``used``.
        fits = running * USAGE_HIGH / usage * target / used
        grown = min(grown, max(target + 1, math.floor(fits)))
    return grown


def _slow_start(
    target: int,
    previous: KvSignals | None,
    current: KvSignals,
    *,
    floor: int,
    ceiling: int,
    in_use: bool,
    grown: int,
) -> Decision:
    queue, running, usage = current.num_queue_reqs, current.num_running_reqs, current.token_usage
    limit_seen = (
        _retractions(previous, current) > 0
        or _above_setpoint(queue, running)
        or (usage is not None and usage >= USAGE_HIGH)
    )
    if limit_seen:
        steady = _steady(target, previous, current, floor=floor, ceiling=ceiling, in_use=in_use)
        cause = steady.reason or f"KV usage {_pct(usage)}"
        return Decision(steady.target, f"slow start ends at {target}: {cause}")
    if target >= ceiling:
        return Decision(ceiling, f"slow start ends at the ceiling {ceiling}")
    if not in_use:
        return Decision(target, None, slow_start=True)  # not used yet: wait for demand, not grow
    new = max(floor, min(ceiling, grown))
    reason = f"slow start: {running:.0f} running, {queue:.0f} waiting, KV usage {_pct(usage)}"
    return Decision(new, reason, slow_start=True)


def _steady(
    target: int, previous: KvSignals | None, current: KvSignals, *, floor: int, ceiling: int, in_use: bool
) -> Decision:
    queue = current.num_queue_reqs
    running = current.num_running_reqs
    setpoint = _setpoint(running)
    usage = current.token_usage
    retracted = _retractions(previous, current)
    if retracted > 0:
        new = math.floor(target * RETRACTION_BACKOFF)
        reason = f"{retracted:.0f} retractions (KV usage {_pct(usage)})"
    elif _above_setpoint(queue, running):
        # A target far above what the server holds (others fill its queue) comes down at once.
        new = min(target - math.ceil(queue - setpoint), math.ceil(running + queue + setpoint))
        reason = f"{queue:.0f} requests waiting in the server queue beside {running:.0f} running"
    elif queue < setpoint - 0.5 and in_use and (usage is None or usage < USAGE_HIGH):
        new = target + max(1, math.ceil(max(setpoint - queue, target * GROWTH)))
        reason = f"headroom: {running:.0f} running, {queue:.0f} waiting, KV usage {_pct(usage)}"
    else:
        return Decision(target, None)
    new = max(floor, min(ceiling, new))
    return Decision(new, reason if new != target else None)


def restarted(previous: KvSignals | None, current: KvSignals) -> bool:
    """Whether the server restarted between two samples: one of its counters went down."""
    if previous is None:
        return False
    pairs = (
        (previous.requests_total, current.requests_total),
        (previous.retracted_total, current.retracted_total),
    )
    return any(before is not None and now is not None and now < before for before, now in pairs)


def _setpoint(running: float) -> float:
    """The queue the steady rules hold at the server."""
    return max(QUEUE_SETPOINT_MIN, QUEUE_SETPOINT_FRACTION * running)


def _above_setpoint(queue: float, running: float) -> bool:
    return queue > _setpoint(running) + 0.5


def _retractions(previous: KvSignals | None, current: KvSignals) -> float:
    if previous is None or previous.retracted_total is None or current.retracted_total is None:
        return 0.0
    # A counter that went down means the server restarted; that is not a retraction.
    return max(0.0, current.retracted_total - previous.retracted_total)


def _pct(usage: float | None) -> str:
    return "unknown" if usage is None else f"{usage:.0%}"
