"""Statistics of a benchmark's samples: the median, percentiles (`kvtier.bench.stats`, one
definition for ``kvtier bench`` and the benchmarks) and the geometric mean of ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.bench.stats import Percentiles, percentile

__all__ = ["Percentiles", "geomean", "median", "percentile"]


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count); NaN if empty."""
    return percentile(values, 50)


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
