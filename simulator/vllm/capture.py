"""Hidden-state capture as vLLM 0.33.0's ``ExampleHiddenStatesConnector`` does it (or speculators' FP8 one).

On when ``SimConfig.capture_dir`` (the connector's ``shared_storage_path``) is set. Per engine
request that was scheduled, whether it finished or was aborted (an abort leaves an orphan nobody
learns the path of)::

    scheduled            <file>.lock created (0644), flock(LOCK_EX) held   -- Capture.begin
    response sent        kv_transfer_params.hidden_states_path names <file>, not yet written
    + write_delay_ms     <file> written under its final name (no temp file), then the lock fd closed

A request refused before scheduling leaves neither file. Nothing here ever deletes a file. The file
holds ``hidden_states`` ``[T, L, H]`` (values from ``simulator.capture_values``) and ``token_ids``
``[T]`` int64; fp8 stores float8_e4m3fn with ``hidden_states_scales`` ``[T, 1, 1]`` float32, one
scale per token as speculators' ``fp8_utils`` computes it.

Faults (``capture_fault_*``) share one uniform draw hashed from ``(request id, attempt)``, as the
SGLang mode's faults do, so the same requests meet the same faults on every run and a retry of a
request id that met one draws afresh:

- ``5xx``: HTTP 500 in vLLM's error shape before scheduling; no lock, no file.
- ``nofile``: the lock is released and no file written (a crash, or ENOSPC, which vLLM only logs).
- ``truncate``: the file is cut short, then the lock released (a failed write).
- ``short``: ``hidden_states`` has fewer rows than ``token_ids`` (an abort mid-prefill).
- ``slow``: the writer holds the lock ``capture_slow_write_s`` longer before writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from http import HTTPStatus

import ml_dtypes
import numpy as np
import numpy.typing as npt
from safetensors.numpy import save as safetensors_bytes

from simulator.capture_values import hidden_states
from simulator.config import CaptureDtype, SimConfig
from simulator.vllm._protocol import VllmError

__all__ = ["FP8_MAX", "FP8_MIN_SCALE", "Capture", "CaptureFault", "encode_capture", "quantize_fp8"]

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MIN_SCALE = 1e-12  # speculators clamps the per-token scale to at least this
LOCK_MODE = 0o644  # the connector's os.open mode for <file>.lock
_SUFFIX_HEX = 8  # vLLM appends f"-{random_uuid():.8}" to the external request id
_MS_PER_S = 1000.0
_SERVER_ERROR_MESSAGE = "The engine failed while running this request (simulated: --capture-fault-5xx)."
_UNSAFE_ID_MESSAGE = (
    "request_id and X-Request-Id must not contain '/' or '..' while hidden states are captured: "
    "the id names a file in the capture directory."
)


class CaptureFault(StrEnum):
    SERVER_ERROR = "5xx"
    NO_FILE = "nofile"
    TRUNCATE = "truncate"
    SHORT = "short"
    SLOW = "slow"


def quantize_fp8(values: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.float32]]:
    """speculators' per-token fp8: ``scale = max(amax / 448, 1e-12)`` over (L, H), ``q = x / scale``."""
    amax = np.abs(values).max(axis=(1, 2), keepdims=True)
    scales = np.maximum(amax / np.float32(FP8_MAX), np.float32(FP8_MIN_SCALE)).astype(np.float32)
    return (values / scales).astype(ml_dtypes.float8_e4m3fn), scales


def encode_capture(
    token_ids: Sequence[int], *, rows: int, layer_ids: Sequence[int], hidden_size: int, dtype: CaptureDtype
) -> bytes:
    """The safetensors bytes of one captured file; ``hidden_states`` covers the first ``rows`` positions."""
    values = hidden_states(token_ids[:rows], layer_ids, hidden_size)
    tensors: dict[str, np.ndarray] = {"token_ids": np.asarray(token_ids, dtype=np.int64)}
    if dtype is CaptureDtype.FP8:
        tensors["hidden_states"], tensors["hidden_states_scales"] = quantize_fp8(values)
    else:
        tensors["hidden_states"] = values.astype(ml_dtypes.bfloat16)
    return safetensors_bytes(tensors)  # no metadata, as the connector's save_file(tensors, filename)


def _unit_interval(key: str) -> float:
    # The SGLang mode's draw (simulator.sglang._faults), repeated: the two front ends share no code.
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class _Job:
    path: str
    lock_fd: int
    token_ids: list[int]
    rows: int
    fault: CaptureFault | None
    cut_at: float  # where a truncated file ends, as a fraction of its length


class Capture:
    """The capture directory's writer: locks at scheduling, files after the response."""

    def __init__(self, config: SimConfig) -> None:
        assert config.capture_dir is not None
        self.config = config
        self.directory = os.path.abspath(config.capture_dir)
        self._bands = [(CaptureFault(name), rate) for name, rate in config.capture_fault_rates]
        self._attempts: dict[str, int] = {}
        self._writes: set[asyncio.Task[None]] = set()
        self._hurry = asyncio.Event()  # set at shutdown: write what is pending now

    def plan(self, request_id: str) -> CaptureFault | None:
        """Check the id and draw this request's fault; raises the ``VllmError`` of a refused request."""
        if "/" in request_id or ".." in request_id:
            raise VllmError(_UNSAFE_ID_MESSAGE, param="request_id")
        fault = self._choose(request_id)
        if fault is CaptureFault.SERVER_ERROR:
            raise VllmError(
                _SERVER_ERROR_MESSAGE, status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError"
            )
        return fault

    def _choose(self, request_id: str) -> CaptureFault | None:
        attempt = self._attempts.get(request_id, 0)
        draw, edge = _unit_interval(f"{request_id}#{attempt}"), 0.0
        for fault, rate in self._bands:
            edge += rate
            if draw < edge:
                self._attempts[request_id] = attempt + 1
                return fault
        return None

    def begin(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        *,
        fault: CaptureFault | None,
        prefilled: bool,
    ) -> str:
        """Lock the file of prompt ``index`` now and write it after the delay; returns its path.

        ``prefilled`` False (aborted mid-prefill) stores fewer rows than tokens, as ``short`` does.
        """
        engine_id = f"{request_id}-{index}-{uuid.uuid4().hex[:_SUFFIX_HEX]}"
        path = os.path.join(self.directory, f"{engine_id}.safetensors")
        try:
            os.makedirs(self.directory, exist_ok=True)
            lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, LOCK_MODE)
        except OSError as exc:
            raise VllmError(
                f"Cannot create {path}.lock: {exc.strerror}; check --capture-dir.",
                status=HTTPStatus.INTERNAL_SERVER_ERROR,
                err_type="InternalServerError",
            ) from exc
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        key = f"{engine_id}#{fault}"
        rows = len(token_ids)
        if fault is CaptureFault.SHORT or not prefilled:
            rows = int(_unit_interval(f"{key}#rows") * len(token_ids))  # always fewer than all
        job = _Job(path, lock_fd, list(token_ids), rows, fault, _unit_interval(f"{key}#cut"))
        task = asyncio.create_task(self._write_later(job), name=f"capture-{engine_id}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return path

    async def close(self) -> None:
        """Write every pending file at once (delays skipped) and release its lock."""
        self._hurry.set()
        await asyncio.gather(*self._writes, return_exceptions=True)

    async def _write_later(self, job: _Job) -> None:
        try:
            await self._wait(self.config.capture_write_delay_ms / _MS_PER_S)
            if job.fault is CaptureFault.SLOW:
                await self._wait(self.config.capture_slow_write_s)
            if job.fault is not CaptureFault.NO_FILE:
                await asyncio.to_thread(self._write, job)
        except OSError:
            # The connector only logs a failed write; the reader finds the file missing or short.
            log.exception("Hidden-states write failed for %s", job.path)
        finally:
            os.close(job.lock_fd)  # releases the flock

    async def _wait(self, delay_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._hurry.wait(), delay_s)

    def _write(self, job: _Job) -> None:
        cfg = self.config
        data = encode_capture(
            job.token_ids,
            rows=job.rows,
            layer_ids=cfg.capture_layer_ids,
            hidden_size=cfg.capture_hidden_size,
            dtype=cfg.capture_dtype,
        )
        if job.fault is CaptureFault.TRUNCATE:
            data = data[: int(job.cut_at * len(data))]
        with open(job.path, "wb") as out:
            out.write(data)
