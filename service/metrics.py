"""Every metric the coordinator exports, declared in one place on its own registry.

Queue depths, pause flags and job progress are read from Redis when Prometheus scrapes, so they
are never stale and cost nothing between scrapes. A job's series carry a ``job`` label only while
the job is ingesting or running; they disappear when it ends (bounded label sets). Partitions
beyond the first 20 of a job, and those longer than 128 characters, are counted as ``other``
(`datagen.control.jobs.MAX_PARTITION_LABELS`, ``MAX_PARTITION_LABEL_CHARS``); a job with a recipe
adds an ``arm`` label per arm (at most 64, `datagen.spec.RecipeSpec`). Redis's memory
against its ``maxmemory`` is read the same way (``INFO memory``), and every write Redis refused at
that limit is counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis, RedisError

from datagen.clock import now_ms
from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobProgress, JobStore
from datagen.control.progress import arm_counts
from datagen.control.redismemory import RefusedWrites, read_memory
from datagen.states import JobState, RebuildReason
from service.fleetview import FleetView

__all__ = ["CoordinatorMetrics"]

# How many jobs a scrape looks at (newest first).
SCRAPE_JOBS = 200


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
            servers = self.fleet.servers()
        except RedisError:
            return  # a scrape while Redis is away shows the gap rather than zeros
        for queue in queues:
            depth.add_metric([queue["name"]], queue["queued"])
            started.add_metric([queue["name"]], queue["started"])
            queue_paused.add_metric([queue["name"]], 1 if queue["paused"] else 0)
        for server in servers:
            server_paused.add_metric([server["name"]], 1 if server["paused"] else 0)
        yield from (depth, started, queue_paused, server_paused)


class _RedisCollector(Collector):
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    def collect(self) -> Iterator[Metric]:
        memory = read_memory(self.redis)
        if memory is None:
            return  # a gap, as for the queues
        yield GaugeMetricFamily(
            "datagen_redis_used_memory_bytes", "Redis memory that counts against maxmemory", memory.used_bytes
        )
        yield GaugeMetricFamily(
            "datagen_redis_maxmemory_bytes", "Redis's maxmemory (0: no limit)", memory.max_bytes
        )
        yield GaugeMetricFamily(
            "datagen_redis_out_of_memory",
            "1 while Redis is over its maxmemory and refuses writes",
            1 if memory.out_of_memory else 0,
        )


class _JobsCollector(Collector):
    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs
        self.dispatch = Dispatch(jobs.redis, jobs.keys)

    def collect(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("datagen_jobs", "Jobs by state", labels=["state"])
        prompts = CounterMetricFamily(
            "datagen_job_prompts", "Prompts of running jobs", labels=["job", "partition", "class", "status"]
        )
        tokens = CounterMetricFamily(
            "datagen_job_generated_tokens",
            "Generated tokens of running jobs",
            labels=["job", "partition", "class"],
        )
        finishes = CounterMetricFamily(
            "datagen_job_finishes",
            "Records of running jobs by finish reason",
            labels=["job", "partition", "class", "finish"],
        )
        arm_done = CounterMetricFamily(
            "datagen_job_arm_done", "Records of running jobs by recipe arm", labels=["job", "arm"]
        )
        arm_tokens = CounterMetricFamily(
            "datagen_job_arm_generated_tokens",
            "Generated tokens of running jobs' records by recipe arm",
            labels=["job", "arm"],
        )
        progress_ratio = GaugeMetricFamily(
            "datagen_job_progress_ratio", "Finished / accepted", labels=["job"]
        )
        eta = GaugeMetricFamily("datagen_job_eta_seconds", "Estimated seconds left", labels=["job"])
        share_target = GaugeMetricFamily(
            "datagen_job_share_target",
            "Share of the fleet the job's priority and weight entitle it to now",
            labels=["job"],
        )
        share_recent = GaugeMetricFamily(
            "datagen_job_share_recent", "Share of the fleet's dispatches of the last minute", labels=["job"]
        )
        weight = GaugeMetricFamily("datagen_job_weight", "The job's fair-share weight", labels=["job"])
        paused = GaugeMetricFamily("datagen_job_paused", "1 while a job is paused", labels=["job"])
        first_record = GaugeMetricFamily(
            "datagen_job_first_record_seconds",
            "Seconds from the job's creation to its first record (while it has none, seconds waited so far)",
            labels=["job"],
        )
        tail = GaugeMetricFamily(
            "datagen_job_tail_seconds",
            "Seconds spent on the job's last 5% of prompts (0 until 95% have finished)",
            labels=["job"],
        )
        try:
            # One round trip for the page; a job deleted since the listing is left out.
            listed = self.jobs.progress_many(self.jobs.index.list_ids(SCRAPE_JOBS))
            jobs = [job for job in listed if job is not None]
            shares = self.dispatch.shares()
            states = {state: 0 for state in JobState}
            for job in jobs:
                states[job.state] += 1
                if not job.state.is_final:
                    self._job(job, (prompts, tokens, finishes, arm_done, arm_tokens), progress_ratio, eta)
                    share = shares.get(job.job_id)
                    share_target.add_metric([job.job_id], share.target if share else 0.0)
                    share_recent.add_metric([job.job_id], share.recent if share else 0.0)
                    weight.add_metric([job.job_id], job.weight)
                    paused.add_metric([job.job_id], 1 if job.paused else 0)
                    _timing(job, first_record, tail)
        except RedisError:
            return
        for state, count in states.items():
            by_state.add_metric([state.value], count)
        yield from (by_state, prompts, tokens, finishes, progress_ratio, eta)
        yield from (arm_done, arm_tokens)  # samples only for jobs with a recipe
        yield from (share_target, share_recent, weight, paused, first_record, tail)

    def _job(
        self,
        job: JobProgress,
        counters: tuple[CounterMetricFamily, ...],
        progress_ratio: GaugeMetricFamily,
        eta: GaugeMetricFamily,
    ) -> None:
        prompts, tokens, finishes, arm_done, arm_tokens = counters
        breakdown = self.jobs.breakdown(job.job_id)
        for name, value in breakdown.items():
            if name.arm is not None:
                continue  # a recipe arm's share of a plain counter, counted there already
            if name.counter == "output_tokens":
                tokens.add_metric([job.job_id, name.label, name.cls], value)
            elif name.finish is not None:
                finishes.add_metric([job.job_id, name.label, name.cls, name.finish], value)
            else:
                prompts.add_metric([job.job_id, name.label, name.cls, name.counter], value)
        if job.recipe_arms:
            for arm, counts in arm_counts(job.recipe_arms, breakdown).items():
                arm_done.add_metric([job.job_id, arm], counts["done"])
                arm_tokens.add_metric([job.job_id, arm], counts["generated_tokens"])
        if job.accepted:
            progress_ratio.add_metric([job.job_id], (job.done + job.failed + job.cancelled) / job.accepted)
        view = job.to_json(at_ms=now_ms())
        if view["eta_s"] is not None:
            eta.add_metric([job.job_id], view["eta_s"])


def _timing(job: JobProgress, first_record: GaugeMetricFamily, tail: GaugeMetricFamily) -> None:
    """A running job's start and tail as gauges that always answer: a start still waited for shows
    the wait so far (a stuck start rises on the dashboard), a tail not yet begun shows 0."""
    at_ms = now_ms()
    first_s = job.time_to_first_record_s()
    first_record.add_metric([job.job_id], job.elapsed_s(at_ms) if first_s is None else first_s)
    tail.add_metric([job.job_id], job.tail_s(at_ms) or 0.0)


class _Refusals:
    """``datagen_redis_oom_refusals_total``, and when the last refusal was (``seen``), which
    ``/healthz`` reports: Redis's memory at rest can be under its limit while large writes are
    still refused."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self.seen = RefusedWrites()

    def inc(self) -> None:
        self._counter.inc()
        self.seen.note()


@dataclass
class CoordinatorMetrics:
    fleet: FleetView
    jobs: JobStore
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.jobs_submitted = Counter("datagen_jobs_submitted", "Jobs accepted by POST /jobs", registry=r)
        self.upload_bytes = Counter("datagen_upload_bytes", "Dataset bytes received", registry=r)
        self.ingested_rows = Counter(
            "datagen_ingested_rows", "Dataset rows ingested by outcome", ["outcome"], registry=r
        )
        self.ingested_prompts = Counter(
            "datagen_ingested_prompts", "Prompts enqueued by class", ["class"], registry=r
        )
        self.ingest_rendered_rows = Counter(
            "datagen_ingest_rendered_rows",
            "Dataset rows parsed and rendered, by where: a rendering process (process) or the "
            "ingestion's own thread (thread: DATAGEN_INGEST_PROCESSES 0, a job's first rows, and "
            "rows it rendered while the processes were behind)",
            ["where"],
            registry=r,
        )
        self.ingest_render_cpu = Counter(
            "datagen_ingest_render_cpu_seconds",
            "CPU seconds spent parsing and rendering dataset rows, by where (as "
            "datagen_ingest_rendered_rows)",
            ["where"],
            registry=r,
        )
        self.jobs_rebuilt = Counter(
            "datagen_jobs_rebuilt",
            "Jobs rebuilt from storage, by why: Redis lost its data (lost), went back to an older "
            "snapshot (rolled_back), counted fewer done prompts than storage holds at coordinator "
            "start (behind), or an operator asked (recover)",
            ["reason"],
            registry=r,
        )
        for reason in RebuildReason:
            self.jobs_rebuilt.labels(reason.value)
        self.redis_oom_refusals = _Refusals(
            Counter(
                "datagen_redis_oom_refusals",
                "Coordinator writes Redis refused at maxmemory (requests answered 503, ingestion waits)",
                registry=r,
            )
        )
        r.register(_FleetCollector(self.fleet))
        r.register(_RedisCollector(self.jobs.redis))
        r.register(_JobsCollector(self.jobs))
