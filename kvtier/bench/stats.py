"""Summary statistics of one level's requests: latency percentiles and throughputs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        mean = sum(values) / len(values) if values else math.nan
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)


def inter_token_gaps(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token gaps after the first chunk: a chunk of k tokens arriving after a gap g counts
    k gaps of g/k, so a server that batches tokens into chunks is not rewarded for it."""
    gaps: list[float] = []
    for i in range(1, len(chunk_times)):
        k = chunk_tokens[i]
        if k > 0:
            gaps += [(chunk_times[i] - chunk_times[i - 1]) / k] * k
    return gaps


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan
