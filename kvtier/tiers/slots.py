"""The arena's slot bookkeeping: each slot's state, generation and refcount, mirrored into the
arena's shared table; the slots of one (pool, chunk size) class; the arena's default size."""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path

import psutil

from kvtier.tiers.arena import ArenaMemory, SlotState
from kvtier.tiers.eviction import EvictionPolicy

log = logging.getLogger(__name__)

FREE, WRITING, READY = int(SlotState.FREE), int(SlotState.WRITING), int(SlotState.READY)


class SlotTable:
    """State, generation and refcount of every slot: Python lists for the owner's hot-path reads,
    written through to the arena's shared table so other processes can check a reference."""

    def __init__(self, memory: ArenaMemory) -> None:
        n = memory.num_extents * memory.max_slots_per_extent
        self._memory = memory
        self.state = [FREE] * n
        self.generation = [int(memory.epoch)] * n
        self.refcount = [0] * n

    def set_state(self, slot: int, state: int) -> None:
        self.state[slot] = state
        self._memory.state[slot] = state

    def bump_generation(self, slot: int) -> None:
        self.generation[slot] += 1
        self._memory.generation[slot] = self.generation[slot]

    def add_ref(self, slot: int, delta: int) -> None:
        self.refcount[slot] += delta
        self._memory.refcount[slot] = self.refcount[slot]


class SlotClass:
    """Slots of one (pool, chunk size)."""

    def __init__(self, pool: str, slot_bytes: int, policy: EvictionPolicy, per_extent: int) -> None:
        self.pool = pool
        self.slot_bytes = slot_bytes
        self.per_extent = per_extent
        self.policy = policy
        self.free: list[int] = []
        self.extents = 0
        self.ready = 0
        self.dirty: deque[tuple[int, int]] = deque()  # (slot, generation), commit order
        self.dirty_count = 0
        self.retired: set[int] = set()  # slots of retired draft revisions: evicted first


def default_arena_size(fraction: float, shm_dir: Path) -> int:
    available = psutil.virtual_memory().available
    shm_free = psutil.disk_usage(str(shm_dir)).free
    size = int(min(available, shm_free) * fraction)
    log.warning(
        "arena.size_bytes is not set: using %.2f GiB, %.0f%% of the %.2f GiB available "
        "(memory %.2f GiB, %s free %.2f GiB); set arena.size_bytes to choose",
        size / 2**30,
        fraction * 100,
        min(available, shm_free) / 2**30,
        available / 2**30,
        shm_dir,
        shm_free / 2**30,
    )
    return size
