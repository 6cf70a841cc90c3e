"""``datagen pull``'s core (`datagen.export.pull`): committed shards pulled into a directory as a
trainer reads it, first record of a key kept across pulls, a stopped pull resumed to the same bytes."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datagen.errors import ConfigError, CoordinatorUnreachableError, StorageError
from datagen.export.pull import CONSUME_BATCH_NAMES, KEYS_FILE, STATE_FILE, TMP_PREFIX, Puller, ShardPulled
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from tests.support.records import features_tensors, make_record, store_features

JOB = "job1"
PROMPT = [10, 11, 12]
FEATURES_MANIFEST = {"job_id": JOB, "incarnation": "inc-1", "spec": {"features": {"layers": [2, 16, 29]}}}
TOKENS_MANIFEST = {"job_id": JOB, "incarnation": "inc-1", "spec": {}}
LAYERS, HIDDEN = 3, 2


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Where a worker writes its capture files before storage adopts them."""
    with tempfile.TemporaryDirectory(prefix="pull-scratch-") as tmp:
        yield Path(tmp)


class Job:
    """A job's records committed shard by shard, each record with a features file when the job has them."""

    def __init__(self, storage: Storage, scratch: Path, features: bool = True) -> None:
        self.storage = storage
        self.scratch = scratch
        self.features = features
        self.files: dict[str, str] = {}  # record label -> stored features file name
        storage.write_manifest(JOB, FEATURES_MANIFEST if features else TOKENS_MANIFEST)

    def record(self, label: str, sample_id: str, output: list[int], *, failed: bool = False) -> Record:
        ids = PROMPT + output
        if not self.features:
            return make_record(sample_id, ids, len(PROMPT), job_id=JOB)
        if failed:
            return make_record(sample_id, ids, len(PROMPT), job_id=JOB, features_error="too long")
        states = np.full((len(ids), LAYERS, HIDDEN), float(len(self.files)))
        self.files[label] = f"{label}.safetensors"
        fields = store_features(
            self.storage, JOB, self.files[label], features_tensors(ids, states), self.scratch
        )
        return make_record(sample_id, ids, len(PROMPT), job_id=JOB, **fields)

    def commit(self, shard: str, records: list[Record], at_ms: int) -> None:
        info = {"committed_at_ms": at_ms, "incarnation": "inc-1"}
        self.storage.commit_shard(JOB, shard, records_to_table(records), info)

    def stored(self, label: str) -> bytes:
        with self.storage.open_feature(JOB, self.files[label]) as fh:
            data: bytes = fh.read()
        return data


def _lines(out: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for part in sorted((out / "records").iterdir())
        for line in part.read_text().splitlines()
    ]


def _files(out: Path) -> dict[str, bytes]:
    """Every file a trainer reads, and the state, by path under ``out``."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != ".datagen-pull.lock"
    }


def _state(out: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((out / STATE_FILE).read_text())
    return state


def _pull(storage: Storage, out: Path, **kwargs: Any) -> list[ShardPulled]:
    with Puller(storage, JOB, out, **kwargs) as puller:
        return puller.pull_available()


def _features_job(storage: Storage, scratch: Path) -> Job:
    """Shard 1: a, b (capture gave up on it), c; shard 2: a again (a duplicate, its own file), d."""
    job = Job(storage, scratch)
    first = [
        job.record("a", "a", [20, 21]),
        job.record("b", "b", [22], failed=True),
        job.record("c", "c", [23]),
    ]
    job.commit("w-00000001", first, 1)
    job.commit("w-00000002", [job.record("a2", "a", [24, 25, 26]), job.record("d", "d", [27, 1])], 2)
    return job


def test_a_row_as_a_trainer_reads_it(storage: Storage, scratch: Path, tmp_path: Path) -> None:
    job = Job(storage, scratch, features=False)
    turn = make_record("s", [*PROMPT, 30], len(PROMPT), job_id=JOB, turn=1)
    job.commit("w-00000001", [job.record("a", "a", [20, 21]), turn], 1)
    out = tmp_path / "pulled"
    [shard] = _pull(storage, out)
    assert (shard.records, shard.rows, shard.part) == (2, 2, "records/part-000000.jsonl")
    assert _lines(out) == [
        {
            "index": 0,
            "id": "a",
            "input_ids": [10, 11, 12, 20, 21],
            "loss_mask": [0, 0, 0, 1, 1],
            "seq_len": 5,
            "hidden_states": None,
        },
        {
            "index": 1,
            "id": "s_t1_g0",
            "input_ids": [10, 11, 12, 30],
            "loss_mask": [0, 0, 0, 1],
            "seq_len": 4,
            "hidden_states": None,
        },
    ]
    assert not (out / "hidden_states").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)] == []


def test_features_job_keeps_first_records_with_their_files(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    job = _features_job(storage, scratch)
    out = tmp_path / "pulled"
    shards = _pull(storage, out)
    assert [(s.part, s.records, s.rows, s.duplicates, s.no_features) for s in shards] == [
        ("records/part-000000.jsonl", 3, 2, 0, 1),  # b: capture gave up on it, left out
        ("records/part-000001.jsonl", 2, 1, 1, 0),  # a again: the first a wins
    ]
    lines = _lines(out)
    assert [(r["index"], r["id"], r["hidden_states"]) for r in lines] == [
        (0, "a", "hidden_states/hs_0.safetensors"),
        (1, "c", "hidden_states/hs_1.safetensors"),
        (2, "d", "hidden_states/hs_2.safetensors"),
    ]
    assert lines[2]["input_ids"] == [10, 11, 12, 27, 1] and lines[2]["loss_mask"] == [0, 0, 0, 1, 1]
    for index, label in enumerate(["a", "c", "d"]):
        assert (out / f"hidden_states/hs_{index}.safetensors").read_bytes() == job.stored(label)
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == [
        f"hs_{i}.safetensors" for i in range(3)
    ]
    state = json.loads((out / STATE_FILE).read_text())
    expected = {
        "shards": 2,
        "records": 5,
        "rows": 3,
        "duplicates": 1,
        "no_features": 1,
        "features_bytes": sum(len(job.stored(label)) for label in ("a", "c", "d")),
    }
    assert {name: state["counts"][name] for name in expected} == expected
    assert (state["job_id"], state["incarnation"], state["next_index"], state["next_part"]) == (
        JOB,
        "inc-1",
        3,
        2,
    )
    assert state["done"] == ["w-00000001", "w-00000002"] and state["pending"] is None
    assert (out / KEYS_FILE).stat().st_size == state["keys_bytes"] == 4 * 16  # a, b, c, d


def test_a_second_pull_adds_only_the_new_shard(storage: Storage, scratch: Path, tmp_path: Path) -> None:
    job = Job(storage, scratch)
    job.commit("w-00000001", [job.record("a", "a", [20]), job.record("b", "b", [21])], 1)
    out = tmp_path / "pulled"
    _pull(storage, out)
    before = _files(out)
    job.commit("w-00000002", [job.record("a2", "a", [22]), job.record("c", "c", [23])], 2)
    [shard] = _pull(storage, out)
    assert (shard.shard, shard.rows, shard.duplicates) == ("w-00000002", 1, 1)
    after = _files(out)
    new = sorted(set(after) - set(before))
    assert new == ["hidden_states/hs_2.safetensors", "records/part-000001.jsonl"]
    assert all(after[name] == data for name, data in before.items() if not name.startswith("."))
    assert [r["id"] for r in _lines(out)] == ["a", "b", "c"]
    assert _pull(storage, out) == []  # nothing new: nothing written


def test_a_late_commit_with_an_earlier_time_is_pulled_not_skipped(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    job = Job(storage, scratch)
    job.commit("w-00000001", [job.record("a", "a", [20])], 1)
    job.commit("w-00000003", [job.record("c", "c", [21])], 3)
    out = tmp_path / "pulled"
    _pull(storage, out)
    job.commit("w-00000002", [job.record("b", "b", [22])], 2)  # a worker whose clock is behind
    [shard] = _pull(storage, out)
    assert (shard.shard, shard.part) == ("w-00000002", "records/part-000002.jsonl")
    assert [(r["index"], r["id"]) for r in _lines(out)] == [(0, "a"), (1, "c"), (2, "b")]


def test_a_pull_stopped_before_its_state_was_saved_resumes_to_the_same_bytes(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    _features_job(storage, scratch)
    out = tmp_path / "pulled"
    with Puller(storage, JOB, out) as puller:
        commits = storage.list_commits(JOB)
        puller.pull_shard(commits[0])
        after_first = (out / STATE_FILE).read_bytes()
        puller.pull_shard(commits[1])
    whole = _files(out)
    # Stopped after shard 2's part and keys were written, before its state: the state of shard 1,
    # as step 1 of shard 2 saved it (pending), and a temporary left half-written.
    state = json.loads(after_first)
    (out / STATE_FILE).write_text(json.dumps({**state, "pending": "w-00000002"}))
    (out / f"{TMP_PREFIX}hs_2.safetensors").write_bytes(b"half")
    [shard] = _pull(storage, out)
    assert (shard.shard, shard.part, shard.rows) == ("w-00000002", "records/part-000001.jsonl", 1)
    assert _files(out) == whole  # the same names, the same bytes, the keys file cut and rewritten
    assert [r["index"] for r in _lines(out)] == [0, 1, 2]
    # The state without the last shard (as if step 1 had not run either): the same again.
    (out / STATE_FILE).write_bytes(after_first)
    _pull(storage, out)
    assert _files(out) == whole


def test_a_pending_shard_goes_first_even_after_a_late_commit(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    job = Job(storage, scratch)
    job.commit("w-00000001", [job.record("a", "a", [20])], 1)
    job.commit("w-00000003", [job.record("c", "c", [21])], 3)
    out = tmp_path / "pulled"
    with Puller(storage, JOB, out) as puller:
        first, third = storage.list_commits(JOB)
        puller.pull_shard(first)
        after_first = json.loads((out / STATE_FILE).read_text())
        puller.pull_shard(third)
    part = (out / "records/part-000001.jsonl").read_bytes()
    # Stopped while pulling w-00000003 (its part already renamed: a trainer may have read it);
    # meanwhile a late commit sorts before it.
    (out / STATE_FILE).write_text(json.dumps({**after_first, "pending": "w-00000003"}))
    job.commit("w-00000002", [job.record("b", "b", [22])], 2)
    assert [s.shard for s in _pull(storage, out)] == ["w-00000003", "w-00000002"]
    assert (out / "records/part-000001.jsonl").read_bytes() == part
    assert [(r["index"], r["id"]) for r in _lines(out)] == [(0, "a"), (1, "c"), (2, "b")]


def test_a_changed_features_file_stops_the_pull_naming_the_record(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    job = _features_job(storage, scratch)
    stored = Path(storage.feature_url(JOB, job.files["c"]))
    data = stored.read_bytes()
    stored.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    out = tmp_path / "pulled"
    with pytest.raises(StorageError) as caught:
        _pull(storage, out)
    message = str(caught.value)
    assert "\n" not in message
    assert f"record c's features file {stored} has sha256 " in message
    assert f"but the record says {hashlib.sha256(data).hexdigest()}" in message
    assert not (out / "records").exists()  # the shard's part never appeared
    assert [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)] == []
    state = json.loads((out / STATE_FILE).read_text())
    assert (state["done"], state["pending"]) == ([], "w-00000001")


def test_another_jobs_or_incarnations_directory_is_refused(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    _features_job(storage, scratch)
    out = tmp_path / "pulled"
    _pull(storage, out)
    storage.write_manifest("job2", {"job_id": "job2", "incarnation": "x", "spec": {}})
    with pytest.raises(ConfigError, match=r"holds a pull of job job1, not job2; pull into another directory"):
        Puller(storage, "job2", out)
    storage.write_manifest(JOB, {**FEATURES_MANIFEST, "incarnation": "inc-2"})
    with pytest.raises(
        ConfigError,
        match=r"holds a pull of incarnation 'inc-1' of job job1, but storage now holds incarnation 'inc-2'",
    ):
        Puller(storage, JOB, out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files but no pull state"):
        Puller(storage, JOB, other)
    assert sorted(p.name for p in other.iterdir()) == [".datagen-pull.lock", "notes.txt"]


def test_one_pull_at_a_time_per_directory(storage: Storage, scratch: Path, tmp_path: Path) -> None:
    _features_job(storage, scratch)
    out = tmp_path / "pulled"
    with Puller(storage, JOB, out), pytest.raises(ConfigError, match="another `datagen pull` is writing"):
        Puller(storage, JOB, out)
    _pull(storage, out)  # released when the first one closed


class Coordinator:
    """The consume endpoint's answers, out of reach while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.calls: list[list[str]] = []

    def __call__(self, names: list[str]) -> dict[str, Any]:
        if self.down:
            raise CoordinatorUnreachableError("cannot reach the coordinator at http://127.0.0.1:1")
        self.calls.append(names)
        return {"removed": len(names), "bytes": 10 * len(names), "retained_bytes": 0}


def test_consume_acknowledges_every_file_a_shard_names_and_retries(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    job = _features_job(storage, scratch)
    coordinator = Coordinator()
    coordinator.down = True
    warnings: list[str] = []
    out = tmp_path / "pulled"
    _pull(storage, out, consume=coordinator, on_warning=warnings.append)
    assert len(warnings) == 1 and "could not acknowledge" in warnings[0]  # once, not once a shard
    state = json.loads((out / STATE_FILE).read_text())
    # Every file the records name, the duplicate's included (b has none).
    assert state["unconsumed"] == [job.files[label] for label in ("a", "c", "a2", "d")]
    coordinator.down = False
    _pull(storage, out, consume=coordinator)  # a restart sends what waits
    assert coordinator.calls == [[job.files[label] for label in ("a", "c", "a2", "d")]]
    state = json.loads((out / STATE_FILE).read_text())
    assert state["unconsumed"] == [] and state["counts"]["consumed_files"] == 4


def test_consume_sends_at_most_a_batch_a_call(storage: Storage, scratch: Path, tmp_path: Path) -> None:
    _features_job(storage, scratch)
    out = tmp_path / "pulled"
    _pull(storage, out)
    names = [f"f{i}.safetensors" for i in range(2 * CONSUME_BATCH_NAMES + 5)]
    state = json.loads((out / STATE_FILE).read_text())
    (out / STATE_FILE).write_text(json.dumps({**state, "unconsumed": names}))
    coordinator = Coordinator()
    _pull(storage, out, consume=coordinator)
    assert [len(call) for call in coordinator.calls] == [CONSUME_BATCH_NAMES, CONSUME_BATCH_NAMES, 5]
    assert [n for call in coordinator.calls for n in call] == names


PULL_SCRIPT = """
import sys
from pathlib import Path
from datagen.export.pull import Puller
from datagen.records.storage import Storage
with Puller(Storage(sys.argv[1]), sys.argv[2], Path(sys.argv[3])) as puller:
    print("pulling", flush=True)
    puller.pull_available()
"""
KILLS = 8
SHARDS_A_KILL = 3
KILL_POLL_S = 0.001
KILL_JITTER_S = 0.005


def _pull_process(storage: Storage, out: Path) -> subprocess.Popen[bytes]:
    """A pull in a process of its own, once it has started pulling (its imports done)."""
    command = [sys.executable, "-c", PULL_SCRIPT, str(storage.root), JOB, str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline() == b"pulling\n"
    return process


def _ended(process: subprocess.Popen[bytes]) -> int:
    assert process.stdout is not None
    process.stdout.close()
    return process.wait()


def test_pulls_killed_at_any_point_end_as_one_pull_did(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    job = Job(storage, scratch)
    for shard in range(30):
        records = [job.record(f"{shard}-{i}", f"s{(shard * 5 + i) % 120}", [20 + i]) for i in range(5)]
        job.commit(f"w-{shard:08d}", records, shard)
    reference = tmp_path / "reference"
    assert _ended(_pull_process(storage, reference)) == 0
    out = tmp_path / "killed"
    delays = random.Random(7)
    for kill in range(1, KILLS + 1):
        process = _pull_process(storage, out)
        # Each gets a few shards further, then is killed anywhere: in a shard or between two.
        while process.poll() is None and len(_state(out)["done"]) < SHARDS_A_KILL * kill:
            time.sleep(KILL_POLL_S)
        time.sleep(delays.uniform(0.0, KILL_JITTER_S))
        process.send_signal(signal.SIGKILL)
        _ended(process)
    assert _ended(_pull_process(storage, out)) == 0
    assert _files(out) == _files(reference)
    assert [r["index"] for r in _lines(out)] == list(range(120))
