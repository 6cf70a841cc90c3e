"""A Python module run with its wall clock set off by some seconds, as on a machine whose clock is
wrong: ``python -m datagen_cli.local.skew OFFSET_S MODULE [ARGS...]`` (``python -m datagen_cli.local.skew -5
datagen coordinator --port 8001``: a coordinator 5 s behind).

``time.time`` and ``time.time_ns``, which every wall-clock time of the project reads, answer the
shifted time; monotonic clocks stay as they are. The shift is made before the module is imported,
so nothing holds the real functions. For the tests and the soak that run two coordinators whose
clocks differ (`tests/service/test_epoch_skew.py`, ``bench/soak_epoch_skew.py``): no decision of
the project may depend on a clock that another process does not share.
"""

from __future__ import annotations

import runpy
import sys
import time

__all__ = ["shift_clock"]

NS_PER_S = 1_000_000_000


def shift_clock(offset_s: float) -> None:
    """Make this process's wall clock ``offset_s`` seconds off (negative: behind)."""
    real_time, real_time_ns = time.time, time.time_ns
    offset_ns = round(offset_s * NS_PER_S)
    time.time = lambda: real_time() + offset_s
    time.time_ns = lambda: real_time_ns() + offset_ns


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m datagen_cli.local.skew OFFSET_S MODULE [ARGS...]")
    offset_s, module, *rest = argv
    shift_clock(float(offset_s))
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
