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

__all__ = ["freeze_start_up"]


def freeze_start_up() -> None:
    """Collect what start-up left as garbage, then freeze every object the process holds: call once
    a process has started (its modules imported, its app made). A frozen object that goes later is
    freed as usual, unless it is in a reference cycle: freeze nothing a cache may let go of."""
    gc.collect()
    gc.freeze()
