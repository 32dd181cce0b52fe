"""Bookkeeping of arena slot classes grows with the extents a class owns, not with the arena."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from kvtier.core.pools import PoolRegistry, Registration
from kvtier.tiers.cpu import CpuTier
from tests.support import MiB, arena_config, keys_for, payload_for, target_spec

MIN_SLOT = 4 << 10
CLASSES = 16


def _tier(shm_path: Path, registry: PoolRegistry) -> CpuTier:
    # many small slots: per-arena-slot structures are large next to per-class ones
    return CpuTier(
        arena_config(shm_path, 64 * MiB, min_slot_bytes=MIN_SLOT, prefault=False), registry
    )


def _register(tier: CpuTier, registry: PoolRegistry) -> list[Registration]:
    regs = []
    for i in range(CLASSES):
        reg = registry.register(target_spec(model=f"m{i}"), MIN_SLOT * (i + 1))
        tier.accept(reg)
        regs.append(reg)
    return regs


def test_classes_that_own_nothing_cost_less_than_a_word_per_arena_slot(shm_path: Path) -> None:
    registry = PoolRegistry()
    tier = _tier(shm_path, registry)
    try:
        slots = tier.memory.num_extents * tier.memory.max_slots_per_extent
        gc.collect()
        tracemalloc.start()
        try:
            _register(tier, registry)
            gc.collect()
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert held < slots * 8, f"{CLASSES} empty classes hold {held} bytes for {slots} slots"
    finally:
        tier.close()


def test_a_class_holds_eviction_nodes_for_the_slots_it_owns(shm_path: Path) -> None:
    registry = PoolRegistry()
    tier = _tier(shm_path, registry)
    try:
        regs = _register(tier, registry)
        small, large = regs[0], regs[-1]
        per_extent = tier.memory.extent_bytes // small.chunk_bytes
        for key in keys_for(small.namespace, per_extent + 1):  # two extents
            assert tier.put(key, payload_for(key, small.chunk_bytes))
        (key,) = keys_for(large.namespace, 1)
        assert tier.put(key, payload_for(key, large.chunk_bytes))
        nodes = {
            chunk: cls.policy.nodes - cls.policy.queues
            for (_pool, chunk), cls in tier.slots.classes.items()
        }
        assert nodes[small.chunk_bytes] == 2 * per_extent
        assert nodes[large.chunk_bytes] == tier.memory.extent_bytes // large.chunk_bytes
        assert sum(nodes.values()) == nodes[small.chunk_bytes] + nodes[large.chunk_bytes]
        # eviction still finds the oldest chunk of the class
        stored = 0
        for key in keys_for(small.namespace, 4 * per_extent, start=10_000):
            stored += tier.put(key, payload_for(key, small.chunk_bytes))
        assert stored == 4 * per_extent
    finally:
        tier.close()
