"""Hidden-state features in storage (adopted files, local and on S3) and the ``speculators-offline``
export, read back as speculators' trainer reads it (``ArrowDataset._get_raw_data`` in
vllm-project/speculators ``src/speculators/train/data.py``), with numpy instead of torch."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from datagen.errors import ConfigError, StorageError
from datagen.export import ExportFormat, ExportOptions, check_exportable, export_job
from datagen.export.features_offline import HIDDEN_STATES_DIR
from datagen.records.reader import verify_job
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from datagen_cli import app
from tests.support.records import (
    features_tensors,
    make_record,
    read_safetensors,
    store_features,
    write_manifest_once,
)
from tests.support.s3 import moto_server, s3_bucket

JOB = "job1"
LAYERS, HIDDEN = 3, 4  # two aux layers and the last one, a tiny hidden size
FEATURES_SPEC = {"layers": [2, 16, 29], "dtype": "bf16"}
PROMPT = [0, 128803, 23166, 128804]
OUTPUTS = {"a": [43, 2118, 1], "c": [671, 3287, 16, 1], "d": [5718, 1], "a-again": [671, 1]}


def _hidden_states(seq_len: int, first: float) -> np.ndarray:
    """[T, L, H] values exact in bf16: ``first`` + 0.25 a step, row-major."""
    return (first + 0.25 * np.arange(seq_len * LAYERS * HIDDEN)).reshape(seq_len, LAYERS, HIDDEN)


def _a_states() -> np.ndarray:
    states = _hidden_states(len(PROMPT) + len(OUTPUTS["a"]), 0.0)
    states[0, 0, :2] = [1.5, -2.0]
    return states


class FeaturesJob:
    """Records of one job, each with a features file written and adopted as a worker does."""

    def __init__(self, storage: Storage, scratch: Path) -> None:
        self.storage = storage
        self.scratch = scratch
        self.names: dict[str, str] = {}  # output -> stored file name

    def record(self, sample_id: str, output: str, states: np.ndarray | None) -> Record:
        ids = PROMPT + OUTPUTS[output]
        if states is None:
            return make_record(
                sample_id, ids, len(PROMPT), job_id=JOB, features_error="too long for every server"
            )
        self.names[output] = f"{output}-{uuid.uuid4().hex[:8]}.safetensors"
        tensors = features_tensors(ids, states)
        fields = store_features(self.storage, JOB, self.names[output], tensors, self.scratch)
        return make_record(sample_id, ids, len(PROMPT), job_id=JOB, **fields)


def build_features_job(storage: Storage, scratch: Path) -> dict[str, str]:
    """Two shards: a (features), b (features_error), c (features); then a again (another file: a
    duplicate, never exported) and d. Returns each stored file's name by output."""
    write_manifest_once(storage, JOB, {"job_id": JOB, "spec": {"features": FEATURES_SPEC}})
    job = FeaturesJob(storage, scratch)
    first = [
        job.record("a", "a", _a_states()),
        job.record("b", "a", None),
        job.record("c", "c", _hidden_states(len(PROMPT) + 4, 100.0)),
    ]
    second = [
        job.record("a", "a-again", _hidden_states(len(PROMPT) + 2, -50.0)),
        job.record("d", "d", _hidden_states(len(PROMPT) + 2, 200.0)),
    ]
    storage.commit_shard(JOB, "w-00000001", records_to_table(first), {"committed_at_ms": 1})
    storage.commit_shard(JOB, "w-00000002", records_to_table(second), {"committed_at_ms": 2})
    return job.names


def read_as_speculators(out: Path, scratch: Path) -> tuple[Any, list[dict[str, np.ndarray]], list[int]]:
    """What speculators' ArrowDataset yields for each row, and its approximate lengths. It loads the
    dataset with ``load_from_disk`` in the saved (torch) format; here the one change is numpy."""
    state = json.loads((out / "state.json").read_text("utf-8"))
    assert state["_format_type"] == "torch"
    copy = scratch / "as-numpy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(HIDDEN_STATES_DIR))
    (copy / "state.json").write_text(json.dumps({**state, "_format_type": "numpy"}), "utf-8")
    data = datasets.load_from_disk(str(copy))
    lengths = list(data.with_format(None)["seq_len"])
    samples = []
    for index in range(len(data)):
        loaded = read_safetensors((out / HIDDEN_STATES_DIR / f"hs_{index}.safetensors").read_bytes())
        # The trainer skips a row whose file holds other tokens (torch.equal: same shape, same ids).
        assert loaded["token_ids"].dtype == data[index]["input_ids"].dtype == np.int64
        assert np.array_equal(loaded["token_ids"], data[index]["input_ids"]), index
        states = loaded["hidden_states"]
        samples.append(
            {
                "hidden_states": states[:, :-1].reshape(states.shape[0], -1),
                "input_ids": loaded["token_ids"],
                "verifier_last_hidden_states": states[:, -1],
                "loss_mask": data[index]["loss_mask"],
            }
        )
    return data, samples, lengths


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Where a worker writes its capture files before storage adopts them."""
    with tempfile.TemporaryDirectory(prefix="features-scratch-") as tmp:
        yield Path(tmp)


# The export ------------------------------------------------------------------------------------


def test_export_reads_as_speculators_trainer_reads_it(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    names = build_features_job(storage, scratch)
    out = tmp_path / "train"
    stats = export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, out)
    summary = stats.summary()
    assert (summary["records"], summary["written"], summary["duplicates"]) == (5, 3, 1)
    assert summary["dropped"]["no_features"] == 1  # b: capture gave up on it
    assert summary["tokens"] == 7 + 8 + 6

    data, samples, lengths = read_as_speculators(out, tmp_path)
    # Rows in export order (commit order, first record of a key), the first a's and not its duplicate.
    assert [s["input_ids"].tolist() for s in samples] == [
        PROMPT + OUTPUTS["a"],
        PROMPT + OUTPUTS["c"],
        PROMPT + OUTPUTS["d"],
    ]
    assert lengths == [7, 8, 6]
    assert data[0]["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert data[0]["loss_mask"].dtype == np.int64
    # Hand-written values of row 0: layer 0 of token 0 starts 1.5, -2.0; the aux layers (0, 1)
    # are flattened side by side; the last layer is the verifier's.
    row = samples[0]
    assert row["hidden_states"].shape == (7, 2 * HIDDEN)
    assert row["hidden_states"].dtype == ml_dtypes.bfloat16
    assert row["hidden_states"][0].astype(np.float32).tolist() == [1.5, -2.0, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert row["verifier_last_hidden_states"][0].astype(np.float32).tolist() == [2.0, 2.25, 2.5, 2.75]
    assert samples[2]["verifier_last_hidden_states"][0, 0].astype(np.float32) == 200.0 + 0.25 * 8
    # Each file is the stored one, byte for byte.
    for index, sample_id in enumerate(["a", "c", "d"]):
        with storage.open_feature(JOB, names[sample_id]) as fh:
            stored = fh.read()
        assert (out / HIDDEN_STATES_DIR / f"hs_{index}.safetensors").read_bytes() == stored
    assert sorted(p.name for p in (out / HIDDEN_STATES_DIR).iterdir()) == [
        "hs_0.safetensors",
        "hs_1.safetensors",
        "hs_2.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no work dir left


def test_shuffled_export_keeps_each_row_with_its_file(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    build_features_job(storage, scratch)
    options = ExportOptions(shuffle_seed=3)
    export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, tmp_path / "train", options)
    _, samples, lengths = read_as_speculators(tmp_path / "train", tmp_path)  # checks every pairing
    assert sorted(s["input_ids"].tolist()[len(PROMPT)] for s in samples) == sorted(
        OUTPUTS[o][0] for o in ("a", "c", "d")
    )
    assert lengths == [len(s["input_ids"]) for s in samples]


def test_a_changed_features_file_stops_the_export_naming_the_record(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    names = build_features_job(storage, scratch)
    stored = Path(storage.feature_url(JOB, names["c"]))
    original = stored.read_bytes()
    stored.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    out = tmp_path / "train"
    with pytest.raises(StorageError) as caught:
        export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, out)
    message = str(caught.value)
    assert message.startswith(f"job job1: record c's features file {stored} has sha256 ")
    assert message.endswith(
        f"but the record says {hashlib.sha256(original).hexdigest()}; run `datagen verify job1` to "
        "list every bad features file"
    )
    assert "\n" not in message
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_missing_features_file_stops_the_export_naming_the_record(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    names = build_features_job(storage, scratch)
    stored = Path(storage.feature_url(JOB, names["d"]))
    stored.unlink()
    with pytest.raises(StorageError) as caught:
        export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, tmp_path / "train")
    message = str(caught.value)
    assert message.startswith(f"job job1: record d: cannot open the features file {stored}: ")
    assert message.endswith("; run `datagen verify job1` to list every bad features file")
    assert not (tmp_path / "train").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_job_without_features_is_refused_in_one_line(storage: Storage, tmp_path: Path) -> None:
    write_manifest_once(storage, JOB, {"job_id": JOB, "spec": {"features": None}})
    record = make_record("a", PROMPT + OUTPUTS["a"], len(PROMPT), job_id=JOB)
    storage.commit_shard(JOB, "w-00000001", records_to_table([record]), {"committed_at_ms": 1})
    expected = "job job1 has no hidden-state features (its spec has no `features`)"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_exportable(storage, JOB, ExportFormat.SPECULATORS_OFFLINE)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, tmp_path / "train")
    out = tmp_path / "cli"
    args = [
        "export",
        JOB,
        "--storage",
        str(storage.root),
        "--format",
        "speculators-offline",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError) and expected in str(result.exception)
    assert not out.exists() and not (tmp_path / "train").exists()


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (ExportOptions(max_length=4), "--max-length cannot clip a speculators-offline export"),
        (ExportOptions(shard_size=2), "--shard-size does not apply to speculators-offline"),
    ],
)
def test_options_that_would_break_the_layout_are_refused(
    storage: Storage, scratch: Path, tmp_path: Path, options: ExportOptions, refusal: str
) -> None:
    build_features_job(storage, scratch)
    with pytest.raises(ConfigError, match=refusal):
        export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, tmp_path / "train", options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs"]  # the storage root's, nothing else


def test_a_job_whose_records_all_lack_features_writes_nothing(storage: Storage, tmp_path: Path) -> None:
    write_manifest_once(storage, JOB, {"job_id": JOB, "spec": {"features": FEATURES_SPEC}})
    record = make_record(
        "a", PROMPT + OUTPUTS["a"], len(PROMPT), job_id=JOB, features_error="every try failed"
    )
    storage.commit_shard(JOB, "w-00000001", records_to_table([record]), {"committed_at_ms": 1})
    with pytest.raises(ConfigError, match=r"no record to export has a features file \(1 left out"):
        export_job(storage, JOB, ExportFormat.SPECULATORS_OFFLINE, tmp_path / "train")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs"]  # the storage root's, nothing else


# Storage ---------------------------------------------------------------------------------------


def test_adopt_renames_a_local_file_into_the_jobs_features_folder(storage: Storage, tmp_path: Path) -> None:
    local = tmp_path / "capture" / "cmpl-1.safetensors"
    local.parent.mkdir()
    local.write_bytes(b"features")
    where = storage.adopt_feature(JOB, "r1.safetensors", local)
    assert (
        where
        == storage.feature_url(JOB, "r1.safetensors")
        == str(Path(storage.root) / "jobs" / JOB / "features" / "r1.safetensors")
    )
    assert not local.exists()
    assert Path(where).read_bytes() == b"features"
    assert storage.feature_size(JOB, "r1.safetensors") == 8
    assert storage.feature_size(JOB, "r2.safetensors") is None
    assert storage.list_features(JOB) == ["r1.safetensors"]
    storage.remove_feature(JOB, "r1.safetensors")
    storage.remove_feature(JOB, "r1.safetensors")  # best effort: nothing there is fine
    assert storage.list_features(JOB) == []


def test_adopt_copies_a_file_from_another_file_system(storage: Storage) -> None:
    """/dev/shm is a tmpfs: the rename fails across file systems, so the file is copied, fsynced
    and renamed into place through a temporary name."""
    shm = Path("/dev/shm")
    assert os.stat(shm).st_dev != os.stat(storage.root).st_dev, "the test needs two file systems"
    with tempfile.NamedTemporaryFile(dir=shm, suffix=".safetensors", delete=False) as fh:
        fh.write(b"x" * 3_000_000)
    local = Path(fh.name)
    storage.adopt_feature(JOB, "big.safetensors", local)
    assert not local.exists()
    assert storage.feature_size(JOB, "big.safetensors") == 3_000_000
    with storage.open_feature(JOB, "big.safetensors") as stored:
        assert stored.read() == b"x" * 3_000_000
    folder = Path(storage.url(JOB, "features"))
    assert [p.name for p in folder.iterdir()] == ["big.safetensors"]  # no temporary name left


@pytest.mark.parametrize(
    "name", ["../escape.safetensors", "r1.json", ".hidden.safetensors", "a/b.safetensors"]
)
def test_bad_feature_names_are_refused(storage: Storage, tmp_path: Path, name: str) -> None:
    local = tmp_path / "f.safetensors"
    local.write_bytes(b"x")
    with pytest.raises(StorageError, match="bad"):
        storage.adopt_feature(JOB, name, local)
    assert local.exists()


def test_adopting_a_missing_file_is_a_storage_error(storage: Storage, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="cannot store the features file"):
        storage.adopt_feature(JOB, "r1.safetensors", tmp_path / "gone.safetensors")
    with pytest.raises(StorageError, match="cannot open the features file"):
        storage.open_feature(JOB, "r1.safetensors")


# On S3 (moto's server on a loopback port) ------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_storage(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Storage:
    return Storage(f"s3://{s3_bucket(moto_endpoint, monkeypatch)}/datagen")


def test_features_on_s3_are_uploaded_verified_and_exported(
    s3_storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    names = build_features_job(s3_storage, scratch)
    assert list(scratch.iterdir()) == []  # each local file was handed over
    url = s3_storage.feature_url(JOB, names["a"])
    assert url.startswith("s3://") and url.endswith(f"/jobs/job1/features/{names['a']}")
    assert s3_storage.list_features(JOB) == sorted(names.values())
    result = verify_job(s3_storage, JOB)
    assert (result.features, result.features_missing, result.features_bad, result.features_none) == (
        4,
        0,
        0,
        1,
    )
    assert result.ok
    export_job(s3_storage, JOB, ExportFormat.SPECULATORS_OFFLINE, tmp_path / "train")
    _, samples, _ = read_as_speculators(tmp_path / "train", tmp_path)
    assert samples[0]["hidden_states"][0, :2].astype(np.float32).tolist() == [1.5, -2.0]
    s3_storage.remove_feature(JOB, names["d"])
    assert s3_storage.feature_size(JOB, names["d"]) is None
    result = verify_job(s3_storage, JOB)
    assert result.features_missing == 1 and not result.ok
