"""deploy/alerts.yml: valid for promtool, loaded by deploy/prometheus.yml and compose, querying only
pinned metrics, and firing when it should (``promtool test rules`` over synthetic series)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.deploy import (
    DEPLOY,
    PROMETHEUS_CONFIG,
    as_list,
    load_compose,
    queryable_datagen_names,
    require_binary,
)

ALERTS = DEPLOY / "alerts.yml"
MIB = 1024 * 1024
OUT_OF_MEMORY = {
    "summary": "Redis is out of memory and refuses writes",
    "description": "Redis is over its maxmemory: submits and job controls answer 503 and the fleet cannot "
    "record progress. Raise maxmemory (CONFIG SET maxmemory, and in redis.conf), or lower "
    "DATAGEN_MAX_QUEUED_PER_CLASS and restart the coordinator. `datagen status` shows the numbers.",
}
MEMORY_HIGH = {
    "summary": "Redis uses 95% of its maxmemory",
    "description": "Redis will refuse writes at its maxmemory. Raise maxmemory, or lower "
    "DATAGEN_MAX_QUEUED_PER_CLASS, before it is reached.",
}


def _series(name: str, instance: str, values: str) -> dict[str, str]:
    return {"series": f'{name}{{instance="{instance}"}}', "values": values}


def _expect(minute: int, alert: str, *firing: dict[str, Any]) -> dict[str, Any]:
    return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": list(firing)}


def _firing(annotations: dict[str, str], **labels: str) -> dict[str, Any]:
    return {"exp_labels": labels, "exp_annotations": annotations}


# Ten minutes at one sample a minute: Redis "c" out of memory from minute 3 to 5 (3 refusals counted
# at minute 3) and at 95 % of its maxmemory from minute 1; Redis "nolimit" has no maxmemory.
UNIT_TESTS: dict[str, Any] = {
    "rule_files": [str(ALERTS)],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                _series("datagen_redis_out_of_memory", "c", "0 0 0 1 1 1 0 0 0 0 0"),
                _series("datagen_redis_oom_refusals_total", "c", "0 0 0 3 3 3 3 3 3 3 3"),
                _series("datagen_redis_used_memory_bytes", "c", f"{50 * MIB} {95 * MIB}x9"),
                _series("datagen_redis_maxmemory_bytes", "c", f"{100 * MIB}x10"),
                _series("datagen_redis_used_memory_bytes", "nolimit", f"{95 * MIB}x10"),
                _series("datagen_redis_maxmemory_bytes", "nolimit", "0x10"),
            ],
            "alert_rule_test": [
                _expect(2, "DatagenRedisOutOfMemory"),
                _expect(4, "DatagenRedisOutOfMemory", _firing(OUT_OF_MEMORY, severity="critical")),
                # The refusals keep it firing for the counter's 5-minute window.
                _expect(7, "DatagenRedisOutOfMemory", _firing(OUT_OF_MEMORY, severity="critical")),
                _expect(9, "DatagenRedisOutOfMemory"),
                _expect(5, "DatagenRedisMemoryHigh"),
                _expect(8, "DatagenRedisMemoryHigh", _firing(MEMORY_HIGH, severity="warning", instance="c")),
            ],
        }
    ],
}


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        [require_binary("promtool"), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_fire_when_redis_is_out_of_memory_or_nearly_full(tmp_path: Path) -> None:
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(yaml.safe_dump(UNIT_TESTS, sort_keys=False))
    result = subprocess.run(
        [require_binary("promtool"), "test", "rules", str(tests)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_query_only_pinned_metrics() -> None:
    known = queryable_datagen_names()
    for rule in _rules():
        named = set(re.findall(r"\bdatagen_\w+", rule["expr"]))
        assert named and named <= known, (rule["alert"], named - known)


def test_prometheus_and_compose_load_the_rules() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == [ALERTS.name]
    prometheus = load_compose()["services"]["prometheus"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in prometheus["volumes"] if str(v).startswith("./")}
    config_dir = Path(mounted["./deploy/prometheus.yml"]).parent
    assert mounted["./deploy/alerts.yml"] == str(config_dir / ALERTS.name)
    assert f"--config.file={config_dir / PROMETHEUS_CONFIG.name}" in as_list(prometheus["command"])
