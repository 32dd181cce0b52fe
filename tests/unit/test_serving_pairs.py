"""The GPU-ratio benchmark's paired levels: each of a server's levels runs beside one of vLLM
alone's on the same prompts, prompts no other pair used, in an order swapped from pair to pair,
each server warmed by its first level; the figures come from the pairs (their throughput ratios,
and the later rounds' TTFT p90 pooled on each side)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.serving_cases import HEADLINE_CONCURRENCY, WARMUP
from benchmarks.serving_figures import Pair
from benchmarks.serving_pairs import (
    FIRST_INDEX,
    PairedLevels,
    hit_ttft_ratio,
    later_rounds_p90,
    pair_ratios,
)


def level(tps: float, ttfts: list[float] = (), ok: int = 4) -> Any:  # type: ignore[assignment]
    """A level as the figures read it: its throughput, whole or not, and its requests' rounds
    and TTFTs (the first one of round 0: a cold prefill)."""
    records = [SimpleNamespace(ok=True, round=0, ttft_s=9.0)]
    records += [SimpleNamespace(ok=True, round=1, ttft_s=t) for t in ttfts]
    return SimpleNamespace(output_tps=tps, ok=ok, requests=4, records=records)


def test_each_level_runs_beside_the_references_on_prompts_of_its_own_in_swapped_order() -> None:
    calls: list[tuple[str, int, int, int]] = []

    def run(server: Any, url: Any, spec: Any, c: int, n: int, index: int, warmup: int) -> Any:
        assert (c, n) == (HEADLINE_CONCURRENCY, 128)
        calls.append((server.name, index, warmup, len(calls)))
        return level(100.0 if server.name == "alone" else 150.0)

    cpu = iter(range(100))
    quiet = iter(range(100))
    pairs = PairedLevels(run, lambda: "spec", 128, 3, lambda: float(next(quiet)))
    alone, first, second = (SimpleNamespace(name=n) for n in ("alone", "first", "second"))
    got = list(pairs.run((first, "m1"), (alone, None), lambda: float(next(cpu))))
    got += list(pairs.run((second, "m2"), (alone, None), lambda: float(next(cpu))))
    order = [(name, index, warmup) for name, index, warmup, _ in calls]
    i = FIRST_INDEX
    assert order == [
        ("first", i, WARMUP), ("alone", i, WARMUP),
        ("alone", i + 1, 0), ("first", i + 1, 0),
        ("first", i + 2, 0), ("alone", i + 2, 0),
        ("second", i + 3, WARMUP), ("alone", i + 3, 0),
        ("alone", i + 4, 0), ("second", i + 4, 0),
        ("second", i + 5, 0), ("alone", i + 5, 0),
    ]  # fmt: skip
    assert [p.ratio for p in got] == [1.5] * 6
    assert all(p.cpu_s == 1.0 for p in got), "kvtierd's CPU over the server's own level"
    assert next(quiet) == len(calls), "each level waited for a quiet machine"


def test_a_servers_figure_is_the_mean_of_its_pairs_that_ran_whole() -> None:
    pairs = [
        Pair(level(120.0), level(100.0), 0.0),
        Pair(level(90.0), level(60.0), 0.0),
        Pair(level(500.0, ok=3), level(100.0), 0.0),  # a request failed: left out
    ]
    found = pair_ratios(pairs)
    assert found.values == [1.2, 1.5]
    assert found.mean == pytest.approx(1.35)
    assert found.se == pytest.approx(0.15)


def test_a_hits_ttft_is_the_later_rounds_p90_pooled_over_each_side() -> None:
    served = [level(1.0, [0.1] * 9 + [0.5]), level(1.0, [0.2] * 10)]
    alone = [level(1.0, [0.4] * 20)]
    assert later_rounds_p90(served) == 0.2, "18 of 20 at or below it; the first rounds left out"
    pairs = [Pair(served[0], alone[0], 0.0), Pair(served[1], alone[0], 0.0)]
    assert hit_ttft_ratio(pairs) == pytest.approx(0.5)
    assert hit_ttft_ratio([]) is None
