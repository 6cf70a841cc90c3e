"""Where a job's objects are under a storage root (a local directory or any fsspec URL), for
`datagen.records.storage`.

Layout (one folder per job under the root)::

    datagen-namespace.json                      the Redis namespace that owns this root
    jobs/<job>/input/<upload>.jsonl             the dataset as uploaded (or .jsonl.gz, .jsonl.zst, .parquet:
                                                its format, `datagen.prompts.inputs`)
    jobs/<job>/input/<upload>.read.json         how to read that upload: its format, column mapping and
                                                file name as given (none for uploads made before it)
    jobs/<job>/input/<upload>.ref.json          a dataset given by reference (nothing uploaded): its URL,
                                                format, column mapping and each file's pins
    jobs/<job>/manifest.json                    provenance and incarnation, written once per incarnation
    jobs/<job>/records/<shard>.parquet          committed records
    jobs/<job>/commits/<shard>.json             one per committed shard (with its incarnation and its
                                                shard's size, sha256 and row count); a shard without it
                                                is not data
    jobs/<job>/features/<name>.safetensors      a job with features: one record's hidden states, stored
                                                before the record that names it is committed (its size
                                                and sha256 in the record); one that no committed record
                                                names is a leftover (`datagen.records.features`)
    jobs/<job>/rejected/<upload>-<line>.jsonl   rows of one ingestion chunk that could not become prompts
    jobs/<job>/flagged/<upload>-<line>.jsonl    rows of one chunk accepted with a warning
    jobs/<job>/stopped/<digest>-g<gen>.jsonl    multi-turn ``all``: why a conversation stopped before
                                                its last turn (one object per sample and gen)
    jobs/<job>/deleted.json, cancelled.json     how an incarnation ended (`datagen.records.manifests`)

Every stored path is built here, from validated job ids and names. An object store's credentials
and endpoint come from its library's environment (for S3: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), never from the URL, so messages cannot leak them.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from datagen.errors import DatagenError, InvalidSpecError, StorageError
from datagen.records.files import ObjectFiles

__all__ = [
    "FEATURES_FOLDER",
    "FEATURE_SUFFIX",
    "INPUT_SUFFIX",
    "INPUT_SUFFIXES",
    "JOB_ID_PATTERN",
    "LEGACY_REJECTED",
    "NAMESPACE_MARKER",
    "READ_SIDECAR_SUFFIX",
    "REFERENCE_SUFFIX",
    "SHARD_PATTERN",
    "JobFolders",
    "stored_name",
    "translated",
    "validate_job_id",
]

# Matched in full: "$" alone accepts a trailing newline. No "-" or ":", the separators of our Redis
# keys and RQ ids, so one job's id can never alias another key.
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9_]{1,64}")
SHARD_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# One path segment: no separator, and no leading dot (so never "." or "..").
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$")
INPUT_SUFFIX = ".jsonl"
REFERENCE_SUFFIX = ".ref.json"
READ_SIDECAR_SUFFIX = ".read.json"
# What an input is named with: an upload's format (`datagen.prompts.inputs.InputFormat`), a reference.
INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", REFERENCE_SUFFIX)
FEATURES_FOLDER = "features"
FEATURE_SUFFIX = ".safetensors"
LEGACY_REJECTED = "rejected.jsonl"
# At the storage root: the Redis namespace whose jobs live here.
NAMESPACE_MARKER = "datagen-namespace.json"


def validate_job_id(job_id: str) -> str:
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise InvalidSpecError(
            f"invalid job id {job_id[:80]!r}: use 1-64 letters, digits or underscores "
            "(it becomes a path and a Redis key)"
        )
    return job_id


def stored_name(part: str) -> str:
    """``part`` as one path segment of a stored object, or `StorageError`."""
    if not _NAME_PATTERN.match(part):
        raise StorageError(f"bad stored name {part!r}")
    return part


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Storage failures as `StorageError`: OSError locally; an object store's client (botocore,
    aiohttp) raises its own types too, so everything but our own errors is translated here."""
    try:
        yield
    except DatagenError:
        raise
    except Exception as exc:
        raise StorageError(f"{what}: {exc}") from exc


class JobFolders:
    """A storage root and its jobs' folders: the base the parts of `datagen.records.storage.Storage`
    build their paths on."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._files = ObjectFiles(root)
        # What `Storage(root)` accepts again: a resolved local path, or the URL.
        self.root: str = self._files.root
        self.is_local: bool = self._files.local

    def _path(self, job_id: str, *parts: str) -> str:
        return self._files.under_root("jobs", validate_job_id(job_id), *(stored_name(p) for p in parts))

    def url(self, job_id: str, *parts: str) -> str:
        """Where a job (or an object of it) is, for messages and tools: a local path or a URL."""
        return self._files.display(self._path(job_id, *parts))

    def job_exists(self, job_id: str) -> bool:
        path = self._path(job_id)
        with translated(f"cannot look for job {job_id} under {self.root}"):
            return self._files.is_dir(path)

    def delete_job(self, job_id: str) -> bool:
        """Remove everything stored for the job (inputs, records, manifest); False if nothing was."""
        with translated(f"cannot delete job {job_id} under {self.root}"):
            return self._files.remove_tree(self._path(job_id))

    def _write_object(self, path: str, data: bytes) -> None:
        """One small object written whole (`datagen.records.files`)."""
        with translated(f"cannot write {self._files.display(path)}"):
            self._files.write(path, lambda fh: fh.write(data))
