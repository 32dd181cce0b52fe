"""Statistics of a benchmark's samples: the samples of every repetition, the median, percentiles
(`kvtier.bench.stats`, one definition for ``kvtier bench`` and the benchmarks) and the geometric
mean of ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.bench.stats import Percentiles, percentile

__all__ = ["Percentiles", "Samples", "geomean", "median", "percentile"]


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count); NaN if empty."""
    return percentile(values, 50)


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass
class Samples:
    """One value per repetition, by figure: ``rates`` (throughputs, costs per byte) and
    ``ratios`` (a figure over its baseline in the same repetition)."""

    rates: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.rates.setdefault(name, []).append(value)

    def ratio(self, name: str, value: float) -> None:
        self.ratios.setdefault(name, []).append(value)

    def medians(self) -> dict[str, float]:
        """Every figure's median, rates then ratios."""
        return {name: median(v) for name, v in (*self.rates.items(), *self.ratios.items())}
