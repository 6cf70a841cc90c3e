"""Every dashboard query against a real Prometheus scraping a running job.

A coordinator, a worker and three simulators run as processes; Prometheus (Debian's binary) scrapes
them every second with deploy/prometheus.yml's scrape jobs pointed at them. Two simulators speak
SGLang; the second is scraped with a relabel rule that stores its series as ``sglang_…``, so the
KV dashboard has to match both name forms. The third speaks vLLM (``datagen sim --api vllm``),
scraped by the ``vllm`` job as simC and once more, as simC-underscore, stored as ``vllm_…``.
Faults are planted so the error panels have something to show: 503s and 500s on one simulator (the
worker gives a prompt one attempt, so 500s fail prompts), a small KV pool with a low admission
reserve on the second (retractions) and a small KV pool on the vLLM one (preemptions), and a
``max_new_tokens`` small enough to truncate generations. A fourth simulator (vLLM, not scraped)
captures hidden states for a small job with features, so the capture panels have data.

While the job runs, every query of every panel, with its variables filled in from Prometheus's
label values, must answer, with finite values; rate panels must show something above zero. A
query reading vLLM's names must answer for the vLLM server too, rate queries above zero there.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen_cli.local.redis_server import LocalRedis, free_port
from tests.support.deploy import (
    PROMETHEUS_CONFIG,
    PanelQuery,
    Prometheus,
    fill,
    load_dashboards,
    panel_queries,
    parse_label_values,
    require_binary,
    variable_query,
    variables,
)
from tests.support.processes import ProcessStack
from tests.support.wait import wait_until

# The module's fixture (a stack, Prometheus, two jobs) is set up in its first test: at a third of
# the machine's speed that took most of the default 120 s.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NS = "prom"
SCRAPE_INTERVAL = "1s"
# Far more than the panels need: the watch ends once every panel has answered, and the stack is
# stopped with the job still running, so its length costs nothing. At 500, then 800, a CI machine at a
# third of its speed ended the job before the last panels had answered.
PROMPTS = 5000
LONG_EVERY = 10  # every tenth prompt is forced into the long class
SHORT_MAX_NEW = 200  # below the simulator's typical output length: many records are truncated
LONG_MAX_NEW = 400
TIME_SCALE = "0.3"
KV_TOKENS = "3000"  # about fifteen running requests before decode overflows the pool
VLLM_CONTEXT_LEN = "2048"  # vLLM's simulator wants the context to fit its KV pool
VLLM_SERVERS = ("simC", "simC-underscore")  # one vLLM simulator, stored in both name forms
# The servers a query reading an engine's names must show (rate queries: above zero), so that one
# engine's data cannot stand in for the other's: simB (SGLang, small KV pool, stored as sglang_…)
# and the vLLM simulator.
MUST_SHOW = {"sglang[:_]": ("simB",), "vllm[:_]": VLLM_SERVERS}
JOB_BUDGET_S = 100
MIN_ROUNDS = 3
# The job with features beside the main one: a few prompts, their hidden states captured on simCap.
FEATURES_JOB = "features"
FEATURES_PROMPTS = 40
FEATURES_LAYERS = "2,16,29,32"  # the simulator's default layers (32 layers)
# Panels counting events this test does not cause: they must answer, but may answer zero.
MAY_STAY_ZERO = {
    "Dead workers' prompts handed back": "no worker dies here (tests/e2e/test_lifecycle.py)",
    "Shard commit errors": "storage does not fail here",
    "Conversations stopped before their last turn": "no multi-turn all job runs here "
    "(tests/workers/test_conversation_tools.py)",
    "Capture orphans removed": "no capture is given up here (tests/e2e/test_features.py)",
    # The job with features ends before the main one starts: its rates may have fallen to zero by
    # the time every other panel has risen (tests/e2e/test_features.py checks what they count).
    "Captured tokens/s": "the job with features ran before the watched one",
    "Feature bytes/s": "the job with features ran before the watched one",
    "Captures/s by outcome": "the job with features ran before the watched one",
}


def _underscore_relabel(engine: str) -> dict[str, Any]:
    return {
        "source_labels": ["__name__"],
        "regex": f"{engine}:(.*)",
        "target_label": "__name__",
        "replacement": f"{engine}_$1",
    }


@dataclass
class Seen:
    rounds: int = 0
    answered: int = 0
    positive: bool = False
    not_finite: list[str] = field(default_factory=list)
    last_expr: str = ""
    # server label -> whether a sample above zero was seen for it
    servers: dict[str, bool] = field(default_factory=dict)


@dataclass
class Observed:
    seen: dict[str, Seen]
    queries: list[PanelQuery]
    job_state: str
    planted: dict[str, float]
    name_forms: dict[str, int]
    targets: list[dict[str, Any]]
    job_id: str
    job_label_values: list[str]
    rules: list[dict[str, Any]]


def _config(coordinator: str, worker: str, sim_a: str, sim_b: str, sim_c: str) -> dict[str, Any]:
    """deploy/prometheus.yml with its targets pointed at this test's processes."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(
        scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL
    )
    # The real alert rules, evaluated against the real series (the config lands in a tmp directory).
    config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / rules) for rules in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for job in jobs.values():
        job.pop("file_sd_configs", None)
    jobs["datagen-coordinator"]["static_configs"] = [{"targets": [coordinator]}]
    jobs["datagen-workers"]["static_configs"] = [{"targets": [worker]}]
    jobs["sglang"]["static_configs"] = [{"targets": [sim_a], "labels": {"server": "simA"}}]
    underscore = copy.deepcopy(jobs["sglang"])
    underscore.update(
        job_name="sglang-underscore-names",
        static_configs=[{"targets": [sim_b], "labels": {"server": "simB"}}],
        metric_relabel_configs=[_underscore_relabel("sglang")],
    )
    vllm_colon, vllm_underscore = VLLM_SERVERS
    jobs["vllm"]["static_configs"] = [{"targets": [sim_c], "labels": {"server": vllm_colon}}]
    vllm = copy.deepcopy(jobs["vllm"])
    vllm.update(
        job_name="vllm-underscore-names",
        static_configs=[{"targets": [sim_c], "labels": {"server": vllm_underscore}}],
        metric_relabel_configs=[_underscore_relabel("vllm")],
    )
    config["scrape_configs"] += [underscore, vllm]
    return config


def _dataset(path: Path) -> None:
    rows = []
    for i in range(PROMPTS):
        row: dict[str, Any] = {
            "id": f"p{i}",
            "messages": [{"role": "user", "content": f"Question {i}: " + "word " * (i % 40)}],
            "partition": ("math", "code", "chat")[i % 3],
        }
        if i % LONG_EVERY == 0:
            row["class"] = "long"
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _resolve(prom: Prometheus, board: dict[str, Any]) -> dict[str, list[str]] | None:
    """Each query variable's values, as Grafana would offer them; None while one has none yet."""
    values = {}
    for name, var in variables(board).items():
        if var["type"] != "query":
            continue
        match, label = parse_label_values(variable_query(var))
        found = prom.label_values(label, match)
        if not found:
            return None
        values[name] = found
    return values


def _observe_round(
    prom: Prometheus, boards: dict[str, dict[str, Any]], queries: list[PanelQuery], seen: dict[str, Seen]
) -> None:
    resolved = {name: _resolve(prom, board) for name, board in boards.items()}
    for query in queries:
        values = resolved[query.dashboard]
        state = seen[query.key]
        state.rounds += 1
        if values is None:
            continue
        expr = fill(query.expr, values)
        state.last_expr = expr
        result = prom.query(expr)
        state.answered += bool(result)
        for sample in result:
            value = float(sample["value"][1])
            if not math.isfinite(value):
                state.not_finite.append(f"{sample['metric']} = {value}")
            state.positive |= value > 0
            server = sample["metric"].get("server", "")
            state.servers[server] = state.servers.get(server, False) or value > 0


def _reads_vllm(query: PanelQuery) -> bool:
    return "vllm[:_]" in query.expr


def _must_show(query: PanelQuery) -> list[str]:
    return [server for marker, servers in MUST_SHOW.items() if marker in query.expr for server in servers]


def _satisfied(query: PanelQuery, state: Seen) -> bool:
    needs_positive = ("rate(" in query.expr or "increase(" in query.expr) and query.title not in MAY_STAY_ZERO
    shown = all(
        server in state.servers and (state.servers[server] or not needs_positive)
        for server in _must_show(query)
    )
    return shown and state.answered > 0 and (state.positive or not needs_positive)


def _planted(prom: Prometheus) -> dict[str, float]:
    checks = {
        "retractions, underscore form": 'sum(sglang_num_retracted_requests_total{server="simB"})',
        "preemptions, vLLM": 'sum(vllm:num_preemptions_total{server="simC"})',
        "503 retries": 'sum(datagen_worker_retries_total{reason="ServerUnavailableError"})',
        "truncated records": 'sum(datagen_worker_finishes_total{finish="length"})',
        "failed prompts": "sum(datagen_worker_failures_total)",
        "failed prompts in the job": 'sum(datagen_job_prompts_total{status="failed"})',
    }
    out = {}
    for name, expr in checks.items():
        result = prom.query(expr)
        out[name] = float(result[0]["value"][1]) if result else 0.0
    return out


def _name_forms(prom: Prometheus) -> dict[str, int]:
    kv_usage = {"sglang": "token_usage", "vllm": "kv_cache_usage_perc"}
    return {
        f"{engine}{sep}": len(prom.query(f'{{__name__="{engine}{sep}{name}"}}'))
        for engine, name in kv_usage.items()
        for sep in ":_"
    }


def _spawn_processes(stack: ProcessStack, ports: dict[str, int], tokenizer: str) -> None:
    sim = ("sim", "--tokenizer", tokenizer, "--time-scale", TIME_SCALE)
    stack.spawn(
        "simA", *sim, "--port", str(ports["simA"]), "--fail-503-rate", "0.1", "--fail-500-rate", "0.03"
    )
    stack.spawn(
        "simB", *sim, "--port", str(ports["simB"]), "--kv-tokens", KV_TOKENS, "--reserve-fraction", "0.3"
    )
    stack.spawn(
        "simC",
        *sim,
        *("--api", "vllm", "--port", str(ports["simC"])),
        # vLLM reserves no room for output at admission, so decode overflows the pool (preemptions).
        *("--kv-tokens", KV_TOKENS, "--context-len", VLLM_CONTEXT_LEN, "--reserve-fraction", "0"),
    )
    capture_dir = stack.tmp / "capture"
    capture_dir.mkdir()
    stack.spawn(
        "simCap",
        *sim,
        *("--api", "vllm", "--port", str(ports["simCap"]), "--capture-dir", str(capture_dir)),
    )
    stack.spawn("coordinator", "coordinator", "--port", str(ports["coordinator"]))
    stack.spawn(
        "worker",
        "worker",
        *("--server", f"simA=http://127.0.0.1:{ports['simA']}"),
        *("--server", f"simB=http://127.0.0.1:{ports['simB']}"),
        # The worker asks the server for its engine (--engine auto).
        *("--server", f"simC=http://127.0.0.1:{ports['simC']}"),
        *("--capture-server", f"simCap=http://127.0.0.1:{ports['simCap']}"),
        *("--capture-dir", str(capture_dir)),
        *("--metrics-port", str(ports["worker"])),
        *("--short-concurrency", "32", "--long-concurrency", "8"),
    )
    for name, path in (
        ("simA", "/health"),
        ("simB", "/health"),
        ("simC", "/health"),
        ("simCap", "/health"),
        ("coordinator", "/healthz"),
        ("worker", "/metrics"),
    ):
        stack.wait_http(f"http://127.0.0.1:{ports[name]}{path}")


def _wait_targets_up(prom: Prometheus, expected: int) -> None:
    def up() -> bool:
        targets = prom.targets()
        return len(targets) == expected and all(t["health"] == "up" for t in targets)

    wait_until(
        up,
        30,
        f"{expected} scrape targets up",
        interval_s=0.2,
        on_timeout=lambda: f"targets: {prom.targets()}\n{prom.log()}",
    )


def _submit(stack: ProcessStack, coordinator: str, tokenizer: str) -> str:
    stack.wait_server_up(coordinator, "simA")
    dataset = stack.tmp / "dataset.jsonl"
    _dataset(dataset)
    # Two arms, for the recipe panels. Both think, so outputs keep their lengths and the job runs as
    # long as before (an arm without thinking would answer shorter and end the job sooner).
    recipe = stack.tmp / "recipe.json"
    arms = [
        {"name": "low", "chat_template_kwargs": {"reasoning_effort": "low"}},
        {"name": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
    ]
    recipe.write_text(json.dumps({"recipe": {"assign": "cycle", "arms": arms}}))
    result = stack.cli(
        *("submit", str(dataset), "--coordinator", coordinator, "--tokenizer", tokenizer),
        *("--spec", str(recipe)),
        *("--chat-template", str(default_chat_template_path()), "--seed", "7"),
        *("--short-max-new-tokens", str(SHORT_MAX_NEW), "--long-max-new-tokens", str(LONG_MAX_NEW)),
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{stack.logs()}"
    return result.stdout.strip().splitlines()[0]


def _submit_features(stack: ProcessStack, coordinator: str, tokenizer: str) -> None:
    """A small job with features, for the capture panels (submitted once the capture server is up)."""
    stack.wait_server_up(coordinator, "simCap")
    dataset = stack.tmp / "features.jsonl"
    rows = [
        {"id": f"f{i}", "messages": [{"role": "user", "content": f"Feature {i}"}]}
        for i in range(FEATURES_PROMPTS)
    ]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = stack.cli(
        *("submit", str(dataset), "--coordinator", coordinator, "--tokenizer", tokenizer),
        *("--chat-template", str(default_chat_template_path()), "--seed", "7", "--job-id", FEATURES_JOB),
        *("--short-max-new-tokens", str(SHORT_MAX_NEW), "--features-layers", FEATURES_LAYERS),
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{stack.logs()}"


def _observe_until_captures_shown(
    prom: Prometheus, boards: dict[str, dict[str, Any]], queries: list[PanelQuery], seen: dict[str, Seen]
) -> None:
    """Rounds until every capture panel has answered: their counters reach Prometheus at its next
    scrapes after the job with features ends."""
    capture = [q for q in queries if "capture" in q.expr or "feature" in q.expr]
    deadline = time.monotonic() + JOB_BUDGET_S
    while True:
        _observe_round(prom, boards, queries, seen)
        if all(seen[q.key].answered for q in capture):
            return
        assert time.monotonic() < deadline, [q.title for q in capture if not seen[q.key].answered]
        time.sleep(0.5)


def _wait_job_done(stack: ProcessStack, coordinator: str, job_id: str) -> None:
    deadline = time.monotonic() + JOB_BUDGET_S
    while (state := _job_state(coordinator, job_id)) not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, (
            f"job {job_id} still {state} after {JOB_BUDGET_S} s\n{stack.logs()}"
        )
        time.sleep(0.2)


def _job_state(coordinator: str, job_id: str) -> str:
    return str(httpx.get(f"{coordinator}/jobs/{job_id}", timeout=5).json()["state"])


def _watch(
    prom: Prometheus,
    boards: dict[str, dict[str, Any]],
    queries: list[PanelQuery],
    job_state: Callable[[], str],
    seen: dict[str, Seen] | None = None,
) -> tuple[dict[str, Seen], str]:
    """Query every panel in rounds until each has answered (and risen) or the job has ended;
    ``seen`` holds what earlier rounds saw."""
    started = time.monotonic()
    seen = seen if seen is not None else {q.key: Seen() for q in queries}
    rounds = 0
    while True:
        _observe_round(prom, boards, queries, seen)
        rounds += 1
        state = job_state()
        satisfied = all(_satisfied(q, seen[q.key]) for q in queries) and rounds >= MIN_ROUNDS
        if satisfied or state in ("completed", "failed", "cancelled"):
            return seen, state
        assert time.monotonic() - started < JOB_BUDGET_S, f"job still {state} after {JOB_BUDGET_S} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    require_binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    boards = load_dashboards()
    queries = [q for name, board in boards.items() for q in panel_queries(name, board)]
    tokenizer = bundled_tokenizer_path()
    ports = {name: free_port() for name in ("simA", "simB", "simC", "simCap", "coordinator", "worker")}
    coordinator = f"http://127.0.0.1:{ports['coordinator']}"
    with LocalRedis() as redis_server:
        env = {
            "DATAGEN_REDIS_URL": redis_server.url,
            "DATAGEN_STORAGE": str(tmp / "data"),
            "DATAGEN_NAMESPACE": NS,
            # One attempt per prompt: a 500 fails it, so the failure panels have data.
            "DATAGEN_MAX_ATTEMPTS": "1",
            "DATAGEN_RETRY_BASE_S": "0.05",
            "DATAGEN_RETRY_MAX_S": "0.2",
            "DATAGEN_HEALTH_INTERVAL_S": "0.2",
            "DATAGEN_CONTROLLER_INTERVAL_S": "0.5",
            # Start at the ceiling: slow start would keep simB's small KV pool from ever
            # retracting, and the retraction panels need the planted fault to show.
            "DATAGEN_CONTROLLER_INITIAL_TARGET": "0",
            "DATAGEN_COMMIT_INTERVAL_S": "0.5",
            "DATAGEN_HEARTBEAT_INTERVAL_S": "1",
            "DATAGEN_REAPER_INTERVAL_S": "1",
            # The stack stops with the job running: the worker hands its prompts back at once.
            "DATAGEN_DRAIN_TIMEOUT_S": "1",
        }
        stack = ProcessStack(tmp, env)
        try:
            _spawn_processes(stack, ports, tokenizer)
            addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
            sims = (addresses["simA"], addresses["simB"], addresses["simC"])
            config = _config(addresses["coordinator"], addresses["worker"], *sims)
            with Prometheus(tmp, config) as prom:
                _wait_targets_up(prom, expected=6)
                # The job with features runs first, to its end: the main job's run (what the panels are
                # watched over) is then as it was without it, and the capture panels have data.
                _submit_features(stack, coordinator, tokenizer)
                _wait_job_done(stack, coordinator, FEATURES_JOB)
                # The capture panels are looked at while their rates still hold the job with features
                # (a ratio of rates answers nothing once they fall to zero).
                early = {q.key: Seen() for q in queries}
                _observe_until_captures_shown(prom, boards, queries, early)
                job_id = _submit(stack, coordinator, tokenizer)
                seen, state = _watch(prom, boards, queries, lambda: _job_state(coordinator, job_id), early)
                yield Observed(
                    seen=seen,
                    queries=queries,
                    job_state=state,
                    planted=_planted(prom),
                    name_forms=_name_forms(prom),
                    targets=prom.targets(),
                    job_id=job_id,
                    job_label_values=prom.label_values("job", "datagen_job_prompts_total"),
                    rules=prom.rules(),
                )
        finally:
            stack.stop()


def test_prometheus_is_installed() -> None:
    """Fails, rather than skips, without Prometheus: CI installs it (scripts/check, as root)."""
    require_binary("prometheus")
    require_binary("promtool")


def test_every_panel_query_answers_while_the_job_runs(observed: Observed) -> None:
    silent = [
        f"{q.key}: {observed.seen[q.key].last_expr or q.expr}"
        for q in observed.queries
        if not observed.seen[q.key].answered
    ]
    assert not silent, "queries that never returned data:\n" + "\n".join(silent)


def test_every_value_is_finite(observed: Observed) -> None:
    bad = {
        q.key: observed.seen[q.key].not_finite[:3]
        for q in observed.queries
        if observed.seen[q.key].not_finite
    }
    assert not bad, bad


def test_vllm_queries_answer_for_the_vllm_server(observed: Observed) -> None:
    """The panels that read vLLM's names show the vLLM simulator, in both name forms."""
    reading = [q for q in observed.queries if _reads_vllm(q)]
    assert reading
    missing = {
        q.key: sorted(observed.seen[q.key].servers)
        for q in reading
        if not set(VLLM_SERVERS) <= set(observed.seen[q.key].servers)
    }
    assert not missing, f"queries without the vLLM servers {VLLM_SERVERS}: {missing}"


def test_rate_panels_rise_above_zero(observed: Observed) -> None:
    flat = [q.key for q in observed.queries if not _satisfied(q, observed.seen[q.key])]
    assert not flat, f"rate queries that stayed at zero: {flat}"
    # The exemptions name real panels, so a renamed panel does not keep a stale pass.
    assert set(MAY_STAY_ZERO) <= {q.title for q in observed.queries}


def test_the_job_was_still_running_when_every_query_had_answered(observed: Observed) -> None:
    assert observed.job_state in ("ingesting", "running"), observed.job_state


def test_planted_faults_are_visible(observed: Observed) -> None:
    assert all(value > 0 for value in observed.planted.values()), observed.planted


def test_job_series_keep_the_datagen_job_id(observed: Observed) -> None:
    # Without honor_labels the scrape job's name would take the label and the id would move
    # to exported_job: the $job variable would offer "datagen-coordinator".
    assert observed.job_id in observed.job_label_values
    assert set(observed.job_label_values) <= {observed.job_id, FEATURES_JOB}


def test_both_name_forms_of_both_engines_are_stored(observed: Observed) -> None:
    assert observed.name_forms == {"sglang:": 1, "sglang_": 1, "vllm:": 1, "vllm_": 1}
    assert {t["labels"]["job"] for t in observed.targets} == {
        "datagen-coordinator",
        "datagen-workers",
        "sglang",
        "sglang-underscore-names",
        "vllm",
        "vllm-underscore-names",
    }


def test_the_alert_rules_evaluate_and_stay_quiet(observed: Observed) -> None:
    """deploy/alerts.yml over the real series: every rule evaluates; Redis has no maxmemory here,
    so none fires."""
    rules = {rule["name"]: rule for rule in observed.rules}
    assert set(rules) == {"DatagenRedisOutOfMemory", "DatagenRedisMemoryHigh"}
    for name, rule in rules.items():
        assert (rule["health"], rule["state"]) == ("ok", "inactive"), (name, rule.get("lastError"))
