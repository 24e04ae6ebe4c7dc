"""Which task an env's cursor names: the train tasks of a finite set visited pass after pass, each
pass in an order of its own that is a pure function of (env, seed, pass), so a resumed or replayed
run draws the same tasks."""

from __future__ import annotations

import random


def task_index(seed: int, cursor: int, size: int | None, env: str) -> int:
    """The task position of `env`'s `cursor`-th task: each pass over a finite set is a fresh
    permutation of it, seeded by (env, seed, pass); an infinite one is read in order."""
    if size is None:
        return cursor
    order = list(range(size))
    random.Random(f"{env}/{seed}/{cursor // size}").shuffle(order)
    return order[cursor % size]
