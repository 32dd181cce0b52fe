"""The real fleet check's arithmetic: what its calibrations make of the TTFTs they measure."""

from __future__ import annotations

import pytest

from benchmarks.fleet_calibration import Calibration, EngineCalibration, Window
from kvtier.bench.client import RequestResult


def served(ttft: float, prompt: int, cached: int) -> RequestResult:
    result = RequestResult("calibration", 0, prompt, 10.0, prompt_tokens=prompt)
    result.chunk_times, result.cached_tokens = [10.0 + ttft], cached
    return result


def test_two_prompt_lengths_give_the_prefill_per_token_and_the_latency_past_it() -> None:
    held = Calibration.of([served(t, 768, 736) for t in (0.09, 0.08, 0.5)])  # one slow outlier
    fresh = Calibration.of([served(t, 768, 0) for t in (0.816, 0.9, 0.7)])
    assert (held.ttft_s, held.computed_tokens, held.cached_tokens) == pytest.approx((0.09, 32, 736))
    engine = EngineCalibration(held=held, fresh=fresh)
    assert engine.prefill_s_per_token == pytest.approx((0.816 - 0.09) / (768 - 32))
    assert engine.latency_s == pytest.approx(0.09 - 32 * engine.prefill_s_per_token)
    # a held prompt quicker than its prefill would take has no latency, not a negative one
    quick = Calibration(ttft_s=0.01, computed_tokens=32, cached_tokens=736)
    assert EngineCalibration(held=quick, fresh=fresh).latency_s == 0.0


def test_the_fresh_prompts_probe_is_not_their_prefill() -> None:
    held = Calibration(ttft_s=0.09, computed_tokens=32, cached_tokens=736)
    fresh = Calibration(ttft_s=0.816, computed_tokens=768, cached_tokens=0)
    engine = EngineCalibration(held=held, fresh=fresh, fresh_probe_s=0.05)
    assert engine.prefill_s_per_token == pytest.approx((0.816 - 0.05 - 0.09) / (768 - 32))


def test_a_window_is_the_increase_of_kvtierds_counters_over_both_nodes() -> None:
    def samples(chunks: float, seconds: float, misses: float) -> dict:
        return {
            ("kvtier_loaded_chunks_total", (("tier", "lmdb"),)): chunks,
            ("kvtier_load_seconds_total", (("tier", "lmdb"),)): seconds,
            ("kvtier_loaded_chunks_total", (("tier", "cpu"),)): 100.0,
            ("kvtier_load_seconds_total", (("tier", "cpu"),)): 1.0,
            ("kvtier_object_store_probe_misses_total", ()): misses,
            ("kvtier_object_store_probe_miss_seconds_total", ()): misses * 0.5,
        }

    # what came before the window (a calibration's loads) is not the window's
    window = Window(
        before=[samples(10, 10.0, 0), samples(0, 0.0, 4)],
        after=[samples(14, 10.4, 2), samples(6, 0.6, 4)],
    )
    assert window.increase("kvtier_loaded_chunks_total", tier="lmdb") == 10
    assert window.load_s_per_chunk("lmdb") == pytest.approx(0.1)
    assert window.load_s_per_chunk("cpu") == 0.0, "nothing loaded in it: no figure, not 0/0"
    assert window.probe_miss_s == pytest.approx(0.5)
