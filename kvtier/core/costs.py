"""What a load from each tier costs, as measured, against what recomputing costs: the figures a
router needs to choose between an engine that holds a prefix in a slow tier and one that must
compute it.

Every estimate decays: recent loads weigh the most, so a tier that slows down (a busy disk, a
store far away) shows it within a few dozen loads. Each keeps its spread (a decaying standard
deviation), so a consumer can tell a steady tier from a noisy one. Loads and prefill steps are
also fitted as a fixed part plus a part per chunk (or token): an object's first byte is paid
once a load, a step's fixed part with or without a hit.
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
    load_fit: LoadFit | None = None
    """A load's time as a fixed part (a first byte, a request) plus a part per chunk; None
    until loads of different lengths were timed."""


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    tiers: dict[str, TierCost]
    prefill_seconds_per_token: float
    prefill_spread: float
    prefill_samples: int
    prefill_fit: StepFit | None = None
    """The steps' time as a fixed part plus a part per token; None until steps of different
    lengths were timed."""

    def load_seconds(self, tier: str, chunks: int) -> float | None:
        """Expected seconds to load ``chunks`` chunks from ``tier`` in one load (its fixed part
        and its part per chunk, where fitted; else the mean per chunk); None before any was
        timed. The object tier's chunks are fetched into lmdb, then loaded from there."""
        cost = self.tiers.get(tier)
        if cost is None or not cost.samples:
            return None
        fit = cost.load_fit
        seconds = (
            fit.per_load + fit.per_chunk * chunks
            if fit is not None
            else cost.seconds_per_chunk * chunks
        )
        if tier == OBJECT:
            after = self.load_seconds(LMDB, chunks)
            return None if after is None else seconds + after
        return seconds

    def recompute_seconds(self, tokens: int) -> float | None:
        """What computing ``tokens`` more costs (`per_token`)."""
        if not self.prefill_samples:
            return None
        return per_token(self.prefill_fit, self.prefill_seconds_per_token) * tokens


CPU, LMDB, OBJECT = "cpu", "lmdb", "object"
TIERS = (CPU, LMDB, OBJECT)


@dataclass(slots=True)
class Tally:
    """Loads from one tier, summed until they are reported: with their count and their sums of
    chunks squared and of chunks times seconds, what a fit of a load's time as a fixed part
    plus a part per chunk needs (a report without the count feeds only the mean per chunk)."""

    chunks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    loads: int = 0
    chunks_squared: float = 0.0
    chunk_seconds: float = 0.0

    def add(self, chunks: int, nbytes: int, seconds: float) -> None:
        """One load of ``chunks`` chunks."""
        self.merge(Tally(chunks, nbytes, seconds, 1, chunks * chunks, chunks * seconds))

    def merge(self, other: Tally) -> None:
        self.chunks += other.chunks
        self.nbytes += other.nbytes
        self.seconds += other.seconds
        self.loads += other.loads
        self.chunks_squared += other.chunks_squared
        self.chunk_seconds += other.chunk_seconds


@dataclass(slots=True)
class EngineTimings:
    """What an engine measured since it last reported: loads per tier, and its prefill steps
    (their count, tokens and seconds, and the sums a least-squares fit of them needs)."""

    loads: dict[str, Tally] = field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_steps: int = 0
    prefill_tokens_squared: float = 0.0
    prefill_token_seconds: float = 0.0

    def loaded(self, tier: str, chunks: int, nbytes: int, seconds: float) -> None:
        self.loads.setdefault(tier, Tally()).add(chunks, nbytes, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """One step that prefilled ``tokens`` in ``seconds``."""
        self.prefill_steps += 1
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds
        self.prefill_tokens_squared += tokens * tokens
        self.prefill_token_seconds += tokens * seconds

    def merge(self, other: EngineTimings) -> None:
        for tier, tally in other.loads.items():
            self.loads.setdefault(tier, Tally()).merge(tally)
        self.prefill_tokens += other.prefill_tokens
        self.prefill_seconds += other.prefill_seconds
        self.prefill_steps += other.prefill_steps
        self.prefill_tokens_squared += other.prefill_tokens_squared
        self.prefill_token_seconds += other.prefill_token_seconds

    def __bool__(self) -> bool:
        return bool(self.loads) or self.prefill_tokens > 0


@dataclass(frozen=True, slots=True)
class StepFit:
    per_step: float
    """Seconds every prefill step pays whatever its length (scheduling, the decodes beside it,
    the forward's fixed cost)."""
    per_token: float
    """Seconds each prefilled token adds: what a hit of one token saves."""


def per_token(fit: StepFit | None, mean: float) -> float:
    """What one prefilled token more costs: the fit's part per token where there is one (a
    step runs for the rest of the prompt anyway), else the steps' mean per token."""
    return fit.per_token if fit is not None else mean


@dataclass(frozen=True, slots=True)
class LoadFit:
    per_load: float
    """Seconds every load from the tier pays whatever its length (an object's first byte)."""
    per_chunk: float
    """Seconds each chunk more adds."""


@dataclass(slots=True)
class LineSums:
    """Decaying sums over timed operations (each weighs half as much after ``HALF_LIFE``
    more): a least-squares fit of an operation's seconds as ``fixed + per_unit * size``."""

    count: float = 0.0
    size: float = 0.0
    size_squared: float = 0.0
    seconds: float = 0.0
    size_seconds: float = 0.0

    def add(
        self, count: int, size: float, size_squared: float, seconds: float, size_seconds: float
    ) -> None:
        """``count`` operations, their sizes, seconds and the sums the fit needs, summed."""
        if count <= 0:
            return
        keep = _DECAY**count
        self.count = self.count * keep + count
        self.size = self.size * keep + size
        self.size_squared = self.size_squared * keep + size_squared
        self.seconds = self.seconds * keep + seconds
        self.size_seconds = self.size_seconds * keep + size_seconds

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_unit)``; None until operations of different sizes were seen (the two
        parts cannot be told apart from operations of one size)."""
        n, x, xx, y, xy = self.count, self.size, self.size_squared, self.seconds, self.size_seconds
        spread = n * xx - x * x  # n^2 times the variance of the sizes
        if n < 2 or spread <= 1e-6 * n * xx:
            return None
        per_unit = (n * xy - x * y) / spread
        fixed = (y - per_unit * x) / n
        if fixed < 0:  # noise past a fixed part of 0: the fit through the origin
            fixed, per_unit = 0.0, xy / xx
        return (fixed, per_unit) if per_unit > 0 else None


class StepSums:
    """The prefill steps' `LineSums`: a step's seconds as ``per_step + per_token * tokens``."""

    def __init__(self) -> None:
        self.sums = LineSums()

    def add(self, t: EngineTimings) -> None:
        self.sums.add(
            t.prefill_steps,
            t.prefill_tokens,
            t.prefill_tokens_squared,
            t.prefill_seconds,
            t.prefill_token_seconds,
        )

    def fit(self) -> StepFit | None:
        line = self.sums.fit()
        return None if line is None else StepFit(*line)


class LoadCosts:
    """Per tier, decaying estimates of load seconds per chunk and per byte; and the engine's
    prefill seconds per token. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_chunk = {tier: Estimate() for tier in TIERS}
        self._per_byte = {tier: Estimate() for tier in TIERS}
        self._loads = {tier: LineSums() for tier in TIERS}
        self._prefill = Estimate()
        self._steps = StepSums()
        self._totals = EngineTimings({tier: Tally() for tier in TIERS})
        """Everything timed so far, never decaying: over any window, seconds over chunks (or
        tokens) is the mean cost in it, where the estimates weigh the last loads most."""

    def loaded(self, tier: str, chunks: int, nbytes: int, seconds: float) -> None:
        """One load of ``chunks`` chunks of ``nbytes`` in all came from ``tier`` in
        ``seconds``."""
        tally = Tally()
        tally.add(chunks, nbytes, seconds)
        self._tallied(tier, tally)

    def _tallied(self, tier: str, tally: Tally) -> None:
        chunks, nbytes, seconds = tally.chunks, tally.nbytes, tally.seconds
        if chunks <= 0 or seconds < 0 or tier not in self._per_chunk:
            return
        with self._lock:
            self._totals.loads[tier].merge(tally)
            self._per_chunk[tier].observe(seconds / chunks, chunks)
            if nbytes > 0:
                self._per_byte[tier].observe(seconds / nbytes, chunks)
            self._loads[tier].add(
                tally.loads, chunks, tally.chunks_squared, seconds, tally.chunk_seconds
            )

    def reported(self, timings: EngineTimings) -> None:
        for tier, tally in timings.loads.items():
            self._tallied(tier, tally)
        self.prefilled(timings.prefill_tokens, timings.prefill_seconds)
        with self._lock:
            self._steps.add(timings)

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._totals.prefill_tokens += tokens
            self._totals.prefill_seconds += seconds
            self._prefill.observe(seconds / tokens, tokens)

    def totals(self) -> EngineTimings:
        """A copy of everything timed so far, every tier named (0 where none was timed)."""
        copy = EngineTimings({tier: Tally() for tier in TIERS})
        with self._lock:
            copy.merge(self._totals)
        return copy

    def snapshot(self) -> CostSnapshot:
        with self._lock:
            tiers = {
                tier: TierCost(
                    per_chunk.mean,
                    per_chunk.spread,
                    self._per_byte[tier].mean,
                    self._per_byte[tier].spread,
                    per_chunk.samples,
                    None if (line := self._loads[tier].fit()) is None else LoadFit(*line),
                )
                for tier, per_chunk in self._per_chunk.items()
            }
            prefill = self._prefill
            fit = self._steps.fit()
            return CostSnapshot(tiers, prefill.mean, prefill.spread, prefill.samples, fit)
