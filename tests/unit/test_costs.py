"""Decaying cost estimates: they converge on what is observed, follow a change within a few dozen
observations, keep a spread that tells steady from noisy, and compose the object tier's load."""

from __future__ import annotations

import math

import pytest
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.kv.worker_side.load_times import RequestLoads

from kvtier.core.costs import (
    HALF_LIFE,
    CostSnapshot,
    EngineTimings,
    Estimate,
    LoadCosts,
    StepFit,
    Tally,
)


def test_a_steady_value_is_its_mean_with_no_spread() -> None:
    e = Estimate()
    for _ in range(10):
        e.observe(0.25)
    assert e.mean == pytest.approx(0.25)
    assert e.spread == pytest.approx(0.0, abs=1e-12)
    assert e.samples == 10


def test_the_spread_is_the_standard_deviation_of_what_was_seen() -> None:
    e = Estimate()
    for i in range(2000):
        e.observe(1.0 if i % 2 else 3.0)
    assert e.mean == pytest.approx(2.0, rel=0.05)
    assert e.spread == pytest.approx(1.0, rel=0.05)


def test_a_change_shows_after_a_few_half_lives() -> None:
    e = Estimate()
    for _ in range(500):
        e.observe(1.0)
    for _ in range(int(4 * HALF_LIFE)):
        e.observe(2.0)
    assert 1.9 < e.mean < 2.0  # weight left on the old value: 2^-4


def test_weights_count_and_nonsense_is_ignored() -> None:
    e = Estimate()
    e.observe(1.0, weight=3)
    e.observe(4.0, weight=1)
    assert e.mean == pytest.approx((3 * 1 + 4) / 4, rel=0.02)
    before = (e.mean, e.samples)
    e.observe(math.nan)
    e.observe(5.0, weight=0)
    assert (e.mean, e.samples) == before


def test_an_object_load_is_its_download_then_its_load_from_lmdb() -> None:
    costs = LoadCosts()
    timings = EngineTimings()
    timings.loaded("cpu", 4, 4 << 20, 0.004)
    timings.loaded("lmdb", 2, 2 << 20, 0.010)
    timings.prefill_tokens, timings.prefill_seconds = 1000, 0.5
    costs.reported(timings)
    costs.loaded("object", 8, 8 << 20, 0.8)
    snap = costs.snapshot()
    assert snap.load_seconds("cpu", 10) == pytest.approx(0.010)
    assert snap.load_seconds("lmdb", 10) == pytest.approx(0.050)
    assert snap.load_seconds("object", 10) == pytest.approx(1.0 + 0.050)
    assert snap.recompute_seconds(64) == pytest.approx(0.032)
    assert snap.tiers["cpu"].seconds_per_byte == pytest.approx(0.001 / (1 << 20))


def test_nothing_measured_answers_none_rather_than_free() -> None:
    snap: CostSnapshot = LoadCosts().snapshot()
    assert snap.load_seconds("cpu", 4) is None
    assert snap.recompute_seconds(64) is None
    costs = LoadCosts()
    costs.loaded("object", 1, 1, 0.1)  # downloads timed, loads from lmdb not yet
    assert costs.snapshot().load_seconds("object", 1) is None


def test_totals_keep_everything_the_estimates_let_decay() -> None:
    costs = LoadCosts()
    for seconds in (0.1,) * 500 + (0.3,) * 500:  # ages past the half-life
        costs.loaded("lmdb", 2, 2 << 20, seconds)
        costs.prefilled(100, seconds)
    totals = costs.totals()
    assert totals.loads["lmdb"].chunks == 2000
    assert totals.loads["lmdb"].seconds / totals.loads["lmdb"].chunks == pytest.approx(0.1)
    assert totals.prefill_seconds / totals.prefill_tokens == pytest.approx(0.002)
    assert costs.snapshot().prefill_seconds_per_token == pytest.approx(0.003, rel=0.01)
    assert totals.loads["object"].chunks == 0
    costs.loaded("lmdb", 1, 1, 1.0)
    assert totals.loads["lmdb"].chunks == 2000, "a copy, not a view of what goes on"


def steps(*lengths: int, per_step: float = 0.02, per_token: float = 1e-3) -> EngineTimings:
    timings = EngineTimings()
    for n in lengths:
        timings.prefilled(n, per_step + per_token * n)
    return timings


def test_prefill_steps_are_fitted_as_a_fixed_part_and_a_part_per_token() -> None:
    costs = LoadCosts()
    costs.reported(steps(800, 64, 96, 800, 160))
    snap = costs.snapshot()
    assert snap.prefill_fit == StepFit(pytest.approx(0.02), pytest.approx(1e-3))
    # a hit saves the tokens' part only; the mean per token counts the fixed part too
    assert snap.recompute_seconds(100) == pytest.approx(0.1)
    assert snap.prefill_seconds_per_token > 1e-3


def test_steps_of_one_length_fit_nothing_and_the_mean_stands() -> None:
    costs = LoadCosts()
    costs.reported(steps(512, 512, 512))
    snap = costs.snapshot()
    assert snap.prefill_fit is None
    assert snap.recompute_seconds(100) == pytest.approx(100 * (0.02 + 0.512) / 512)


def test_a_fixed_part_below_zero_is_noise_and_fits_through_the_origin() -> None:
    costs = LoadCosts()
    costs.reported(steps(100, 1000, per_step=0.0, per_token=1e-3))
    noisy = EngineTimings()
    noisy.prefilled(100, 0.05)  # short steps quicker than their share: the line would cross 0
    noisy.prefilled(1000, 1.0)
    costs.reported(noisy)
    fit = costs.snapshot().prefill_fit
    assert fit is not None
    assert fit.per_step == 0.0
    assert 0.9e-3 < fit.per_token < 1e-3


def test_the_fit_follows_the_last_steps() -> None:
    costs = LoadCosts()
    costs.reported(steps(*[64, 800] * 500, per_token=1e-3))
    costs.reported(steps(*[64, 800] * int(4 * HALF_LIFE), per_token=2e-3))  # the engine slowed
    fit = costs.snapshot().prefill_fit
    assert fit is not None
    assert 1.9e-3 < fit.per_token <= 2e-3


def test_loads_are_fitted_as_a_fixed_part_and_a_part_per_chunk() -> None:
    """An object's first byte is paid once a load: 3 chunks cost it plus 3 x the chunk's part,
    not 3 x a mean that spreads the first byte over whatever lengths were timed."""
    costs = LoadCosts()
    for chunks in (1, 8, 2, 16, 4) * 4:
        costs.loaded("object", chunks, chunks << 20, 0.030 + 0.0091 * chunks)
    timings = EngineTimings()
    for _ in range(3):
        timings.loaded("lmdb", 1, 1 << 20, 0.0064)
    costs.reported(timings)
    snap = costs.snapshot()
    fit = snap.tiers["object"].load_fit
    assert fit is not None
    assert (fit.per_load, fit.per_chunk) == (pytest.approx(0.030), pytest.approx(0.0091))
    assert snap.load_seconds("object", 3) == pytest.approx(0.030 + 3 * 0.0091 + 3 * 0.0064)
    assert snap.tiers["lmdb"].load_fit is None, "loads of one length: the mean per chunk"


def test_an_engines_summed_loads_are_fitted_load_by_load() -> None:
    """Loads summed in one report (the workers' reports merged before a heartbeat) fit their
    fixed part: the report counts the loads, not one load of all their chunks."""
    costs = LoadCosts()
    timings = EngineTimings()
    for chunks in (1, 6, 3):
        timings.loaded("lmdb", chunks, chunks << 20, 0.002 + 0.005 * chunks)
    merged = EngineTimings()
    merged.merge(timings)
    costs.reported(merged)
    fit = costs.snapshot().tiers["lmdb"].load_fit
    assert fit is not None
    assert (fit.per_load, fit.per_chunk) == (pytest.approx(0.002), pytest.approx(0.005))


def test_a_report_without_load_counts_feeds_only_the_mean() -> None:
    """An engine of an older build sends sums without their count: no fit is made of them."""
    costs = LoadCosts()
    costs.reported(EngineTimings({"lmdb": Tally(chunks=10, nbytes=10, seconds=0.05)}))
    costs.reported(EngineTimings({"lmdb": Tally(chunks=2, nbytes=2, seconds=0.03)}))
    tier = costs.snapshot().tiers["lmdb"]
    assert tier.load_fit is None
    assert tier.samples == 2


def test_requests_loads_as_the_worker_reports_them_fit_both_parts_of_every_tier() -> None:
    """The worker sums each request's chunks of one tier into one load (lmdb's read-ahead,
    done once for a batch, shared among its lmdb loads): from such reports the fit recovers
    a known fixed part and part per chunk for the arena and for lmdb."""
    costs = LoadCosts()
    fixed = {"cpu": 0.0004, "lmdb": 0.003}
    per_chunk = {"cpu": 0.0002, "lmdb": 0.0015}
    for sizes in ((1, 4), (2, 7), (3, 1)):
        timings = EngineTimings()
        loads = RequestLoads({"lmdb": fixed["lmdb"] * len(sizes)})
        for request, chunks in enumerate(sizes):
            for i in range(chunks):
                for tier, key in (("cpu", b""), ("lmdb", b"k")):
                    copy = ChunkCopy("target", i, 0, 1, (i + 1,), request=str(request), key=key)
                    first = fixed[tier] if i == 0 and tier == "cpu" else 0.0
                    loads.add(copy, 1 << 20, first + per_chunk[tier])
        loads.report(timings)
        costs.reported(timings)
    for tier in ("cpu", "lmdb"):
        fit = costs.snapshot().tiers[tier].load_fit
        assert fit is not None, tier
        assert (fit.per_load, fit.per_chunk) == (
            pytest.approx(fixed[tier]),
            pytest.approx(per_chunk[tier]),
        )
