"""A coordinator's epoch watch (`service.watch.RedisWatch`) checked in a fast loop, in a process of
its own (run under `datagen_cli.local.skew` to set its clock off):

    python -m tests.support.epoch_ticker REDIS_URL NAMESPACE STORAGE SECONDS INTERVAL_S

It starts as a coordinator does (the start-up reconcile and settle, under the reconcile lease),
then calls ``check()`` every INTERVAL_S for SECONDS and prints one JSON object: every look that
was not SAME (monotonic time and what it saw) and how many reconciles this process ran. The
storage is the test's (usually empty: a reconcile is then quick)."""

from __future__ import annotations

import json
import sys
import time

import redis

from datagen.control.epoch import EpochChange, EpochWatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.leases import Leases
from datagen.records.storage import Storage
from service.lifecycle import JobControls
from service.rebuild import Rebuilder, Suspicion
from service.watch import RedisWatch


class _CountingRebuilder(Rebuilder):
    reconciles = 0

    def reconcile(self, suspicion: Suspicion) -> list[str]:
        type(self).reconciles += 1
        return super().reconcile(suspicion)


def main(url: str, namespace: str, storage_root: str, seconds: float, interval_s: float) -> None:
    client = redis.Redis.from_url(url)
    keys = Keys(namespace)
    jobs = JobStore(client, keys)
    storage = Storage(storage_root)
    leases = Leases(client)
    rebuilder = _CountingRebuilder(
        jobs,
        storage,
        JobControls(client, keys, jobs, storage),
        start_ingest=lambda *args: None,
        stop_ingest=lambda job_id: None,
        leases=leases,
    )
    watch = RedisWatch(EpochWatch(client, keys), leases, keys, jobs, rebuilder, resume=lambda: None)
    watch.start_up()
    _CountingRebuilder.reconciles = 0  # the start-up's own reconcile is not a rollback's
    seen: list[tuple[float, str]] = []
    looks = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        change = watch.check()
        looks += 1
        if change is not EpochChange.SAME:
            seen.append((time.monotonic(), change.value))
        time.sleep(interval_s)
    print(json.dumps({"looks": looks, "seen": seen, "reconciles": _CountingRebuilder.reconciles}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))
