"""The worker's copy plan: one stacked view per pool and one copy per run of blocks must move the
same bytes as page-by-page copies, for any block ids (CPU tensors, no engine). And loads are
trusted only once their copies landed: with copies that land as late as a device's, a slot
rewritten in between is a load error."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier_vllm.kv.metadata import ChunkCopy, KVTierMetadata
from kvtier_vllm.kv.worker_side import background_loads
from kvtier_vllm.kv.worker_side.load_times import LandingFence
from kvtier_vllm.kv.worker_side.pages import block_runs, pages_of, stacked
from kvtier_vllm.shared.copies import CpuCopies, DeferredCopies, Pair

from kvtier.core.protocol import FailedChunk, Failure, SlotRef, TierCode
from tests.bare_worker import BareWorker, bare_worker
from tests.support import keys_for

LAYERS, BLOCKS, PAGE = 3, 40, 64


def cache() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Layers as vLLM hands them out: views of one buffer at one stride."""
    buffer = torch.randint(0, 255, (LAYERS, BLOCKS, 2, PAGE // 4), dtype=torch.int16)
    return buffer, [page_bytes(buffer[i]) for i in range(LAYERS)]


def page_bytes(layer: torch.Tensor) -> torch.Tensor:
    held = pages_of(layer)
    assert held is not None
    return held[0]


def test_runs_cover_every_block_once_in_order() -> None:
    assert block_runs((4, 5, 6, 9, 10, 2)) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert block_runs((7,)) == [(0, 7, 1)]


def test_runs_leave_out_the_null_block() -> None:
    # a sliding-window group's positions before the window are vLLM's null block, id 0
    assert block_runs((0, 0, 0, 5, 6)) == [(3, 5, 2)]
    assert block_runs((0, 1, 2, 0)) == [(1, 1, 2)]
    assert block_runs((0,)) == []


def test_the_stacked_view_is_the_layers_pages() -> None:
    _buffer, pages = cache()
    stack = stacked(pages)
    assert stack is not None
    for i, page in enumerate(pages):
        assert torch.equal(stack[i], page)
    assert stacked([pages[0], pages[2]]) is not None  # any fixed stride
    assert stacked([pages[1], pages[0]]) is None  # not increasing: no single view


def test_run_copies_equal_page_by_page_copies() -> None:
    rng = random.Random(7)
    _buffer, pages = cache()
    stack = stacked(pages)
    assert stack is not None
    for _ in range(50):
        blocks = tuple(rng.sample(range(1, BLOCKS), rng.randint(1, 8)))
        if rng.random() < 0.5:
            start = rng.randrange(1, BLOCKS - len(blocks))
            blocks = tuple(range(start, start + len(blocks)))
        slot = torch.empty((LAYERS, len(blocks), pages[0].shape[1]), dtype=torch.uint8)
        for index, block, n in block_runs(blocks):
            slot[:, index : index + n].copy_(stack[:, block : block + n])
        expected = torch.stack([p[list(blocks)] for p in pages])
        assert torch.equal(slot, expected)


def test_a_layer_reading_another_layers_cache_is_not_stored_twice() -> None:
    from kvtier_vllm.kv.worker_side.pages import own_caches
    from kvtier_vllm.layout.plans import KVGroup

    buffer, _ = cache()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    # layer 3 shares layer 1's cache (cross-layer KV sharing); vLLM appends it to that group
    caches = {names[0]: buffer[0], names[1]: buffer[1], names[2]: buffer[2], names[3]: buffer[1]}
    groups = [KVGroup(0, (names[0], names[1], names[2], names[3]))]
    assert own_caches(groups, caches) == [KVGroup(0, tuple(names[:3]))]
    # the hybrid allocator's groups share buffers across groups, never within one: kept
    hybrid = [KVGroup(0, (names[0],), window=199), KVGroup(1, (names[3],))]
    caches[names[3]] = buffer[0]
    assert own_caches(hybrid, caches) == hybrid


# -- loads are checked once their copies landed ---------------------------------------------


@pytest.fixture
def bare(shm_path: Path) -> Iterator[BareWorker]:
    bare = bare_worker(shm_path, torch.device("cpu"))
    yield bare
    bare.close()


def deferred(
    bare: BareWorker, before_landing: Callable[[DeferredCopies, list[Pair]], None] | None = None
) -> DeferredCopies:
    copies = DeferredCopies(before_landing)
    bare.worker.copies = copies
    return copies


def rewriting(bare: BareWorker, ref: SlotRef) -> tuple[Callable[..., None], list[SlotRef]]:
    """A hook that evicts ``ref``'s chunk and stores another in its slot, the first time
    copies are about to land; and the chunk stored there."""
    rewritten: list[SlotRef] = []

    def hook(copies: DeferredCopies, pairs: list[Pair]) -> None:
        if not rewritten:
            rewritten.append(bare.rewrite(ref))

    return hook, rewritten


def test_deferred_copies_land_in_issue_order_when_their_fence_is_asked() -> None:
    def full(value: int) -> torch.Tensor:
        return torch.full((4,), value, dtype=torch.uint8)

    copies = DeferredCopies(busy_queries=1)
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    copies.copy(a, full(1))
    first = copies.fence()
    copies.copy(b, full(2))
    copies.copy(a, full(3))
    assert copies.pending == 3
    assert not a.any()
    assert not first()  # a device still busy
    assert first()
    assert torch.equal(a, full(1))
    assert not b.any()
    copies.fence().wait()
    assert torch.equal(a, full(3))
    assert torch.equal(b, full(2))
    copies.copy(b, full(4))
    copies.end_loads()  # the forward that reads them runs next, on the host
    assert copies.pending == 0
    assert torch.equal(b, full(4))


@pytest.mark.parametrize("plan", ["target", "draft"])
def test_a_slot_rewritten_between_queueing_and_landing_is_a_block_load_error(
    bare: BareWorker, plan: str
) -> None:
    moved, kept = bare.store(plan), bare.store(plan)
    hook, rewritten = rewriting(bare, moved)
    deferred(bare, hook)
    bare.worker.start_load_kv(bare.meta([bare.load(moved, (3, 4)), bare.load(kept, (7, 8))]))
    # the forward read another chunk's bytes: only the generation check can tell
    assert torch.equal(bare.blocks(plan, (3, 4)), bare.slot(rewritten[0]))
    assert bare.worker.block_ids_with_load_errors() == {3, 4}
    assert torch.equal(bare.blocks(plan, (7, 8)), bare.slot(kept))
    assert bare.worker.block_ids_with_load_errors() == set()  # reported once
    stats = bare.worker.take_stats()
    assert stats is not None
    assert stats.data[f"load.{plan}.chunks"] == 2
    assert stats.data[f"load.{plan}.errors"] == 1
    # reported to the tiers, which tell the operator (nothing is dropped for it)
    reported = bare.worker.worker_meta()
    assert reported is not None
    assert reported.failed_chunks == [FailedChunk(moved.key, TierCode.CPU, Failure.GENERATION)]


def test_a_slot_unchanged_until_its_copy_landed_loads_cleanly(bare: BareWorker) -> None:
    ref, draft = bare.store("target"), bare.store("draft")
    landed: list[int] = []
    copies = deferred(bare, lambda copies, pairs: landed.append(len(pairs)))
    bare.worker.start_load_kv(bare.meta([bare.load(ref, (1, 2)), bare.load(draft, (5, 9))]))
    assert landed
    assert copies.pending == 0
    assert bare.worker.block_ids_with_load_errors() == set()
    assert torch.equal(bare.blocks("target", (1, 2)), bare.slot(ref))
    assert torch.equal(bare.blocks("draft", (5, 9)), bare.slot(draft))


def test_an_asynchronous_load_whose_slot_moved_before_landing_fails_its_request(
    bare: BareWorker,
) -> None:
    moved, kept = bare.store(), bare.store()
    hook, _ = rewriting(bare, moved)
    deferred(bare, hook)
    loads = [bare.load(moved, (3, 4), "r1"), bare.load(kept, (7, 8), "r2")]
    bare.worker.start_load_kv(bare.meta(loads, receiving=["r1", "r2"]))
    assert bare.finished_loads() == ({"r2"}, {"r1"})
    assert bare.worker.block_ids_with_load_errors() == set()  # per request, never per block
    assert torch.equal(bare.blocks("target", (7, 8)), bare.slot(kept))


def test_an_asynchronous_load_of_one_group_fails_only_the_blocks_whose_slot_moved(
    bare: BareWorker,
) -> None:
    # one KV-cache group: vLLM takes the failed blocks and computes the request from the first
    moved, kept = bare.store(), bare.store()
    hook, _ = rewriting(bare, moved)
    deferred(bare, hook)
    loads = [bare.load(kept, (7, 8), "r1"), bare.load(moved, (3, 4), "r1")]
    bare.worker.start_load_kv(bare.meta(loads, receiving=["r1"], block_errors=True))
    assert bare.finished_loads() == ({"r1"}, set())
    assert bare.worker.block_ids_with_load_errors() == {3, 4}
    assert torch.equal(bare.blocks("target", (7, 8)), bare.slot(kept))


def test_an_asynchronous_load_is_copied_off_the_engines_thread(
    bare: BareWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = bare.store()
    release, entered = threading.Event(), threading.Event()
    issue = bare.worker._issue_loads

    def held(*args: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return issue(*args)

    monkeypatch.setattr(bare.worker, "_issue_loads", held)
    bare.worker.start_load_kv(bare.meta([bare.load(ref, (1, 2), "r1")], receiving=["r1"]))
    # start_load_kv returned while the load is held: the engine's step goes on without it
    assert entered.wait(30)
    assert bare.worker.finished_loads() == (set(), set())
    assert not bare.blocks("target", (1, 2)).any()
    release.set()
    assert bare.finished_loads() == ({"r1"}, set())
    assert torch.equal(bare.blocks("target", (1, 2)), bare.slot(ref))


def test_a_store_is_reported_only_once_its_copies_landed(bare: BareWorker) -> None:
    (ref,) = bare.tier.reserve(keys_for(bare.namespaces["target"], 1, start=1000))
    assert ref is not None
    bare.pages["target"][:, [5, 6]] = torch.randint(0, 256, (2, 2, 4096), dtype=torch.uint8)
    bare.worker.copies = DeferredCopies(busy_queries=1)
    store = ChunkCopy("target", ref.slot, ref.offset, ref.generation, (5, 6))
    bare.worker.wait_for_save(KVTierMetadata(str(bare.arena_path), stores=[store]))
    assert bare.worker.worker_meta() is None  # still copying: not to be committed yet
    assert not torch.equal(bare.slot(ref), bare.blocks("target", (5, 6)))
    reported = bare.worker.worker_meta()
    assert reported is not None
    assert reported.stored == [(ref.slot, ref.generation)]
    assert torch.equal(bare.slot(ref), bare.blocks("target", (5, 6)))


def test_a_step_whose_slots_were_given_in_another_arena_file_writes_none_of_them(
    bare: BareWorker,
) -> None:
    # a restarted daemon's new arena at the path, before the scheduler's session followed it:
    # the step's slot numbers are the old arena's, and may hold another chunk in the new one
    (ref,) = bare.tier.reserve(keys_for(bare.namespaces["target"], 1, start=1000))
    assert ref is not None
    bare.pages["target"][:, [5, 6]] = torch.randint(0, 256, (2, 2, 4096), dtype=torch.uint8)
    before = bare.slot(ref).clone()
    store = ChunkCopy("target", ref.slot, ref.offset, ref.generation, (5, 6))
    inode = bare.arena_path.stat().st_ino
    meta = KVTierMetadata(str(bare.arena_path), arena_inode=inode + 1, stores=[store])
    bare.worker.wait_for_save(meta)
    reported = bare.worker.worker_meta()
    assert reported is not None
    assert reported.failed == [(ref.slot, ref.generation)]
    assert not reported.stored
    assert torch.equal(bare.slot(ref), before)
    bare.worker.wait_for_save(
        KVTierMetadata(str(bare.arena_path), arena_inode=inode, stores=[store])
    )
    landed = bare.worker.worker_meta()
    assert landed is not None
    assert landed.stored == [(ref.slot, ref.generation)]
    assert torch.equal(bare.slot(ref), bare.blocks("target", (5, 6)))


def test_an_asynchronous_load_whose_issuing_raised_fails_its_request_whole(
    bare: BareWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("issuing broken by the test")

    monkeypatch.setattr(bare.worker, "_issue_loads", broken)
    loads = [bare.load(bare.store(), (1, 2), "r1")]
    bare.worker.start_load_kv(bare.meta(loads, receiving=["r1"], block_errors=True))
    # never left waiting: reported finished and failed, so vLLM recomputes it
    assert bare.finished_loads() == (set(), {"r1"})
    assert bare.worker.block_ids_with_load_errors() == set()


def test_a_step_that_computes_nothing_reports_the_load_it_started(
    bare: BareWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background_loads, "IDLE_WAIT_S", 30.0)  # however slow this machine is
    release = threading.Event()
    issue = bare.worker._issue_loads

    def held(*args: Any) -> Any:
        assert release.wait(30)
        return issue(*args)

    monkeypatch.setattr(bare.worker, "_issue_loads", held)
    ref = bare.store()
    meta = bare.meta([bare.load(ref, (1, 2), "r1")], receiving=["r1"])
    meta.idle = True
    bare.worker.start_load_kv(meta)
    threading.Timer(0.01, release.set).start()
    # nothing else runs: the worker waits for the load rather than step on without it
    assert bare.worker.finished_loads() == ({"r1"}, set())
    assert torch.equal(bare.blocks("target", (1, 2)), bare.slot(ref))


def test_each_requests_load_is_timed_as_one_load_of_its_chunks(bare: BareWorker) -> None:
    """kvtierd fits a load as a fixed part plus a part per chunk: a request's chunks from the
    arena are reported as one load of that many, not one load a chunk."""
    refs = [bare.store() for _ in range(4)]
    loads = [bare.load(ref, (2 * i + 1, 2 * i + 2), "r1") for i, ref in enumerate(refs[:3])]
    loads.append(bare.load(refs[3], (9, 10), "r2"))
    bare.worker.start_load_kv(bare.meta(loads, receiving=["r1", "r2"]))
    assert bare.finished_loads() == ({"r1", "r2"}, set())
    reported = bare.worker.worker_meta()
    assert reported is not None
    arena = reported.timings.loads["cpu"]
    assert (arena.loads, arena.chunks) == (2, 4)
    assert arena.chunks_squared == 3 * 3 + 1 * 1


@pytest.mark.parametrize("request_id", ["", "r1"], ids=["sync", "async"])
def test_a_loads_seconds_are_counted_with_its_bytes(bare: BareWorker, request_id: str) -> None:
    ref = bare.store()
    receiving = [request_id] if request_id else []
    bare.worker.start_load_kv(bare.meta([bare.load(ref, (1, 2), request_id)], receiving))
    if request_id:
        assert bare.finished_loads() == ({request_id}, set())
    assert bare.worker.block_ids_with_load_errors() == set()
    stats = bare.worker.take_stats()
    assert stats is not None
    assert stats.data["load.target.bytes"] == bare.blocks("target", (1, 2)).numel()
    assert stats.data["load.target.seconds"] > 0


# -- a load's seconds run until its copies landed ---------------------------------------------

LANDING_S = 1000.0
"""What copies landing takes on the test's clock: far more than issuing them takes here."""


class Clock:
    """The worker's clock for loads queued and landed: moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def landing(self, copies: DeferredCopies, pairs: list[Pair]) -> None:
        self.now += LANDING_S  # a device's copy stream, busy moving the bytes


@pytest.mark.parametrize("request_id", ["", "r1"], ids=["sync", "async"])
def test_a_device_loads_seconds_run_until_its_copies_landed(
    bare: BareWorker, request_id: str
) -> None:
    """Queued on a device, a copy lands later: its load is timed to its landing, in the
    transfer seconds and in the load times kvtierd fits its per-tier costs to."""
    clock = Clock()
    bare.worker.clock = clock
    bare.worker.copies = DeferredCopies(clock.landing, busy_queries=2)
    target, draft = bare.store("target"), bare.store("draft")
    loads = [bare.load(target, (1, 2), request_id), bare.load(draft, (5,), request_id)]
    receiving = [request_id] if request_id else []
    bare.worker.start_load_kv(bare.meta(loads, receiving))
    if request_id:  # the fence is asked later, until the copies landed
        assert bare.finished_loads() == ({request_id}, set())
    assert bare.worker.block_ids_with_load_errors() == set()
    stats = bare.worker.take_stats()
    assert stats is not None
    # the wait is split over the loads by their bytes: the target chunk has twice the draft's
    assert stats.data["load.target.bytes"] == 2 * stats.data["load.draft.bytes"]
    assert stats.data["load.target.seconds"] >= LANDING_S * 2 / 3
    assert stats.data["load.draft.seconds"] >= LANDING_S / 3
    reported = bare.worker.worker_meta()
    assert reported is not None
    arena = reported.timings.loads["cpu"]
    assert (arena.loads, arena.chunks) == (1, 2)
    assert arena.seconds >= LANDING_S


def test_a_fence_is_timed_to_when_it_was_first_seen_passed() -> None:
    clock = Clock()
    copies = DeferredCopies(clock.landing, busy_queries=1)
    copies.copy(torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8))
    fence = LandingFence(copies, clock)
    assert not fence()  # the device still busy: not landed yet, nothing counted
    assert fence.shares([1, 2]) == [0.0, 0.0]
    assert fence()
    clock.now += LANDING_S  # asked again later: it had landed already
    assert fence()
    assert fence.shares([1, 2]) == pytest.approx([LANDING_S / 3, LANDING_S * 2 / 3])


def test_a_cpu_loads_fence_adds_nothing_however_late_it_is_asked() -> None:
    clock = Clock()
    fence = LandingFence(CpuCopies(), clock)
    clock.now += LANDING_S  # the forward ran on the host before the fence was asked
    fence.wait()
    assert fence.shares([1, 2]) == [0.0, 0.0]
