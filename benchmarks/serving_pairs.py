"""The GPU-ratio model's multi-round levels, each measured beside one of vLLM alone's.

This machine's speed drifts: two identical servers started a minute apart differ by up to a
quarter, more than any target's margin, so a ratio of two servers measured minutes apart says
little. vLLM alone (the reference) is therefore kept up through the run, and each server's level
runs right before or after one of the reference's of the same prompts (prompts of their own,
which no cache holds), the order swapped from pair to pair. A pair runs within a minute, so its
ratio carries little of the drift; a server's figure is the mean over its pairs, with its
standard error. A server against another (kvtier against LMCache) is the ratio of their means
over vLLM alone's. A hit's TTFT is judged on the rounds after each user's first, the server's
pairs against the reference's levels beside them, both pooled.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence

from benchmarks.harness.system import wait_until_quiet
from benchmarks.serving_cases import HEADLINE_CONCURRENCY, WARMUP
from benchmarks.serving_figures import Level, Pair, Ratios
from kvtier.bench import LevelResult, WorkloadSpec
from tests.fixtures.servers import VllmServer

log = logging.getLogger("kvtier.bench.serving")

FIRST_INDEX = 500
"""The workload's user indices the pairs take, one per pair: apart from the other phases'."""

Up = tuple[VllmServer, str | None]
"""A server that is up, and its kvtierd's metrics (None: none)."""


class PairedLevels:
    """``pairs`` levels of each server given, of ``requests`` each at the headline concurrency,
    beside the reference's (run by ``level``, on ``workload``'s multi-round prompts)."""

    def __init__(
        self,
        level: Level,
        workload: Callable[..., WorkloadSpec],
        requests: int,
        pairs: int,
        quiet: Callable[[], float | None] = wait_until_quiet,
    ) -> None:
        self.level = level
        self.quiet = quiet
        """Waits for the machine to be quiet: what a server left running in the background
        (kvtierd's write-back of its level) never falls on the other's level."""
        self.workload = workload
        self.requests = requests
        self.pairs = pairs
        self._index = itertools.count(FIRST_INDEX)  # never repeated: no server holds them
        self._warm: list[VllmServer] = []

    def run(self, up: Up, reference: Up, cpu_s: Callable[[], float]) -> Iterator[Pair]:
        """The pairs of ``up`` beside ``reference``; ``cpu_s``: kvtierd's CPU time so far."""
        spec = self.workload()
        for i in range(self.pairs):
            index = next(self._index)
            order = (up, reference) if i % 2 == 0 else (reference, up)
            levels: dict[int, tuple[LevelResult, float]] = {}
            for server, metrics_url in order:
                before = cpu_s()
                level = self._level(server, metrics_url, spec, index)
                levels[id(server)] = level, cpu_s() - before
            (served, spent), (alone, _) = levels[id(up[0])], levels[id(reference[0])]
            pair = Pair(served, alone, spent)
            log.info("  pair %d: %.3f of vLLM alone's output tokens/s", i, pair.ratio)
            yield pair

    def _level(
        self, server: VllmServer, metrics_url: str | None, spec: WorkloadSpec, index: int
    ) -> LevelResult:
        warm = any(server is known for known in self._warm)
        if not warm:
            self._warm.append(server)  # a server's first level warms it
        if self.quiet() is None:
            log.warning("the machine stayed busy: the level runs anyway")
        warmup = 0 if warm else WARMUP
        concurrency = HEADLINE_CONCURRENCY
        return self.level(server, metrics_url, spec, concurrency, self.requests, index, warmup)


def pair_ratios(pairs: Sequence[Pair]) -> Ratios:
    """A server's throughput over the reference's, one per pair that ran whole."""
    return Ratios([p.ratio for p in pairs if not math.isnan(p.ratio)])


def later_rounds_p90(levels: Sequence[LevelResult]) -> float | None:
    """TTFT p90 of the requests after each user's first (those a cache can serve), pooled."""
    later = sorted(r.ttft_s for lv in levels for r in lv.records if r.ok and r.round > 0)
    return later[math.ceil(0.9 * len(later)) - 1] if later else None


def hit_ttft_ratio(pairs: Sequence[Pair]) -> float | None:
    """The later rounds' TTFT p90 of a server's pairs over the reference's beside them."""
    served = later_rounds_p90([p.server for p in pairs])
    alone = later_rounds_p90([p.alone for p in pairs])
    return served / alone if served is not None and alone else None
