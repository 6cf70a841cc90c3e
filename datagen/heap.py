"""A long-running process's start-up objects, kept out of the cyclic garbage collector's way.

A full collection walks every object the collector tracks. A coordinator holds about 150,000 once
its modules (FastAPI, pydantic, transformers) are imported, and ingestion, which keeps each chunk's
prompts alive for a moment, sets off a full collection every two seconds or so: up to 100 ms each
on a 2-core machine, with the GIL held, which was most of ``GET /jobs/{id}``'s p99 during
ingestion (107 ms; 40 ms with them frozen), and 1.9 s of collections in a run that ingested 60,000
prompts (0.8 s frozen; ``bench/ingest_load.py``). Objects made at start-up live as long as the
process, so frozen (``gc.freeze``) they cost nothing more and lose nothing: a full collection then
walks only what was made since.
"""

from __future__ import annotations

import gc

__all__ = ["INGEST_GEN0_THRESHOLD", "collect_less_often", "freeze_start_up"]

# The youngest generation's threshold in a process that holds rows for a moment by the thousand
# (the coordinator: a chunk's prompts; a rendering process: a batch's results). At Python's 700 a
# coordinator's collector ran 2,010 young, 182 middle and 16 full collections while it ingested
# 60,000 prompts, 0.82 s with the GIL held; at 10,000, 291, 26 and 3, 0.43 s (`bench/README.md`,
# seventh pass). A young collection costs about the same per object whatever the threshold; the
# older generations are walked ten times less often.
INGEST_GEN0_THRESHOLD = 10_000


def freeze_start_up() -> None:
    """Collect what start-up left as garbage, then freeze every object the process holds: call once
    a process has started (its modules imported, its app made). A frozen object that goes later is
    freed as usual, unless it is in a reference cycle: freeze nothing a cache may let go of."""
    gc.collect()
    gc.freeze()


def collect_less_often(gen0: int = INGEST_GEN0_THRESHOLD) -> None:
    """Set the cyclic collector's youngest threshold to ``gen0``, the older ones as they are."""
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
