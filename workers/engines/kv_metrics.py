"""A server's KV-cache pressure from its Prometheus ``/metrics`` page: the reading is shared, the
names are each engine's (:class:`KvMetricNames`, declared beside its replies), so the KV controller
(:mod:`workers.fleet.kv_policy`) sees :class:`workers.engines.base.KvSignals` and never a metric name.

A page may give a name with ``:`` or ``_`` after the engine's prefix, and one sample per
data-parallel rank; a counter that went down between two pages means the server restarted (the
policy's concern, not this module's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from workers.engines.base import KvSignals

__all__ = ["KvMetricNames", "read_kv_signals"]


@dataclass(frozen=True)
class KvMetricNames:
    """One engine's metric names: its ``prefixes``, and ``fields`` mapping a name (without prefix
    and ``_total``) to the :class:`KvSignals` field it gives."""

    prefixes: tuple[str, ...]
    fields: Mapping[str, str]

    def field_of(self, family: str) -> str | None:
        for prefix in self.prefixes:
            if family.startswith(prefix):
                return self.fields.get(family[len(prefix) :].removesuffix("_total"))
        return None


def read_kv_signals(text: str, names: KvMetricNames) -> KvSignals:
    """The controller's inputs from a Prometheus text page; absent signals stay None/0.

    Counts are summed over data-parallel ranks; KV usage, a fraction per rank, is the fullest
    rank's.
    """
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        field = names.field_of(family.name)
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
