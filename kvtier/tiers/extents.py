"""Which slot class holds each extent of the arena, kept in the owning process's memory.

The owner decides only from this table. Each extent's slot size is written through to the
arena file's extent table so that processes mapping the arena can find a slot's bytes; what they
read there is data to them, checked by the slot's generation, and the owner never reads it back.
"""

from __future__ import annotations

from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.slots import SlotClass


class Extents:
    def __init__(self, memory: ArenaMemory) -> None:
        self._memory = memory
        n = memory.num_extents
        self._slot_bytes = [0] * n
        self._class: list[SlotClass | None] = [None] * n
        self._free = list(range(n - 1, -1, -1))  # popped from the end: lowest first
        memory.extent_slot_bytes[:] = 0

    @property
    def free(self) -> int:
        """Extents no class holds."""
        return len(self._free)

    def first_slot(self, extent: int) -> int:
        return extent * self._memory.max_slots_per_extent

    def take(self, cls: SlotClass) -> bool:
        """Give ``cls`` a free extent; False when none is free."""
        if not self._free:
            return False
        extent = self._free.pop()
        self._slot_bytes[extent] = cls.slot_bytes
        self._class[extent] = cls
        self._memory.extent_slot_bytes[extent] = cls.slot_bytes
        cls.add_extent(extent, self.first_slot(extent))
        return True

    def give_back(self, extent: int) -> None:
        """Return an extent whose slots are all free to the free list."""
        cls = self._class[extent]
        assert cls is not None
        cls.drop_extent(extent, self.first_slot(extent))
        self._class[extent] = None
        self._slot_bytes[extent] = 0
        self._memory.extent_slot_bytes[extent] = 0
        self._free.append(extent)

    def extent_of(self, slot: int) -> int:
        return slot // self._memory.max_slots_per_extent

    def class_of(self, slot: int) -> SlotClass:
        cls = self._class[slot // self._memory.max_slots_per_extent]
        assert cls is not None
        return cls

    def slot_offset(self, slot: int) -> int:
        mem = self._memory
        extent, index = divmod(slot, mem.max_slots_per_extent)
        return mem.data_offset + extent * mem.extent_bytes + index * self._slot_bytes[extent]

    def slots_of(self, extent: int) -> range:
        cls = self._class[extent]
        assert cls is not None
        first = self.first_slot(extent)
        return range(first, first + cls.per_extent)
