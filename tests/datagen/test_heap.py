"""Start-up objects frozen out of the collector's generations (`datagen.heap`)."""

from __future__ import annotations

import subprocess
import sys


def test_start_up_objects_are_frozen_and_garbage_made_before_is_collected() -> None:
    # In a process of its own: a freeze lasts as long as the process.
    script = """
import gc, weakref
from datagen.heap import freeze_start_up

class Node:
    pass

cycle = Node(); cycle.me = cycle  # garbage a collection must find before the freeze
gone = weakref.ref(cycle); del cycle
kept = [object() for _ in range(1000)]
freeze_start_up()
assert gone() is None, "the garbage was frozen, not collected"
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
tracked = len(gc.get_objects())
assert tracked < 100, tracked  # a full collection now walks only what is made from here on
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_collect_less_often_raises_only_the_youngest_threshold() -> None:
    script = """
import gc
from datagen.heap import INGEST_GEN0_THRESHOLD, collect_less_often

gc.set_threshold(700, 11, 12)
collect_less_often()
assert gc.get_threshold() == (10_000, 11, 12), gc.get_threshold()
assert INGEST_GEN0_THRESHOLD == 10_000
collect_less_often(2_000)
assert gc.get_threshold() == (2_000, 11, 12), gc.get_threshold()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
