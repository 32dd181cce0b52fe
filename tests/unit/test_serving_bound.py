"""The GPU-ratio benchmark's throughput bound: vLLM alone's level less the prefill of the
tokens kvtier found cached, plus their load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.serving_gpu_ratio import throughput_bound

MEASURED = {"prefill": {"prefill_s_per_token": 50e-6}, "loads": {"arena_s_per_token": 5e-6}}


def test_the_bound_takes_the_hits_prefill_out_and_their_load_in() -> None:
    alone = SimpleNamespace(duration_s=10.0, cached_tokens=2_000)
    served = SimpleNamespace(duration_s=8.0, cached_tokens=42_000)
    # 40,000 tokens kvtier served that vLLM alone computed: 2.0 s of prefill, 0.2 s of load
    assert throughput_bound(alone, served, MEASURED) == pytest.approx(10.0 / 8.2)


def test_no_bound_without_the_costs_or_the_cached_tokens() -> None:
    alone = SimpleNamespace(duration_s=10.0, cached_tokens=0)
    served = SimpleNamespace(duration_s=8.0, cached_tokens=None)
    assert throughput_bound(alone, served, MEASURED) is None
    assert throughput_bound(alone, SimpleNamespace(cached_tokens=1), {}) is None
