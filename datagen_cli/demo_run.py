"""``datagen demo``: the whole pipeline on one machine with nothing configured.

Starts a private Redis, the simulated SGLang server, a worker and a coordinator as separate
processes (real HTTP, real RQ), submits the packaged ``datagen/data/prompts.jsonl`` (written by
``examples/make_prompts.py``; ``examples/prompts.jsonl`` links to it) with the bundled DeepSeek
tokenizer and the shipped R1 template, shows progress, prints a summary, and stops every process
it started, also on Ctrl-C.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console

import datagen
from datagen.errors import ConfigError
from datagen.export.rows import ExportStats, RowFilter, RowFilterOptions, filtered_batches
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.storage import Storage
from datagen.states import ServerState
from datagen_cli.client import CoordinatorClient
from datagen_cli.local.processes import STARTUP_TIMEOUT_S, ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port
from datagen_cli.waiting import wait_for_job

__all__ = ["DEMO_DATASET", "run_demo"]

# Package data, so the demo runs from a wheel too (not only from a checkout).
DEMO_DATASET = Path(datagen.__file__).resolve().parent / "data" / "prompts.jsonl"
# The simulated GPU runs at this fraction of real time: the demo takes seconds, not hours.
DEMO_TIME_SCALE = 0.01
DEMO_SPEC: dict[str, Any] = {
    "short_max_new_tokens": 1024,
    "long_max_new_tokens": 4096,
    "long_threshold_tokens": 1500,
    "sampling": {"temperature": 0.6, "top_p": 0.95, "sampling_seed": 1234},
}


def _wait_fleet(client: CoordinatorClient, procs: ChildProcesses) -> None:
    """Until the worker has taken its server: the coordinator's pre-flight checks need it."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        procs.check_alive()
        if any(server["state"] == ServerState.UP for server in client.servers()):
            return
        time.sleep(0.2)
    raise ConfigError(
        f"the worker did not take the simulated server within {STARTUP_TIMEOUT_S:.0f} s; "
        f"see the logs in {procs.log_dir}"
    )


def _child_env(redis_url: str, storage: Path) -> dict[str, str]:
    return child_env(
        {"DATAGEN_REDIS_URL": redis_url, "DATAGEN_STORAGE": str(storage), "DATAGEN_NAMESPACE": "demo"}
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(data_dir: Path, dataset: Path | None, console: Console) -> int:
    dataset = dataset or DEMO_DATASET
    if not dataset.is_file():
        raise ConfigError(f"dataset {dataset} not found; pass --dataset FILE.jsonl")
    data_dir = data_dir.resolve()
    log_dir = data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # SIGTERM would otherwise end this process without running the cleanup below and leave the
    # children running; turn it into the same path as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    with LocalRedis() as redis_server:
        procs = ChildProcesses(log_dir, _child_env(redis_server.url, data_dir))
        try:
            sim_port, coord_port = free_port(), free_port()
            tokenizer = bundled_tokenizer_path()
            console.print(f"[bold]demo[/bold]: Redis {redis_server.url}, logs in {log_dir}")
            procs.spawn(
                "sim",
                "sim",
                "--port",
                str(sim_port),
                "--tokenizer",
                tokenizer,
                "--time-scale",
                str(DEMO_TIME_SCALE),
            )
            procs.wait_http(f"http://127.0.0.1:{sim_port}/health")
            procs.spawn(
                "worker", "worker", "--server", f"sim=http://127.0.0.1:{sim_port}",
                "--short-concurrency", "64", "--long-concurrency", "16", "--metrics-port", "0",
            )  # fmt: skip
            procs.spawn("coordinator", "coordinator", "--port", str(coord_port))
            coordinator_url = f"http://127.0.0.1:{coord_port}"
            procs.wait_http(f"{coordinator_url}/healthz")
            spec = dict(DEMO_SPEC, tokenizer=tokenizer, chat_template=str(default_chat_template_path()))
            with CoordinatorClient(coordinator_url) as client:
                _wait_fleet(client, procs)
                job = client.submit(dataset, spec)
                console.print(f"submitted {dataset} as job [bold]{job['id']}[/bold]", soft_wrap=True)
                code = wait_for_job(client, job["id"], console)
                final = client.job(job["id"])
        finally:
            procs.stop()
    _summary(console, final, Storage(data_dir), time.monotonic() - started)
    return code


def _summary(console: Console, job: dict[str, Any], storage: Storage, wall_s: float) -> None:
    stats = ExportStats()
    finishes: dict[str, int] = {}
    # The first record of each key, unfiltered, as every export reads them.
    row_filter = RowFilter(RowFilterOptions(min_supervised_tokens=0), stats)
    for batch in filtered_batches(storage, job["id"], row_filter):
        for finish in batch.column("finish_type").to_pylist():
            finishes[finish] = finishes.get(finish, 0) + 1
    shards = len(storage.list_commits(job["id"]))
    records_dir = storage.url(job["id"], "records")
    console.print(
        f"\n[bold green]done[/bold green] in {wall_s:.1f} s: job {job['id']} is {job['state']}\n"
        f"  prompts: {job['total']} accepted, {job['done']} done, {job['failed']} failed, "
        f"{job['rejected']} rejected rows\n"
        f"  records: {stats.records - stats.duplicates} unique in {shards} Parquet shards\n"
        f"           under {records_dir}\n"
        f"  finish reasons: {', '.join(f'{k} {v}' for k, v in sorted(finishes.items()))}\n"
        f"  tokens: {job['prompt_tokens']} prompt, {job['generated_tokens']} generated, "
        f"{job['tokens_per_s']:.0f} generated tok/s\n"
        f"  check with:\n"
        f"    datagen report {job['id']} --storage {storage.root}\n"
        f"  export with:\n"
        f"    datagen export {job['id']} --storage {storage.root} --format specforge --out {job['id']}.jsonl",
        soft_wrap=True,
    )
