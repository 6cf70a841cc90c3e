"""Helpers for the deployment tests: the dashboards' queries, compose.yaml, a real Prometheus.

The expected metric table below is written by hand on purpose: a metric renamed or relabelled in
code fails ``test_deploy_metric_names.py``, and a dashboard query naming a metric that is not in
the table fails ``test_deploy_dashboards.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from datagen_cli.local.redis_server import free_port
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "compose.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"

INSTALL_HINT = (
    "is not installed: run scripts/check as root (it installs Debian's `prometheus` package, "
    "which ships both `prometheus` and `promtool`), or `apt-get install prometheus`"
)

# Grafana's built-in variables that panels may use without defining them.
BUILTIN_VARIABLES = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms", "__dashboard"}
)
# What the tests put in place of Grafana's interval variables.
WINDOW = "30s"

# Every datagen_* metric family: (type, label names). Counters are queried as NAME_total and
# histograms as NAME_bucket / NAME_sum / NAME_count. A `job` label is the datagen job id.
EXPECTED_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    name: (kind, frozenset(labels))
    for name, kind, labels in [
        # workers/metrics.py
        ("datagen_worker_requests", "counter", ("server", "class", "outcome")),
        ("datagen_worker_prompt_tokens", "counter", ("server", "class")),
        ("datagen_worker_generated_tokens", "counter", ("server", "class")),
        ("datagen_worker_request_latency_seconds", "histogram", ("server", "class")),
        ("datagen_worker_in_flight", "gauge", ("server", "class")),
        ("datagen_worker_time_to_result_seconds", "histogram", ("class",)),
        ("datagen_worker_finishes", "counter", ("class", "finish")),
        ("datagen_worker_output_length_tokens", "histogram", ("class",)),
        ("datagen_worker_prompt_length_tokens", "histogram", ("class",)),
        ("datagen_worker_retries", "counter", ("reason",)),
        ("datagen_worker_backup_requests", "counter", ("server", "class", "outcome")),
        ("datagen_worker_failures", "counter", ("reason",)),
        ("datagen_worker_conversations_stopped", "counter", ("reason",)),
        ("datagen_worker_aborted", "counter", ()),
        ("datagen_worker_server_up", "gauge", ("server",)),
        ("datagen_worker_server_paused", "gauge", ("server",)),
        ("datagen_worker_queue_paused", "gauge", ("class",)),
        ("datagen_worker_in_flight_target", "gauge", ("server", "class")),
        ("datagen_worker_controller_changes", "counter", ("server", "direction")),
        ("datagen_worker_kv_token_usage", "gauge", ("server",)),
        ("datagen_worker_server_queue", "gauge", ("server",)),
        ("datagen_worker_server_running", "gauge", ("server",)),
        ("datagen_worker_server_retractions", "gauge", ("server",)),
        ("datagen_worker_reaped", "counter", ("outcome",)),
        ("datagen_worker_claims", "counter", ("class",)),
        ("datagen_worker_claimed_prompts", "counter", ("class",)),
        ("datagen_worker_records_committed", "counter", ()),
        ("datagen_worker_commit_errors", "counter", ()),
        ("datagen_worker_captured_tokens", "counter", ("server",)),
        ("datagen_worker_feature_bytes", "counter", ("server",)),
        ("datagen_worker_captures", "counter", ("server", "outcome")),
        ("datagen_worker_capture_dir_bytes", "gauge", ()),
        ("datagen_worker_capture_orphans_removed", "counter", ()),
        ("datagen_worker_capture_waiting", "gauge", ()),
        # service/metrics.py
        ("datagen_jobs_submitted", "counter", ()),
        ("datagen_jobs_rebuilt", "counter", ("reason",)),
        ("datagen_upload_bytes", "counter", ()),
        ("datagen_ingested_rows", "counter", ("outcome",)),
        ("datagen_ingested_prompts", "counter", ("class",)),
        ("datagen_ingest_rendered_rows", "counter", ("where",)),
        ("datagen_ingest_render_cpu_seconds", "counter", ("where",)),
        ("datagen_queue_depth", "gauge", ("class",)),
        ("datagen_queue_started", "gauge", ("class",)),
        ("datagen_queue_paused", "gauge", ("class",)),
        ("datagen_server_paused", "gauge", ("server",)),
        ("datagen_jobs", "gauge", ("state",)),
        ("datagen_job_prompts", "counter", ("job", "partition", "class", "status")),
        ("datagen_job_generated_tokens", "counter", ("job", "partition", "class")),
        ("datagen_job_finishes", "counter", ("job", "partition", "class", "finish")),
        ("datagen_job_arm_done", "counter", ("job", "arm")),
        ("datagen_job_arm_generated_tokens", "counter", ("job", "arm")),
        ("datagen_job_progress_ratio", "gauge", ("job",)),
        ("datagen_job_eta_seconds", "gauge", ("job",)),
        ("datagen_job_share_target", "gauge", ("job",)),
        ("datagen_job_share_recent", "gauge", ("job",)),
        ("datagen_job_weight", "gauge", ("job",)),
        ("datagen_job_paused", "gauge", ("job",)),
        ("datagen_job_first_record_seconds", "gauge", ("job",)),
        ("datagen_job_tail_seconds", "gauge", ("job",)),
        ("datagen_redis_used_memory_bytes", "gauge", ()),
        ("datagen_redis_maxmemory_bytes", "gauge", ()),
        ("datagen_redis_out_of_memory", "gauge", ()),
        ("datagen_redis_oom_refusals", "counter", ()),
    ]
}

# What the dashboards may read from the inference servers, as the simulator serves it: SGLang's
# names and labels (simulator/sglang/metrics.py) and vLLM's (simulator/vllm/metrics.py).
_SGLANG_SCHEDULER = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
_SGLANG_TOKENIZER = ("model_name", "engine_type")
EXPECTED_SGLANG: dict[str, tuple[str, frozenset[str]]] = {
    name: (kind, frozenset(labels))
    for name, kind, labels in [
        ("sglang:token_usage", "gauge", _SGLANG_SCHEDULER),
        ("sglang:num_used_tokens", "gauge", _SGLANG_SCHEDULER),
        ("sglang:max_total_num_tokens", "gauge", _SGLANG_SCHEDULER),
        ("sglang:num_running_reqs", "gauge", _SGLANG_SCHEDULER),
        ("sglang:num_queue_reqs", "gauge", _SGLANG_SCHEDULER),
        ("sglang:gen_throughput", "gauge", _SGLANG_SCHEDULER),
        ("sglang:context_len", "gauge", _SGLANG_SCHEDULER),
        ("sglang:num_retracted_requests", "counter", _SGLANG_SCHEDULER),
        ("sglang:queue_time_seconds", "histogram", _SGLANG_SCHEDULER),
        ("sglang:prompt_tokens", "counter", _SGLANG_TOKENIZER),
        ("sglang:generation_tokens", "counter", _SGLANG_TOKENIZER),
        ("sglang:num_requests", "counter", _SGLANG_TOKENIZER),
        ("sglang:num_aborted_requests", "counter", _SGLANG_TOKENIZER),
        ("sglang:e2e_request_latency_seconds", "histogram", _SGLANG_TOKENIZER),
        ("sglang:time_to_first_token_seconds", "histogram", _SGLANG_TOKENIZER),
        ("sglang:inter_token_latency_seconds", "histogram", _SGLANG_TOKENIZER),
    ]
}
_VLLM = ("model_name", "engine")
EXPECTED_VLLM: dict[str, tuple[str, frozenset[str]]] = {
    name: (kind, frozenset(labels))
    for name, kind, labels in [
        ("vllm:num_requests_running", "gauge", _VLLM),
        ("vllm:num_requests_waiting", "gauge", _VLLM),
        ("vllm:kv_cache_usage_perc", "gauge", _VLLM),
        ("vllm:num_preemptions", "counter", _VLLM),
        ("vllm:prompt_tokens", "counter", _VLLM),
        ("vllm:generation_tokens", "counter", _VLLM),
        ("vllm:request_success", "counter", (*_VLLM, "finished_reason")),
        ("vllm:time_to_first_token_seconds", "histogram", _VLLM),
        ("vllm:inter_token_latency_seconds", "histogram", _VLLM),
        ("vllm:e2e_request_latency_seconds", "histogram", _VLLM),
        ("vllm:request_queue_time_seconds", "histogram", _VLLM),
    ]
}
# The engines' prefixes; a dashboard matches both stored forms with `{__name__=~"sglang[:_]NAME"}`.
ENGINE_PREFIXES = ("sglang", "vllm")

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def series_names(kind: str, name: str) -> list[str]:
    """The names a family's samples are stored under."""
    return [name + suffix for suffix in _SUFFIXES[kind]]


def queryable_datagen_names() -> set[str]:
    return {s for name, (kind, _) in EXPECTED_METRICS.items() for s in series_names(kind, name)}


def queryable_engine_series() -> dict[str, tuple[str, frozenset[str]]]:
    """Series name (``sglang:…``, ``vllm:…``) -> (family type, label names) for both engines."""
    return {
        series: family
        for table in (EXPECTED_SGLANG, EXPECTED_VLLM)
        for name, family in table.items()
        for series in series_names(family[0], name)
    }


# -- dashboards ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel_id: int
    title: str
    ref_id: str
    expr: str

    @property
    def key(self) -> str:
        return f"{self.dashboard} / {self.title} / {self.ref_id}"


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in dashboard_files()}


def iter_panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(name: str, board: dict[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(name, panel["id"], panel["title"], target["refId"], target["expr"])
        for panel in iter_panels(board)
        for target in panel.get("targets", [])
        if not target.get("hide")
    ]


def variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board.get("templating", {}).get("list", [])}


_VARIABLE_RE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def used_variables(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in _VARIABLE_RE.finditer(text)}


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query")
    return str(query.get("query", "") if isinstance(query, dict) else query or "")


_LABEL_VALUES_RE = re.compile(r"^label_values\(\s*(?:(?P<match>.+?)\s*,\s*)?(?P<label>\w+)\s*\)$")


def parse_label_values(query: str) -> tuple[str | None, str]:
    """``label_values(selector, label)`` or ``label_values(label)`` -> (selector, label)."""
    found = _LABEL_VALUES_RE.match(query.strip())
    if found is None:
        raise ValueError(f"not a label_values query: {query!r}")
    return found["match"], found["label"]


def grafana_regex_escape(value: str) -> str:
    """What Grafana's Prometheus data source does to a value going into a regex matcher."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


def fill(expr: str, values: dict[str, list[str]]) -> str:
    """Replace template variables the way Grafana does for multi-value regex matchers."""

    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name in ("__rate_interval", "__interval", "__range"):
            return WINDOW
        chosen = values[name]
        escaped = [grafana_regex_escape(v) for v in chosen]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    return _VARIABLE_RE.sub(one, expr)


# -- compose ------------------------------------------------------------------------------------

_INTERPOLATION_RE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $$."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3) or ""
        value = env.get(name)
        if (op in (":-", ":?") and not value) or (op in ("-", "?") and value is None):
            if op.endswith("?"):
                raise ValueError(f"compose needs {name}: {arg}")
            return arg
        return value or ""

    return _INTERPOLATION_RE.sub(one, text)


def interpolation_names(text: str) -> set[str]:
    return {m.group(1) or m.group(4) for m in _INTERPOLATION_RE.finditer(text) if m.group(0) != "$$"}


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml with anchors merged and variables substituted (defaults unless ``env`` sets them)."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return dict(_substitute(raw, env or {}))


def _substitute(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_substitute(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _substitute(value, env) for key, value in node.items()}
    return node


def as_list(command: str | list[str] | None) -> list[str]:
    if command is None:
        return []
    return command.split() if isinstance(command, str) else [str(c) for c in command]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def active_services(compose: dict[str, Any], profiles: set[str]) -> dict[str, dict[str, Any]]:
    """Services ``docker compose --profile …`` starts: no profile, or one of ``profiles``."""
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or profiles & set(service["profiles"])
    }


def prometheus_targets(config: dict[str, Any]) -> dict[str, list[tuple[str, dict[str, str]]]]:
    """Scrape job -> [(host:port, extra labels)] from static_configs."""
    return {
        job["job_name"]: [
            (target, dict(static.get("labels") or {}))
            for static in job.get("static_configs", [])
            for target in static["targets"]
        ]
        for job in config["scrape_configs"]
    }


# -- Prometheus ---------------------------------------------------------------------------------


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"`{name}` {INSTALL_HINT}")
    return path


class Prometheus:
    """A real Prometheus on a free loopback port with its TSDB under ``tmp``."""

    READY_TIMEOUT_S = 30.0

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        self.tmp = tmp
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> Prometheus:
        binary = require_binary("prometheus")
        config_file = self.tmp / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self._log = open(self.tmp / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={self.tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.tmp,
        )
        try:
            wait_until(self._ready, self.READY_TIMEOUT_S, "prometheus to become ready", on_timeout=self.log)
        except AssertionError:
            self.__exit__(None, None, None)
            raise
        return self

    def _ready(self) -> bool:
        assert self._proc is not None and self._proc.poll() is None, f"prometheus exited:\n{self.log()}"
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()

    def log(self) -> str:
        path = self.tmp / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        reply = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query", {"query": expr})
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return list(data["result"])

    def label_values(self, label: str, match: str | None) -> list[str]:
        params = {"match[]": match} if match else {}
        return sorted(self._get(f"/api/v1/label/{label}/values", params))

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets", {"state": "active"})["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its ``health``, ``lastError`` and ``state``."""
        return [rule for group in self._get("/api/v1/rules", {})["groups"] for rule in group["rules"]]


def clean_env() -> dict[str, str]:
    """The test process's environment without DATAGEN_* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
