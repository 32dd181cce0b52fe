"""Whether a granted hit loads synchronously or asynchronously (``load_mode``).

An asynchronous load holds up no running request, but its own request waits through a step at
least: vLLM schedules it once the workers report the load landed. A synchronous load runs inside
the step that first schedules its request, so every request of that step waits for it. With
``auto`` a load is synchronous where the wait it puts on that step (its expected time, times the
requests the step runs and itself) is shorter than the step an asynchronous load waits through.
Few requests and long steps (a model that prefills for hundreds of milliseconds a step and
loads a hit in ten) favour loading at once; many requests, short steps or a slow tier favour the
background.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvtier.core.costs import CPU, LMDB, CostSnapshot
from kvtier.core.protocol import in_lmdb
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.timings import StepTimings
from kvtier_vllm.shared.settings import LoadMode


def expected_load_s(plan: LoadPlan, costs: CostSnapshot | None) -> float | None:
    """Seconds ``plan``'s leased chunks are expected to take to load, by the tier each is leased
    in (the arena, or lmdb's map); None where a tier it needs has no measured cost."""
    refs = plan.refs()
    if costs is None or not refs:
        return None
    from_lmdb = sum(1 for ref in refs if in_lmdb(ref))
    total = 0.0
    for tier, chunks in ((CPU, len(refs) - from_lmdb), (LMDB, from_lmdb)):
        if chunks:
            seconds = costs.load_seconds(tier, chunks)
            if seconds is None:
                return None
            total += seconds
    return total


class LoadModes:
    """Chooses, per hit answered to vLLM, whether its request waits for the load while the
    others run; counts the loads granted in each mode."""

    def __init__(
        self,
        mode: LoadMode,
        timings: StepTimings,
        costs: Callable[[], CostSnapshot | None],
        *,
        several_groups: bool,
    ) -> None:
        # vLLM takes the load failures of several groups only per request, after an async load
        self.mode = LoadMode.ASYNC if several_groups else mode
        self._timings = timings
        self._costs = costs
        self._stall_s = 0.0
        """Expected seconds of the synchronous loads granted for the step being scheduled."""
        self._granted: Counter[str] = Counter()

    def asynchronous(self, plan: LoadPlan) -> bool:
        """Whether ``plan``'s request waits for its load while the others run."""
        if self.mode is not LoadMode.AUTO:
            return self.mode is LoadMode.ASYNC
        return self._sync_stall(plan) is None

    def _sync_stall(self, plan: LoadPlan) -> float | None:
        """The seconds ``plan`` would hold up the step loading synchronously, where that is
        shorter than the step an asynchronous load waits through; else None."""
        seconds = expected_load_s(plan, self._costs())
        if seconds is None or not self._holds_up_less_than_a_step(seconds):
            return None
        return seconds

    def _holds_up_less_than_a_step(self, load_s: float) -> bool:
        step, running = self._timings.busy, self._timings.running
        if not running or not step.samples:
            return False  # nothing runs beside it to hold up, or no step measured yet
        return (self._stall_s + load_s) * (running + 1) < step.mean

    def wait_s(self, load_s: float) -> float:
        """What a load expected to take ``load_s`` costs beyond the load, per request of the
        step, as a recompute's time is: a load in the background makes its own request wait a
        step (vLLM schedules it once the load landed, where a recomputed one runs in the step
        at hand), while a recompute holds up every request of that step. So the step, shared
        over the requests it runs and this one; nothing for a load in its step, or where no
        request runs (the next step begins as the load lands)."""
        step, running = self._timings.busy, self._timings.running
        if self.mode is LoadMode.SYNC or not running or not step.samples:
            return 0.0
        if self.mode is LoadMode.AUTO and self._holds_up_less_than_a_step(load_s):
            return 0.0
        return step.mean / (running + 1)

    def granted(self, plan: LoadPlan, asynchronous: bool) -> None:
        """vLLM took ``plan`` in the mode answered for it."""
        self._granted["async" if asynchronous else "sync"] += 1
        if not asynchronous and self.mode is LoadMode.AUTO:
            self._stall_s += expected_load_s(plan, self._costs()) or 0.0

    def next_step(self) -> None:
        """The step was scheduled: the next one holds no synchronous load yet."""
        self._stall_s = 0.0

    def report(self, stats: KVTierStats) -> None:
        """Add the loads granted since the last report, by mode, to ``stats``."""
        for mode, loads in self._granted.items():
            stats.load_moded(mode, loads)
        self._granted.clear()
