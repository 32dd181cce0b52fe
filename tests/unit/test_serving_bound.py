"""The GPU-ratio benchmark's throughput bound (vLLM alone's level less the prefill of the
tokens kvtier found cached, plus their load) and kvtierd's CPU share of a level."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.serving_cases import LMDB_BACKED
from benchmarks.serving_figures import Outcome
from benchmarks.serving_gpu_ratio import throughput_bound

MEASURED = {"prefill": {"prefill_s_per_token": 50e-6}, "loads": {"arena_s_per_token": 5e-6}}


def level(duration_s: float, **cached_by_source: int) -> SimpleNamespace:
    """A level as the bound reads it: its wall time and the prompt tokens served cached, by
    source, from the server's /metrics."""
    server = SimpleNamespace(cached_tokens_by_source=cached_by_source)
    return SimpleNamespace(duration_s=duration_s, server=server)


def test_the_bound_takes_the_hits_prefill_out_and_their_load_in() -> None:
    alone = level(10.0, local_cache_hit=2_000)
    served = level(8.0, local_cache_hit=2_000, external_kv_transfer=40_000)
    # 40,000 tokens kvtier served that vLLM alone computed: 2.0 s of prefill, 0.2 s of load
    assert throughput_bound(alone, served, MEASURED) == pytest.approx(10.0 / 8.2)


def test_no_bound_without_the_costs_or_the_cached_tokens() -> None:
    alone = level(10.0)
    assert throughput_bound(alone, level(8.0), MEASURED) is None  # the server counted none
    assert throughput_bound(alone, level(8.0, local_cache_hit=1), {}) is None


def test_kvtierds_cpu_share_is_its_cpu_time_over_the_level_at_that_concurrency() -> None:
    out = Outcome(LMDB_BACKED)
    out.multi_round = [
        SimpleNamespace(concurrency=1, duration_s=20.0),  # type: ignore[list-item]
        SimpleNamespace(concurrency=4, duration_s=10.0),  # type: ignore[list-item]
    ]
    out.daemon_cpu_s = [2.0, 3.5]
    assert out.daemon_cpu_share(4) == pytest.approx(0.35)
    assert out.daemon_cpu_share(1) == pytest.approx(0.1)
    assert out.daemon_cpu_share(8) is None  # no such level
    out.daemon_cpu_s = [float("nan"), float("nan")]  # a server without kvtierd
    assert out.daemon_cpu_share(4) is None
