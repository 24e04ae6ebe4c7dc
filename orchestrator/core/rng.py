"""A counter-based PRNG whose whole state is one integer in the orchestrator state.

splitmix64 of (seed, counter): drawing number k never depends on how the state was reached, so a
fold of the log reproduces every draw, and a snapshot stores one int instead of a Mersenne state.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, counter: int) -> float:
    """The counter-th draw in [0, 1) of the stream named by seed."""
    return (splitmix64((seed * 0x100000001B3) ^ splitmix64(counter)) >> 11) / float(1 << 53)


def choose_by_ratio(ratios: dict[str, float], u: float) -> str:
    """Pick a key with probability proportional to its ratio, walking keys in their given order."""
    total = sum(ratios.values())
    threshold = u * total
    running = 0.0
    for name, weight in ratios.items():
        running += weight
        if threshold < running:
            return name
    return next(reversed(ratios))
