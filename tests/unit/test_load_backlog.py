"""Loads queued ahead count against loading a new hit: the worker issues asynchronous loads one
after another, so a hit granted behind several others waits for them, and one that saves less
than that wait is recomputed. The backlog's arithmetic, the choice it feeds, and a real
scheduler over embedded tiers (no engine) granting loads with costs fed to it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.kv.scheduler_side.load_backlog import LoadBacklog
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

from kvtier.core.costs import CostSnapshot, LoadFit, StepFit, TierCost
from kvtier.core.load_choice import choose
from tests.support import HandClock
from tests.unit.test_scheduler_lookups import (
    CHUNK_TOKENS,
    chunk_keys,
    open_scheduler,
    request,
    step,
    store,
)


def test_the_backlog_is_the_loads_out_less_the_time_the_thread_has_worked_on_them() -> None:
    clock = HandClock()
    backlog = LoadBacklog(clock)
    assert backlog.seconds_ahead() == 0.0
    backlog.granted("a", 0.3)
    clock.now += 0.1
    backlog.granted("b", 0.2)
    backlog.granted("c", None)  # no cost measured: nothing counted ahead
    assert backlog.seconds_ahead() == pytest.approx(0.5 - 0.1)
    backlog.landed(["a", "unknown"])
    assert backlog.seconds_ahead() == pytest.approx(0.2)  # b's, from its own grant
    clock.now += 1.0
    assert backlog.seconds_ahead() == 0.0  # overdue loads count as nothing, never less
    backlog.landed(["b", "c"])
    assert len(backlog) == 0


def cost(per_chunk: float) -> TierCost:
    return TierCost(per_chunk, 0.0, 0.0, 0.0, 9, LoadFit(0.0, per_chunk))


def costs(load_s: float, recompute_s: float, chunk_tokens: int) -> CostSnapshot:
    """A chunk loads from the arena in ``load_s`` and recomputes in ``recompute_s``."""
    per_token = recompute_s / chunk_tokens
    return CostSnapshot({"cpu": cost(load_s)}, per_token, 0.0, 9, StepFit(0.0, per_token))


def test_a_hit_saving_less_than_the_loads_ahead_of_it_is_recomputed() -> None:
    snapshot = costs(1e-3, 9e-3, 256)  # each chunk saves 8 ms
    assert choose([("cpu", 4)], 256, snapshot, ahead_s=0.0).tokens == 4 * 256
    assert choose([("cpu", 4)], 256, snapshot, ahead_s=0.031).tokens == 4 * 256
    behind = choose([("cpu", 4)], 256, snapshot, ahead_s=0.033)
    assert behind.tokens == 0
    assert behind.runs[0].seconds_saved == pytest.approx(0.033 - 4 * 8e-3)
    assert choose([("cpu", 5)], 256, snapshot, ahead_s=0.033).tokens == 5 * 256  # saves 40 ms


def granted(scheduler: KVTierScheduler, req_id: str) -> int:
    """``req_id``'s stored two-chunk hit asked for and, where it is loaded, granted and sent
    with a step (asynchronously: no step is timed); the tokens answered."""
    req = request(req_id, 3)
    store(scheduler, chunk_keys(scheduler, req, range(2)))
    tokens, load_async = scheduler.get_num_new_matched_tokens(req, 0)
    if tokens:
        assert load_async
        blocks = list(range(1, len(req.block_hashes) + 1))
        ids = SimpleNamespace(get_block_ids=lambda: [blocks])
        scheduler.update_state_after_alloc(req, ids, tokens)
        new = SimpleNamespace(req_id=req_id, block_ids=[blocks], num_computed_tokens=0)
        scheduler.build_connector_meta(step([new], {req_id: 1}))
    return tokens


def test_a_scheduler_recomputes_a_hit_queued_behind_slow_loads_and_loads_it_once_they_land(
    shm_path: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    scheduler = open_scheduler(shm_path, tmp_path)
    try:
        assert scheduler.client is not None
        # a chunk takes 5 s to load: a and b save 25 s a chunk and go out, 20 s of loads
        snapshot = costs(5.0, 30.0, CHUNK_TOKENS)
        monkeypatch.setattr(scheduler.client, "costs", lambda: snapshot)
        assert granted(scheduler, "a") == 2 * CHUNK_TOKENS
        assert granted(scheduler, "b") == 2 * CHUNK_TOKENS
        snapshot = costs(5.0, 5.01, CHUNK_TOKENS)  # now a chunk saves 10 ms
        assert scheduler.pending.backlog.seconds_ahead() > 10.0
        assert granted(scheduler, "c") == 0
        scheduler.update_connector_output(None, (), (), ["a", "b"])
        assert scheduler.pending.backlog.seconds_ahead() == 0.0
        assert granted(scheduler, "d") == 2 * CHUNK_TOKENS
    finally:
        scheduler.shutdown()
