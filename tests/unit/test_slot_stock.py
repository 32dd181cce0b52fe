"""Slots reserved ahead of the stores that fill them: a blank slot takes the chunk its store
names when it commits (and frees itself where the arena holds that chunk already), a step's
stores take slots from the stock without a reservation call, and slots held go back when old
and at shutdown. A real scheduler over embedded tiers (no engine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.kv.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.kv.scheduler_side import slot_stock
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
from kvtier_vllm.kv.scheduler_side.slot_stock import SlotStock

from kvtier.client import InProcessClient
from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey, blank_key, is_blank, namespace_of
from kvtier.core.protocol import Ready, SlotRef
from tests.support import HandClock
from tests.unit.test_scheduler_lookups import CHUNK_TOKENS, arena, chunk_keys, open_scheduler
from tests.unit.test_step_stores import prompt, reserved_keys, step


@pytest.fixture
def scheduler(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KVTierScheduler]:
    """An embedded scheduler whose client reserves ahead as kvtierd's does (the embedded
    client's reservations are function calls: it keeps no stock)."""
    ASKED.clear()
    yield from reserving_behind(shm_path, tmp_path, monkeypatch, _reserve_behind, SESSION)


def reserving_behind(
    shm_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reserve_behind: Callable[[InProcessClient, list[ChunkKey]], Any],
    session: list[str | None],
) -> Iterator[KVTierScheduler]:
    """An embedded scheduler whose client reserves with ``reserve_behind`` and gives
    ``session[0]`` as its session mark (first "first"), shut down after."""
    monkeypatch.setattr(InProcessClient, "reserve_behind", reserve_behind)
    monkeypatch.setattr(InProcessClient, "session_mark", lambda _: session[0])
    session[0] = "first"
    s = open_scheduler(shm_path, tmp_path, load_policy="always")
    yield s
    s.shutdown()


def _reserve_behind(client: InProcessClient, keys: list[ChunkKey]) -> Ready[list[SlotRef | None]]:
    if not all(is_blank(key) for key in keys):
        ASKED.append(list(keys))
    return Ready(client.reserve_slots(keys))


SESSION: list[str | None] = ["first"]
"""The session mark the scheduler's client gives now."""
ASKED: list[list[ChunkKey]] = []
"""The chunks each reservation asked for without waiting named (not held ahead)."""


def test_an_embedded_engine_keeps_no_stock_its_stores_reserve_in_their_step(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedded = open_scheduler(shm_path, tmp_path, load_policy="always")
    try:
        calls = reserved_keys(embedded, monkeypatch)
        a, b = prompt("a", 2), prompt("b", 2)
        run_step(embedded, a, 1)
        meta = run_step(embedded, b, 100)
        assert calls == [chunk_keys(embedded, req, range(2)) for req in (a, b)]
        assert len(meta.stores) == 2
        assert arena(embedded).slots.reserved == 4, "a's and b's stores, nothing held ahead"
    finally:
        embedded.shutdown()


def blanks(key: ChunkKey, count: int) -> list[ChunkKey]:
    return [blank_key(namespace_of(key), i, len(key) - NAMESPACE_BYTES) for i in range(count)]


def test_a_blank_slot_takes_the_chunk_its_store_names_unless_the_arena_has_it(
    scheduler: KVTierScheduler,
) -> None:
    client = scheduler.client
    assert client is not None
    keys = chunk_keys(scheduler, prompt("a", 2), range(2))
    refs = client.reserve(blanks(keys[0], 3))
    assert all(refs)
    assert arena(scheduler).slots.reserved == 3
    first, second, third = (ref for ref in refs if ref is not None)
    assert client.commit([first]) == 0, "a blank key is never a chunk"
    elsewhere = ChunkKey(bytes(NAMESPACE_BYTES) + keys[0][NAMESPACE_BYTES:])
    assert client.commit([replace(first, key=elsewhere)]) == 0, "another namespace's chunk"
    assert client.lookup(keys).hits == 0

    assert client.commit([replace(first, key=keys[0])]) == 1
    assert client.lookup(keys).hits == 1
    duplicates = arena(scheduler).stats().counters.get("store_duplicate", 0)
    assert client.commit([replace(second, key=keys[0])]) == 0
    assert arena(scheduler).stats().counters["store_duplicate"] == duplicates + 1
    client.abort([replace(third, key=keys[1])])  # given back by the chunk its store named
    assert arena(scheduler).slots.reserved == 0
    assert client.lookup(keys).hits == 1


def run_step(scheduler: KVTierScheduler, req: Any, first_block: int) -> KVTierMetadata:
    """``req`` scheduled whole in one step, its blocks from ``first_block`` on."""
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: []), 0)
    blocks = list(range(first_block, first_block + len(req.block_hashes)))
    new = [SimpleNamespace(req_id=req.request_id, block_ids=[blocks], num_computed_tokens=0)]
    return scheduler.build_connector_meta(step(new, {req.request_id: req.num_prompt_tokens}))


def stock_after_a_first_step(
    scheduler: KVTierScheduler, clock: HandClock | None = None
) -> SlotStock:
    """The scheduler's stock, on ``clock`` where given, once a step stored two chunks of "a"
    and its top-up came back."""
    stock = scheduler.stores.stock if scheduler.stores is not None else None
    assert stock is not None
    if clock is not None:
        stock.clock = clock
    run_step(scheduler, prompt("a", 2), 1)
    stock.collect()
    return stock


def written(meta: KVTierMetadata) -> KVTierWorkerMetadata:
    return KVTierWorkerMetadata(stored=[(c.slot, c.generation) for c in meta.stores])


def test_stores_take_slots_held_ahead_without_a_call_and_commit_them_as_their_chunks(
    scheduler: KVTierScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = reserved_keys(scheduler, monkeypatch)
    a, b = prompt("a", 2), prompt("b", 2)
    first = run_step(scheduler, a, 1)
    assert [chunk_keys(scheduler, a, range(2))] == ASKED, "nothing held yet: asked for"
    assert len(first.stores) == 2, "answered at once here: copied in its step"
    stock = scheduler.stores.stock if scheduler.stores is not None else None
    assert stock is not None
    stock.collect()
    assert stock.held == 4, "twice the step's stores held for the next"
    second = run_step(scheduler, b, 100)
    assert len(ASKED) == 1, "b's stores asked for no reservation"
    assert calls == [], "no step waited for one"
    assert len(second.stores) == 2
    assert stock.held == 2
    scheduler.update_connector_output(written(first))
    scheduler.update_connector_output(written(second))
    for req in (a, b):
        scheduler.request_finished(req)
    scheduler.update_connector_output(KVTierWorkerMetadata())
    again = prompt("again", 2, like="b")
    assert scheduler.get_num_new_matched_tokens(again, 0)[0] == 2 * CHUNK_TOKENS
    stock.collect()
    assert stock.held == 4, "the idle engine keeps its stock for the next requests"
    stock.give_back()
    assert arena(scheduler).slots.reserved == 0


def test_slots_held_too_long_go_back_and_are_never_handed_to_a_store(
    scheduler: KVTierScheduler,
) -> None:
    clock = HandClock()
    stock = stock_after_a_first_step(scheduler, clock)
    assert stock.held == 4
    aborted = arena(scheduler).stats().counters.get("store_aborted", 0)
    clock.now += slot_stock.MAX_AGE_S + 1
    meta = run_step(scheduler, prompt("b", 1), 100)
    assert arena(scheduler).stats().counters["store_aborted"] == aborted + 4
    assert len(meta.stores) == 1, "b's chunk was reserved in its step"
    # a's two, b's one, and the stock asked anew
    assert arena(scheduler).slots.reserved == 2 + 1 + 4


def test_slots_are_used_only_in_the_session_they_were_reserved_in(
    scheduler: KVTierScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = reserved_keys(scheduler, monkeypatch)
    stock = stock_after_a_first_step(scheduler)
    assert stock.held == 4
    SESSION[0] = None  # kvtierd not heard from lately: the stock waits, and is not topped up
    unheard = prompt("unheard", 1)
    meta = run_step(scheduler, unheard, 100)
    assert calls[-1] == chunk_keys(scheduler, unheard, range(1)), "reserved in its step"
    assert len(meta.stores) == 1
    assert stock.held == 4
    SESSION[0] = "second"  # a new session (a restarted kvtierd): what the old one held is gone
    aborted = arena(scheduler).stats().counters.get("store_aborted", 0)
    after = prompt("after", 1)
    meta = run_step(scheduler, after, 200)
    assert ASKED[-1] == chunk_keys(scheduler, after, range(1)), "a slot of the old session"
    assert len(meta.stores) == 1
    assert arena(scheduler).stats().counters.get("store_aborted", 0) == aborted, "aborted"
    stock.collect()
    # topped up in the new session (within the share of blank slots: here no kvtierd ended the
    # old session, whose slots stay reserved)
    assert stock.held > 0


def test_a_namespace_that_stores_no_more_leaves_the_stock(scheduler: KVTierScheduler) -> None:
    clock = HandClock()
    stock = stock_after_a_first_step(scheduler, clock)
    assert stock.namespaces == 1
    for _ in range(slot_stock.DEMAND_STEPS):  # steps that store nothing
        stock.collect()
        stock.step([])
    assert stock.namespaces == 1, "its slots are still held"
    clock.now += slot_stock.MAX_AGE_S + 1
    stock.step([])
    assert stock.held == 0
    assert arena(scheduler).slots.reserved == 2, "a's two stores only: the aged slots went back"
    assert stock.namespaces == 0
