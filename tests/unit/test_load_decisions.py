"""The connector's load decisions: the policy decides per lookup, each run's decision and what
it saves are counted and reach vLLM's /metrics."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.kv.connector_stats import KVTierPromMetrics, KVTierStats
from kvtier_vllm.kv.scheduler_side.load_chooser import tier_runs
from kvtier_vllm.kv.scheduler_side.load_decisions import REMEASURE_EVERY, LoadDecisions
from kvtier_vllm.shared.settings import LoadPolicy, parse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.core.costs import CostSnapshot, LoadFit, StepFit, TierCost
from kvtier.core.protocol import TierCode

TOKENS = 256
PER_TOKEN = 8.3e-3 / TOKENS
# a GPU node's costs (benchmarks/fleet_costs.py): the arena is cheap, the object store is not
GPU = CostSnapshot(
    {
        "cpu": TierCost(0.52e-3, 0, 0, 0, 9, LoadFit(0.0, 0.52e-3)),
        "lmdb": TierCost(6.4e-3, 0, 0, 0, 9, LoadFit(0.0, 6.4e-3)),
        "object": TierCost(9.1e-3, 0, 0, 0, 9, LoadFit(30e-3, 9.1e-3)),
    },
    PER_TOKEN,
    0.0,
    9,
    StepFit(0.01, PER_TOKEN),
)
MIXED = [("cpu", 3), ("object", 1), ("cpu", 1)]


def decided(decisions: LoadDecisions, runs: list[tuple[str, int]]) -> int:
    """The tokens ``decisions`` loads of the hit ``runs``, its choice counted as final."""
    choice = decisions.choose(runs, TOKENS)
    decisions.count(choice)
    return choice.tokens


def test_measured_is_the_default_and_always_loads_every_hit_unchanged() -> None:
    assert parse({}).load_policy is LoadPolicy.MEASURED
    always = LoadDecisions(parse({"load_policy": "always"}).load_policy, lambda: GPU)
    assert decided(always, MIXED) == 5 * TOKENS
    stats = KVTierStats()
    always.report(stats)
    assert stats.is_empty(), "always decides nothing: nothing is counted"


def test_measured_loads_the_prefix_that_beats_recomputing_and_counts_each_run() -> None:
    measured = LoadDecisions(LoadPolicy.MEASURED, lambda: GPU)
    assert decided(measured, MIXED) == 3 * TOKENS
    stats = KVTierStats()
    measured.report(stats)
    assert stats.data["decided|cpu|load"] == 1
    assert stats.data["decided|object|recompute"] == 1
    assert stats.data["decided|cpu|recompute"] == 1
    loaded = 3 * (8.3e-3 - 0.52e-3)
    assert stats.data["saved|load"] == pytest.approx(loaded)
    # the object run's load less its recompute, less what the arena chunk after it saves
    recomputed = (30e-3 + 9.1e-3 + 6.4e-3 - 8.3e-3) - (8.3e-3 - 0.52e-3)
    assert stats.data["saved|recompute"] == pytest.approx(recomputed)
    again = KVTierStats()
    measured.report(again)
    assert again.is_empty(), "counted once"


def test_without_costs_measured_loads_every_hit_and_saves_nothing_counted() -> None:
    measured = LoadDecisions(LoadPolicy.MEASURED, lambda: None)
    assert decided(measured, MIXED) == 5 * TOKENS
    stats = KVTierStats()
    measured.report(stats)
    assert stats.data == {"decided|cpu|load": 2, "decided|object|load": 1}


def test_tier_runs_group_a_hits_codes_in_prefix_order() -> None:
    cpu, lmdb, obj = int(TierCode.CPU), int(TierCode.LMDB), int(TierCode.OBJECT)
    assert tier_runs(bytes([cpu, cpu, obj, lmdb, lmdb, cpu])) == [
        ("cpu", 2),
        ("object", 1),
        ("lmdb", 2),
        ("cpu", 1),
    ]
    assert tier_runs(b"") == []


def test_decisions_reach_vllms_metrics() -> None:
    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["e"], {0: ["0"]})
    measured = LoadDecisions(LoadPolicy.MEASURED, lambda: GPU)
    for _ in range(2):
        decided(measured, MIXED)
        stats = KVTierStats()
        measured.report(stats)
        prom.observe(stats.data)
    decisions = "vllm:kvtier_load_decisions_total"
    labels = {"e": "0", "tier": "object", "decision": "recompute"}
    assert registry.get_sample_value(decisions, labels) == 2
    assert registry.get_sample_value(decisions, {**labels, "tier": "cpu", "decision": "load"}) == 2
    saved = registry.get_sample_value(
        "vllm:kvtier_load_decision_saved_seconds_total", {"e": "0", "decision": "load"}
    )
    assert saved == pytest.approx(2 * 3 * (8.3e-3 - 0.52e-3))


def test_a_hit_cut_short_is_loaded_whole_now_and_then_to_be_measured_again() -> None:
    """A tier's cost is measured on its loads: were a slow one never loaded again, it could
    never show that it sped up. One cut hit in REMEASURE_EVERY loads whole."""
    measured = LoadDecisions(LoadPolicy.MEASURED, lambda: GPU)
    loaded = [decided(measured, MIXED) for _ in range(2 * REMEASURE_EVERY)]
    whole = [i for i, tokens in enumerate(loaded) if tokens == 5 * TOKENS]
    assert whole == [REMEASURE_EVERY - 1, 2 * REMEASURE_EVERY - 1]
    assert set(loaded) == {3 * TOKENS, 5 * TOKENS}
    stats = KVTierStats()
    measured.report(stats)
    assert stats.data["decided|object|load"] == 2
    assert stats.data["decided|object|recompute"] == 2 * REMEASURE_EVERY - 2
    for _ in range(REMEASURE_EVERY - 1):  # whole anyway: not counted toward the next
        assert decided(measured, [("cpu", 4)]) == 4 * TOKENS
    later = [decided(measured, MIXED) for _ in range(REMEASURE_EVERY)]
    assert later[-1] == 5 * TOKENS
    assert set(later[:-1]) == {3 * TOKENS}
