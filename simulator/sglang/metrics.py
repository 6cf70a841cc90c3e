"""Every Prometheus metric the simulator exports, under SGLang's names and labels.

Each app gets its own ``CollectorRegistry`` so several simulators can run in one process.
Names use SGLang's colon form; ``prometheus_client`` appends ``_total`` to counters itself.
Scheduler-side series carry ``tp_rank``/``pp_rank``/``moe_ep_rank`` like SGLang's rank-0
scheduler; tokenizer-side series carry only ``model_name`` and ``engine_type``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["SimMetrics"]

_ENGINE_TYPE = "unified"
_RANK = "0"

# SGLang's default buckets (observability/metrics_collector.py).
_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
)  # fmt: skip
_QUEUE_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
    300, 400, 500, 600, 1200, 1800, 2400,
)  # fmt: skip


class SimMetrics:
    """The metric children of one simulated server, already bound to their labels."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        tok = {"model_name": model_name, "engine_type": _ENGINE_TYPE}
        sched = {**tok, "tp_rank": _RANK, "pp_rank": _RANK, "moe_ep_rank": _RANK}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(sched), registry=self.registry).labels(**sched)

        def counter(name: str, doc: str, labels: dict[str, str]) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, labels: dict[str, str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(
                **labels
            )

        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.max_total_num_tokens = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.context_len = gauge("sglang:context_len", "The context length.")
        self.num_retracted_requests = counter(
            "sglang:num_retracted_requests", "Number of retracted requests.", sched
        )
        self.queue_time_seconds = histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", sched, _QUEUE_BUCKETS
        )

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.", tok)
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", tok
        )
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.", tok)
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Number of requests aborted.", tok)
        self.e2e_request_latency_seconds = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            tok,
            _E2E_BUCKETS,
        )
        self.time_to_first_token_seconds = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            tok,
            _TTFT_BUCKETS,
        )
        self.inter_token_latency_seconds = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            tok,
            _ITL_BUCKETS,
        )

    def set_constants(self, *, max_total_num_tokens: int, context_len: int) -> None:
        self.max_total_num_tokens.set(max_total_num_tokens)
        self.context_len.set(context_len)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, as ``GET /metrics`` serves it."""
        return generate_latest(self.registry)
