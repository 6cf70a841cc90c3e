"""Every metric a worker exports, declared in one place on the worker's own registry.

Labels are bounded: ``server`` (the worker's configured names), ``class`` (``short``, ``long``),
``finish`` (SGLang's finish types, `datagen.states.FinishType`), ``direction`` (``up``, ``down``),
``outcome`` (requests: ``ok``, ``retryable``, ``fatal``; reaped prompts: ``requeued``, ``uncharged``
(requeued without spending a worker loss: its worker still beats), ``failed``;
backup requests: ``won``, ``lost``, ``failed``, ``stopped``, ``cancelled``, see `workers.run.backup`)
and ``reason`` (the class name of a `datagen.errors` exception; for a prompt that failed after its
retries ran out, ``gave_up_`` and the class name of the last retryable error; for a conversation
that stopped, `datagen.states.StopReason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from datagen.states import StopReason

__all__ = ["LATENCY_BUCKETS_S", "LENGTH_BUCKETS", "RESULT_BUCKETS_S", "WorkerMetrics"]

LATENCY_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 2400, 3600)
RESULT_BUCKETS_S = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 72 * 3600)
LENGTH_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "datagen_worker_requests",
            "Requests to SGLang by outcome",
            ["server", "class", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "datagen_worker_prompt_tokens", "Prompt tokens sent", ["server", "class"], registry=r
        )
        self.generated_tokens = Counter(
            "datagen_worker_generated_tokens", "Output tokens received", ["server", "class"], registry=r
        )
        self.request_latency = Histogram(
            "datagen_worker_request_latency_seconds",
            "Wall time of one /generate call",
            ["server", "class"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "datagen_worker_in_flight", "Requests in flight", ["server", "class"], registry=r
        )
        self.time_to_result = Histogram(
            "datagen_worker_time_to_result_seconds",
            "From enqueue to the committed record",
            ["class"],
            buckets=RESULT_BUCKETS_S,
            registry=r,
        )
        self.finishes = Counter(
            "datagen_worker_finishes", "Committed records by finish reason", ["class", "finish"], registry=r
        )
        self.output_length = Histogram(
            "datagen_worker_output_length_tokens",
            "Output tokens per record",
            ["class"],
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.prompt_length = Histogram(
            "datagen_worker_prompt_length_tokens",
            "Prompt tokens per record",
            ["class"],
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.retries = Counter("datagen_worker_retries", "Retried attempts by reason", ["reason"], registry=r)
        self.backup_requests = Counter(
            "datagen_worker_backup_requests",
            "Backup requests for stragglers, by how they ended",
            ["server", "class", "outcome"],
            registry=r,
        )
        self.failures = Counter("datagen_worker_failures", "Prompts failed for good", ["reason"], registry=r)
        self.conversations_stopped = Counter(
            "datagen_worker_conversations_stopped",
            "Multi-turn all: conversations ended before their last turn (truncated, tool_mismatch, error)",
            ["reason"],
            registry=r,
        )
        for reason in StopReason:  # every reason's series exists from the start, at zero
            self.conversations_stopped.labels(reason.value)
        self.aborted = Counter(
            "datagen_worker_aborted", "In-flight prompts aborted because their job was cancelled", registry=r
        )
        self.server_up = Gauge(
            "datagen_worker_server_up", "1 while a server takes requests", ["server"], registry=r
        )
        self.server_paused = Gauge(
            "datagen_worker_server_paused", "1 while a server is paused", ["server"], registry=r
        )
        self.queue_paused = Gauge(
            "datagen_worker_queue_paused", "1 while a class's queue is paused", ["class"], registry=r
        )
        self.in_flight_target = Gauge(
            "datagen_worker_in_flight_target",
            "This worker's in-flight limit",
            ["server", "class"],
            registry=r,
        )
        self.controller_changes = Counter(
            "datagen_worker_controller_changes",
            "KV controller target changes",
            ["server", "direction"],
            registry=r,
        )
        self.kv_token_usage = Gauge(
            "datagen_worker_kv_token_usage",
            "KV usage read (sglang:token_usage, vllm:kv_cache_usage_perc)",
            ["server"],
            registry=r,
        )
        self.server_queue = Gauge(
            "datagen_worker_server_queue",
            "Requests waiting read (sglang:num_queue_reqs, vllm:num_requests_waiting)",
            ["server"],
            registry=r,
        )
        self.server_running = Gauge(
            "datagen_worker_server_running",
            "Requests running read (sglang:num_running_reqs, vllm:num_requests_running)",
            ["server"],
            registry=r,
        )
        self.server_retractions = Gauge(
            "datagen_worker_server_retractions",
            "Retractions read (sglang:num_retracted_requests_total, vllm:num_preemptions_total)",
            ["server"],
            registry=r,
        )
        # Prompts per claim (claimed prompts / claims) is what one Redis call buys: the control
        # plane's cost is mostly per claim.
        self.claims = Counter(
            "datagen_worker_claims", "Claims that started at least one prompt", ["class"], registry=r
        )
        self.claimed_prompts = Counter(
            "datagen_worker_claimed_prompts", "Prompts started by claims", ["class"], registry=r
        )
        self.reaped = Counter(
            "datagen_worker_reaped", "Prompts of dead workers by outcome", ["outcome"], registry=r
        )
        self.records_committed = Counter(
            "datagen_worker_records_committed", "Records committed to storage", registry=r
        )
        self.commit_errors = Counter(
            "datagen_worker_commit_errors", "Shard commits that failed and will be retried", registry=r
        )
        # Hidden-state capture (jobs with features, `workers.run.capture`).
        self.captured_tokens = Counter(
            "datagen_worker_captured_tokens",
            "Tokens whose hidden states were captured, checked and stored",
            ["server"],
            registry=r,
        )
        self.feature_bytes = Counter(
            "datagen_worker_feature_bytes",
            "Bytes of features stored (after any FP8 conversion)",
            ["server"],
            registry=r,
        )
        self.captures = Counter(
            "datagen_worker_captures",
            "Capture tries by outcome: stored, retried (a failed check, a 5xx), gave_up, unfit, refused",
            ["server", "outcome"],
            registry=r,
        )
        self.capture_dir_bytes = Gauge(
            "datagen_worker_capture_dir_bytes", "Bytes in the capture directory at the last sweep", registry=r
        )
        self.capture_orphans_removed = Counter(
            "datagen_worker_capture_orphans_removed",
            "Files no request waits for (aborted, timed out) deleted from the capture directory",
            registry=r,
        )
        self.capture_waiting = Gauge(
            "datagen_worker_capture_waiting",
            "Captures waiting: the capture directory is over its byte cap, or a job at its features budget",
            registry=r,
        )
