"""Load or recompute: the prefix of a hit worth loading falls each way on the costs fed to it.
Costs are those of a GPU node (benchmarks/fleet_costs.py): a 256-token chunk costs 8.3 ms to
recompute, 0.52 ms from the arena, 6.4 ms from lmdb, 9.1 ms and a 30 ms first byte from the
object store (then its load from lmdb)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.core.costs import CostSnapshot, EngineTimings, LoadCosts, LoadFit, StepFit, TierCost
from kvtier.core.load_choice import CostChooser, RunChoice, choose

TOKENS = 256
PER_TOKEN = 8.3e-3 / TOKENS


def tier(per_chunk: float, first_byte: float = 0.0) -> TierCost:
    return TierCost(per_chunk, 0.0, 0.0, 0.0, 100, LoadFit(first_byte, per_chunk))


GPU = CostSnapshot(
    {"cpu": tier(0.52e-3), "lmdb": tier(6.4e-3), "object": tier(9.1e-3, 30e-3)},
    PER_TOKEN,
    0.0,
    100,
    StepFit(0.01, PER_TOKEN),
)


def test_a_cheap_tier_is_loaded() -> None:
    choice = choose([("cpu", 4), ("lmdb", 2)], TOKENS, GPU)
    assert choice.tokens == 6 * TOKENS
    assert [run.load for run in choice.runs] == [True, True]
    assert choice.runs[0].seconds_saved == pytest.approx(4 * (8.3e-3 - 0.52e-3))
    assert choice.measured


def test_a_short_run_from_the_object_store_is_recomputed() -> None:
    choice = choose([("object", 1)], TOKENS, GPU)
    assert choice.tokens == 0
    (run,) = choice.runs
    assert not run.load
    # its first byte, its download and its load from lmdb, less its recompute
    assert run.seconds_saved == pytest.approx(30e-3 + 9.1e-3 + 6.4e-3 - 8.3e-3)


def test_the_first_byte_is_paid_once_a_run() -> None:
    """A store with quick chunks behind a slow first byte: a long run is worth its first
    byte, a short one is not."""
    store = replace(GPU, tiers={**GPU.tiers, "object": tier(1e-3, 30e-3), "lmdb": tier(1e-3)})
    assert choose([("object", 2)], TOKENS, store).tokens == 0
    assert choose([("object", 10)], TOKENS, store).tokens == 10 * TOKENS


def test_mixed_runs_load_the_prefix_that_saves_the_most() -> None:
    """A slow run in the middle: the arena's chunks before it are loaded, the rest recomputed
    (loading past it would cost more than the one arena chunk after it saves)."""
    choice = choose([("cpu", 3), ("object", 1), ("cpu", 1)], TOKENS, GPU)
    assert choice.tokens == 3 * TOKENS
    assert [run.load for run in choice.runs] == [True, False, False]
    saved_by_recomputing = sum(r.seconds_saved or 0.0 for r in choice.runs if not r.load)
    assert saved_by_recomputing > 0
    # a long arena run after the slow one outweighs it: the whole hit
    assert choose([("cpu", 3), ("object", 1), ("cpu", 8)], TOKENS, GPU).tokens == 12 * TOKENS


def test_without_measured_costs_the_whole_hit_is_loaded() -> None:
    runs = [("cpu", 2), ("object", 1)]
    unmeasured = replace(GPU, tiers={"cpu": GPU.tiers["cpu"]})  # no object load timed yet
    for costs in (None, replace(GPU, prefill_fit=None), unmeasured, LoadCosts().snapshot()):
        choice = choose(runs, TOKENS, costs)
        assert choice.tokens == 3 * TOKENS
        assert choice.runs == (RunChoice("cpu", 2, True, None), RunChoice("object", 1, True, None))
        assert not choice.measured


def test_the_chooser_asks_for_the_costs_at_each_choice() -> None:
    known: list[CostSnapshot | None] = [None]
    chooser = CostChooser(lambda: known[0])
    assert chooser.tokens_to_load([("object", 1)], TOKENS) == TOKENS
    known[0] = GPU  # a heartbeat brought kvtierd's costs
    assert chooser.tokens_to_load([("object", 1)], TOKENS) == 0
    assert chooser.tokens_to_load([], TOKENS) == 0


def test_costs_timed_as_kvtierd_and_the_engines_time_them_decide() -> None:
    """From loads and prefill steps as they are timed: the fit's first byte is what makes a
    short object run not worth loading and a long one worth it (the mean per chunk of the
    same loads would price both alike)."""
    costs = LoadCosts()
    engine = EngineTimings()
    for chunks, tokens in [(1, 256), (8, 2048), (2, 512), (16, 4096)] * 4:
        costs.loaded("object", chunks, chunks << 20, 0.030 + 0.0011 * chunks)
        engine.loaded("lmdb", 1, 1 << 20, 0.0011)
        engine.prefilled(tokens, 0.01 + PER_TOKEN * tokens)
    costs.reported(engine)
    snap = costs.snapshot()
    assert choose([("object", 2)], TOKENS, snap).tokens == 0
    assert choose([("object", 12)], TOKENS, snap).tokens == 12 * TOKENS


def test_the_step_a_load_in_the_background_waits_counts_against_it() -> None:
    """A request loading in the background waits a step (20 ms here) that one recomputing
    runs through: 4 lmdb chunks save 7.6 ms, less than that step, and are recomputed; loaded
    in their step (no wait) they are loaded. The arena's chunks save more than the step."""

    def in_background(load_s: float) -> float:
        return 20e-3

    lmdb = choose([("lmdb", 4)], TOKENS, GPU, wait_s=in_background)
    assert lmdb.tokens == 0
    (run,) = lmdb.runs
    assert run.seconds_saved == pytest.approx(20e-3 - 4 * (8.3e-3 - 6.4e-3))
    assert choose([("lmdb", 4)], TOKENS, GPU, wait_s=lambda load_s: 0.0).tokens == 4 * TOKENS
    assert choose([("cpu", 4)], TOKENS, GPU, wait_s=in_background).tokens == 4 * TOKENS


def test_the_wait_is_priced_at_the_prefixs_own_load() -> None:
    """Where a longer prefix would load in the background and a shorter one in its step, the
    shorter one is loaded when the step's wait eats the longer one's extra saving."""
    asked: list[float] = []

    def background_past_2ms(load_s: float) -> float:
        asked.append(load_s)
        return 0.0 if load_s <= 2e-3 else 50e-3

    choice = choose([("cpu", 3), ("lmdb", 4)], TOKENS, GPU, wait_s=background_past_2ms)
    assert choice.tokens == 3 * TOKENS
    assert [run.load for run in choice.runs] == [True, False]
    assert asked[0] == pytest.approx(3 * 0.52e-3)
    assert asked[1] == pytest.approx(3 * 0.52e-3 + 4 * 6.4e-3)
