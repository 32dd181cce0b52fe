"""Room in the arena: its slot classes and the extents each holds, which slot a store gets, and
which chunks make room for it (in the order below): a free slot, a free extent
within the pool's share, an extent another class lends, else a victim. Which slots may go, and
freeing them, is the slots' part (`SlotHolder`); this object only chooses.

Extents come back: an extent whose slots are all free returns to the free list, and a class
with no free slot and no free extent takes one from another class, evicting that extent's clean
chunks. The lender is a class idle for `ArenaConfig.reclaim_idle_s`, or at once one whose
namespaces no open session of kvtierd holds (the one holding the most idle extents first),
else a busy class of the same pool holding at least two extents more than the borrower, so
two models in use level out rather than take turns. A pool keeps its floor
(`PoolConfig.floor_share`) while a namespace of it is registered, and a pool below its floor
may take from busy pools above theirs; otherwise a busy pool keeps what its stores took. An
extent holding a dirty, leased, pinned or reserved slot is never taken: a borrow that finds
its lenders dirty makes write-back write every dirty chunk (as a refused store does), even when
the store then evicts the borrower's own chunk, and a later store finds the extent clean. A class no
registered namespace uses (they expire when idle: `PoolRegistry`) gives its extents back the
same way and is forgotten, so `max_slot_classes` counts the classes in use.

Eviction takes the best victim of a replica over its quota first, else the best victim of any
replica, by the configured policy; a retired draft revision's chunks go before either. Slots
that are leased, pinned or not yet written to the next tier (dirty) are never evicted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

from kvtier.core.config import ArenaConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import CapacityError, PoolLayoutError
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import UsageStats
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.arena_usage import ReplicaUsage
from kvtier.tiers.eviction import make_policy
from kvtier.tiers.extents import Extents
from kvtier.tiers.slots import SlotClass

ClassKey = tuple[str, int]  # (pool, slot bytes)

_SCAN_LIMIT = 256  # slots inspected per queue when looking for a victim
_EXTENT_SCAN = 8  # a lender's extents inspected for one that can be cleared
BLANK_SHARE = 8
"""A class holds at most this fraction of its pool's slots reserved blank: slots engines hold
ahead of their stores never crowd out the stores themselves."""
_RECLAIM_RETRY_S = 0.05  # a class no class could lend to asks again after this long


class SlotHolder(Protocol):
    """What the room asks of the slots' keeper (`cpu_slots.ArenaSlots`)."""

    def evictable(self, slot: int) -> bool:
        """Whether ``slot``'s chunk may be evicted now (neither dirty nor leased)."""
        ...

    def owner_number(self, slot: int) -> int: ...

    def evict_slot(self, slot: int, reason: str) -> None:
        """Free ``slot``'s chunk, keeping its extent, counted as ``evictions_<reason>``."""
        ...

    def clear(self, slots: range, reason: str, owner: int | None) -> bool:
        """Evict every chunk in ``slots``; False, and nothing evicted, when one of them is
        reserved, leased, pinned, dirty or, with ``owner``, another replica's."""
        ...


class ArenaRoom:
    """Slot classes by (pool, slot bytes), the extent table, and the choice of a slot for a
    store. Guarded by the lock of `cpu_slots.ArenaSlots`, the ``slots`` that holds it."""

    def __init__(
        self,
        config: ArenaConfig,
        registry: PoolRegistry,
        memory: ArenaMemory,
        usage: ReplicaUsage,
        counters: Counters,
        slots: SlotHolder,
    ) -> None:
        self._config = config
        self._registry = registry
        self._memory = memory
        self._usage = usage
        self._capacity = usage.pool_capacity_bytes
        self._counters = counters
        self._slots = slots
        self.refused = 0
        """Stores refused for want of room since write-back last asked (`take_refused`)."""
        self._classes: dict[ClassKey, SlotClass] = {}
        self.by_key: Mapping[ClassKey, SlotClass] = MappingProxyType(self._classes)
        """The classes, read-only."""
        self._extents = Extents(memory)  # the owner's own table; the file's copy is for clients
        # the extent table's own lookups, bound here: they sit on every store's and load's path
        self.class_of: Callable[[int], SlotClass] = self._extents.class_of
        """The class holding a slot."""
        self.slot_offset: Callable[[int], int] = self._extents.slot_offset
        """Where a slot's bytes start in the arena."""
        self._policy_node = [0] * (memory.num_extents * memory.max_slots_per_extent)
        """slot -> its node in its class's eviction policy"""

    def class_for(self, reg: Registration) -> SlotClass:
        """The class for ``reg``'s chunks, made on first use (raising `PoolLayoutError` or
        `CapacityError` when it cannot be)."""
        cls = self._classes.get((reg.pool, reg.chunk_bytes))
        if cls is None:
            self._check(reg)
            if len(self._classes) >= self._config.max_slot_classes:
                self.forget_unused_classes()
            if len(self._classes) >= self._config.max_slot_classes:
                raise CapacityError(
                    f"the arena has {len(self._classes)} slot classes in use, the most "
                    f"arena.max_slot_classes allows; a pool of {reg.chunk_bytes}-byte chunks "
                    "needs one more: raise arena.max_slot_classes, or wait for idle namespaces "
                    "to expire (server.namespace_idle_s)"
                )
            policy = make_policy(self._config.eviction_policy, self._policy_node)
            per_extent = self._memory.extent_bytes // reg.chunk_bytes
            cls = self._classes[(reg.pool, reg.chunk_bytes)] = SlotClass(
                reg.pool, reg.chunk_bytes, policy, per_extent, time.monotonic()
            )
        return cls

    def _check(self, reg: Registration) -> None:
        """Raise `PoolLayoutError` when the arena cannot hold this pool's chunks."""
        if reg.pool not in self._config.pools:
            known = sorted(self._config.pools)
            raise PoolLayoutError(f"pool {reg.pool!r} has no arena budget; configured: {known}")
        if reg.chunk_bytes > self._memory.extent_bytes:
            raise PoolLayoutError(
                f"chunks of {reg.chunk_bytes} bytes exceed arena.extent_bytes "
                f"({self._memory.extent_bytes}); raise arena.extent_bytes"
            )
        smallest = self._memory.extent_bytes // self._memory.max_slots_per_extent
        if reg.chunk_bytes < smallest:
            # small models' chunks (fp8 hidden states, a few layers) fall below the default
            raise PoolLayoutError(
                f"{reg.pool} chunks of {reg.chunk_bytes} bytes are below arena.min_slot_bytes "
                f"({smallest}): set arena.min_slot_bytes to {reg.chunk_bytes} or less, or "
                "put more blocks in a chunk (blocks_per_chunk)"
            )

    def forget_unused_classes(self) -> None:
        """Give back the extents of classes no registered namespace uses, and forget those
        left with none."""
        live = self._registry.live_classes
        for key, cls in list(self._classes.items()):
            if key in live:
                continue
            for extent in cls.held():
                self._clear_extent(extent, "expired")
            if cls.extents:
                if cls.dirty_count:
                    self.refused += 1  # write-back then writes them all; the next pass clears
            else:
                del self._classes[key]
                self._counters.add("slot_classes_expired", 1)

    def live_counts(self) -> dict[str, int]:
        """Slot classes and namespaces in use now, and extents no class holds."""
        return {
            "slot_classes": len(self._classes),
            "namespaces": self._registry.live_count(),
            "free_extents": self._extents.free,
        }

    def pool_usage(self) -> dict[str, UsageStats]:
        """Bytes and chunks each pool holds, and its capacity."""
        pools: dict[str, UsageStats] = {}
        for cls in self._classes.values():
            usage = pools.setdefault(cls.pool, UsageStats())
            usage.used_bytes += cls.ready * cls.slot_bytes
            usage.chunks += cls.ready
        for name in pools:
            pools[name].capacity_bytes = self._capacity(name)
        return pools

    def past_clean_reserve(
        self, everything: bool, reserve: float, held_slots: Callable[[str, int], int]
    ) -> list[SlotClass]:
        """The classes whose clean or free slots are fewer than ``reserve`` of the slots they
        can reach, those ``held_slots`` holds for loads aside (all, with ``everything``)."""
        past = []
        for cls in self._classes.values():
            capacity = (cls.extents + self.growable_extents(cls)) * cls.per_extent
            # slots held for loads are neither free nor evictable
            clean_or_free = capacity - cls.dirty_count - held_slots(cls.pool, cls.slot_bytes)
            if everything or clean_or_free < reserve * capacity:
                past.append(cls)
        return past

    def dirty_count(self) -> int:
        """Chunks not yet written to the next tier."""
        return sum(c.dirty_count for c in self._classes.values())

    def take_refused(self) -> int:
        refused, self.refused = self.refused, 0
        return refused

    # -- allocation and eviction ----------------------------------------------------------

    def _pool_extents(self, pool: str) -> int:
        return sum(c.extents for c in self._classes.values() if c.pool == pool)

    def growable_extents(self, cls: SlotClass) -> int:
        """Extents ``cls`` may still take: free ones, within its pool's share."""
        limit = self._capacity(cls.pool) // self._memory.extent_bytes
        return max(0, min(self._extents.free, limit - self._pool_extents(cls.pool)))

    def _grow(self, cls: SlotClass) -> bool:
        return self.growable_extents(cls) > 0 and self._extents.take(cls)

    def _borrow(self, cls: SlotClass, owner: int | None = None) -> bool:
        """Take an extent from another class for ``cls`` (see the module's text); with ``owner``,
        only an extent holding that replica's chunks alone."""
        now = time.monotonic()
        if now < cls.reclaim_after:
            return False
        dirty_lender = False
        for lender in self._lenders(cls, now):
            for extent in heapq.nlargest(_EXTENT_SCAN, lender.held()):  # stores fill low first
                if self._clear_extent(extent, "reclaim", owner):
                    self._counters.add("extents_lent", 1)
                    return self._extents.take(cls)
            dirty_lender = dirty_lender or lender.dirty_count > 0
        if dirty_lender and not self.refused:
            # the store may yet succeed by evicting the borrower's own chunks, so nothing is
            # refused: press write-back anyway (once until it asks), or the lender's extents
            # stay dirty for as long as the clean reserve leaves them so
            self.refused = 1
        cls.reclaim_after = now + _RECLAIM_RETRY_S
        return False

    def _floor(self, pool: str) -> int:
        share = self._config.pools[pool]
        return int(self._memory.num_extents * min(share.floor_share, share.max_share))

    def _lenders(self, cls: SlotClass, now: float) -> list[SlotClass]:
        """The classes that may lend ``cls`` an extent, the ones to ask first first."""
        held = self._pool_extents(cls.pool)
        room = held < self._capacity(cls.pool) // self._memory.extent_bytes
        below_floor = held < self._floor(cls.pool)
        live_pools = {pool for pool, _ in self._registry.live_classes}
        session_classes = self._registry.held_classes()
        idle: list[SlotClass] = []
        busy: list[SlotClass] = []
        for other in self._classes.values():
            if other is cls or not other.extents:
                continue
            if other.pool != cls.pool:
                if not room:
                    continue  # the pool is at its share: only its own classes lend to it
                lender_floor = self._floor(other.pool) if other.pool in live_pools else 0
                if self._pool_extents(other.pool) <= lender_floor:
                    continue
            # a class no open session holds is idle now: its engines went away
            unheld = (
                session_classes is not None
                and (other.pool, other.slot_bytes) not in session_classes
            )
            if unheld or now - other.last_used >= self._config.reclaim_idle_s:
                idle.append(other)
            elif other.pool != cls.pool:
                # a busy pool keeps what its stores took above the floors: a draft beside its
                # target would otherwise level out with it, and its chunks are worth little alone
                if below_floor:
                    busy.append(other)
            elif other.extents > cls.extents + 1:
                busy.append(other)
        idle.sort(key=lambda c: (-c.extents, c.last_used))
        busy.sort(key=lambda c: -c.extents)
        return idle + busy

    def _clear_extent(self, extent: int, reason: str, owner: int | None = None) -> bool:
        """Evict every chunk in ``extent`` and give it back (see `SlotHolder.clear`)."""
        if not self._slots.clear(self._extents.slots_of(extent), reason, owner):
            return False
        self._give_back(extent)
        return True

    def _give_back(self, extent: int) -> None:
        self._extents.give_back(extent)
        self._counters.add("extents_returned", 1)

    def _first_victim(self, cls: SlotClass, queue: int) -> int | None:
        for scanned, slot in enumerate(cls.policy.candidates(queue)):
            if scanned >= _SCAN_LIMIT:
                break
            if self._slots.evictable(slot):
                return slot
        return None

    def _retired_victim(self, cls: SlotClass, q: int | None, reason: str) -> tuple[int, str] | None:
        """A chunk of a retired draft revision (of replica ``q``, when given): these go first."""
        for slot in itertools.islice(cls.retired, _SCAN_LIMIT):
            if self._slots.evictable(slot) and (q is None or self._slots.owner_number(slot) == q):
                self._counters.add("retired_evicted", 1)
                return slot, reason
        return None

    def _victim(self, cls: SlotClass) -> tuple[int, str] | None:
        retired = self._retired_victim(cls, None, "capacity")
        if retired is not None:
            return retired
        for q in self._usage.over_quota_replicas(cls.pool):
            slot = self._first_victim(cls, q)
            if slot is not None:
                return slot, "quota"
        best: int | None = None
        for q in range(cls.policy.queues):
            slot = self._first_victim(cls, q)
            if slot is not None and (best is None or cls.policy.rank(slot) < cls.policy.rank(best)):
                best = slot
        return None if best is None else (best, "capacity")

    def _admits_blank(self, cls: SlotClass, q: int) -> bool:
        """Whether ``cls`` may hold one more slot reserved blank for replica ``q``: at most
        `BLANK_SHARE` of its pool, or of the replica's quota where that is less."""
        usage = self._usage
        room = min(
            usage.pool_capacity_bytes(cls.pool), usage.quota_bytes(usage.name_of(q), cls.pool)
        )
        return cls.blank < room // cls.slot_bytes // BLANK_SHARE

    def allocate(self, cls: SlotClass, q: int, blank: bool = False) -> int | None:
        """A free slot of ``cls`` for replica ``q``, room made if need be; None, counted as
        refused, when there is none to make. ``blank``: for a blank key, counted in
        ``cls.blank``, and refused past `_admits_blank`."""
        if blank:
            if not self._admits_blank(cls, q):
                self._counters.add("blank_refused", 1)
                return None
            cls.blank += 1  # undone below where no slot is found
        slot = cls.take_free()
        if slot is None:
            slot = self._make_room(cls, q)
            if slot is None:
                self._counters.add("store_rejected", 1)
                self.refused += 1
                cls.blank -= blank
        return slot

    def _make_room(self, cls: SlotClass, q: int) -> int | None:
        if self._grow(cls):
            return cls.take_free()
        if self._usage.over_quota(q, cls.pool, cls.slot_bytes):
            # a replica at its quota makes room from its own chunks only, or stores nothing;
            # an idle class's extent holding them goes before the class's own chunks, as below
            victim = self._retired_victim(cls, q, "quota")
            if victim is None and self._borrow(cls, owner=q):
                return cls.take_free()
            if victim is None:
                slot = self._first_victim(cls, q)
                victim = None if slot is None else (slot, "quota")
                if victim is None:
                    self._counters.add("store_over_quota", 1)
        elif self._borrow(cls):
            return cls.take_free()
        else:
            victim = self._victim(cls)
        if victim is None:
            return None
        slot, reason = victim
        self._slots.evict_slot(slot, reason)
        return cls.take_free()

    def free_slot(self, slot: int, cls: SlotClass, keep_extent: bool) -> None:
        """Return a slot to its class ``cls``; an extent left with no slot in use goes back to
        the arena, unless ``keep_extent``."""
        extent = self._extents.extent_of(slot)
        if cls.put_free(extent, slot) and not keep_extent:
            self._give_back(extent)
