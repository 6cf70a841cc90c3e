"""A fresh worker process whose first turns all finish at once: every conversation reaches its next
turn's render at the same moment, in many threads, before any tokenizer is loaded in the process.

The lazy imports of a first tokenizer load are not safe from several threads (issue 21: 3-8 % of
such prompts failed with "cannot import name 'AutoTokenizer'"). The worker imports them at start and
loads a renderer once per key behind a lock; nothing may fail, and nothing may even be retried.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import default_chat_template_path
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import JobState
from datagen_cli.local.processes import child_env
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator

NS = "cload"
CONVERSATIONS = 96
WORKER_TIMEOUT_S = 240


def _rows() -> list[dict[str, object]]:
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}: name a prime."},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "And another?"},
            ],
        }
        for i in range(CONVERSATIONS)
    ]


@pytest.mark.e2e
def test_a_cold_worker_renders_many_next_turns_at_once(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, tmp_path: Path
) -> None:
    spec = JobSpec.model_validate(
        {
            "tokenizer": tokenizer_path,
            "chat_template": str(default_chat_template_path()),
            "multi_turn": "all",
            "short_max_new_tokens": 4000,
            "long_threshold_tokens": 100_000,
            "sampling": {"sampling_seed": 3},
        }
    )
    ingest_rows(redis_client, storage, Keys(NS), "load", spec, _rows())
    env = child_env(
        {
            "DATAGEN_REDIS_URL": redis_url,
            "DATAGEN_STORAGE": str(storage.root),
            "DATAGEN_NAMESPACE": NS,
            "DATAGEN_METRICS_PORT": "0",
            # One shard commit for the whole first wave: all next turns start together.
            "DATAGEN_COMMIT_INTERVAL_S": "0.5",
        }
    )
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        command = [sys.executable, "-m", "datagen_cli", "worker", "--burst", "--server", f"s0={url}"]
        command += ["--short-concurrency", str(CONVERSATIONS)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "crashed the task" not in log and "failed " not in log, log[-4000:]
    assert "building turn" not in log, log[-4000:]  # not even a retried first render
    progress = JobStore(redis_client, Keys(NS)).progress("load")
    records = {
        (r["sample_id"], r["turn"]) for b in storage.iter_record_batches("load") for r in b.to_pylist()
    }
    assert (progress.state, progress.failed) == (JobState.COMPLETED, 0)
    assert progress.done == progress.accepted == len(records) == 2 * CONVERSATIONS
