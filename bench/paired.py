"""Two sides timed in one run, fairly: a warm-up of each that is not counted, then rounds in
which the order alternates (A then B, B then A, ...), so the machine's drift and the server's
caches favour neither; the figure is the median of the per-round ratios, with its spread."""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence


def order(round_index: int, sides: Sequence[str]) -> list[str]:
    """The sides in the order they run in round ``round_index`` (reversed every other round)."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


async def alternated_rounds(
    rounds: int, sides: dict[str, Callable[[], Awaitable[float]]], warmup: int = 1
) -> dict[str, list[float]]:
    """Each side's figure (what its callable returns) per counted round, after ``warmup``
    rounds of each side whose figures are dropped."""
    figures: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(warmup + rounds):
        for name in order(r, list(sides)):
            value = await sides[name]()
            if r >= warmup:
                figures[name].append(value)
    return figures


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, float | list[float]]:
    """The per-round ratios numerator / denominator (same round: paired), their median, and
    their spread (lowest, highest, and the quartiles)."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
        "q1": round(quartiles[0], 3),
        "q3": round(quartiles[2], 3),
        "rounds": [round(x, 3) for x in ratios],
    }


def spread(values: Sequence[float], digits: int = 4) -> dict[str, float]:
    """The median and the range of `values`, rounded."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }
