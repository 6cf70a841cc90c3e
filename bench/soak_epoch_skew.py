"""Soak: two coordinators whose clocks are apart, over minutes, must never take each other for a
Redis that lost or rolled back its data (issue 36, item 1).

One private Redis and one storage root; a simulator and a worker; coordinator ``a`` on the real
clock and coordinator ``b`` with its wall clock ``--offset-s`` off (`datagen_cli.local.skew`), both of
one namespace, each ticking Redis's epoch every second. Jobs are submitted all along (every
``--submit-every-s``, to ``a`` and ``b`` in turn, ``--rows`` rows each, a slow simulator), so
that live jobs are there for a false rollback to rebuild. Every ``--report-s`` and at the end it
prints:

- the epoch's counter (how many ticks Redis counted) and what each coordinator logged: Redis
  seen rolled back, seen losing its data, another's settled epoch taken;
- rebuilds: ``datagen_jobs_rebuilt_total`` of both coordinators together, and jobs whose
  ``rebuilt`` field is set;
- jobs submitted, completed, live.

Expected: 0 rollbacks, 0 losses, 0 rebuilds (exit 1 otherwise). Before issue 36 a coordinator 3 s
behind made the other see 17 rollbacks in 3 minutes and rebuild live jobs 9 times.

Run: ``python bench/soak_epoch_skew.py [--minutes 20] [--offset-s -5] [--rows 300]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from _common import SAMPLING_SEED, job_spec, offline_hub, short_rows, write_jsonl

from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port

NAMESPACE = "soak"
HTTP_TIMEOUT_S = 30.0
WAIT_SERVERS_S = 60.0
# What a coordinator logs when it takes Redis for one that lost or rolled back its data, and when
# it takes another coordinator's settled epoch (`service.watch`).
ROLLED_BACK = "Redis went back to an older snapshot"
LOST = "Redis lost its data"
SETTLED = "another coordinator rebuilt jobs from storage"


def main() -> None:
    args = _parse()
    offline_hub()
    with tempfile.TemporaryDirectory(prefix="soak-skew-") as tmp:
        root = Path(tmp)
        redis_server = LocalRedis().start()
        procs = ChildProcesses(
            root,
            child_env(
                {
                    "DATAGEN_REDIS_URL": redis_server.url,
                    "DATAGEN_STORAGE": str(root / "data"),
                    "DATAGEN_NAMESPACE": NAMESPACE,
                    "DATAGEN_METRICS_PORT": "0",
                }
            ),
        )
        try:
            failed = _soak(args, root, procs, redis.Redis.from_url(redis_server.url))
        finally:
            procs.stop()
            redis_server.stop()
    raise SystemExit(1 if failed else 0)


def _soak(args: argparse.Namespace, root: Path, procs: ChildProcesses, client: redis.Redis) -> bool:
    sim_port = free_port()
    procs.spawn(
        "sim",
        "sim",
        "--port",
        str(sim_port),
        "--tokenizer",
        bundled_tokenizer_path(),
        "--time-scale",
        str(args.time_scale),
    )
    procs.wait_http(f"http://127.0.0.1:{sim_port}/health")
    urls = {}
    for name, offset in (("a", 0.0), ("b", args.offset_s)):
        port = free_port()
        procs.spawn(f"coordinator-{name}", "coordinator", "--port", str(port), clock_offset_s=offset)
        urls[name] = f"http://127.0.0.1:{port}"
        procs.wait_http(f"{urls[name]}/healthz")
    procs.spawn("worker", "worker", "--server", f"s=http://127.0.0.1:{sim_port}", "--short-concurrency", "32")
    _wait_servers(urls["a"])
    print(f"coordinators a (real clock) and b ({args.offset_s:+.1f} s), {args.minutes} min", flush=True)

    started = time.monotonic()
    until = started + args.minutes * 60
    next_submit = next_report = started
    jobs: list[str] = []
    while (now := time.monotonic()) < until:
        procs.check_alive()
        if now >= next_submit:
            jobs.append(_submit(root, urls["ab"[len(jobs) % 2]], len(jobs), args))
            next_submit = now + args.submit_every_s
        if now >= next_report:
            _report(root, urls, client, jobs, now - started)
            next_report = now + args.report_s
        time.sleep(0.5)
    figures = _report(root, urls, client, jobs, time.monotonic() - started)
    failed = figures["rolled_back"] or figures["lost"] or figures["rebuilds"] or figures["rebuilt_jobs"]
    print("RESULT:", "FAILED" if failed else "ok", json.dumps(figures), flush=True)
    return bool(failed)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--offset-s", type=float, default=-5.0, help="coordinator b's clock offset")
    parser.add_argument("--rows", type=int, default=300, help="rows per submitted job")
    parser.add_argument("--submit-every-s", type=float, default=20.0)
    parser.add_argument("--report-s", type=float, default=60.0)
    parser.add_argument("--time-scale", type=float, default=0.2, help="the simulator's (larger: slower)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    return parser.parse_args()


def _wait_servers(url: str) -> None:
    deadline = time.monotonic() + WAIT_SERVERS_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/servers", timeout=HTTP_TIMEOUT_S).json().get("servers"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the worker published no server")


def _submit(root: Path, url: str, n: int, args: argparse.Namespace) -> str:
    dataset = root / f"job{n}.jsonl"
    write_jsonl(dataset, [{**row, "id": f"j{n}-{row['id']}"} for row in short_rows(args.rows)])
    # Only what differs from the defaults: the spec a user would write.
    spec = job_spec(short_max_new_tokens=args.max_new_tokens, sampling={"sampling_seed": SAMPLING_SEED})
    with open(dataset, "rb") as fh:
        response = httpx.post(
            f"{url}/jobs",
            data={"spec": spec.model_dump_json(exclude_defaults=True)},
            files={"dataset": (dataset.name, fh, "application/jsonl")},
            timeout=HTTP_TIMEOUT_S,
        )
    if response.status_code != 202:
        raise RuntimeError(f"submit to {url} answered {response.status_code}: {response.text}")
    return str(response.json()["id"])


def _report(
    root: Path, urls: dict[str, str], client: redis.Redis, jobs: list[str], elapsed_s: float
) -> dict[str, Any]:
    logs = {name: (root / f"coordinator-{name}.log").read_text(errors="replace") for name in urls}
    states = [_job(urls["a"], job_id) for job_id in jobs]
    figures = {
        "minutes": round(elapsed_s / 60, 2),
        "epoch_seq": int(client.hget(Keys(NAMESPACE).epoch(), "seq") or 0),
        "rolled_back": sum(log.count(ROLLED_BACK) for log in logs.values()),
        "lost": sum(log.count(LOST) for log in logs.values()),
        "settled_taken": sum(log.count(SETTLED) for log in logs.values()),
        "rebuilds": sum(_rebuilds(url) for url in urls.values()),
        "rebuilt_jobs": sum(1 for job in states if job.get("rebuilt")),
        "jobs": len(jobs),
        "completed": sum(1 for job in states if job.get("state") == "completed"),
        "live": sum(1 for job in states if job.get("state") in ("ingesting", "running")),
        "prompts_done": sum(int(job.get("done") or 0) for job in states),
    }
    print(json.dumps(figures), flush=True)
    return figures


def _job(url: str, job_id: str) -> dict[str, Any]:
    try:
        return httpx.get(f"{url}/jobs/{job_id}", timeout=HTTP_TIMEOUT_S).json()  # type: ignore[no-any-return]
    except httpx.HTTPError:
        return {}


def _rebuilds(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("datagen_jobs_rebuilt_total{")
    )


if __name__ == "__main__":
    main()
