"""Garbage-collector settings for processes that hold a large, long-lived, acyclic heap.

A run keeps many long-lived objects (events, traces, tasks) and creates no garbage cycles worth
chasing, yet with Python's default thresholds the collector keeps rescanning that heap, a pause of
the event loop that grows with the episodes in flight, and a cost in every fold. Fewer young
collections and a frozen start-up heap leave the heap alone (bench/test_core_bench.py and
bench/test_resume_bench.py measure both).
"""

from __future__ import annotations

import contextlib
import gc

THRESHOLDS = (50_000, 20, 100)


@contextlib.contextmanager
def tuned_gc():
    """Within the block: objects that exist now are never rescanned, and young collections run
    every 50,000 allocations instead of 700. The previous settings come back afterwards."""
    previous = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


@contextlib.contextmanager
def paused_gc():
    """No collection within the block: for folds, which allocate millions of short-lived,
    acyclic views that the collector would only rescan (about 15% of a cold fold)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
