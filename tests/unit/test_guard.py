"""The connector's hook guard: a failure becomes the fallback, and a profiled hook is a range."""

from __future__ import annotations

import torch
from kvtier_vllm.guard import contained, failures
from torch.profiler import ProfilerActivity, profile


def test_a_hook_that_raises_returns_its_fallback_and_is_counted() -> None:
    before = failures["test_hook"]

    def broken() -> int:
        raise RuntimeError("boom")

    assert contained("test_hook", broken, lambda: 7) == 7
    assert contained("test_hook", lambda: 3, lambda: 7) == 3
    assert failures["test_hook"] == before + 1


def test_a_hook_run_under_torchs_profiler_is_a_kvtier_range() -> None:
    assert contained("unprofiled", lambda: 1, lambda: 0) == 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert contained("start_load_kv", lambda: torch.ones(4).sum().item(), lambda: 0) == 4
    names = {event.name for event in prof.events()}
    assert "kvtier:start_load_kv" in names
    assert "kvtier:unprofiled" not in names
