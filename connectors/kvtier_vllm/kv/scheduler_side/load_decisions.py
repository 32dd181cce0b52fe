"""Which part of a hit the connector loads: the prefix measured to beat recomputing it
(`kvtier.core.load_choice`, over the costs its client reads without a call), or every chunk
(``load_policy: always``). The asynchronous loads out count against loading a new hit: it
would queue behind them (`LoadBacklog`), and so does the step a load in the background makes its
request wait, per request of that step (`LoadModes.wait_s`). A request's decision is counted
once, when its plan is final, for the metrics until the next report."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from kvtier.core.costs import CostSnapshot
from kvtier.core.load_choice import CostChooser, LoadChoice, whole_hit
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.shared.settings import LoadPolicy

REMEASURE_EVERY = 32
"""One hit in this many that the costs would cut short is loaded whole: a tier's cost is only
measured on its loads, so one that sped up again (a disk no longer busy) shows it."""


class LoadDecisions:
    """Decides, per lookup, how many tokens of a hit to load, and counts each run's decision
    and the seconds it is expected to save, once a request's plan is final."""

    def __init__(
        self,
        policy: LoadPolicy,
        costs: Callable[[], CostSnapshot | None],
        ahead_s: Callable[[], float] = lambda: 0.0,
        wait_s: Callable[[float], float] = lambda load_s: 0.0,
    ) -> None:
        self.policy = policy
        self._chooser = CostChooser(costs)
        self._ahead_s = ahead_s
        """Seconds of loads a load granted now would wait behind."""
        self._wait_s = wait_s
        """Seconds a load of the given seconds adds to its request's wait beyond itself."""
        self._decided: Counter[tuple[str, str]] = Counter()
        """Runs decided since the last report, by tier and decision."""
        self._saved: defaultdict[str, float] = defaultdict(float)
        """Seconds the decisions are expected to save, by decision."""
        self._cut = 0
        """Hits the costs cut short, loaded whole every `REMEASURE_EVERY`."""

    def choose(self, runs: Sequence[tuple[str, int]], chunk_tokens: int) -> LoadChoice:
        """The prefix of the hit ``runs`` (``(tier, chunks)`` in prefix order) to load."""
        if self.policy is LoadPolicy.ALWAYS:
            return whole_hit(runs, chunk_tokens)
        choice = self._chooser.choose(runs, chunk_tokens, self._ahead_s(), self._wait_s)
        whole = sum(run.chunks for run in choice.runs) * chunk_tokens
        if choice.tokens < whole:
            self._cut += 1
            if self._cut % REMEASURE_EVERY == 0:  # loaded to be measured: no saving counted
                choice = whole_hit([(r.tier, r.chunks) for r in choice.runs], chunk_tokens)
        return choice

    def count(self, choice: LoadChoice) -> None:
        """Counts a request's final ``choice``: each run's decision, and what it saves."""
        if self.policy is LoadPolicy.ALWAYS:
            return  # nothing was decided
        saved: defaultdict[str, float] = defaultdict(float)
        for run in choice.runs:
            decision = "load" if run.load else "recompute"
            self._decided[run.tier, decision] += 1
            if run.seconds_saved is not None:
                saved[decision] += run.seconds_saved
        # a run alone may save less than nothing (a cheap one behind a slow one), never the
        # choice's loads or recomputes together: the prefix chosen saves the most
        for decision, seconds in saved.items():
            self._saved[decision] += max(0.0, seconds)

    def report(self, stats: KVTierStats) -> None:
        """Add the decisions counted since the last report to ``stats``."""
        for (tier, decision), runs in self._decided.items():
            stats.load_decided(tier, decision, runs)
        for decision, seconds in self._saved.items():
            stats.load_saved(decision, seconds)
        self._decided.clear()
        self._saved.clear()
