"""The arena's slot bookkeeping: each slot's state, generation and refcount, mirrored into the
arena's shared table; the slots of one (pool, chunk size) class; the arena's default size."""

from __future__ import annotations

import heapq
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
    """Slots of one (pool, chunk size), in the extents the class holds.

    Free slots are kept per extent, and a store takes one from the lowest-numbered extent that
    has one: chunks pack into few extents, so the others empty out and go back to the arena."""

    def __init__(
        self, pool: str, slot_bytes: int, policy: EvictionPolicy, per_extent: int, now: float
    ) -> None:
        self.pool = pool
        self.slot_bytes = slot_bytes
        self.per_extent = per_extent
        self.policy = policy
        self._free: dict[int, list[int]] = {}  # extent -> its free slots
        self._open: list[int] = []  # heap of extents that may have a free slot
        self._queued: set[int] = set()  # the extents in ``_open``
        self.ready = 0
        self.dirty: deque[tuple[int, int]] = deque()  # (slot, generation), commit order
        self.dirty_count = 0
        self.blank = 0
        """Slots reserved under a blank key (`kvtier.core.keys.blank_key`), not yet named."""
        self.retired: set[int] = set()  # slots of retired draft revisions: evicted first
        self.last_used = now
        """When a store or a load last used the class (time.monotonic)."""
        self.reclaim_after = 0.0
        """No class could lend it an extent: not asked again before this time."""

    @property
    def extents(self) -> int:
        return len(self._free)

    def held(self) -> list[int]:
        """The extents the class holds."""
        return list(self._free)

    def add_extent(self, extent: int, first_slot: int) -> None:
        slots = range(first_slot, first_slot + self.per_extent)
        self._free[extent] = list(reversed(slots))
        self._queue(extent)
        self.policy.add_slots(slots)

    def drop_extent(self, extent: int, first_slot: int) -> None:
        """Give up an extent whose slots are all free."""
        del self._free[extent]
        if extent in self._queued:
            self._queued.discard(extent)
            self._open.remove(extent)
            heapq.heapify(self._open)
        self.policy.drop_slots(range(first_slot, first_slot + self.per_extent))

    def take_free(self) -> int | None:
        while self._open:
            free = self._free.get(self._open[0])
            if free:
                return free.pop()
            self._queued.discard(heapq.heappop(self._open))  # full since it was pushed
        return None

    def _queue(self, extent: int) -> None:
        if extent not in self._queued:
            self._queued.add(extent)
            heapq.heappush(self._open, extent)

    def put_free(self, extent: int, slot: int) -> bool:
        """Return a slot; True when its extent is now entirely free."""
        free = self._free[extent]
        free.append(slot)
        self._queue(extent)
        return len(free) == self.per_extent


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
