"""Load or recompute: how much of a hit is worth loading, from the measured costs.

A hit is a prefix of chunks held in runs, one tier each, in prefix order. A run can only be
loaded with every run before it (vLLM's hits are prefixes), so the choice is a prefix: the one
whose recompute time less its load time (each run's fixed part included) is the largest. The
loads already queued ahead of it (``ahead_s``) count against its first run: loading anything
waits for them, recomputing does not; and so does what else a load of the prefix costs
(``wait_s`` of the prefix's load time, in the same units as a recompute's time: the caller's
share of the step a request loading in the background waits through). Where a cost is not
measured yet, the whole hit is loaded, as it was before costs were asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.costs import CostSnapshot


@dataclass(frozen=True, slots=True)
class RunChoice:
    """One run of a hit: its tier, its chunks, whether it is loaded, and the seconds that choice
    is expected to save over the other for it (loaded: its recompute time less its load time;
    recomputed: the reverse). None where the costs are not measured."""

    tier: str
    chunks: int
    load: bool
    seconds_saved: float | None


@dataclass(frozen=True, slots=True)
class LoadChoice:
    tokens: int
    """The tokens of the hit's prefix to load."""
    runs: tuple[RunChoice, ...]

    @property
    def measured(self) -> bool:
        """Whether the choice rests on measured costs (else the whole hit is loaded)."""
        return all(run.seconds_saved is not None for run in self.runs)


def choose(
    runs: Sequence[tuple[str, int]],
    chunk_tokens: int,
    costs: CostSnapshot | None,
    ahead_s: float = 0.0,
    wait_s: Callable[[float], float] = lambda load_s: 0.0,
) -> LoadChoice:
    """The prefix of the hit ``runs`` (``(tier, chunks)`` in prefix order) worth loading, with
    ``chunk_tokens`` tokens a chunk, after ``ahead_s`` seconds of loads queued before it and
    with ``wait_s(load seconds)`` more that its request waits: the one expected to save the most
    against recomputing it (a shorter one where that saves more; the longer one on a tie).
    Without a measured cost for each run's tier, or without the prefill fit, the whole hit."""
    runs = [(tier, chunks) for tier, chunks in runs if chunks > 0]
    measured = _measured_runs(runs, chunk_tokens, costs)
    if measured is None:
        return whole_hit(runs, chunk_tokens)
    saved = [recompute - load for load, recompute in measured]
    best, best_saved, prefix, loading = 0, 0.0, -ahead_s, 0.0
    for i, (run_saved, (load, _)) in enumerate(zip(saved, measured, strict=True), 1):
        prefix += run_saved
        loading += load
        net = prefix - wait_s(loading)
        if net >= best_saved:
            best, best_saved = i, net
    if saved:  # the wait counts against the first run: loading anything waits for it
        saved[0] -= ahead_s + wait_s(sum(load for load, _ in measured[: best or len(saved)]))
    choices = tuple(
        RunChoice(tier, chunks, i < best, run_saved if i < best else -run_saved)
        for i, ((tier, chunks), run_saved) in enumerate(zip(runs, saved, strict=True))
    )
    return LoadChoice(sum(chunks for _, chunks in runs[:best]) * chunk_tokens, choices)


def whole_hit(runs: Sequence[tuple[str, int]], chunk_tokens: int) -> LoadChoice:
    """Every run of the hit ``runs`` loaded, with no saving known."""
    loads = tuple(RunChoice(tier, chunks, True, None) for tier, chunks in runs)
    return LoadChoice(sum(chunks for _, chunks in runs) * chunk_tokens, loads)


def _measured_runs(
    runs: Sequence[tuple[str, int]], chunk_tokens: int, costs: CostSnapshot | None
) -> list[tuple[float, float]] | None:
    """Per run, its load and recompute seconds; None where one is not measured."""
    if costs is None or costs.prefill_fit is None:
        return None
    measured = []
    for tier, chunks in runs:
        load = costs.load_seconds(tier, chunks)
        recompute = costs.recompute_seconds(chunks * chunk_tokens)
        if load is None or recompute is None:
            return None
        measured.append((load, recompute))
    return measured


class CostChooser:
    """Chooses with the costs ``costs`` returns at each choice (None: none known yet)."""

    def __init__(self, costs: Callable[[], CostSnapshot | None]) -> None:
        self._costs = costs

    def choose(
        self,
        runs: Sequence[tuple[str, int]],
        chunk_tokens: int,
        ahead_s: float = 0.0,
        wait_s: Callable[[float], float] = lambda load_s: 0.0,
    ) -> LoadChoice:
        """The prefix worth loading, and per run the choice and what it saves (`choose`)."""
        return choose(runs, chunk_tokens, self._costs(), ahead_s, wait_s)

    def tokens_to_load(self, runs: Sequence[tuple[str, int]], chunk_tokens: int) -> int:
        """The tokens of the hit's prefix worth loading (`choose`)."""
        return self.choose(runs, chunk_tokens).tokens
