"""Hidden-state features for EAGLE-3 training: a worker's data path from a vLLM capture server's
file to the copy a job keeps (wait for the write, check the file against the ids sent, store it as
bf16 or FP8, clean the server's folder). A library: no Redis, no control plane, no workers."""

from datagen.features.capture_dir import CaptureDir, SweepResult
from datagen.features.capture_file import DEFAULT_CHUNK_ROWS, FeatureDtype, StoredFeatures, check_and_store
from datagen.features.locks import wait_for_write

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "CaptureDir",
    "FeatureDtype",
    "StoredFeatures",
    "SweepResult",
    "check_and_store",
    "wait_for_write",
]
