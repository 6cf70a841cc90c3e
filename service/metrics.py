"""Every metric the coordinator exports, declared in one place on its own registry.

Queue depths and pause flags are read from Redis when Prometheus scrapes, so they are never
stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import RedisError

from service.fleetview import FleetView

__all__ = ["CoordinatorMetrics"]


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("datagen_queue_depth", "Prompts waiting in a queue", labels=["class"])
        started = GaugeMetricFamily("datagen_queue_started", "Prompts started by workers", labels=["class"])
        queue_paused = GaugeMetricFamily(
            "datagen_queue_paused", "1 while a queue is paused", labels=["class"]
        )
        server_paused = GaugeMetricFamily(
            "datagen_server_paused", "1 while a server is paused", labels=["server"]
        )
        try:
            queues = self.fleet.queues()
            servers = self.fleet.server_names()
            paused_servers = {s["name"] for s in self.fleet.servers() if s["paused"]}
        except RedisError:
            return  # a scrape while Redis is away shows the gap rather than zeros
        for queue in queues:
            depth.add_metric([queue["name"]], queue["queued"])
            started.add_metric([queue["name"]], queue["started"])
            queue_paused.add_metric([queue["name"]], 1 if queue["paused"] else 0)
        for name in servers:
            server_paused.add_metric([name], 1 if name in paused_servers else 0)
        yield from (depth, started, queue_paused, server_paused)


@dataclass
class CoordinatorMetrics:
    fleet: FleetView
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.jobs_submitted = Counter(
            "datagen_jobs_submitted", "Jobs accepted by POST /jobs", registry=self.registry
        )
        self.upload_bytes = Counter("datagen_upload_bytes", "Dataset bytes received", registry=self.registry)
        self.registry.register(_FleetCollector(self.fleet))
