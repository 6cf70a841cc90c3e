"""The KV-pressure controller: keep "just enough" in flight on each server.

SGLang admits a request only when its prompt plus a reserve for its ``max_new_tokens`` fits in
the KV pool; what is sent beyond that waits in the *server's* queue, where it cannot move to a
server that frees up, dies with a restart and ignores a paused queue. So the controller moves a
server's in-flight target (a total over both classes, shared by every worker that lists the
server) between a floor and the configured maximum:

- retractions since the last sample: the pool overflowed during decode, cut the target by 30 %;
- requests waiting in the server's queue beyond a small tolerance: snap the target down to what
  the server actually runs (plus the tolerance), or by 10 % if it is already there;
- the target is in use (running + waiting near it), nothing waits and KV usage has headroom:
  grow by 10 % (at least one request).

It reads the server's ``/metrics`` in either name form (``sglang:`` or ``sglang_``), summing over
data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Decision", "KvSignals", "decide", "parse_kv_signals"]

RETRACTION_BACKOFF = 0.7
QUEUE_BACKOFF = 0.9
GROWTH = 0.1
QUEUE_TOLERANCE_ABS = 2
QUEUE_TOLERANCE_FRACTION = 0.05
USAGE_HIGH = 0.9
BINDING_FRACTION = 0.9

_SIGNALS = {
    "token_usage": "token_usage",
    "num_queue_reqs": "num_queue_reqs",
    "num_running_reqs": "num_running_reqs",
    "num_retracted_requests": "retracted_total",
    "max_total_num_tokens": "max_total_num_tokens",
}


@dataclass(frozen=True)
class KvSignals:
    token_usage: float | None = None
    num_queue_reqs: float = 0.0
    num_running_reqs: float = 0.0
    retracted_total: float | None = None
    max_total_num_tokens: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return {
            "token_usage": self.token_usage,
            "num_queue_reqs": self.num_queue_reqs,
            "num_running_reqs": self.num_running_reqs,
            "retracted_total": self.retracted_total,
            "max_total_num_tokens": self.max_total_num_tokens,
        }


def _signal_name(family: str) -> str | None:
    for prefix in ("sglang:", "sglang_"):
        if family.startswith(prefix):
            name = family[len(prefix) :]
            return _SIGNALS.get(name.removesuffix("_total"))
    return None


def parse_kv_signals(text: str) -> KvSignals:
    """The controller's inputs from a Prometheus text page; absent signals stay None/0."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        field = _signal_name(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            values.setdefault(field, []).append(float(sample.value))
    usage = values.get("token_usage")
    retracted = values.get("retracted_total")
    capacity = values.get("max_total_num_tokens")
    return KvSignals(
        token_usage=max(usage) if usage else None,
        num_queue_reqs=sum(values.get("num_queue_reqs", [0.0])),
        num_running_reqs=sum(values.get("num_running_reqs", [0.0])),
        retracted_total=sum(retracted) if retracted else None,
        max_total_num_tokens=sum(capacity) if capacity else None,
    )


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str | None  # None: unchanged


def decide(
    target: int, previous: KvSignals | None, current: KvSignals, *, floor: int, ceiling: int
) -> Decision:
    """The next in-flight target for one server."""
    queue = current.num_queue_reqs
    running = current.num_running_reqs
    tolerance = max(QUEUE_TOLERANCE_ABS, QUEUE_TOLERANCE_FRACTION * running)
    usage = current.token_usage
    retracted = _retractions(previous, current)
    if retracted > 0:
        new = math.floor(target * RETRACTION_BACKOFF)
        reason = f"{retracted:.0f} retractions (KV usage {_pct(usage)})"
    elif queue > tolerance:
        snapped = math.ceil(running + tolerance)
        new = snapped if snapped < target else math.floor(target * QUEUE_BACKOFF)
        reason = f"{queue:.0f} requests waiting in the server queue beside {running:.0f} running"
    elif running + queue >= BINDING_FRACTION * target and (usage is None or usage < USAGE_HIGH):
        new = target + max(1, math.ceil(target * GROWTH))
        reason = f"headroom: {running:.0f} running, {queue:.0f} waiting, KV usage {_pct(usage)}"
    else:
        return Decision(target, None)
    new = max(floor, min(ceiling, new))
    return Decision(new, reason if new != target else None)


def _retractions(previous: KvSignals | None, current: KvSignals) -> float:
    if previous is None or previous.retracted_total is None or current.retracted_total is None:
        return 0.0
    # A counter that went down means the server restarted; that is not a retraction.
    return max(0.0, current.retracted_total - previous.retracted_total)


def _pct(usage: float | None) -> str:
    return "unknown" if usage is None else f"{usage:.0%}"
