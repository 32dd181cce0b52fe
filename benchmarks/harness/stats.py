"""Statistics of a benchmark's samples: the samples of every repetition, the median, percentiles
(`kvtier.bench.stats`, one definition for ``kvtier bench`` and the benchmarks) and the geometric
mean of ratios."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from benchmarks.harness.sizes import MiB
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


def medians_by_chunk_size(samples: Mapping[int, Samples]) -> dict[str, dict[str, float]]:
    """Each chunk size's medians, keyed by the size in MiB (``"4MiB"``)."""
    return {f"{chunk // MiB}MiB": s.medians() for chunk, s in samples.items()}


def geomeans_across(rows: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Every figure's geometric mean over the rows (chunk sizes), in the first row's order."""
    names = list(next(iter(rows.values())))
    return {name: geomean([row[name] for row in rows.values()]) for name in names}
