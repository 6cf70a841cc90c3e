"""Issue 36, item 1: an epoch that clocks cannot fool.

Two coordinators' epoch watches (`service.watch.RedisWatch`, the code a coordinator runs) in two
processes on one Redis, one of them with its wall clock 5 s behind (`datagen_cli.local.skew`), each
checking the epoch every few milliseconds (thousands of interleavings of their looks and ticks, a
minute of a real coordinator's ticks many times over): neither ever sees Redis lose or roll back
its data. Then a real rollback (the epoch written back to what it was a moment before, as a
restored snapshot has it) is seen, reconciled by exactly one of them, and both go on.

Before this issue ``seq`` was a wall-clock stamp that each coordinator wrote after a separate
look: a coordinator 3 s behind made the other see 17 false rollbacks in 3 minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from datagen.control.keys import Keys
from datagen_cli.local.processes import child_env
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

NS = "skew"
ROOT = Path(__file__).resolve().parents[2]
OFFSET_S = -5.0
RUN_S = 6.0
INTERVAL_S = 0.002
# When the "snapshot" is taken and when Redis is put back to it, after both have started.
SNAPSHOT_AT_S = 1.5
RESTORE_AT_S = 3.5


def _ticker(url: str, storage: Path, offset_s: float) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "datagen_cli.local.skew", str(offset_s), "tests.support.epoch_ticker"]
    command += [url, NS, str(storage), str(RUN_S), str(INTERVAL_S)]
    return subprocess.Popen(
        command, cwd=ROOT, env=child_env({}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_two_coordinators_with_clocks_apart_see_no_rollback_and_a_real_one_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    key = Keys(NS).epoch()
    ahead, behind = _ticker(redis_url, tmp_path, 0.0), _ticker(redis_url, tmp_path, OFFSET_S)
    started = time.monotonic()
    wait_until(lambda: redis_client.exists(key), 30, "the first coordinator's start-up settle")
    time.sleep(max(0.0, started + SNAPSHOT_AT_S - time.monotonic()))
    snapshot = redis_client.hgetall(key)
    time.sleep(max(0.0, started + RESTORE_AT_S - time.monotonic()))
    assert int(redis_client.hget(key, "seq") or 0) > int(snapshot[b"seq"]) + 100, "the ticks went on"
    restored_at = time.monotonic()
    redis_client.hset(key, mapping=snapshot)  # Redis back at the older snapshot

    reports = []
    for proc in (ahead, behind):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    print(
        f"\nlooks: {[r['looks'] for r in reports]}; not SAME: {[r['seen'] for r in reports]}; "
        f"reconciles: {[r['reconciles'] for r in reports]}"
    )
    for report in reports:
        assert report["looks"] > 500, report
        before = [change for at, change in report["seen"] if at < restored_at]
        # The later of the two starts settles the epoch once: the earlier takes it as settled.
        assert set(before) <= {"settled elsewhere"}, f"a false change before the restore: {report['seen']}"
    after = [change for report in reports for at, change in report["seen"] if at >= restored_at]
    assert "rolled back" in after, "the restored snapshot went unseen"
    assert sum(r["reconciles"] for r in reports) == 1, "the rollback is reconciled exactly once"
    assert "lost" not in after
