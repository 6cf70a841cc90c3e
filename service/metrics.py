"""Every metric the coordinator exports, declared in one place on its own registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

__all__ = ["CoordinatorMetrics"]


@dataclass
class CoordinatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.jobs_submitted = Counter(
            "datagen_jobs_submitted", "Jobs accepted by POST /jobs", registry=self.registry
        )
        self.upload_bytes = Counter("datagen_upload_bytes", "Dataset bytes received", registry=self.registry)
        self.http_errors = Counter(
            "datagen_http_errors", "Requests answered with an error", ["reason"], registry=self.registry
        )
