"""The Prometheus metrics of the simulator speaking vLLM, under vLLM's names and labels.

vLLM 0.33.0 declares them in ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) with the
labels ``model_name`` (the served model name) and ``engine`` (the engine index, ``"0"`` here), and
the buckets of ``vllm/v1/metrics/buckets.py``. The engine writes the same attributes it writes for
SGLang (``simulator.scheduler.EngineMetrics``); the series vLLM has no counterpart for (SGLang's
rounded ``token_usage``, ``gen_throughput``, ``num_used_tokens``, its request counters) go to a
registry that is never served. ``vllm:request_success_total`` needs the finish reason, which only
the HTTP layer knows, so it counts stop and length there; aborts come from the engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["FINISHED_REASONS", "VllmMetrics"]

_ENGINE = "0"
# vLLM's FinishReason strings (FINISH_REASON_STRINGS in vllm/v1/engine/__init__.py); every one
# gets a request_success child at start, as vLLM does.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_USED_TOKENS = "sim_used_tokens"


class VllmMetrics:
    """The metric children of one simulated vLLM server, already bound to their labels."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._unserved = CollectorRegistry()
        labels = {"model_name": model_name, "engine": _ENGINE}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)
            return family.labels(**labels)

        self.num_running_reqs = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_queue_reqs = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_retracted_requests = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASONS
        }
        self.num_aborted_requests = self.request_success["abort"]
        self.time_to_first_token_seconds = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token_latency_seconds = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.e2e_request_latency_seconds = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time_seconds = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )

        self.num_used_tokens = Gauge(_USED_TOKENS, "KV slots held by live requests.", registry=self._unserved)
        self.token_usage = Gauge("sim_token_usage", "SGLang's rounded token usage.", registry=self._unserved)
        self.gen_throughput = Gauge("sim_gen_throughput", "Generation throughput.", registry=self._unserved)
        self.num_requests = Counter("sim_requests", "Requests the engine finished.", registry=self._unserved)

    def set_constants(self, *, max_total_num_tokens: int, context_len: int) -> None:
        # vLLM's gauge is the exact fraction of KV blocks in use; SGLang's is rounded to 0.01.
        def usage() -> float:
            used = self._unserved.get_sample_value(_USED_TOKENS) or 0.0
            return used / max_total_num_tokens

        self.kv_cache_usage.set_function(usage)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, as ``GET /metrics`` serves it."""
        return generate_latest(self.registry)
