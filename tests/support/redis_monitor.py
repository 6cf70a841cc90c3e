"""A job's own Redis commands, counted command by command with MONITOR: the small-job cost test
(`tests/datagen/test_small_job_cost.py`) and `bench/tenants.py`'s one more small job.

A command counts for the job when it names the job (its keys, its prompts' RQ ids), and a script's
commands count with the script when any of those it ran does (a claim that hands out the job's
prompts costs its scans of the dispatch sets too). Claims that find nothing and the processes'
background loops name no job: they are the fleet's idle cost, not the job's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import redis

__all__ = ["RedisMonitor", "job_commands"]

# How long MONITOR takes to be on once asked.
MONITOR_START_S = 0.3
JOIN_TIMEOUT_S = 5.0


class RedisMonitor:
    """Every command Redis runs while it listens (client and script commands), as MONITOR shows them."""

    def __init__(self, redis_url: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.lines: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)

    def _listen(self) -> None:
        with self.client.monitor() as monitor:
            for command in monitor.listen():
                self.lines.append(command)
                if self._stop.is_set():
                    return

    def __enter__(self) -> RedisMonitor:
        self._thread.start()
        time.sleep(MONITOR_START_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.client.ping()  # one more line, so the listener sees the stop
        self._thread.join(JOIN_TIMEOUT_S)
        self.client.close()


def job_commands(
    lines: list[dict[str, Any]], job_id: str, namespace: str, skip_client: str = ""
) -> tuple[Counter[str], int]:
    """The commands that name the job, a script's with its call, ``skip_client``'s (``host:port``:
    a poller's) left out; and how many of them the fleet's timers put there: a worker heartbeat's
    ZADD of the job's prompts to the started registry (a call of its own), and the TTL a claim sets
    on a window bucket it made."""
    calls: list[list[dict[str, Any]]] = []
    for line in lines:
        if line.get("client_type") == "lua" and calls:
            calls[-1].append(line)
        elif f"{line['client_address']}:{line['client_port']}" != skip_client:
            calls.append([line])
    counts: Counter[str] = Counter()
    timed = 0
    window = f"{namespace}:dispatch:window:"
    for call in calls:
        # A script's call by what it ran, not its arguments: a worker's claims name the jobs it
        # knows (`known`), whether or not they hand out any of their prompts.
        ran = call[1:] if len(call) > 1 else call
        if any(job_id in command["command"] for command in ran):
            words = [command["command"].split() for command in call]
            counts.update(w[0].upper() for w in words)
            if len(words) == 1 and words[0][0].upper() == "ZADD" and words[0][1].startswith("rq:wip:"):
                timed += 1
            timed += sum(1 for w in words if w[0].upper() == "EXPIRE" and window in w[1])
    return counts, timed
