"""The worker's GPU copy path: a cudaHostRegister'ed kvtier arena, copies on a side stream,
completion by events, and loads checked only once their event completed. Runs where CUDA is
present (a device machine); CI has none."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from kvtier_vllm.shared.copies import CpuCopies, CudaCopies, copies_for

from kvtier.client import ArenaMemory
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.cpu import CpuTier
from tests.support import arena_config, keys_for, target_spec

CHUNK = 1 << 20

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
)
# the worker builds on vLLM's connector base; a device machine may have CUDA but no vLLM
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="no vllm: KVTierWorker needs vLLM"
)


def test_cpu_devices_get_plain_copies() -> None:
    copies = copies_for(torch.device("cpu"))
    assert type(copies) is CpuCopies
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    copies.begin_stores()
    copies.copy(dst, src)
    assert copies.end_stores()()
    assert torch.equal(dst, src)


@pytest.mark.gpu
@needs_cuda
def test_arena_round_trip_through_the_gpu_on_a_side_stream(shm_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    tier = CpuTier(arena_config(shm_path, 64 << 20), registry)
    try:
        (ref,) = tier.reserve(keys_for(ns, 1))
        assert ref is not None
        memory = ArenaMemory.attach(shm_path)
        arena = torch.frombuffer(memory.view(0, memory.size), dtype=torch.uint8)
        copies = copies_for(torch.device("cuda"))
        assert isinstance(copies, CudaCopies)
        copies.attach(arena)
        assert copies._registered == arena.data_ptr(), "the arena is pinned"
        pages = torch.randint(0, 255, (CHUNK,), dtype=torch.uint8, device="cuda")
        slot = arena[ref.offset : ref.offset + CHUNK]
        copies.begin_stores()
        copies.copy(slot, pages)
        done = copies.end_stores()
        torch.cuda.synchronize()
        assert done()
        assert torch.equal(slot, pages.cpu())
        back = torch.zeros_like(pages)
        copies.begin_loads()
        copies.copy(back, slot)
        copies.end_loads()
        assert torch.equal(back, pages)  # the current stream waited on the load event
        copies.detach()
        memory.close()
    finally:
        tier.close()


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_a_slot_rewritten_while_its_load_waits_on_the_side_stream_is_a_load_error(
    shm_path: Path,
) -> None:
    from tests.bare_worker import bare_worker  # imports vLLM

    bare = bare_worker(shm_path, torch.device("cuda"))
    try:
        worker = bare.worker
        worker.copies = copies_for(torch.device("cuda"))
        worker.start_load_kv(bare.meta([]))  # maps and pins the arena, which may synchronize
        moved, kept = bare.store(), bare.store()
        # the side stream waits for the current one: the copies queue up behind this
        torch.cuda._sleep(1 << 28)  # type: ignore[no-untyped-call]
        worker.start_load_kv(bare.meta([bare.load(moved, (3, 4)), bare.load(kept, (7, 8))]))
        bare.rewrite(moved)  # on the host, before the device read the slot
        assert worker.block_ids_with_load_errors() == {3, 4}
        assert torch.equal(bare.blocks("target", (7, 8)), bare.slot(kept))
    finally:
        bare.close()
