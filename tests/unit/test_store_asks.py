"""A store the stock holds no slot for is asked for without the step waiting, and copied with
the step that finds the answer there: from the blocks its request still holds (a request that
finished meanwhile keeps them until that step, reported sent after its copies), never from
blocks a preemption took (its slots are aborted), and never under another session. A real
scheduler over embedded tiers (no engine), whose client answers reservations when told."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

from kvtier.client import InProcessClient
from kvtier.core.keys import ChunkKey, is_blank
from kvtier.core.protocol import Ready, SlotRef
from tests.unit.test_scheduler_lookups import CHUNK_TOKENS, arena, chunk_keys, step
from tests.unit.test_slot_stock import reserving_behind, run_step, written
from tests.unit.test_step_stores import prompt


class HeldAnswer:
    """A reservation kvtierd makes when the test gives its answer."""

    def __init__(self, reserve: Callable[[], list[SlotRef | None]]) -> None:
        self._reserve = reserve
        self._refs: list[SlotRef | None] | None = None

    def give(self) -> None:
        self._refs = self._reserve()

    def done(self) -> bool:
        return self._refs is not None

    def wait(self, timeout_s: float | None) -> bool:
        return self.done()

    def result(self) -> list[SlotRef | None]:
        assert self._refs is not None
        return self._refs


ANSWERS: list[HeldAnswer] = []
SESSION: list[str | None] = ["first"]


def _reserve_behind(client: InProcessClient, keys: list[ChunkKey]) -> Any:
    if all(is_blank(key) for key in keys):
        return Ready([None] * len(keys))  # a small arena holds no slot blank: no stock
    answer = HeldAnswer(lambda: client.reserve_slots(keys))
    ANSWERS.append(answer)
    return answer


@pytest.fixture
def scheduler(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KVTierScheduler]:
    """An embedded scheduler whose client reserves without waiting as kvtierd's does."""
    ANSWERS.clear()
    yield from reserving_behind(shm_path, tmp_path, monkeypatch, _reserve_behind, SESSION)


def hits(scheduler: KVTierScheduler, like: str, chunks: int) -> int:
    return scheduler.get_num_new_matched_tokens(prompt("again", chunks, like=like), 0)[0] or 0


def test_a_store_is_copied_with_the_step_that_finds_its_answer(
    scheduler: KVTierScheduler,
) -> None:
    a = prompt("a", 2)
    first = run_step(scheduler, a, 1)
    assert first.stores == [], "no slot held: nothing waited for"
    assert len(ANSWERS) == 1
    assert arena(scheduler).slots.reserved == 0
    running = scheduler.build_connector_meta(step([], {"a": 1}))
    assert running.stores == [], "not answered yet"
    ANSWERS[0].give()
    second = scheduler.build_connector_meta(step([], {"a": 1}))
    assert [c.block_ids for c in second.stores] == [(1, 2, 3, 4), (5, 6, 7, 8)], "a's blocks"
    scheduler.update_connector_output(written(second))
    assert scheduler.request_finished(a) == (False, None), "nothing out: its blocks may go"
    scheduler.update_connector_output(written(first))
    assert hits(scheduler, "a", 2) == 2 * CHUNK_TOKENS


def test_a_request_that_finishes_first_keeps_its_blocks_until_the_copy(
    scheduler: KVTierScheduler,
) -> None:
    a = prompt("a", 2)
    run_step(scheduler, a, 1)
    assert scheduler.request_finished(a) == (True, None), "kept for its stores"
    idle = scheduler.build_connector_meta(step([], {}))
    assert (idle.stores, idle.sending) == ([], []), "still kept: the answer is not there"
    ANSWERS[0].give()
    copied = scheduler.build_connector_meta(step([], {}))
    assert len(copied.stores) == 2
    assert copied.sending == ["a"], "reported sent once its copies landed"
    scheduler.update_connector_output(written(copied))
    assert hits(scheduler, "a", 2) == 2 * CHUNK_TOKENS
    assert scheduler.build_connector_meta(step([], {})).sending == [], "reported once"


def test_slots_asked_for_a_request_preempted_since_are_aborted_unwritten(
    scheduler: KVTierScheduler,
) -> None:
    a = prompt("a", 2)
    a.num_preemptions = 0
    run_step(scheduler, a, 1)
    a.num_preemptions = 1  # vLLM freed its blocks: another request may be writing them
    assert scheduler.request_finished(a) == (False, None), "no blocks of it left to keep"
    ANSWERS[0].give()
    assert arena(scheduler).slots.reserved == 2
    meta = scheduler.build_connector_meta(step([], {"b": 1}))
    assert meta.stores == []
    assert arena(scheduler).slots.reserved == 0, "aborted"
    assert hits(scheduler, "a", 2) == 0


def test_an_answer_from_another_session_is_never_written(scheduler: KVTierScheduler) -> None:
    a = prompt("a", 2)
    run_step(scheduler, a, 1)
    ANSWERS[0].give()
    SESSION[0] = "second"  # a restarted kvtierd: the slots answered were the old arena's
    assert [ref.key for ref in ANSWERS[0].result() if ref] == chunk_keys(scheduler, a, range(2))
    meta = scheduler.build_connector_meta(step([], {"a": 1}))
    assert meta.stores == []


def test_a_step_whose_metadata_is_dropped_lets_kept_blocks_go_and_aborts_what_comes(
    scheduler: KVTierScheduler,
) -> None:
    a = prompt("a", 2)
    run_step(scheduler, a, 1)
    assert scheduler.request_finished(a) == (True, None)
    failed = scheduler.abandon_step(step([], {}))  # a hook failed: nothing of the step stored
    assert failed.sending == ["a"], "its blocks go"
    ANSWERS[0].give()
    assert arena(scheduler).slots.reserved == 2
    meta = scheduler.build_connector_meta(step([], {}))
    assert (meta.stores, meta.sending) == ([], []), "never copied from blocks gone"
    assert arena(scheduler).slots.reserved == 0, "aborted"
