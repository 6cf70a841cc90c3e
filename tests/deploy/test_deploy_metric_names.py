"""Metric names and label sets are pinned, so the dashboards cannot drift from the code silently.

The expected tables (tests/support/deploy.py: EXPECTED_METRICS, and the engines' EXPECTED_SGLANG and
EXPECTED_VLLM) are written by hand. A change to a metric's name or labels must change its table and,
with it, the dashboards that query the metric.
"""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from datagen.control.jobs import JobStore
from datagen.control.keys import BreakdownField, Keys
from datagen.spec import JobSpec
from service.fleetview import FleetView
from service.metrics import CoordinatorMetrics
from simulator.sglang.metrics import SimMetrics
from simulator.vllm.metrics import VllmMetrics
from tests.support.deploy import EXPECTED_METRICS, EXPECTED_SGLANG, EXPECTED_VLLM
from tests.support.jobfields import add_breakdown, add_ingest_counts
from workers.metrics import WorkerMetrics

Family = tuple[str, frozenset[str]]


def _families(registry: CollectorRegistry) -> dict[str, Family]:
    """Name -> (type, label names) of every family a registry exposes, samples or not.

    Declared metrics expose no samples (hence no label names) until a child exists, so their
    declaration is read (prometheus_client's ``_labelnames``); custom collectors' families are
    read from their samples, which the caller makes sure exist.
    """
    found: dict[str, Family] = {}
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            found[collector._name] = (str(collector._type), frozenset(collector._labelnames))
            continue
        for family in collector.collect():
            assert family.samples, f"{family.name}: no samples to read its labels from"
            labels = {frozenset(s.labels) - {"le"} for s in family.samples}
            assert len(labels) == 1, (family.name, labels)
            found[family.name] = (family.type, labels.pop())
    return found


def _datagen(table: dict[str, Family]) -> dict[str, Family]:
    return {name: family for name, family in table.items() if name.startswith("datagen_")}


def test_worker_metrics_are_pinned() -> None:
    expected = {n: f for n, f in EXPECTED_METRICS.items() if n.startswith("datagen_worker_")}
    assert _families(WorkerMetrics().registry) == expected


def test_coordinator_metrics_are_pinned(redis_client: redis.Redis) -> None:
    keys = Keys("pin")
    jobs = JobStore(redis_client, keys)
    # A running job with progress and a paused server, so every collected family has samples.
    jobs.create("j1", JobSpec.model_validate({"tokenizer": "tok", "recipe": {"arms": [{"name": "low"}]}}))
    with redis_client.pipeline() as pipe:
        add_ingest_counts(pipe, jobs.keys, "j1", {"accepted": 4, "done": 1, "output_tokens": 30}, line=4)
        add_breakdown(
            pipe,
            jobs.keys,
            "j1",
            {
                BreakdownField("accepted", "math", "short"): 4,
                BreakdownField("done", "math", "short"): 1,
                BreakdownField("output_tokens", "math", "short"): 30,
                BreakdownField("finish:stop", "math", "short"): 1,
                BreakdownField.of_arm("done", "low", "math", "short"): 1,
                BreakdownField.of_arm("output_tokens", "low", "math", "short"): 30,
            },
        )
        pipe.sadd(keys.paused_servers(), "gpu0")
        pipe.execute()
    metrics = CoordinatorMetrics(fleet=FleetView(redis_client, keys), jobs=jobs)
    found = _families(metrics.registry)
    expected = {n: f for n, f in EXPECTED_METRICS.items() if not n.startswith("datagen_worker_")}
    assert _datagen(found) == expected
    assert set(found) == set(expected)  # nothing outside the datagen_ prefix


def test_simulator_metrics_match_sglang_names() -> None:
    assert _families(SimMetrics("sim/model").registry) == EXPECTED_SGLANG


def test_vllm_simulator_metrics_match_vllm_names() -> None:
    """vLLM's names and labels (docs/reference/vllm-contract.md, section 8), as the simulator serves them."""
    assert _families(VllmMetrics("sim/model").registry) == EXPECTED_VLLM
