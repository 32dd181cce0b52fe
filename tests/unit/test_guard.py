"""The connector's hook guard: a failure becomes the fallback, a profiled hook is a range, and
each hook's time reaches vLLM's metrics."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvtier_vllm.kv.connector_stats import KVTierPromMetrics, KVTierStats, take_report
from kvtier_vllm.shared import guard
from kvtier_vllm.shared.guard import contained, failures
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
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


def test_each_hooks_time_is_added_up_failures_included() -> None:
    guard.seconds.clear()

    def slow() -> int:
        time.sleep(0.02)
        return 1

    def slow_failure() -> int:
        time.sleep(0.03)
        raise RuntimeError("boom")

    started = time.perf_counter()
    contained("timed_hook", slow, lambda: 0)
    contained("timed_hook", slow, lambda: 0)
    contained("failing_hook", slow_failure, lambda: 0)
    elapsed = time.perf_counter() - started
    assert 0.04 <= guard.seconds["timed_hook"] < elapsed
    assert 0.03 <= guard.seconds["failing_hook"] < elapsed


def nothing_due() -> None:
    """No hook seconds waiting, no report due, and the interval restarted now. A take with
    nothing to take changes neither its clock nor a report left due by an earlier test."""
    contained("reset", lambda: 1, lambda: 0)
    guard.take_seconds(due=True)


def test_hook_seconds_are_taken_when_due_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing_due()
    contained("timed_hook", lambda: 1, lambda: 0)
    monkeypatch.setattr(guard, "REPORT_INTERVAL_S", 3600.0)
    assert guard.take_seconds() == {}  # not due: they wait
    taken = guard.take_seconds(due=True)
    assert set(taken) == {"timed_hook"}
    assert taken["timed_hook"] > 0
    assert guard.take_seconds(due=True) == {}  # taken once
    contained("timed_hook", lambda: 1, lambda: 0)
    monkeypatch.setattr(guard, "REPORT_INTERVAL_S", 0.0)
    assert set(guard.take_seconds()) == {"timed_hook"}  # the interval passed


def test_a_finished_request_makes_the_next_take_due(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing_due()
    monkeypatch.setattr(guard, "REPORT_INTERVAL_S", 3600.0)
    contained("build_connector_meta", lambda: 1, lambda: 0)
    assert take_report(KVTierStats())[0] is None  # no news, the interval has not passed
    guard.report_with_next_stats()
    reported, _ = take_report(KVTierStats())
    assert reported is not None
    assert reported.data["hook|build_connector_meta"] > 0
    contained("build_connector_meta", lambda: 1, lambda: 0)
    assert take_report(KVTierStats())[0] is None  # due once, for the take that followed


def test_a_side_reports_hook_seconds_alone_only_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing_due()
    monkeypatch.setattr(guard, "REPORT_INTERVAL_S", 3600.0)
    contained("wait_for_save", lambda: 1, lambda: 0)
    reported, fresh = take_report(KVTierStats())
    assert reported is None
    assert fresh.is_empty()
    news = KVTierStats()
    news.record("store", "target", 1024, 0.001, True)
    reported, fresh = take_report(news)
    assert reported is news
    assert fresh is not news
    assert fresh.is_empty()
    assert reported.data["hook|wait_for_save"] > 0  # rides on the news


def test_hook_seconds_reach_vllms_metrics() -> None:
    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["e"], {0: ["0"]})
    for spent in (0.25, 0.5):
        stats = KVTierStats()
        stats.hooks({"build_connector_meta": spent, "start_load_kv": 0.125})
        prom.observe(stats.data)
    name = "vllm:kvtier_hook_seconds_total"
    assert registry.get_sample_value(name, {"e": "0", "hook": "build_connector_meta"}) == 0.75
    assert registry.get_sample_value(name, {"e": "0", "hook": "start_load_kv"}) == 0.25
