"""The ``speculators-offline`` export: a job's records with their hidden-state features, in the
layout speculators' trainer reads offline (``scripts/train.py --data-path OUT``: its ``ArrowDataset``
loads ``load_from_disk(OUT)`` and, by default, the hidden states under ``OUT/hidden_states``)::

    OUT/data-00000-of-00001.arrow …     a Hugging Face dataset (``Dataset.save_to_disk``), one row per
    OUT/dataset_info.json, state.json   record: ``input_ids`` and ``loss_mask`` (list<int64>), ``seq_len``
                                        (int64), in the order rows are exported
    OUT/hidden_states/hs_{i}.safetensors   row i's stored features file, byte for byte (vLLM's layout:
                                        ``hidden_states`` [T, L, H], ``token_ids`` [T] = ``input_ids``)

The trainer skips a row whose file's ``token_ids`` differ from ``dataset[i]["input_ids"]``, takes
``hidden_states[:, :-1]`` flattened as the draft's input and ``hidden_states[:, -1]`` as the
verifier's last state, and joins ``loss_mask`` by index. It compares torch tensors, so the dataset
is saved in the ``torch`` format, as speculators' ``prepare_data.py`` saves its own: loading it
(``load_from_disk``) needs torch, as training does. An fp8 job's files (``hidden_states`` F8_E4M3,
``hidden_states_scales``) are for speculators' ``fp8`` backend, which reads the same layout.

Rows are the records the other exports keep (the first record of each key; the same partition,
truncation and supervised-token filters) that have a features file; the rest (``features_error``:
capture gave up on them) are left out and counted as dropped ``no_features``. Each file is copied
with its size and sha256 held to its record: a file that differs stops the export with one line
naming the record. Whole sequences only: ``--max-length`` would cut ``input_ids`` short of the
hidden states stored for them (the trainer cuts to its ``--total-seq-len`` itself).

The export is written in a temporary directory next to ``OUT`` and renamed to ``OUT`` when whole,
so a failed export leaves nothing that looks like one. The ``datasets`` package writes the dataset:
it is imported only here, and the export is refused in one line where it is not installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from datagen.errors import ConfigError, StorageError
from datagen.export.rows import ROW_COLUMNS, ExportStats
from datagen.records.reader import export_ids, list_parts
from datagen.records.schema import FEATURE_COLUMNS, FEATURES_FILE, loss_mask_values
from datagen.records.storage import Storage

__all__ = [
    "DATASETS_PACKAGE",
    "HIDDEN_STATES_DIR",
    "NO_FEATURES",
    "OFFLINE_COLUMNS",
    "OFFLINE_SCHEMA",
    "FeaturesExportStats",
    "OfflineSink",
    "check_features_job",
]

DATASETS_PACKAGE = "datasets"
HIDDEN_STATES_DIR = "hidden_states"
# The drop reason of a record without a features file.
NO_FEATURES = "no_features"
# What speculators' prepare_data.py saves: int64 (torch.long) ids and mask, and each row's length.
OFFLINE_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int64())),
        pa.field("loss_mask", pa.list_(pa.int64())),
        pa.field("seq_len", pa.int64()),
    ]
)
# speculators' ArrowDataset compares torch tensors: the format the saved dataset loads in.
DATASET_FORMAT = "torch"
DATASET_STATE_FILE = "state.json"
COPY_BUFFER_BYTES = 1024 * 1024
# What the export decodes: the rows, and their features files.
OFFLINE_COLUMNS = [*ROW_COLUMNS, *FEATURE_COLUMNS]
_FILE_COLUMNS = (FEATURES_FILE, "features_bytes", "features_sha256")


class FeaturesExportStats(ExportStats):
    """`ExportStats` with the records left out for having no features file."""

    def summary(self) -> dict[str, Any]:
        summary = super().summary()
        summary["dropped"][NO_FEATURES] = self.dropped.get(NO_FEATURES, 0)
        return summary


def check_features_job(storage: Storage, job_id: str) -> None:
    """Refuse (one line, `ConfigError`) a job whose manifest has no ``features``, or a machine
    without the ``datasets`` package."""
    manifest = storage.read_manifest(job_id) or {}
    if not (manifest.get("spec") or {}).get("features"):
        raise ConfigError(
            f"job {job_id} has no hidden-state features (its spec has no `features`): the "
            "speculators-offline export needs them; export a token format (specforge, speculators, "
            "parquet) instead"
        )
    if importlib.util.find_spec(DATASETS_PACKAGE) is None:
        raise ConfigError(
            "the speculators-offline export writes a Hugging Face dataset: install the datasets "
            "package (pip install datasets)"
        )


def _offline_rows(batch: pa.RecordBatch) -> pa.Table:
    values, offsets = list_parts(batch.column("input_ids"))
    base = offsets[0]
    rebased = pa.array(offsets - base, pa.int32())
    ids = pa.ListArray.from_arrays(rebased, pa.array(values[base : offsets[-1]].astype(np.int64)))
    mask = loss_mask_values(offsets, batch.column("prompt_len").to_numpy()).astype(np.int64)
    masks = pa.ListArray.from_arrays(rebased, pa.array(mask))
    lengths = pa.array(np.diff(offsets).astype(np.int64))
    return pa.Table.from_arrays([ids, masks, lengths], schema=OFFLINE_SCHEMA)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """The ``datasets`` module, its progress bars off meanwhile (the export draws its own)."""
    datasets = importlib.import_module(DATASETS_PACKAGE)
    utils = importlib.import_module(f"{DATASETS_PACKAGE}.utils")
    if utils.are_progress_bars_disabled():
        yield datasets
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF_DATASETS_DISABLE_PROGRESS_BARS=0 keeps them: fine
        utils.disable_progress_bars()
    try:
        yield datasets
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            utils.enable_progress_bars()


class OfflineSink:
    """The export directory, built in a temporary directory next to ``out``: each row's features
    file copied (and held to its record) as it comes, the rows streamed to an Arrow file, then
    the dataset saved and the directory renamed to ``out``."""

    def __init__(self, storage: Storage, job_id: str, out: Path, stats: ExportStats) -> None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(
                f"output {out} exists and is not an empty directory; remove it or choose another"
            )
        self.storage = storage
        self.job_id = job_id
        self.out = out
        self.stats = stats
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            self._work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        except OSError as exc:
            raise StorageError(f"cannot write the export to {out}: {exc}") from exc
        self._export = self._work / "export"
        self._rows_path = self._work / "rows.arrow"
        try:
            (self._export / HIDDEN_STATES_DIR).mkdir(parents=True)
            self._writer: ipc.RecordBatchStreamWriter | None = ipc.new_stream(
                str(self._rows_path), OFFLINE_SCHEMA
            )
        except OSError as exc:
            shutil.rmtree(self._work, ignore_errors=True)
            raise StorageError(f"cannot write the export to {out}: {exc}") from exc

    def write(self, batch: pa.RecordBatch, on_row: Callable[[int], None]) -> None:
        """The rows of ``batch`` that have a features file; ``on_row`` gets rows written so far."""
        has_file = pc.is_valid(batch.column(FEATURES_FILE))
        self.stats.dropped[NO_FEATURES] += batch.num_rows - (pc.sum(has_file).as_py() or 0)
        rows = batch.filter(has_file)
        if not rows.num_rows:
            return
        ids = export_ids(rows)
        files = zip(*(rows.column(c).to_pylist() for c in _FILE_COLUMNS), strict=True)
        for record, (name, size, sha256) in zip(ids, files, strict=True):
            target = self._export / HIDDEN_STATES_DIR / f"hs_{self.stats.written}.safetensors"
            self._copy(record, name, size, sha256, target)
            self.stats.written += 1
            on_row(self.stats.written)
        assert self._writer is not None
        self._writer.write_table(_offline_rows(rows))
        self.stats.tokens += int(pc.sum(pc.list_value_length(rows.column("input_ids"))).as_py() or 0)

    def _copy(self, record: str, name: str, size: int | None, sha256: str | None, target: Path) -> None:
        """Copy one stored file, held to its record's size and sha256 as it streams."""
        digest = hashlib.sha256()
        copied = 0
        try:
            src = self.storage.open_feature(self.job_id, name)
        except StorageError as exc:
            raise StorageError(f"job {self.job_id}: record {record}: {exc}; {self._verify_hint}") from exc
        with src, target.open("wb") as dst:
            while chunk := src.read(COPY_BUFFER_BYTES):
                digest.update(chunk)
                dst.write(chunk)
                copied += len(chunk)
        if copied != size:
            problem = f"has {copied} bytes but the record says {size}"
        elif digest.hexdigest() != sha256:
            problem = f"has sha256 {digest.hexdigest()} but the record says {sha256}"
        else:
            return
        where = self.storage.feature_url(self.job_id, name)
        raise StorageError(
            f"job {self.job_id}: record {record}'s features file {where} {problem}; {self._verify_hint}"
        )

    @property
    def _verify_hint(self) -> str:
        return f"run `datagen verify {self.job_id}` to list every bad features file"

    def finish(self) -> list[Path]:
        """Save the dataset and rename the export into place; refuses an export without rows (a
        dataset of none cannot be loaded)."""
        assert self._writer is not None
        self._writer.close()
        self._writer = None
        if not self.stats.written:
            raise ConfigError(
                f"job {self.job_id}: no record to export has a features file "
                f"({self.stats.dropped.get(NO_FEATURES, 0)} left out without one); nothing written"
            )
        with _quiet_datasets() as datasets:
            dataset = datasets.Dataset.from_file(str(self._rows_path))
            dataset.save_to_disk(str(self._export))
            del dataset
        state_path = self._export / DATASET_STATE_FILE
        state = json.loads(state_path.read_text("utf-8"))
        state["_format_type"] = DATASET_FORMAT
        state_path.write_text(json.dumps(state, indent=2, sort_keys=True), "utf-8")
        os.replace(self._export, self.out)
        shutil.rmtree(self._work, ignore_errors=True)
        return [self.out]

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        shutil.rmtree(self._work, ignore_errors=True)
