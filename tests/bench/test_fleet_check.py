"""The real fleet check's arithmetic: what its calibrations make of the TTFTs they measure."""

from __future__ import annotations

import pytest

from benchmarks.fleet_check import Calibration, EngineCalibration
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
