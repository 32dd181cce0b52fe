"""What a load from each tier costs, as measured, against what recomputing costs: the figures a
router needs to choose between an engine that holds a prefix in a slow tier and one that must
compute it.

Every estimate decays: recent loads weigh the most, so a tier that slows down (a busy disk, a
store far away) shows it within a few dozen loads. Each keeps its spread (a decaying standard
deviation), so a consumer can tell a steady tier from a noisy one.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

HALF_LIFE = 64.0
"""Observations after which an observation weighs half as much."""
_DECAY = 0.5 ** (1.0 / HALF_LIFE)


@dataclass(slots=True)
class Estimate:
    """A decaying mean and standard deviation of weighted observations."""

    mean: float = 0.0
    variance: float = 0.0
    weight: float = 0.0
    samples: int = 0

    def observe(self, value: float, weight: float = 1.0) -> None:
        if weight <= 0 or not math.isfinite(value):
            return
        self.weight = self.weight * _DECAY + weight
        share = weight / self.weight
        delta = value - self.mean
        self.mean += share * delta
        self.variance = (1 - share) * (self.variance + share * delta * delta)
        self.samples += 1

    @property
    def spread(self) -> float:
        return math.sqrt(max(0.0, self.variance))


@dataclass(frozen=True, slots=True)
class TierCost:
    seconds_per_chunk: float
    seconds_per_chunk_spread: float
    seconds_per_byte: float
    seconds_per_byte_spread: float
    samples: int


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    tiers: dict[str, TierCost]
    prefill_seconds_per_token: float
    prefill_spread: float
    prefill_samples: int

    def load_seconds(self, tier: str, chunks: int) -> float | None:
        """Expected seconds to load ``chunks`` chunks from ``tier``; None before any was timed.
        The object tier's chunks are fetched into lmdb, then loaded from there."""
        cost = self.tiers.get(tier)
        if cost is None or not cost.samples:
            return None
        seconds = cost.seconds_per_chunk * chunks
        if tier == OBJECT:
            after = self.load_seconds(LMDB, chunks)
            return None if after is None else seconds + after
        return seconds

    def recompute_seconds(self, tokens: int) -> float | None:
        if not self.prefill_samples:
            return None
        return self.prefill_seconds_per_token * tokens


CPU, LMDB, OBJECT = "cpu", "lmdb", "object"
TIERS = (CPU, LMDB, OBJECT)


@dataclass(slots=True)
class Tally:
    """Loads from one tier, summed until they are reported."""

    chunks: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def add(self, chunks: int, nbytes: int, seconds: float) -> None:
        self.chunks += chunks
        self.nbytes += nbytes
        self.seconds += seconds


@dataclass(slots=True)
class EngineTimings:
    """What an engine measured since it last reported: loads per tier, and its prefill."""

    loads: dict[str, Tally] = field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0

    def loaded(self, tier: str, chunks: int, nbytes: int, seconds: float) -> None:
        self.loads.setdefault(tier, Tally()).add(chunks, nbytes, seconds)

    def merge(self, other: EngineTimings) -> None:
        for tier, tally in other.loads.items():
            self.loaded(tier, tally.chunks, tally.nbytes, tally.seconds)
        self.prefill_tokens += other.prefill_tokens
        self.prefill_seconds += other.prefill_seconds

    def __bool__(self) -> bool:
        return bool(self.loads) or self.prefill_tokens > 0


@dataclass(slots=True)
class CostTotals:
    """Everything timed so far, never decaying: over any window, seconds over chunks (or
    tokens) is the mean cost in it, where the estimates weigh the last loads most."""

    loads: dict[str, Tally] = field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0


class LoadCosts:
    """Per tier, decaying estimates of load seconds per chunk and per byte; and the engine's
    prefill seconds per token. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_chunk = {tier: Estimate() for tier in TIERS}
        self._per_byte = {tier: Estimate() for tier in TIERS}
        self._prefill = Estimate()
        self._totals = CostTotals({tier: Tally() for tier in TIERS})

    def loaded(self, tier: str, chunks: int, nbytes: int, seconds: float) -> None:
        """``chunks`` chunks of ``nbytes`` in all came from ``tier`` in ``seconds``."""
        if chunks <= 0 or seconds < 0 or tier not in self._per_chunk:
            return
        with self._lock:
            self._totals.loads[tier].add(chunks, nbytes, seconds)
            self._per_chunk[tier].observe(seconds / chunks, chunks)
            if nbytes > 0:
                self._per_byte[tier].observe(seconds / nbytes, chunks)

    def reported(self, timings: EngineTimings) -> None:
        for tier, tally in timings.loads.items():
            self.loaded(tier, tally.chunks, tally.nbytes, tally.seconds)
        self.prefilled(timings.prefill_tokens, timings.prefill_seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._totals.prefill_tokens += tokens
            self._totals.prefill_seconds += seconds
            self._prefill.observe(seconds / tokens, tokens)

    def totals(self) -> CostTotals:
        with self._lock:
            t = self._totals
            loads = {tier: Tally(x.chunks, x.nbytes, x.seconds) for tier, x in t.loads.items()}
            return CostTotals(loads, t.prefill_tokens, t.prefill_seconds)

    def snapshot(self) -> CostSnapshot:
        with self._lock:
            tiers = {
                tier: TierCost(
                    per_chunk.mean,
                    per_chunk.spread,
                    self._per_byte[tier].mean,
                    self._per_byte[tier].spread,
                    per_chunk.samples,
                )
                for tier, per_chunk in self._per_chunk.items()
            }
            prefill = self._prefill
            return CostSnapshot(tiers, prefill.mean, prefill.spread, prefill.samples)
