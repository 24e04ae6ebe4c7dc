"""Which task an env's cursor names: the train tasks of a finite set visited pass after pass, each
pass in an order of its own that is a pure function of (env, seed, pass), so a resumed or replayed
run draws the same tasks."""

from __future__ import annotations

import functools
import random


@functools.lru_cache(maxsize=8)
def pass_order(env: str, seed: int, pass_number: int, size: int) -> tuple[int, ...]:
    """The order of a finite set's `size` tasks in pass `pass_number`: a permutation seeded by
    (env, seed, pass). Kept for the next draws (a few passes: episodes in flight straddle a pass
    boundary), not shuffled again for each."""
    order = list(range(size))
    random.Random(f"{env}/{seed}/{pass_number}").shuffle(order)
    return tuple(order)


def task_index(seed: int, cursor: int, size: int | None, env: str) -> int:
    """The task position of `env`'s `cursor`-th task: in a finite set, its place in the pass's
    order (:func:`pass_order`); an infinite one is read in order."""
    if size is None:
        return cursor
    return pass_order(env, seed, cursor // size, size)[cursor % size]
