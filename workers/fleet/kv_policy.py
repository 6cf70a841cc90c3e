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

How the setpoint and slow start were measured, and what they changed, is in ``bench/README.md``
("Fourth pass" and "Fifth pass").

It takes :class:`workers.engines.base.KvSignals` only: each engine reads them from its own
``/metrics`` (:mod:`workers.engines.kv_metrics`), a preemption counting as a retraction, summed
over data-parallel ranks. A counter that went down (requests served, retractions) means the server
restarted, which starts slow start again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.engines.base import KvSignals

__all__ = ["Decision", "decide", "restarted"]

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
