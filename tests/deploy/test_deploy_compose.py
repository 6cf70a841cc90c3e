"""compose.yaml and deploy/prometheus.yml, checked without Docker.

compose.yaml is validated against a pinned copy of the Compose specification's JSON schema; every
datagen service's command is parsed by the real CLI, its DATAGEN_* variables are loaded by the real
settings models, its ports are matched against Prometheus's targets, and the `sim` profile's
services are started as plain processes with compose's environment.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import typer
import yaml

from datagen.settings import (
    DEFAULT_COORDINATOR_PORT,
    DEFAULT_METRICS_PORT,
    CoordinatorSettings,
    WorkerSettings,
    known_variables,
    load,
)
from datagen_cli import app
from datagen_cli.local.redis_server import LocalRedis, free_port
from tests.support.deploy import (
    COMPOSE_FILE,
    DEPLOY,
    PROMETHEUS_CONFIG,
    REPO,
    active_services,
    as_list,
    environment,
    interpolation_names,
    load_compose,
    prometheus_targets,
    require_binary,
)
from tests.support.processes import ProcessStack
from tests.support.wait import wait_until
from workers.fleet.servers import ServerSpec

SCHEMA = DEPLOY / "compose-spec.json"
DATAGEN_IMAGE = "eagle3-datagen:local"
REDIS_PORT = 6379
SIMS = ("sim-0", "sim-1")
SERVERS_UP_TIMEOUT_S = 30.0
# A multi-node GPU node's settings (docs/operator/deployment.md): its own servers, the central
# Redis, shared storage.
GPU_NODE_ENV = {
    "DATAGEN_SERVERS": "gpu0=http://host.docker.internal:30000,gpu1=http://host.docker.internal:30001",
    "DATAGEN_REDIS_URL": "redis://central:6379/0",
    "SHARED_STORAGE": "/mnt/shared/datagen",
    "DATAGEN_API_TOKEN": "secret",
}


def _cli() -> Any:
    """The click group behind the Typer app (Typer may vendor its own click)."""
    return typer.main.get_command(app)


def _datagen_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {name: s for name, s in compose["services"].items() if s.get("image") == DATAGEN_IMAGE}
    assert {"coordinator", "worker", "sim-0", "sim-1"} <= set(found)
    return found


def _parse(service: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(command name, parsed parameters) as the real CLI parses the service's command."""
    args = as_list(service["command"])
    command = _cli().commands[args[0]]
    with command.make_context(f"datagen {args[0]}", args[1:]) as ctx:
        return args[0], dict(ctx.params)


def _listen_port(name: str, service: dict[str, Any]) -> int:
    if service.get("image", "").startswith("redis:"):
        return REDIS_PORT
    command, params = _parse(service)
    env = environment(service)
    if command == "coordinator":
        return int(params["port"] or env.get("DATAGEN_PORT", DEFAULT_COORDINATOR_PORT))
    if command == "worker":
        return int(params["metrics_port"] or env.get("DATAGEN_METRICS_PORT", DEFAULT_METRICS_PORT))
    if command == "sim":
        return int(params["port"])
    raise AssertionError(f"{name}: no known listening port")


def _schema_validator() -> jsonschema.Draft201909Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


def test_pinned_schema_is_the_recorded_file() -> None:
    provenance = (DEPLOY / "compose-spec.json.provenance").read_text()
    recorded = re.search(r"File:\s+sha256 ([0-9a-f]{64})", provenance)
    assert recorded is not None
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == recorded[1]


@pytest.mark.parametrize("env", [{}, GPU_NODE_ENV], ids=["defaults", "gpu-node"])
def test_compose_validates_against_the_compose_spec(env: dict[str, str]) -> None:
    validator = _schema_validator()
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    for document in (raw, load_compose(env)):
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]
        assert not errors, errors


def test_the_schema_catches_mistakes() -> None:
    validator = _schema_validator()
    compose = load_compose()
    compose["services"]["worker"]["enviroment"] = {}
    assert not validator.is_valid(compose)


def test_every_datagen_command_parses_with_the_real_cli() -> None:
    for name, service in _datagen_services(load_compose()).items():
        command, _ = _parse(service)
        assert command in ("coordinator", "worker", "sim"), name
    with pytest.raises(Exception, match="metrics-prot") as error:
        _parse({"command": ["worker", "--metrics-prot", "9400"]})
    assert type(error.value).__name__ == "NoSuchOption"


def test_the_dockerfiles_python_snippets_run() -> None:
    # The image runs these at build time; an import moved in the code breaks the build, which no
    # Docker engine here would show.
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    snippets = re.findall(r"python -c '([^']+)'", dockerfile)
    assert snippets, "the Dockerfile's `python -c` snippets were not found"
    for code in snippets:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"Dockerfile: python -c {code!r} failed:\n{done.stderr[-2000:]}"


def test_environment_names_are_known_settings() -> None:
    known = known_variables()
    text = COMPOSE_FILE.read_text()
    referenced = {n for n in interpolation_names(text) if n.startswith("DATAGEN_")}
    assert referenced <= known, referenced - known
    for name, service in load_compose()["services"].items():
        unknown = {k for k in environment(service) if k.startswith("DATAGEN_")} - known
        assert not unknown, f"{name}: {unknown}"


@pytest.mark.parametrize("env", [{}, GPU_NODE_ENV], ids=["defaults", "gpu-node"])
def test_environment_values_load(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, service in _datagen_services(load_compose(env)).items():
        command, _ = _parse(service)
        with monkeypatch.context() as patch:
            for key, value in environment(service).items():
                patch.setenv(key, value)
            if command == "worker":
                worker = load(WorkerSettings)
                assert ServerSpec.parse_many([worker.servers])
                assert worker.require_redis_url() and worker.storage == "/data"
            elif command == "coordinator":
                coordinator = load(CoordinatorSettings)
                assert coordinator.require_redis_url() and coordinator.storage == "/data"
                # Beyond loopback only by explicit consent; the port is published on loopback.
                assert coordinator.allow_insecure_bind or coordinator.api_token
            else:
                assert not any(k.startswith("DATAGEN_") for k in environment(service)), name


def test_ports_match_prometheus_targets() -> None:
    compose = load_compose()
    services = compose["services"]
    targets = prometheus_targets(yaml.safe_load(PROMETHEUS_CONFIG.read_text()))
    scraped = set()
    for job, entries in targets.items():
        for target, _labels in entries:
            host, _, port = target.rpartition(":")
            assert host in services, f"{job}: {target} is no compose service"
            assert int(port) == _listen_port(host, services[host]), f"{job}: {target}"
            scraped.add(host)
    # Everything that serves /metrics is scraped.
    assert scraped == set(_datagen_services(compose))
    # Published ports point at the port each process listens on.
    for name, service in services.items():
        for mapping in service.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[1])
            if name in scraped or name == "redis":
                assert container_port == _listen_port(name, service), (name, mapping)


def test_sglang_targets_carry_the_workers_server_names() -> None:
    compose = load_compose()
    worker = environment(compose["services"]["worker"])
    by_address = {
        spec.url.removeprefix("http://"): spec.name
        for spec in ServerSpec.parse_many([worker["DATAGEN_SERVERS"]])
    }
    targets = prometheus_targets(yaml.safe_load(PROMETHEUS_CONFIG.read_text()))["sglang"]
    assert {t: labels["server"] for t, labels in targets} == by_address


def test_every_file_sd_glob_has_an_example_and_server_targets_name_their_server() -> None:
    """One deploy/targets/*.yml.example per scrape job's glob; an inference server's entries
    (sglang-*.yml, vllm-*.yml) carry the `server` label its worker uses."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    examples = {path.stem: path for path in (DEPLOY / "targets").glob("*.yml.example")}
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            for pattern in sd["files"]:
                matching = [path for name, path in examples.items() if fnmatch(name, Path(pattern).name)]
                assert matching, f"{job['job_name']}: no example for {pattern}"
                for example in matching if job["job_name"] in ("sglang", "vllm") else []:
                    groups = yaml.safe_load(example.read_text())
                    assert all(group["labels"]["server"] for group in groups), example.name


def test_prometheus_scrapes_every_5_s_and_keeps_the_job_label() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"datagen-coordinator", "datagen-workers", "sglang", "vllm"}
    assert jobs["datagen-coordinator"].get("honor_labels") is True


def test_redis_keeps_an_append_only_file() -> None:
    redis = load_compose()["services"]["redis"]
    command = as_list(redis["command"])
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert any(str(v).endswith(":/data") for v in redis["volumes"])


def test_multi_node_storage_is_one_shared_directory() -> None:
    compose = load_compose(GPU_NODE_ENV)
    for name in ("coordinator", "worker"):
        assert "/mnt/shared/datagen:/data" in compose["services"][name]["volumes"], name


def test_promtool_accepts_the_config_and_the_example_targets(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The example file_sd files, installed under the names the config globs for.
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for example in sorted((DEPLOY / "targets").glob("*.yml.example")):
        shutil.copy(example, tmp_path / example.name.removesuffix(".example"))
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(tmp_path / Path(f).name) for f in sd["files"]]
    for rules in config["rule_files"]:  # relative to the config file, as compose mounts them
        shutil.copy(DEPLOY / rules, tmp_path / rules)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "WARNING" not in result.stdout + result.stderr, (
        result.stdout + result.stderr
    )


# -- the sim profile as plain processes ----------------------------------------------------------


class _Rewriter:
    """Maps compose's service addresses, ports and volumes onto this machine's loopback and tmp."""

    def __init__(self, compose: dict[str, Any], tmp: Path, redis_port: int) -> None:
        self.compose = compose
        self.tmp = tmp
        self.ports: dict[str, tuple[int, int]] = {"redis": (REDIS_PORT, redis_port)}
        for name, service in _datagen_services(compose).items():
            self.ports[name] = (_listen_port(name, service), free_port())

    def text(self, value: str, own: str) -> str:
        for name, (port, new) in self.ports.items():
            value = re.sub(rf"(?<![\w.-]){re.escape(name)}:{port}\b", f"127.0.0.1:{new}", value)
        port, new = self.ports[own]
        value = re.sub(rf"\b(?:127\.0\.0\.1|localhost):{port}\b", f"127.0.0.1:{new}", value)
        return value.replace("0.0.0.0", "127.0.0.1")

    def args(self, name: str, args: list[str]) -> list[str]:
        port, new = self.ports[name]
        out = []
        for i, arg in enumerate(args):
            previous = args[i - 1] if i else ""
            if previous in ("--port", "--metrics-port") and arg == str(port):
                arg = str(new)
            out.append(self.text(arg, name))
        return out

    def env(self, name: str, service: dict[str, Any]) -> dict[str, str]:
        env = {k: self.text(v, name) for k, v in environment(service).items()}
        port, new = self.ports[name]
        for key in ("DATAGEN_PORT", "DATAGEN_METRICS_PORT"):
            if env.get(key) == str(port):
                env[key] = str(new)
        for volume in service.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            local = self.tmp / "volumes" / re.sub(r"\W", "_", source)
            local.mkdir(parents=True, exist_ok=True)
            env = {
                k: str(local) + v[len(target) :] if v == target or v.startswith(target + "/") else v
                for k, v in env.items()
            }
        return env

    def url(self, name: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[name][1]}{path}"


def _healthcheck(rewriter: _Rewriter, name: str, service: dict[str, Any]) -> list[str]:
    test = as_list(service["healthcheck"]["test"])
    assert test[0] == "CMD" and test[1] == "python", (name, test)
    return [sys.executable, *(rewriter.text(arg, name) for arg in test[2:])]


def _metric(text: str, name: str, labels: str) -> float | None:
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else None


def _wait_servers_up(rewriter: _Rewriter, stack: ProcessStack, timeout_s: float) -> None:
    """Until the worker has reached both simulators and the coordinator shows both up."""

    def worker_up() -> list[float | None]:
        text = httpx.get(rewriter.url("worker", "/metrics"), timeout=5).text
        return [_metric(text, "datagen_worker_server_up", f'server="{s}"') for s in SIMS]

    def coordinator_states() -> dict[str, str]:
        servers = httpx.get(rewriter.url("coordinator", "/servers"), timeout=5).json()["servers"]
        return {s["name"]: s["state"] for s in servers}

    wait_until(
        lambda: worker_up() == [1.0, 1.0] and coordinator_states() == dict.fromkeys(SIMS, "up"),
        timeout_s,
        "the worker to reach both simulators and the coordinator to show them up",
        interval_s=0.2,
        on_timeout=lambda: f"worker: {worker_up()}, coordinator: {coordinator_states()}\n{stack.logs()}",
    )


@pytest.mark.e2e
def test_sim_profile_services_run_as_plain_processes(tmp_path: Path) -> None:
    compose = load_compose()
    services = {
        name: s for name, s in active_services(compose, {"sim"}).items() if s.get("image") == DATAGEN_IMAGE
    }
    assert set(services) == {"coordinator", "worker", "sim-0", "sim-1"}
    stacks: list[ProcessStack] = []
    with LocalRedis() as redis_server:
        rewriter = _Rewriter(compose, tmp_path, redis_server.port)
        try:
            # Simulators first, as a GPU node has SGLang up before its worker.
            for name in sorted(services, key=lambda n: not n.startswith("sim")):
                stack = ProcessStack(tmp_path, rewriter.env(name, services[name]))
                stacks.append(stack)
                stack.spawn(name, *rewriter.args(name, as_list(services[name]["command"])))
            stack = stacks[-1]
            for name in services:
                path = {"coordinator": "/healthz", "worker": "/metrics"}.get(name, "/health")
                stack.wait_http(rewriter.url(name, path))
                check = subprocess.run(
                    _healthcheck(rewriter, name, services[name]), capture_output=True, timeout=30
                )
                assert check.returncode == 0, (name, check.stderr)
            # The worker reached both simulators through compose's DATAGEN_SERVERS, and published
            # them in the shared Redis (every control interval), where the coordinator reads them.
            _wait_servers_up(rewriter, stack, SERVERS_UP_TIMEOUT_S)
        finally:
            for stack in stacks:
                stack.stop()
