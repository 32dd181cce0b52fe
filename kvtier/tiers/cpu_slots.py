"""The arena's slots as the cpu tier keeps them: one slot size class per pool and chunk size,
growing by whole extents up to its pool's share of the arena (a small draft pool wastes nothing
on target-sized slots), per-replica quotas, and eviction.

Extents come back: an extent whose slots are all free returns to the free list, and a class
with no free slot and no free extent takes one from another class, evicting that extent's clean
chunks. The lender is a class idle for `ArenaConfig.reclaim_idle_s`, or at once one whose
namespaces no open session of kvtierd holds (the one holding the most idle extents first),
else a busy class of the same pool holding at least two extents more than the borrower, so
two models in use level out rather than take turns. A pool keeps its floor
(`PoolConfig.floor_share`) while a namespace of it is registered, and a pool below its floor
may take from busy pools above theirs; otherwise a busy pool keeps what its stores took. An
extent holding a dirty, leased, pinned or reserved slot is never taken: the refused store makes
write-back write every dirty chunk, and the next store finds the extent clean. A class no
registered namespace uses (they expire when idle: `PoolRegistry`) gives its extents back the
same way and is forgotten, so `max_slot_classes` counts the classes in use.

Eviction takes the best victim of a replica over its quota first, else the best victim of any
replica, by the configured policy; a retired draft revision's chunks go before either. Slots
that are leased, pinned or not yet written to the next tier (dirty) are never evicted.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import psutil

from kvtier.core import blockfmt
from kvtier.core.config import ArenaConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import CapacityError, PoolLayoutError
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import SlotRef
from kvtier.tiers.arena import ArenaMemory, resolve_group
from kvtier.tiers.commit_checksums import CommitChecksums
from kvtier.tiers.eviction import make_policy
from kvtier.tiers.extents import Extents
from kvtier.tiers.slots import FREE, READY, WRITING, SlotClass, SlotTable, default_arena_size

log = logging.getLogger("kvtier.tiers.cpu")  # the tier's logger, which operators filter on

_SCAN_LIMIT = 256  # slots inspected per queue when looking for a victim
_EXTENT_SCAN = 8  # a lender's extents inspected for one that can be cleared
_RECLAIM_RETRY_S = 0.05  # a class no class could lend to asks again after this long


class ArenaSlots:
    """The slot bookkeeping `cpu.CpuTier` holds: the arena's memory, classes, each slot's key,
    owner and flags, quotas, victims. Its lock guards all of it; callers take it around the
    methods here, which change the bookkeeping in place. ``tell`` hears of chunks leaving."""

    def __init__(
        self,
        config: ArenaConfig,
        registry: PoolRegistry,
        tell: Callable[[bool, Sequence[ChunkKey]], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.tell = tell
        if config.size_bytes is None:
            size = default_arena_size(config.auto_fraction, config.path.parent)
        else:
            size = int(config.size_bytes)
        self._check_memory(size)
        self.memory = ArenaMemory.create(
            config.path,
            size,
            config.extent_for(size),
            config.min_slot_bytes,
            config.prefault,
            mode=config.file_mode,
            gid=resolve_group(config.group, "arena.group"),
        )
        mem = self.memory
        n = mem.num_extents * mem.max_slots_per_extent
        self.table = SlotTable(mem)
        self.lock = threading.RLock()
        self._extents = Extents(mem)  # the owner's own table; the file's copy is for clients
        self.classes: dict[tuple[str, int], SlotClass] = {}
        self._policy_node = [0] * n  # slot -> its node in its class's eviction policy
        self.committed: dict[ChunkKey, int] = {}  # committed chunks
        self.writing: dict[ChunkKey, int] = {}  # reserved, not yet committed
        self.keys: list[ChunkKey | None] = [None] * n
        self.owner = [0] * n
        self.dirty = [False] * n
        self.pinned = [False] * n
        self.pinned_keys: set[ChunkKey] = set()
        self.hidden = [False] * n  # dropped while leased: out of the index, freed on release
        self.replicas: dict[str, int] = {}
        self.replica_names: list[str] = []
        self.used: Counter[tuple[int, str]] = Counter()  # (replica, pool) -> bytes
        self.inflight: Counter[tuple[int, str]] = Counter()  # reserved, not committed
        self.chunks: Counter[tuple[int, str]] = Counter()  # (replica, pool) -> chunks
        self._quota_override: dict[tuple[str, str], int] = {}
        self.retired: set[bytes] = set()  # namespaces whose chunks go first
        self.counters = Counters()
        self.checksums = CommitChecksums(
            n,
            self.lock,
            lambda ref: self.current(ref, READY),
            self._payload_checksum,
            self.counters,
        )
        self.refused = 0
        """Stores refused for want of room since write-back last asked (`CpuTier.take_refused`)."""
        registry.admit_with(self.accept)  # a pool the arena refuses is never registered
        log.info(
            "arena %s: %.2f GiB, %d extents of %d MiB",
            config.path,
            mem.size / 2**30,
            mem.num_extents,
            mem.extent_bytes >> 20,
        )

    # -- set-up ---------------------------------------------------------------------------

    def _check_memory(self, size: int) -> None:
        total = psutil.virtual_memory().total
        if size > total:
            raise CapacityError(
                f"arena.size_bytes: {size} bytes exceeds this machine's {total} bytes of memory"
            )

    def replica(self, name: str) -> int:
        q = self.replicas.get(name)
        if q is None:
            q = self.replicas[name] = len(self.replica_names)
            self.replica_names.append(name)
        return q

    def accept(self, reg: Registration) -> None:
        """Check that the arena can hold this pool's chunks (raises `PoolLayoutError`)."""
        with self.lock:
            self.class_for(reg)

    def class_for(self, reg: Registration) -> SlotClass:
        cls = self.classes.get((reg.pool, reg.chunk_bytes))
        if cls is None:
            if reg.pool not in self.config.pools:
                known = sorted(self.config.pools)
                raise PoolLayoutError(f"pool {reg.pool!r} has no arena budget; configured: {known}")
            if reg.chunk_bytes > self.memory.extent_bytes:
                raise PoolLayoutError(
                    f"chunks of {reg.chunk_bytes} bytes exceed arena.extent_bytes "
                    f"({self.memory.extent_bytes}); raise arena.extent_bytes"
                )
            smallest = self.memory.extent_bytes // self.memory.max_slots_per_extent
            if reg.chunk_bytes < smallest:
                # small models' chunks (fp8 hidden states, a few layers) fall below the default
                raise PoolLayoutError(
                    f"{reg.pool} chunks of {reg.chunk_bytes} bytes are below arena.min_slot_bytes "
                    f"({smallest}): set arena.min_slot_bytes to {reg.chunk_bytes} or less, or "
                    "put more blocks in a chunk (blocks_per_chunk)"
                )
            if len(self.classes) >= self.config.max_slot_classes:
                self._forget_unused_classes()
            if len(self.classes) >= self.config.max_slot_classes:
                raise CapacityError(
                    f"the arena has {len(self.classes)} slot classes in use, the most "
                    f"arena.max_slot_classes allows; a pool of {reg.chunk_bytes}-byte chunks "
                    "needs one more: raise arena.max_slot_classes, or wait for idle namespaces "
                    "to expire (server.namespace_idle_s)"
                )
            policy = make_policy(self.config.eviction_policy, self._policy_node)
            per_extent = self.memory.extent_bytes // reg.chunk_bytes
            cls = self.classes[(reg.pool, reg.chunk_bytes)] = SlotClass(
                reg.pool, reg.chunk_bytes, policy, per_extent, time.monotonic()
            )
        return cls

    def expire_idle(self) -> None:
        """Expire idle namespaces, then forget the slot classes none uses any more."""
        self.registry.expire_idle()
        with self.lock:
            self._forget_unused_classes()

    def _forget_unused_classes(self) -> None:
        live = self.registry.live_classes
        for key, cls in list(self.classes.items()):
            if key in live:
                continue
            for extent in cls.held():
                self._clear_extent(extent, "expired")
            if cls.extents:
                if cls.dirty_count:
                    self.refused += 1  # write-back then writes them all; the next pass clears
            else:
                del self.classes[key]
                self.counters.add("slot_classes_expired", 1)

    def live_counts(self) -> dict[str, int]:
        """Slot classes and namespaces in use now, and extents no class holds."""
        with self.lock:
            return {
                "slot_classes": len(self.classes),
                "namespaces": self.registry.live_count(),
                "free_extents": self._extents.free,
            }

    def pool_capacity_bytes(self, pool: str) -> int:
        share = self.config.pools[pool].max_share
        return max(1, int(self.memory.num_extents * share)) * self.memory.extent_bytes

    def quota_bytes(self, replica: str, pool: str) -> int:
        override = self._quota_override.get((replica, pool))
        if override is not None:
            return override
        return int(self.pool_capacity_bytes(pool) * self.config.pools[pool].replica_share)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        with self.lock:
            if nbytes is None:
                self._quota_override.pop((replica, pool), None)
            else:
                self._quota_override[(replica, pool)] = nbytes

    # -- allocation and eviction ----------------------------------------------------------

    def _pool_extents(self, pool: str) -> int:
        return sum(c.extents for c in self.classes.values() if c.pool == pool)

    def growable_extents(self, cls: SlotClass) -> int:
        """Extents ``cls`` may still take: free ones, within its pool's share."""
        limit = self.pool_capacity_bytes(cls.pool) // self.memory.extent_bytes
        return max(0, min(self._extents.free, limit - self._pool_extents(cls.pool)))

    def _grow(self, cls: SlotClass) -> bool:
        return self.growable_extents(cls) > 0 and self._extents.take(cls)

    def _borrow(self, cls: SlotClass, owner: int | None = None) -> bool:
        """Take an extent from another class for ``cls`` (see the module's text); with
        ``owner``, only an extent holding that replica's chunks alone."""
        now = time.monotonic()
        if now < cls.reclaim_after:
            return False
        for lender in self._lenders(cls, now):
            for extent in heapq.nlargest(_EXTENT_SCAN, lender.held()):  # stores fill low first
                if self._clear_extent(extent, "reclaim", owner):
                    self.counters.add("extents_lent", 1)
                    return self._extents.take(cls)
        cls.reclaim_after = now + _RECLAIM_RETRY_S
        return False

    def _floor(self, pool: str) -> int:
        share = self.config.pools[pool]
        return int(self.memory.num_extents * min(share.floor_share, share.max_share))

    def _lenders(self, cls: SlotClass, now: float) -> list[SlotClass]:
        held = self._pool_extents(cls.pool)
        room = held < self.pool_capacity_bytes(cls.pool) // self.memory.extent_bytes
        below_floor = held < self._floor(cls.pool)
        live_pools = {pool for pool, _ in self.registry.live_classes}
        session_classes = self.registry.held_classes()
        idle: list[SlotClass] = []
        busy: list[SlotClass] = []
        for other in self.classes.values():
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
            if unheld or now - other.last_used >= self.config.reclaim_idle_s:
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
        """Evict every chunk in ``extent`` and give it back; False, and nothing evicted, when
        one of its slots is reserved, leased, pinned, dirty (not yet written back) or, with
        ``owner``, holds another replica's chunk."""
        slots = self._extents.slots_of(extent)
        state = self.table.state
        for slot in slots:
            if state[slot] == WRITING or (
                state[slot] == READY
                and (
                    self.dirty[slot]
                    or self.pinned[slot]
                    or self.table.refcount[slot]
                    or (owner is not None and self.owner[slot] != owner)
                )
            ):
                return False
        for slot in slots:
            if state[slot] == READY:
                self.release_slot(slot, keep_extent=True)
                self.counters.add(f"evictions_{reason}", 1)
        self._give_back(extent)
        return True

    def _give_back(self, extent: int) -> None:
        self._extents.give_back(extent)
        self.counters.add("extents_returned", 1)

    def _evictable(self, slot: int) -> bool:
        return not self.dirty[slot] and self.table.refcount[slot] == 0

    def _first_victim(self, cls: SlotClass, queue: int) -> int | None:
        for scanned, slot in enumerate(cls.policy.candidates(queue)):
            if scanned >= _SCAN_LIMIT:
                break
            if self._evictable(slot):
                return slot
        return None

    def _retired_victim(self, cls: SlotClass, q: int | None, reason: str) -> tuple[int, str] | None:
        """A chunk of a retired draft revision (of replica ``q``, when given): these go first."""
        for slot in itertools.islice(cls.retired, _SCAN_LIMIT):
            if self._evictable(slot) and (q is None or self.owner[slot] == q):
                self.counters.add("retired_evicted", 1)
                return slot, reason
        return None

    def _victim(self, cls: SlotClass) -> tuple[int, str] | None:
        retired = self._retired_victim(cls, None, "capacity")
        if retired is not None:
            return retired
        over = []
        for name, q in self.replicas.items():
            excess = self.used[(q, cls.pool)] - self.quota_bytes(name, cls.pool)
            if excess > 0:
                over.append((excess, q))
        for _excess, q in sorted(over, reverse=True):
            slot = self._first_victim(cls, q)
            if slot is not None:
                return slot, "quota"
        best: int | None = None
        for q in range(cls.policy.queues):
            slot = self._first_victim(cls, q)
            if slot is not None and (best is None or cls.policy.rank(slot) < cls.policy.rank(best)):
                best = slot
        return None if best is None else (best, "capacity")

    def _over_quota(self, q: int, cls: SlotClass) -> bool:
        name = self.replica_names[q]
        held = self.used[(q, cls.pool)] + self.inflight[(q, cls.pool)]
        return held + cls.slot_bytes > self.quota_bytes(name, cls.pool)

    def allocate(self, cls: SlotClass, q: int) -> int | None:
        slot = cls.take_free()
        if slot is None and self._grow(cls):
            slot = cls.take_free()
        if slot is not None:
            return slot
        if self._over_quota(q, cls):
            # a replica at its quota makes room from its own chunks only, or stores nothing
            victim = self._retired_victim(cls, q, "quota")
            if victim is None:
                slot = self._first_victim(cls, q)
                victim = None if slot is None else (slot, "quota")
                if victim is None and self._borrow(cls, owner=q):
                    return cls.take_free()
                if victim is None:
                    self.counters.add("store_over_quota", 1)
        elif self._borrow(cls):
            return cls.take_free()
        else:
            victim = self._victim(cls)
        if victim is None:
            return None
        slot, reason = victim
        self.release_slot(slot, keep_extent=True)
        self.counters.add(f"evictions_{reason}", 1)
        return cls.take_free()

    def release_slot(self, slot: int, keep_extent: bool = False) -> None:
        """Return a READY or WRITING slot to its class's free list and bump its generation; an
        extent left with no slot in use goes back to the arena, unless ``keep_extent``."""
        cls = self._extents.class_of(slot)
        key = self.keys[slot]
        if self.table.state[slot] == READY:
            assert key is not None
            if self.hidden[slot]:
                self.hidden[slot] = False
            else:
                self.unpublish(key)
            cls.policy.remove(slot)
            cls.retired.discard(slot)
            cls.ready -= 1
            self.used[(self.owner[slot], cls.pool)] -= cls.slot_bytes
            self.chunks[(self.owner[slot], cls.pool)] -= 1
            if self.dirty[slot]:
                self.dirty[slot] = False
                cls.dirty_count -= 1
        elif key is not None and self.writing.pop(key, None) is not None:
            self.inflight[(self.owner[slot], cls.pool)] -= cls.slot_bytes
        self.keys[slot] = None
        self.pinned[slot] = False
        self.checksums.forget(slot)
        self.table.bump_generation(slot)
        self.table.set_state(slot, FREE)
        extent = self._extents.extent_of(slot)
        if cls.put_free(extent, slot) and not keep_extent:
            self._give_back(extent)

    def unpublish(self, key: ChunkKey) -> None:
        del self.committed[key]
        self.memory.index.remove(key)  # before the generation moves: see arena_index.py
        self.tell(False, [key])

    def ref(self, key: ChunkKey, slot: int, nbytes: int) -> SlotRef:
        offset = self._extents.slot_offset(slot)
        return SlotRef(key, slot, offset, nbytes, self.table.generation[slot])

    def current(self, ref: SlotRef, state: int) -> bool:
        return (
            0 <= ref.slot < len(self.keys)
            and self.keys[ref.slot] == ref.key
            and self.table.state[ref.slot] == state
            and self.table.generation[ref.slot] == ref.generation
        )

    def _payload_checksum(self, ref: SlotRef) -> bytes:
        """The slot's bytes hashed in place in the mapping (the hash drops the GIL), over the
        length write-back copies."""
        nbytes = self.class_of(ref.slot).slot_bytes
        return blockfmt.payload_checksum(
            self.memory.view(self._extents.slot_offset(ref.slot), nbytes)
        )

    def class_of(self, slot: int) -> SlotClass:
        return self._extents.class_of(slot)
