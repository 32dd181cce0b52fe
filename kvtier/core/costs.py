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
    prefill_fit: StepFit | None = None
    """The steps' time as a fixed part plus a part per token; None until steps of different
    lengths were timed."""

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
        """What computing ``tokens`` more costs (`per_token`)."""
        if not self.prefill_samples:
            return None
        return per_token(self.prefill_fit, self.prefill_seconds_per_token) * tokens


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
            self.loaded(tier, tally.chunks, tally.nbytes, tally.seconds)
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


@dataclass(slots=True)
class StepSums:
    """Decaying sums over prefill steps (each weighs half as much after ``HALF_LIFE`` more):
    a least-squares fit of a step's seconds as ``per_step + per_token * tokens``."""

    steps: float = 0.0
    tokens: float = 0.0
    tokens_squared: float = 0.0
    seconds: float = 0.0
    token_seconds: float = 0.0

    def add(self, t: EngineTimings) -> None:
        if t.prefill_steps <= 0:
            return
        keep = _DECAY**t.prefill_steps
        self.steps = self.steps * keep + t.prefill_steps
        self.tokens = self.tokens * keep + t.prefill_tokens
        self.tokens_squared = self.tokens_squared * keep + t.prefill_tokens_squared
        self.seconds = self.seconds * keep + t.prefill_seconds
        self.token_seconds = self.token_seconds * keep + t.prefill_token_seconds

    def fit(self) -> StepFit | None:
        """None until steps of different lengths were seen (the two parts cannot be told apart
        from steps of one length)."""
        n, x, xx, y, xy = (
            self.steps,
            self.tokens,
            self.tokens_squared,
            self.seconds,
            self.token_seconds,
        )
        spread = n * xx - x * x  # n^2 times the variance of the steps' lengths
        if n < 2 or spread <= 1e-6 * n * xx:
            return None
        per_token = (n * xy - x * y) / spread
        per_step = (y - per_token * x) / n
        if per_step < 0:  # noise past a fixed part of 0: the fit through the origin
            per_step, per_token = 0.0, xy / xx
        return StepFit(per_step, per_token) if per_token > 0 else None


class LoadCosts:
    """Per tier, decaying estimates of load seconds per chunk and per byte; and the engine's
    prefill seconds per token. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_chunk = {tier: Estimate() for tier in TIERS}
        self._per_byte = {tier: Estimate() for tier in TIERS}
        self._prefill = Estimate()
        self._steps = StepSums()
        self._totals = EngineTimings({tier: Tally() for tier in TIERS})
        """Everything timed so far, never decaying: over any window, seconds over chunks (or
        tokens) is the mean cost in it, where the estimates weigh the last loads most."""

    def loaded(self, tier: str, chunks: int, nbytes: int, seconds: float) -> None:
        """``chunks`` chunks of ``nbytes`` in all came from ``tier`` in ``seconds``."""
        if chunks <= 0 or seconds < 0 or tier not in self._per_chunk:
            return
        with self._lock:
            self._totals.loaded(tier, chunks, nbytes, seconds)
            self._per_chunk[tier].observe(seconds / chunks, chunks)
            if nbytes > 0:
                self._per_byte[tier].observe(seconds / nbytes, chunks)

    def reported(self, timings: EngineTimings) -> None:
        for tier, tally in timings.loads.items():
            self.loaded(tier, tally.chunks, tally.nbytes, tally.seconds)
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
                )
                for tier, per_chunk in self._per_chunk.items()
            }
            prefill = self._prefill
            fit = self._steps.fit()
            return CostSnapshot(tiers, prefill.mean, prefill.spread, prefill.samples, fit)
