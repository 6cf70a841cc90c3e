"""The Grafana dashboards as files: ids, data sources, variables and queries that can be checked
without running anything. That every query returns data is test_deploy_prometheus.py's job."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.support.deploy import (
    BUILTIN_VARIABLES,
    COMPOSE_FILE,
    ENGINE_PREFIXES,
    GRAFANA_PROVISIONING,
    iter_panels,
    load_dashboards,
    panel_queries,
    parse_label_values,
    queryable_datagen_names,
    queryable_engine_series,
    used_variables,
    variable_query,
    variables,
)
from tests.support.deploy import variables as board_variables

DASHBOARDS = load_dashboards()
EXPECTED_BOARDS = {"fleet.json", "kv.json", "job.json"}
# The vLLM counterpart of each SGLang name a panel reads (docs/reference/vllm-contract.md, section 8).
# A panel matches both, so one query shows either engine's servers.
VLLM_EQUIVALENT = {
    "token_usage": "kv_cache_usage_perc",
    "num_running_reqs": "num_requests_running",
    "num_queue_reqs": "num_requests_waiting",
    "num_retracted_requests_total": "num_preemptions_total",
    "generation_tokens_total": "generation_tokens_total",
    "num_requests_total": "request_success_total",
    "queue_time_seconds_bucket": "request_queue_time_seconds_bucket",
    "queue_time_seconds_count": "request_queue_time_seconds_count",
}
# SGLang names vLLM has nothing like: their panels say so in their description.
SGLANG_ONLY = {"num_used_tokens", "max_total_num_tokens", "context_len", "gen_throughput"}
# A server with several data-parallel ranks (SGLang) or engines (vLLM) reports a series for each.
# KV usage is a fraction and the capacities are per rank: a server's value is the highest, not the sum.
TAKE_THE_MAX = {
    "sglang:token_usage",
    "vllm:kv_cache_usage_perc",
    "sglang:max_total_num_tokens",
    "sglang:context_len",
}
# Labels Prometheus adds to every scraped series (the `server` label comes from the scrape config).
TARGET_LABELS = {"server", "instance", "job"}
PROMETHEUS_NAMES = {"up"}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "on", "and", "or", "unless", "without", "ignoring",
    "rate", "increase", "histogram_quantile", "le", "bool", "offset", "group_left", "group_right",
}  # fmt: skip


def _provisioned_datasources() -> list[dict[str, Any]]:
    found = []
    for path in sorted((GRAFANA_PROVISIONING / "datasources").glob("*.yml")):
        found.extend(yaml.safe_load(path.read_text())["datasources"])
    return found


@pytest.fixture(params=sorted(DASHBOARDS), ids=str)
def board(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, DASHBOARDS[request.param]


def test_the_three_dashboards_exist_with_unique_uids() -> None:
    assert set(DASHBOARDS) == EXPECTED_BOARDS
    uids = [b["uid"] for b in DASHBOARDS.values()]
    assert len(set(uids)) == len(uids)
    assert all(b["title"] and b["panels"] for b in DASHBOARDS.values())


def test_panel_ids_are_unique(board: tuple[str, dict[str, Any]]) -> None:
    ids = [panel["id"] for panel in iter_panels(board[1])]
    assert len(ids) == len(set(ids)), ids


def test_panels_fit_the_grid_without_overlapping(board: tuple[str, dict[str, Any]]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in iter_panels(board[1]):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_query_panel_has_targets_with_unique_ref_ids(board: tuple[str, dict[str, Any]]) -> None:
    for panel in iter_panels(board[1]):
        if panel["type"] == "row":
            continue
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_datasource_references_resolve(board: tuple[str, dict[str, Any]]) -> None:
    name, dashboard = board
    provisioned = {ds["uid"]: ds for ds in _provisioned_datasources()}
    assert any(ds["type"] == "prometheus" for ds in provisioned.values())
    defined = board_variables(dashboard)
    datasource_vars = {n for n, v in defined.items() if v["type"] == "datasource"}
    for var in datasource_vars:
        assert defined[var]["query"] == "prometheus"
        # The default selection is the data source deploy/ provisions.
        assert defined[var]["current"]["value"] in provisioned

    def check(ref: Any, where: str) -> None:
        assert isinstance(ref, dict) and ref.get("type") == "prometheus", (name, where, ref)
        uid = ref["uid"]
        variable = used_variables(uid)
        if variable:
            assert variable <= datasource_vars, (name, where, uid)
        else:
            assert uid in provisioned, (name, where, uid)

    for panel in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        check(panel.get("datasource"), panel["title"])
        for target in panel["targets"]:
            check(target.get("datasource", panel["datasource"]), f"{panel['title']}/{target['refId']}")
    for definition in defined.values():
        if definition["type"] == "query":
            check(definition.get("datasource"), f"variable {definition['name']}")


def test_every_variable_used_is_defined_and_every_query_variable_used(
    board: tuple[str, dict[str, Any]],
) -> None:
    name, dashboard = board
    defined = variables(dashboard)
    used: set[str] = set()
    for panel in iter_panels(dashboard):
        for text in [panel.get("title", ""), *(t["expr"] for t in panel.get("targets", []))]:
            used |= used_variables(text)
        for target in panel.get("targets", []):
            used |= used_variables(target.get("legendFormat", ""))
    for var in defined.values():
        used |= used_variables(variable_query(var))
    missing = used - set(defined) - BUILTIN_VARIABLES
    assert not missing, f"{name} uses undefined variables {missing}"
    # Every query variable narrows at least one panel; the ones the issue asks for exist.
    exprs = " ".join(q.expr for q in panel_queries(name, dashboard))
    for var_name, var in defined.items():
        if var["type"] == "query":
            assert f"${var_name}" in exprs, f"{name}: variable {var_name} is used by no panel"
            parse_label_values(variable_query(var))  # label_values(...) queries only
    assert {"job", "server", "instance"} & set(defined)


def test_fleet_kv_and_job_variables() -> None:
    assert {"job", "server", "instance"} <= set(variables(DASHBOARDS["fleet.json"]))
    assert {"server", "instance"} <= set(variables(DASHBOARDS["kv.json"]))
    assert {"job", "instance"} <= set(variables(DASHBOARDS["job.json"]))


def test_no_query_papers_over_missing_data() -> None:
    for name, dashboard in DASHBOARDS.items():
        for query in panel_queries(name, dashboard):
            assert not re.search(r"\bor\s+vector\s*\(", query.expr), query.key
            assert "absent(" not in query.expr, query.key


def _metric_names(expr: str) -> set[str]:
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_strings)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_ranges))
    labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!=|!~|=)", without_strings))
    groups = re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr)
    grouping = {word for group in groups for word in re.findall(r"\w+", group)}
    numbers = {n for n in names if re.fullmatch(r"[0-9.]+", n)}
    return names - labels - grouping - PROMQL_WORDS - numbers - {"__name__"}


def _engine_names(expr: str) -> list[str]:
    """The series names (``sglang:…``, ``vllm:…``) that ``{__name__=~"…"}`` matchers in ``expr`` read."""
    names = []
    for regex in re.findall(r'__name__=~"([^"]+)"', expr):
        for alternative in regex.split("|"):
            prefix, both_forms, rest = alternative.partition("[:_]")
            assert prefix in ENGINE_PREFIXES and both_forms, f"match both name forms: {alternative} in {expr}"
            names.append(f"{prefix}:{rest}")
    return names


def _labels(expr: str) -> set[str]:
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    matched = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!=|!~|=)", without_strings))
    groups = re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr)
    return (matched | {word for group in groups for word in re.findall(r"\w+", group)}) - {"__name__"}


def test_every_metric_queried_exists() -> None:
    """Names are pinned by test_deploy_metric_names.py, so a rename cannot leave a panel empty."""
    known = queryable_datagen_names() | PROMETHEUS_NAMES
    engine_series = queryable_engine_series()
    for name, dashboard in DASHBOARDS.items():
        exprs = [(q.key, q.expr) for q in panel_queries(name, dashboard)]
        for var_name, var in variables(dashboard).items():
            if var["type"] == "query":
                exprs.append((f"{name} / ${var_name}", parse_label_values(variable_query(var))[0] or ""))
        for key, expr in exprs:
            for metric in _metric_names(expr):
                assert metric in known, f"{key}: unknown metric {metric}"
            for series in _engine_names(expr):
                assert series in engine_series, f"{key}: unknown metric {series}"
                kind, labels = engine_series[series]
                extra = _labels(expr) - labels - TARGET_LABELS - ({"le"} if kind == "histogram" else set())
                assert not extra, f"{key}: {series} has no labels {extra}"
            bare = re.sub(r"(?:sglang|vllm)\[:_\]", "", expr)
            assert "sglang:" not in bare and "vllm:" not in bare, f"{key}: one name form only"


def test_engine_queries_cover_sglang_and_vllm() -> None:
    """Each SGLang name a query reads comes with its vLLM counterpart, or the panel says vLLM has none."""
    for name, dashboard in DASHBOARDS.items():
        for panel in iter_panels(dashboard):
            for target in panel.get("targets", []):
                names = _engine_names(target["expr"])
                sglang = {n.removeprefix("sglang:") for n in names if n.startswith("sglang:")}
                vllm = {n.removeprefix("vllm:") for n in names if n.startswith("vllm:")}
                key = f"{name} / {panel['title']} / {target['refId']}"
                assert sglang <= set(VLLM_EQUIVALENT) | SGLANG_ONLY, f"{key}: decide {sglang - SGLANG_ONLY}"
                assert vllm == {VLLM_EQUIVALENT[n] for n in sglang - SGLANG_ONLY}, key
                if sglang & SGLANG_ONLY:
                    assert "vLLM" in panel["description"], (
                        f"{key}: say that vLLM has no {sglang & SGLANG_ONLY}"
                    )
                elif names:
                    assert "vllm:" in panel["description"], f"{key}: name the vLLM metric"


def test_engine_fractions_take_the_max_and_counts_the_sum() -> None:
    aggregated = re.compile(r'(\w+) by \(([^)]*)\) \((?:rate\()?\{__name__=~"([^"]+)"')
    for name, dashboard in DASHBOARDS.items():
        for query in panel_queries(name, dashboard):
            found = aggregated.findall(query.expr)
            assert len(found) == query.expr.count("__name__"), f"{query.key}: aggregate by server"
            for op, grouping, regex in found:
                assert "server" in grouping, query.key
                names = set(_engine_names(f'__name__=~"{regex}"'))
                assert op == ("max" if names <= TAKE_THE_MAX else "sum"), query.key


def test_dashboards_are_provisioned_from_the_mounted_directory() -> None:
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "datagen.yml").read_text())["providers"]
    paths = {p["options"]["path"] for p in providers}
    grafana = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    assert {mounts[p] for p in paths} == {"./dashboards"}
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.rsplit("/", 1)[1] in DASHBOARDS
    urls = {ds["url"] for ds in _provisioned_datasources()}
    assert urls == {"http://prometheus:9090"}
