"""How long a request with a hit waited for its first load, in the scheduler's stats and in
vLLM's /metrics as ``vllm:kvtier_load_wait_seconds``: over real embedded tiers with no engine."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.kv.connector_stats import KVTierPromMetrics, KVTierStats
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.unit.test_scheduler_lookups import (
    CHUNK_TOKENS,
    chunk_keys,
    open_scheduler,
    request,
    step,
    store,
)

WAITED_S = 0.2
"""How long before its grant each request first asked (set on its state, not slept)."""


def asked_and_granted(scheduler: KVTierScheduler, req_id: str) -> Any:
    """``req_id`` asks, finds a stored hit of two chunks, first asked WAITED_S ago, and vLLM
    grants and schedules it."""
    req = request(req_id, 3)
    store(scheduler, chunk_keys(scheduler, req, range(2)))
    tokens, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert tokens == 2 * CHUNK_TOKENS
    state = scheduler.state(req)
    assert state.asked_at is not None
    state.asked_at -= WAITED_S
    blocks = list(range(1, len(req.block_hashes) + 1))
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [blocks]), tokens)
    new = SimpleNamespace(req_id=req_id, block_ids=[blocks], num_computed_tokens=0)
    scheduler.build_connector_meta(step([new], {req_id: 1}))
    return req


def waits(scheduler: KVTierScheduler) -> list[float]:
    stats = scheduler.take_stats()
    data = stats.data if stats is not None else {}
    return sorted(v for k, v in data.items() if k.startswith("load_wait|"))


@pytest.fixture
def opened(shm_path: Path, tmp_path: Path) -> Any:
    made: list[KVTierScheduler] = []

    def make(**settings: Any) -> KVTierScheduler:
        made.append(open_scheduler(shm_path, tmp_path, **settings))
        return made[-1]

    yield make
    for s in made:
        s.shutdown()


def test_an_async_load_waits_from_the_first_ask_until_the_workers_report_it(opened: Any) -> None:
    scheduler = opened()
    asked_and_granted(scheduler, "a")
    asked_and_granted(scheduler, "b")
    assert waits(scheduler) == []  # out with the workers: nothing landed yet
    scheduler.update_connector_output(None, ["b"], (), ["a", "b"])  # b's load failed
    [waited] = waits(scheduler)
    assert WAITED_S <= waited < 60
    scheduler.update_connector_output(None, (), (), ["a"])  # a second report counts nothing
    assert waits(scheduler) == []


def test_a_sync_load_waits_until_the_step_that_schedules_it(opened: Any) -> None:
    scheduler = opened(load_mode="sync")
    req = asked_and_granted(scheduler, "a")
    [waited] = waits(scheduler)
    assert WAITED_S <= waited < 60
    scheduler.get_num_new_matched_tokens(req, 0)  # asked again (preempted): not its first load
    assert waits(scheduler) == []


def test_a_request_finished_before_its_load_landed_counts_no_wait(opened: Any) -> None:
    scheduler = opened()
    req = asked_and_granted(scheduler, "a")
    scheduler.request_finished(req)
    scheduler.update_connector_output(None, (), (), ["a"])
    assert waits(scheduler) == []


def test_each_wait_is_observed_exactly_in_vllms_histogram() -> None:
    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["e"], {0: ["0"]})
    stats = KVTierStats()
    for seconds in (0.003, 0.04, 0.04):  # one step's waits, each kept apart
        stats.load_waited(seconds)
    prom.observe(stats.data)
    prom.observe(KVTierStats(data={"load_wait|0": 2.0}).data)  # the next step's

    def sample(suffix: str, **labels: str) -> float | None:
        name = f"vllm:kvtier_load_wait_seconds_{suffix}"
        return registry.get_sample_value(name, {"e": "0", **labels})

    assert sample("count") == 4
    assert sample("sum") == pytest.approx(0.003 + 0.04 + 0.04 + 2.0)
    assert sample("bucket", le="0.005") == 1
    assert sample("bucket", le="0.05") == 3
    assert sample("bucket", le="2.5") == 4
