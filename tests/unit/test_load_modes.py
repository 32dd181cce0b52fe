"""``load_mode: auto``: a granted hit loads inside the step where the wait it puts on the step's
requests is shorter than the step an asynchronous load waits through, else in the background;
the choice falls each way on the costs and step times fed to it, over real embedded tiers."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.kv.scheduler_side.load_modes import LoadModes, expected_load_s
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
from kvtier_vllm.kv.scheduler_side.timings import StepTimings
from kvtier_vllm.shared.settings import LoadMode, parse

from kvtier.core.costs import CostSnapshot, EngineTimings, LoadFit, TierCost
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import LMDB_SLOT, SlotRef
from tests.unit.test_load_backlog import costs as priced
from tests.unit.test_scheduler_lookups import (
    CHUNK_TOKENS,
    chunk_keys,
    open_scheduler,
    request,
    step,
    store,
)

ARENA_S, LMDB_S = 1e-3, 50e-3  # seconds a chunk


def costs(arena_s: float = ARENA_S, lmdb_s: float = LMDB_S) -> CostSnapshot:
    return CostSnapshot(
        {
            "cpu": TierCost(arena_s, 0, 0, 0, 9, LoadFit(0.0, arena_s)),
            "lmdb": TierCost(lmdb_s, 0, 0, 0, 9, LoadFit(0.0, lmdb_s)),
        },
        1e-3,
        0.0,
        9,
    )


def plan(arena_chunks: int, lmdb_chunks: int = 0) -> LoadPlan:
    key = ChunkKey(b"k" * 32)
    refs = [SlotRef(key, i, 0, 1, 1) for i in range(arena_chunks)]
    refs += [SlotRef(key, LMDB_SLOT, 0, 1, 1) for _ in range(lmdb_chunks)]
    return LoadPlan(0, len(refs), {"target": (0, refs)}, [])


def timed(step_s: float, running: int) -> StepTimings:
    """Step timings whose steps took ``step_s`` with ``running`` requests in each."""
    timings = StepTimings()
    for _ in range(3):
        timings.busy.observe(step_s)
    timings.running = running
    return timings


def test_auto_is_the_default_and_loads_in_the_step_only_what_costs_the_step_less() -> None:
    assert parse({}).load_mode is LoadMode.AUTO
    # 3 requests run, steps take 0.5 s: 4 arena chunks hold the step's 4 requests 16 ms
    modes = LoadModes(LoadMode.AUTO, timed(0.5, 3), costs, several_groups=False)
    assert not modes.asynchronous(plan(4))
    # from lmdb's map, 4 x 50 ms x 4 requests is more than the step it would wait through
    assert modes.asynchronous(plan(0, 4))
    assert expected_load_s(plan(2, 2), costs()) == pytest.approx(2 * ARENA_S + 2 * LMDB_S)
    # short steps: the same arena load is cheaper for the others in the background
    short = LoadModes(LoadMode.AUTO, timed(0.010, 3), costs, several_groups=False)
    assert short.asynchronous(plan(4))


def test_auto_loads_in_the_background_until_it_measured_what_it_needs() -> None:
    nothing_runs = LoadModes(LoadMode.AUTO, timed(0.5, 0), costs, several_groups=False)
    assert nothing_runs.asynchronous(plan(4))  # no one to hold up: as today
    assert LoadModes(LoadMode.AUTO, StepTimings(), costs, several_groups=False).asynchronous(
        plan(4)
    )  # no step timed
    no_costs = LoadModes(LoadMode.AUTO, timed(0.5, 3), lambda: None, several_groups=False)
    assert no_costs.asynchronous(plan(4))
    unmeasured_lmdb = CostSnapshot({"cpu": costs().tiers["cpu"]}, 1e-3, 0.0, 9)
    only_arena = LoadModes(
        LoadMode.AUTO, timed(0.5, 3), lambda: unmeasured_lmdb, several_groups=False
    )
    assert not only_arena.asynchronous(plan(4))
    assert only_arena.asynchronous(plan(3, 1))


def test_the_sync_loads_granted_in_one_step_add_up_until_the_next_step() -> None:
    modes = LoadModes(
        LoadMode.AUTO, timed(0.5, 3), lambda: costs(arena_s=40e-3), several_groups=False
    )
    first = plan(2)  # 80 ms, x 4 requests: 320 ms of a 500 ms step
    assert not modes.asynchronous(first)
    modes.granted(first, asynchronous=False)
    assert modes.asynchronous(plan(2))  # 160 ms of loads in the step, x 4: past the step
    modes.next_step()
    assert not modes.asynchronous(plan(2))


def test_set_modes_are_kept_and_several_groups_always_load_in_the_background() -> None:
    for mode, expected in ((LoadMode.SYNC, False), (LoadMode.ASYNC, True)):
        modes = LoadModes(mode, StepTimings(), lambda: None, several_groups=False)
        assert modes.asynchronous(plan(4)) is expected
    forced = LoadModes(LoadMode.SYNC, timed(0.5, 3), costs, several_groups=True)
    assert forced.asynchronous(plan(4))
    auto = LoadModes(LoadMode.AUTO, timed(0.5, 3), costs, several_groups=True)
    assert auto.asynchronous(plan(4))


def test_step_timings_count_the_requests_of_the_last_step_and_time_only_busy_steps() -> None:
    timings = StepTimings()
    timings.began(step([], {"a": 1, "b": 1, "c": 64}))
    timings.ended(None)
    assert (timings.running, timings.busy.samples) == (3, 1)
    timings.began(step([], {}))
    timings.ended(None)
    assert (timings.running, timings.busy.samples) == (0, 1)


def granted(scheduler: KVTierScheduler, req: Any) -> tuple[bool, Any]:
    """``req`` asks for its stored hit and vLLM grants it and schedules it: (whether it was
    answered as an asynchronous load, the step's metadata)."""
    tokens, load_async = scheduler.get_num_new_matched_tokens(req, 0)
    assert tokens == 2 * CHUNK_TOKENS
    blocks = list(range(1, len(req.block_hashes) + 1))
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [blocks]), tokens)
    new = SimpleNamespace(req_id=req.request_id, block_ids=[blocks], num_computed_tokens=0)
    return load_async, scheduler.build_connector_meta(step([new], {req.request_id: 1}))


@pytest.mark.parametrize(("arena_s", "sync"), [(1e-6, True), (10.0, False)])
def test_a_scheduler_over_real_tiers_chooses_each_mode_on_the_costs_its_tiers_measured(
    shm_path: Path, tmp_path: Path, arena_s: float, sync: bool
) -> None:
    scheduler = open_scheduler(shm_path, tmp_path)
    try:
        assert scheduler.client is not None
        measured = EngineTimings()
        for chunks in (1, 2, 4):
            measured.loaded("cpu", chunks, chunks * 1024, chunks * arena_s)
        measured.prefilled(CHUNK_TOKENS, 0.1)
        scheduler.client.report_timings(measured)
        # a step of 3 running requests that lasts a while (its length only needs a floor)
        scheduler.build_connector_meta(step([], {"x": 1, "y": 1, "z": 1}))
        time.sleep(0.2)
        scheduler.update_connector_output(None)
        req = request("a", 3)
        store(scheduler, chunk_keys(scheduler, req, range(2)))
        load_async, meta = granted(scheduler, req)
        assert load_async is not sync
        # a sync load goes out with the step that schedules it, naming no request; an async
        # one with the step after its grant, naming the request its workers report done
        assert [c.request for c in meta.loads] == ["" if sync else "a"] * 2
        assert meta.receiving == ([] if sync else ["a"])
        stats = scheduler.take_stats()
        assert stats is not None
        assert stats.data["mode|" + ("sync" if sync else "async")] == 1
    finally:
        scheduler.shutdown()


def test_a_load_in_the_background_costs_a_step_shared_over_the_steps_requests() -> None:
    modes = LoadModes(LoadMode.AUTO, timed(0.5, 3), costs, several_groups=False)
    assert modes.wait_s(4 * ARENA_S) == 0.0  # loaded in its step
    # in the background: its request waits a 0.5 s step, which a recompute would cost each
    # of the 4 requests in it a part of
    assert modes.wait_s(4 * LMDB_S) == pytest.approx(0.5 / 4)
    idle = LoadModes(LoadMode.AUTO, timed(0.5, 0), costs, several_groups=False)
    assert idle.wait_s(4 * LMDB_S) == 0.0  # nothing runs: its request is scheduled as it lands
    for mode, wait in ((LoadMode.SYNC, 0.0), (LoadMode.ASYNC, 0.5 / 4)):
        fixed = LoadModes(mode, timed(0.5, 3), costs, several_groups=False)
        assert fixed.wait_s(4 * ARENA_S) == pytest.approx(wait)
    unmeasured = LoadModes(LoadMode.AUTO, StepTimings(), costs, several_groups=False)
    assert unmeasured.wait_s(4 * LMDB_S) == 0.0  # no step measured: loaded as before


def test_a_scheduler_recomputes_a_hit_that_saves_less_than_its_share_of_the_step_it_waits(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two arena chunks load in 10 ms and save 2 ms. Beside 3 running requests in steps of
    30 ms, loading them in the step would hold up four requests 40 ms: they would load in the
    background, where their request waits the 30 ms step, 7.5 ms a request of it, more than
    they save: recomputed. Beside one running request they load in the step, and are loaded."""
    scheduler = open_scheduler(shm_path, tmp_path)
    try:
        assert scheduler.client is not None
        snapshot = priced(5e-3, 6e-3, CHUNK_TOKENS)
        monkeypatch.setattr(scheduler.client, "costs", lambda: snapshot)
        for _ in range(3):
            scheduler.timings.busy.observe(0.030)
        hits = {}
        for req_id, running in (("crowded", 3), ("quiet", 1)):
            scheduler.timings.running = running
            req = request(req_id, 3)
            store(scheduler, chunk_keys(scheduler, req, range(2)))
            hits[req_id] = scheduler.get_num_new_matched_tokens(req, 0)
        assert hits == {"crowded": (0, False), "quiet": (2 * CHUNK_TOKENS, False)}
    finally:
        scheduler.shutdown()
