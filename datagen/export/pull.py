"""``datagen pull``: a job's committed records, and their features where the job has them, written
into a directory as they commit, in a layout a trainer reads beside the job::

    DIR/records/part-{k:06d}.jsonl        one part per pulled shard that had rows to write; a line a row:
                                          {"index", "id", "input_ids", "loss_mask", "seq_len",
                                          "hidden_states"} (``hidden_states`` null in a job without
                                          features)
    DIR/hidden_states/hs_{i}.safetensors  row i's stored features file, byte for byte
    DIR/.datagen-pull.json                what is pulled (`PullState`)
    DIR/.datagen-pull-keys                the keys pulled, one `key_digest` each, append-only
    DIR/.datagen-pull.lock                held while a pull runs: one pull per directory

Rows are numbered 0, 1, 2, … in pull order: shards in commit order as each is first listed, the
first record of each key (``sample_id``, ``turn``, ``gen``) kept, across restarts; a later record of
a key is a duplicate, left out and counted. In a features job a record without a features file
(``features_error``) is left out and counted, as the ``speculators-offline`` export leaves it out.
A commit listed late with an earlier ``committed_at_ms`` (clock skew between workers) is pulled when
it is listed: never skipped, but then after shards the export would put after it.

A shard is pulled in steps, so that a pull stopped anywhere (kill -9 included) and started again
writes the same names with the same bytes, and skips nothing:

1. the state names the shard ``pending``, with the next row index and part number;
2. each kept row's features file is copied to a temporary name in DIR (its size and sha256 held to
   the record while it streams), fsynced and renamed to ``hs_{i}``; its line goes to a temporary part;
3. the part is fsynced and renamed into place (after its features files: a part's files are there);
4. the shard's new key digests are appended to the keys file, fsynced;
5. the state marks the shard done, with the counters, the keys file's valid length and (``consume``)
   the features files still to acknowledge.

Every state is written whole (temporary file, fsync, rename). A restart truncates the keys file to the
state's length, removes temporaries and pulls the pending shard first, from the same index and part.

Acknowledging (``consume``): once a shard's state is saved, the names of every features file its
records name (duplicates' included: they take storage too) are sent, at most `CONSUME_BATCH_NAMES`
a call; a call that fails because the coordinator is out of reach is tried again after the next
shard, at the next poll and on a restart (the names wait in the state). Storage then frees those
files: a later pull or export of the job cannot copy them any more.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa

from datagen.errors import ConfigError, CoordinatorUnreachableError, RetryableError, StorageError
from datagen.export.features_offline import HIDDEN_STATES_DIR
from datagen.records.files import fsync_path
from datagen.records.reader import RowViews, key_digest
from datagen.records.schema import FEATURE_COLUMNS, FEATURES_FILE
from datagen.records.storage import Storage

__all__ = [
    "CONSUME_BATCH_NAMES",
    "KEYS_FILE",
    "RECORDS_DIR",
    "STATE_FILE",
    "PullCounts",
    "PullState",
    "Puller",
    "ShardPulled",
    "part_name",
]

STATE_FILE = ".datagen-pull.json"
KEYS_FILE = ".datagen-pull-keys"
LOCK_FILE = ".datagen-pull.lock"
# Every file on its way into DIR starts so; a restart removes those left by a stopped pull.
TMP_PREFIX = ".datagen-pull-tmp-"
RECORDS_DIR = "records"
STATE_VERSION = 1
CONSUME_BATCH_NAMES = 1000
COPY_BUFFER_BYTES = 1024 * 1024
_ROW_COLUMNS = ["sample_id", "turn", "gen", "input_ids", "prompt_len"]
_OWN_FILES = (STATE_FILE, KEYS_FILE, LOCK_FILE)

# What `Puller` is given to acknowledge features files: the coordinator's answer to one call.
Consume = Callable[[list[str]], dict[str, Any]]


def part_name(part: int) -> str:
    return f"part-{part:06d}.jsonl"


def hidden_states_name(index: int) -> str:
    return f"hs_{index}.safetensors"


@dataclass
class PullCounts:
    """Totals over every shard pulled into the directory. ``records`` are committed records read
    (duplicates included), ``rows`` the lines written; ``records_bytes`` the parts' sizes."""

    shards: int = 0
    records: int = 0
    rows: int = 0
    duplicates: int = 0
    no_features: int = 0
    tokens: int = 0
    records_bytes: int = 0
    features_bytes: int = 0
    consumed_files: int = 0
    consumed_bytes: int = 0


@dataclass
class PullState:
    """``DIR/.datagen-pull.json``: whose records these are (job and incarnation), the shards done in
    pull order, the shard being pulled (``pending``), where the next row and part go, the keys
    file's valid length and the features files not yet acknowledged."""

    job_id: str
    incarnation: str
    features: bool
    done: list[str] = field(default_factory=list)
    pending: str | None = None
    next_index: int = 0
    next_part: int = 0
    keys_bytes: int = 0
    counts: PullCounts = field(default_factory=PullCounts)
    unconsumed: list[str] = field(default_factory=list)
    version: int = STATE_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: Path) -> PullState:
        try:
            body = json.loads(data)
            counts = PullCounts(**body.pop("counts"))
            state = cls(**body, counts=counts)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(
                f"{where} is not a `datagen pull` state ({exc}); pull into another directory"
            ) from exc
        if state.version != STATE_VERSION:
            raise ConfigError(f"{where} is of pull state version {state.version}, not {STATE_VERSION}")
        return state


@dataclass(frozen=True)
class ShardPulled:
    """One shard pulled: ``part`` is where its rows went (None: none to write)."""

    shard: str
    part: str | None
    records: int
    rows: int
    duplicates: int
    no_features: int
    records_bytes: int
    features_bytes: int


class Puller:
    """Pulls one job's committed shards into ``out``; holds the directory's lock until `close`.

    Opening refuses (one line, `ConfigError`) a directory that another pull holds, one that holds
    another job's pull or another incarnation's, and one with other files but no pull state."""

    def __init__(
        self,
        storage: Storage,
        job_id: str,
        out: Path,
        *,
        consume: Consume | None = None,
        on_shard: Callable[[ShardPulled], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> None:
        self.storage = storage
        self.job_id = job_id
        self.out = out
        self._consume = consume
        self._on_shard = on_shard
        self._on_warning = on_warning
        self._consume_failing = False
        self._lock = self._take_lock()
        try:
            self.state = self._open_state()
            self.seen = self._load_keys()
            self._remove_temporaries()
        except BaseException:
            self.close()
            raise

    # Opening ------------------------------------------------------------------------------------
    def _take_lock(self) -> IO[bytes]:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            lock = (self.out / LOCK_FILE).open("ab")
        except OSError as exc:
            raise StorageError(f"cannot write the pull into {self.out}: {exc}") from exc
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.close()
            raise ConfigError(
                f"another `datagen pull` is writing into {self.out} (it holds {LOCK_FILE}); stop it first"
            ) from exc
        return lock

    def _current_incarnation(self) -> tuple[str, bool]:
        manifest = self.storage.read_manifest(self.job_id)
        if manifest is None:
            return "", False
        return str(manifest.get("incarnation", "")), bool((manifest.get("spec") or {}).get("features"))

    def _open_state(self) -> PullState:
        incarnation, features = self._current_incarnation()
        path = self.out / STATE_FILE
        if not path.exists():
            others = [p.name for p in self.out.iterdir() if p.name not in _OWN_FILES]
            if any(not name.startswith(TMP_PREFIX) for name in others):
                raise ConfigError(
                    f"{self.out} holds files but no pull state ({STATE_FILE}); pull into an empty or new "
                    "directory"
                )
            state = PullState(self.job_id, incarnation, features)
            self._save(state)
            return state
        state = PullState.from_json(path.read_bytes(), path)
        if state.job_id != self.job_id:
            raise ConfigError(
                f"{self.out} holds a pull of job {state.job_id}, not {self.job_id}; pull into another "
                "directory"
            )
        self._hold_incarnation(state, incarnation, features)
        return state

    def _hold_incarnation(self, state: PullState, incarnation: str, features: bool) -> None:
        """Refuse the records of another incarnation of the job (deleted and submitted again); a
        state that holds nothing yet takes the current one (a job whose manifest came late)."""
        if state.incarnation == incarnation:
            return
        if not state.done and state.pending is None:
            state.incarnation, state.features = incarnation, features
            self._save(state)
            return
        raise ConfigError(
            f"{self.out} holds a pull of incarnation {state.incarnation!r} of job {self.job_id}, but storage "
            f"now holds incarnation {incarnation!r} (the job was deleted, or deleted and submitted again); "
            "pull into another directory"
        )

    def _load_keys(self) -> set[bytes]:
        """The digests of the keys pulled, the keys file cut to the state's valid length first (a
        stopped pull may have appended a shard's keys and not saved its state)."""
        path = self.out / KEYS_FILE
        size = path.stat().st_size if path.exists() else 0
        if size < self.state.keys_bytes:
            raise ConfigError(
                f"{path} is shorter ({size} bytes) than its state says ({self.state.keys_bytes}); it was "
                "changed outside `datagen pull`: pull into another directory"
            )
        with path.open("ab") as fh:
            fh.truncate(self.state.keys_bytes)
            fh.flush()
            os.fsync(fh.fileno())
        data = path.read_bytes()
        width = len(key_digest("", 0, 0))
        return {data[i : i + width] for i in range(0, len(data), width)}

    def _remove_temporaries(self) -> None:
        for path in self.out.iterdir():
            if path.name.startswith(TMP_PREFIX):
                path.unlink()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._lock.close()  # closing the file releases its lock

    def __enter__(self) -> Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Pulling ------------------------------------------------------------------------------------
    def pull_available(self) -> list[ShardPulled]:
        """Pull every committed shard not pulled yet (the pending one first), then acknowledge what
        is left to acknowledge; returns the shards pulled."""
        incarnation, features = self._current_incarnation()
        self._hold_incarnation(self.state, incarnation, features)
        done = set(self.state.done)
        todo = [c for c in self.storage.list_commits(self.job_id) if str(c["shard"]) not in done]
        todo.sort(key=lambda c: c["shard"] != self.state.pending)  # stable: commit order otherwise
        pulled = [self.pull_shard(commit) for commit in todo]
        self.acknowledge()
        return pulled

    def pull_shard(self, commit: dict[str, Any]) -> ShardPulled:
        shard = str(commit["shard"])
        self.state.pending = shard
        self._save(self.state)
        columns = [*_ROW_COLUMNS, *(FEATURE_COLUMNS if self.state.features else ())]
        table = self.storage.read_shard_table(self.job_id, commit, columns)
        writer = _ShardWriter(self, shard)
        try:
            for batch in table.to_batches():
                writer.add(batch)
            pulled = writer.finish()
        finally:
            writer.discard()
        if self._on_shard is not None:
            self._on_shard(pulled)
        if self._consume is not None:
            self.acknowledge()
        return pulled

    def seal(self, pulled: ShardPulled, new_keys: list[bytes], names: list[str], tokens: int) -> None:
        """Steps 4 and 5 of a shard (the module's docstring): its keys, then the state."""
        keys_path = self.out / KEYS_FILE
        with keys_path.open("ab") as fh:
            fh.write(b"".join(new_keys))
            fh.flush()
            os.fsync(fh.fileno())
        self.seen.update(new_keys)
        state, counts = self.state, self.state.counts
        state.keys_bytes += sum(len(k) for k in new_keys)
        state.done.append(pulled.shard)
        state.pending = None
        state.next_index += pulled.rows
        state.next_part += pulled.part is not None
        counts.shards += 1
        counts.records += pulled.records
        counts.rows += pulled.rows
        counts.duplicates += pulled.duplicates
        counts.no_features += pulled.no_features
        counts.tokens += tokens
        counts.records_bytes += pulled.records_bytes
        counts.features_bytes += pulled.features_bytes
        if self._consume is not None:
            state.unconsumed.extend(names)
        self._save(state)

    # Acknowledging ------------------------------------------------------------------------------
    def acknowledge(self) -> bool:
        """Send the names not yet acknowledged, a batch a call, each batch dropped from the state
        once answered; False when the coordinator could not be reached (they wait for the next try).
        Without ``consume``, nothing to send."""
        if self._consume is None:
            return True
        while self.state.unconsumed:
            batch = self.state.unconsumed[:CONSUME_BATCH_NAMES]
            try:
                answer = self._consume(batch)
            except (RetryableError, CoordinatorUnreachableError) as exc:
                if not self._consume_failing:
                    self._warn(f"could not acknowledge features files yet (tried again later): {exc}")
                self._consume_failing = True
                return False
            self._consume_failing = False
            del self.state.unconsumed[: len(batch)]
            self.state.counts.consumed_files += int(answer.get("removed") or 0)
            self.state.counts.consumed_bytes += int(answer.get("bytes") or 0)
            self._save(self.state)
        return True

    def _warn(self, message: str) -> None:
        if self._on_warning is not None:
            self._on_warning(message)

    # Files --------------------------------------------------------------------------------------
    def temporary(self, name: str) -> Path:
        return self.out / f"{TMP_PREFIX}{name}"

    def _save(self, state: PullState) -> None:
        publish(self.temporary(STATE_FILE), state.to_json(), self.out / STATE_FILE)


def publish(temporary: Path, data: bytes, target: Path) -> None:
    """Write ``data`` whole under ``target``: to ``temporary``, fsynced, renamed, the directory fsynced."""
    with temporary.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temporary, target)
    fsync_path(target.parent)


class _ShardWriter:
    """Step 2 of one shard: its kept rows' features files and lines, then the part renamed into place."""

    def __init__(self, puller: Puller, shard: str) -> None:
        self.puller = puller
        self.shard = shard
        state = puller.state
        self.part = part_name(state.next_part)
        self.index = state.next_index
        self.tmp_part = puller.temporary(self.part)
        self.lines: IO[bytes] = self.tmp_part.open("wb")
        self.new_keys: list[bytes] = []
        self.fresh: set[bytes] = set()
        self.names: list[str] = []  # every features file the shard's records name
        self.records = self.rows = self.duplicates = self.no_features = 0
        self.tokens = self.features_bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        views = RowViews(batch)
        keys = zip(*(batch.column(c).to_pylist() for c in ("sample_id", "turn", "gen")), strict=True)
        files = self._file_columns(batch)
        for i, (key, file) in enumerate(zip(keys, files, strict=True)):
            self.records += 1
            name, size, sha256 = file
            if name is not None:
                self.names.append(name)
            digest = key_digest(*key)
            if digest in self.puller.seen or digest in self.fresh:
                self.duplicates += 1
                continue
            self.fresh.add(digest)
            self.new_keys.append(digest)
            if self.puller.state.features and name is None:
                self.no_features += 1  # capture gave up on it: the export leaves it out too
                continue
            self._write_row(views, i, (name, size, sha256))

    def _file_columns(self, batch: pa.RecordBatch) -> Iterator[tuple[Any, Any, Any]]:
        if not self.puller.state.features:
            return iter([(None, None, None)] * batch.num_rows)
        columns = (batch.column(c).to_pylist() for c in (FEATURES_FILE, "features_bytes", "features_sha256"))
        return zip(*columns, strict=True)

    def _write_row(self, views: RowViews, i: int, file: tuple[Any, Any, Any]) -> None:
        index = self.index + self.rows
        hidden_states = None
        if self.puller.state.features:
            target = f"{HIDDEN_STATES_DIR}/{hidden_states_name(index)}"
            self.features_bytes += self._copy(views.ids[i], *file, self.puller.out / target)
            hidden_states = target
        ids = views.input_ids(i)
        line = {
            "index": index,
            "id": views.ids[i],
            "input_ids": ids.tolist(),
            "loss_mask": views.loss_mask(i).tolist(),
            "seq_len": len(ids),
            "hidden_states": hidden_states,
        }
        self.lines.write(json.dumps(line, separators=(",", ":")).encode("utf-8") + b"\n")
        self.rows += 1
        self.tokens += len(ids)

    def _copy(self, record: str, name: str, size: int | None, sha256: str | None, target: Path) -> int:
        """One stored features file copied under ``target``, held to its record's size and sha256 as
        it streams; returns its size."""
        puller = self.puller
        job_id = puller.job_id
        hint = f"run `datagen verify {job_id}` to list every bad features file"
        try:
            src = puller.storage.open_feature(job_id, name)
        except StorageError as exc:
            raise StorageError(
                f"job {job_id}: record {record}: {exc} (freed by an earlier --consume?); {hint}"
            ) from exc
        tmp = puller.temporary(target.name)
        digest, copied = hashlib.sha256(), 0
        with src, tmp.open("wb") as dst:
            while chunk := src.read(COPY_BUFFER_BYTES):
                digest.update(chunk)
                dst.write(chunk)
                copied += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        problem = None
        if copied != size:
            problem = f"has {copied} bytes but the record says {size}"
        elif digest.hexdigest() != sha256:
            problem = f"has sha256 {digest.hexdigest()} but the record says {sha256}"
        if problem is not None:
            tmp.unlink()
            where = puller.storage.feature_url(job_id, name)
            raise StorageError(f"job {job_id}: record {record}'s features file {where} {problem}; {hint}")
        target.parent.mkdir(exist_ok=True)
        os.replace(tmp, target)
        return copied

    def finish(self) -> ShardPulled:
        """Steps 3 to 5: the part renamed into place after its features files, then keys and state."""
        self.lines.flush()
        os.fsync(self.lines.fileno())
        self.lines.close()
        out = self.puller.out
        if self.features_bytes:
            fsync_path(out / HIDDEN_STATES_DIR)
        part: str | None = None
        records_bytes = 0
        if self.rows:
            part = f"{RECORDS_DIR}/{self.part}"
            (out / RECORDS_DIR).mkdir(exist_ok=True)
            records_bytes = self.tmp_part.stat().st_size
            os.replace(self.tmp_part, out / part)
            fsync_path(out / RECORDS_DIR)
        pulled = ShardPulled(
            self.shard,
            part,
            self.records,
            self.rows,
            self.duplicates,
            self.no_features,
            records_bytes,
            self.features_bytes,
        )
        self.puller.seal(pulled, self.new_keys, self.names, self.tokens)
        return pulled

    def discard(self) -> None:
        """Whatever happened, no temporary part is left behind."""
        self.lines.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp_part.unlink()
