"""The arena's slots as the cpu tier keeps them, and every move of a slot: FREE -> WRITING
(reserved) -> READY (committed, visible) -> FREE, its generation bumped each time it is freed
so that a stale reservation or lease is recognised instead of trusted; leases, dirty and pinned
flags beside. One slot size class per pool and chunk size (`arena_room`), growing by whole
extents up to its pool's share of the arena (a small draft pool wastes nothing on target-sized
slots), per-replica quotas (`arena_usage`), and eviction.

Which slot a store gets, which chunks make room, and how extents move between classes is
`arena_room`'s part; slots that are leased, pinned or not yet written to the next tier (dirty)
are never evicted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

from kvtier.core import blockfmt
from kvtier.core.config import ArenaConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey, is_blank, may_name, namespace_of
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import SlotRef, TierStats
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.arena_room import ArenaRoom, ClassKey
from kvtier.tiers.arena_usage import ReplicaUsage
from kvtier.tiers.commit_checksums import ChecksumLedger, CommitChecksums
from kvtier.tiers.slots import FREE, READY, WRITING, SlotClass, SlotTable

log = logging.getLogger("kvtier.tiers.cpu")  # the tier's logger, which operators filter on


class ArenaSlots:
    """The arena's memory and every slot's key, owner, state and flags, which `cpu.CpuTier`
    asks for in batches; its lock guards all of it. ``tell`` hears of chunks arriving (True)
    and leaving (False); ``counters`` counts the events."""

    def __init__(
        self,
        config: ArenaConfig,
        registry: PoolRegistry,
        memory: ArenaMemory,
        tell: Callable[[bool, Sequence[ChunkKey]], None],
        counters: Counters,
    ) -> None:
        self._config = config
        self._registry = registry
        self._tell = tell
        self.memory = mem = memory
        n = mem.num_extents * mem.max_slots_per_extent
        self.slot_count = n
        self._table = SlotTable(mem)
        self._lock = threading.RLock()
        self.usage = ReplicaUsage(config, mem.num_extents, mem.extent_bytes)
        self._committed: dict[ChunkKey, int] = {}  # committed chunks
        self._writing: dict[ChunkKey, int] = {}  # reserved, not yet committed
        self._keys: list[ChunkKey | None] = [None] * n
        self._owner = [0] * n
        self._dirty = [False] * n
        self._pinned = [False] * n
        self._pinned_keys: set[ChunkKey] = set()
        self._hidden = [False] * n  # dropped while leased: out of the index, freed on release
        self._retired: set[bytes] = set()  # namespaces whose chunks go first
        self._counters = counters
        self._checksums = CommitChecksums(
            n,
            self._lock,
            lambda ref: self._current(ref, READY),
            self._payload_checksum,
            counters,
        )
        self._room = ArenaRoom(config, registry, mem, self.usage, counters, self)
        self._closed = False
        registry.admit_with(self.accept)  # a pool the arena refuses is never registered

    # -- set-up and classes ---------------------------------------------------------------

    def keep_checksums_in(self, ledger: ChecksumLedger | None) -> None:
        """Record commit checksums in ``ledger`` too, for the arena's next owner."""
        self._checksums.keep_in(ledger, self._span)

    def _span(self, slot: int) -> tuple[int, int]:
        """Where this process placed ``slot``: (offset, nbytes)."""
        return self.memory.slot_offset(slot), self._room.class_of(slot).slot_bytes

    def accept(self, reg: Registration) -> None:
        """Check that the arena can hold this pool's chunks (raises `PoolLayoutError`)."""
        with self._lock:
            self._room.class_for(reg)

    @property
    def classes(self) -> Mapping[ClassKey, SlotClass]:
        """The slot classes by (pool, slot bytes), read-only."""
        return self._room.by_key

    def expire_idle(self) -> None:
        """Expire idle namespaces, then forget the slot classes none uses any more."""
        self._registry.expire_idle()
        with self._lock:
            self._room.forget_unused_classes()

    def live_counts(self) -> dict[str, int]:
        """Slot classes and namespaces in use now, and extents no class holds."""
        with self._lock:
            return self._room.live_counts()

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        with self._lock:
            self.usage.set_quota(replica, pool, nbytes)

    # -- the store path: reserve -> write -> commit | abort -------------------------------

    def reserve(
        self, keys: Sequence[ChunkKey], regs: Sequence[Registration], replica: str
    ) -> list[SlotRef | None]:
        """A WRITING slot per key; None for a key present, in flight, or with no room."""
        out: list[SlotRef | None] = []
        now = time.monotonic()
        with self._lock:
            q = self.usage.number(replica)
            for key, reg in zip(keys, regs, strict=True):
                if key in self._committed or key in self._writing:
                    self._counters.add("store_duplicate", 1)
                    out.append(None)
                    continue
                cls = self._room.class_for(reg)
                cls.last_used = now
                slot = self._room.allocate(cls, q, blank=is_blank(key))
                if slot is None:
                    out.append(None)
                    continue
                self._keys[slot] = key
                self._owner[slot] = q
                self._writing[key] = slot
                self.usage.reserved(q, cls.pool, cls.slot_bytes)
                self._table.set_state(slot, WRITING)
                out.append(self._ref(key, slot, reg.chunk_bytes))
        return out

    def commit(self, refs: Sequence[SlotRef], *, dirty: bool, lease: bool) -> int:
        """Make reserved slots READY and visible; ``dirty`` marks them for write-back, and
        ``lease`` takes a read lease on each. Returns how many were still reserved. A blank
        slot (`kvtier.core.keys.blank_key`) takes the chunk its ref names, unless held already."""
        done = 0
        committed: list[ChunkKey] = []
        hashing = dirty and self._config.commit_checksum
        with self._lock:
            for ref in refs:
                if not self._current(ref, WRITING) or is_blank(ref.key):
                    self._counters.add("commit_stale", 1)
                    continue
                slot = ref.slot
                cls = self._room.class_of(slot)
                if (blank := self._keys[slot]) != ref.key:  # reserved blank: named now
                    if ref.key in self._committed or ref.key in self._writing:
                        self._release_slot(slot)
                        self._counters.add("store_duplicate", 1)
                        continue
                    self._writing[ref.key] = self._writing.pop(blank)  # type: ignore[arg-type]
                    self._keys[slot] = ref.key
                    cls.blank -= 1
                q = self._owner[slot]
                del self._writing[ref.key]
                self._committed[ref.key] = slot
                self._table.set_state(slot, READY)
                self.memory.index.insert(ref.key, slot)
                cls.ready += 1
                self.usage.committed(q, cls.pool, cls.slot_bytes)
                if ref.key in self._pinned_keys:
                    self._pinned[slot] = True
                else:
                    cls.policy.insert(slot, q)
                    if self._retired and namespace_of(ref.key) in self._retired:
                        cls.retired.add(slot)
                if dirty:
                    self._dirty[slot] = True
                    cls.dirty_count += 1
                    cls.dirty.append((slot, ref.generation))
                    if hashing:
                        self._checksums.later(ref)
                if lease:
                    self._table.add_ref(slot, 1)
                self._counters.add("stores", 1)
                done += 1
                committed.append(ref.key)
            self._tell(True, committed)
        return done

    def abort(self, refs: Sequence[SlotRef], counter: str) -> int:
        """Free reserved slots, counting ``counter`` for each; returns how many were reserved."""
        done = 0
        with self._lock:
            for ref in refs:
                if self._current(ref, WRITING):
                    self._release_slot(ref.slot)
                    self._counters.add(counter, 1)
                    done += 1
        return done

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return list(map(self._committed.__contains__, keys))

    def slot_of(self, key: ChunkKey) -> int | None:
        """The slot holding committed ``key``."""
        return self._committed.get(key)

    @property
    def reserved(self) -> int:
        """Slots reserved and not yet committed or aborted."""
        return len(self._writing)

    # -- the load path: lease -> read -> release ------------------------------------------

    def lease(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        """A refcounted read lease per present key; a leased slot is never freed."""
        out: list[SlotRef | None] = []
        now = time.monotonic()
        with self._lock:
            for key in keys:
                slot = self._committed.get(key)
                if slot is None:
                    self._counters.add("misses", 1)
                    out.append(None)
                    continue
                cls = self._room.class_of(slot)
                self._table.add_ref(slot, 1)
                cls.policy.access(slot)
                cls.last_used = now
                self._counters.add("hits", 1)
                out.append(self._ref(key, slot, cls.slot_bytes))
        return out

    def release(self, refs: Sequence[SlotRef], counter: str) -> None:
        """End leases; ``counter`` names an event counted for each (none when empty)."""
        with self._lock:
            for ref in refs:
                if self._current(ref, READY) and self._table.refcount[ref.slot] > 0:
                    if counter:
                        self._counters.add(counter, 1)
                    self._table.add_ref(ref.slot, -1)
                    if self._hidden[ref.slot] and self._table.refcount[ref.slot] == 0:
                        self._release_slot(ref.slot)
                else:
                    self._counters.add("release_stale", 1)

    # -- write-back -----------------------------------------------------------------------

    def take_dirty(
        self, limit: int, everything: bool, reserve: float, held_slots: Callable[[str, int], int]
    ) -> list[SlotRef]:
        """Lease up to ``limit`` dirty chunks, oldest first, from the classes past their clean
        ``reserve`` (all, with ``everything``; see `ArenaRoom.past_clean_reserve`)."""
        out: list[SlotRef] = []
        with self._lock:
            for cls in self._room.past_clean_reserve(everything, reserve, held_slots):
                while cls.dirty and len(out) < limit:
                    slot, gen = cls.dirty.popleft()
                    key = self._keys[slot]
                    if key is None or not self._dirty[slot] or self._table.generation[slot] != gen:
                        continue  # freed or re-used since it was queued
                    self._table.add_ref(slot, 1)
                    out.append(self._ref(key, slot, cls.slot_bytes))
        return out

    def take_refused(self) -> int:
        """Stores refused for want of a free or clean slot since last asked."""
        with self._lock:
            return self._room.take_refused()

    def writeback_pending(self) -> int:
        with self._lock:
            return self._room.dirty_count()

    def commit_checksum(self, ref: SlotRef, take_now: bool) -> bytes | None:
        """The payload checksum taken when ``ref``'s chunk was committed (`CommitChecksums.of`)."""
        return self._checksums.of(ref, take_now=take_now)

    def writeback_done(
        self,
        refs: Sequence[SlotRef],
        ok: bool,
        changed: Collection[ChunkKey],
        skipped: Collection[ChunkKey],
    ) -> None:
        """End write-back leases, the chunks clean; those in ``changed`` are dropped, those in
        ``skipped`` were never written and count apart from the written ones."""
        with self._lock:
            for ref in refs:
                if not self._current(ref, READY):
                    continue
                slot = ref.slot
                self._table.add_ref(slot, -1)
                if self._dirty[slot]:
                    self._dirty[slot] = False
                    self._room.class_of(slot).dirty_count -= 1
                if ref.key in changed:
                    self._drop_changed(ref)
                    continue
                if ref.key in skipped:
                    self._counters.add("writeback_skipped", 1)
                else:
                    self._counters.add("writeback_ok" if ok else "writeback_failed", 1)

    def _drop_changed(self, ref: SlotRef) -> None:
        """Drop a chunk whose bytes changed after its commit: lookups miss it from now on; a
        leased slot leaves the index now and is freed when its last lease ends."""
        slot = ref.slot
        cls = self._room.class_of(slot)
        log.error(
            "arena: chunk %s (pool %s, replica %s) changed after it was committed: its "
            "checksum no longer matches; dropped, not written back",
            ref.key.hex(),
            cls.pool,
            self.usage.name_of(self._owner[slot]),
        )
        self._counters.add("corrupt", 1)
        self._counters.add(f"corrupt:{cls.pool}", 1)
        self._checksums.forget(slot)
        if self._table.refcount[slot] == 0:
            self._release_slot(slot)
            return
        self._unpublish(ref.key)
        self._hidden[slot] = True
        cls.policy.remove(slot)
        cls.retired.discard(slot)

    # -- what operators and the tiers above ask -------------------------------------------

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Free the chunks of ``keys`` no lease holds; returns how many."""
        dropped = 0
        with self._lock:
            for key in keys:
                slot = self._committed.get(key)
                if slot is not None and self._table.refcount[slot] == 0:
                    self._release_slot(slot)
                    dropped += 1
        return dropped

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> None:
        """Pin keys (present or stored later) out of eviction, or unpin them."""
        with self._lock:
            for key in keys:
                (self._pinned_keys.add if pinned else self._pinned_keys.discard)(key)
                slot = self._committed.get(key)
                if slot is None or self._pinned[slot] == pinned:
                    continue
                self._pinned[slot] = pinned
                policy = self._room.class_of(slot).policy
                if pinned:
                    policy.remove(slot)
                else:
                    policy.insert(slot, self._owner[slot])

    def evict(self, pool: str | None, namespace: bytes | None, replica: str | None) -> int:
        """Free the chunks that match, unless pinned or leased; returns how many."""
        dropped = 0
        with self._lock:
            q = self.usage.find(replica) if replica is not None else None
            if replica is not None and q is None:
                return 0
            for key, slot in list(self._committed.items()):
                if self._pinned[slot] or self._table.refcount[slot] != 0:
                    continue
                if pool is not None and self._room.class_of(slot).pool != pool:
                    continue
                if namespace is not None and namespace_of(key) != namespace:
                    continue
                if q is not None and self._owner[slot] != q:
                    continue
                self._release_slot(slot)
                dropped += 1
            self._counters.add("evictions_admin", dropped)
        return dropped

    def mark_retired(self, namespace: bytes, retired: bool) -> None:
        """Have a namespace's chunks evicted before any other, or no longer."""
        with self._lock:
            (self._retired.add if retired else self._retired.discard)(namespace)
            for key, slot in self._committed.items():
                if namespace_of(key) == namespace and not self._pinned[slot]:
                    cls = self._room.class_of(slot)
                    (cls.retired.add if retired else cls.retired.discard)(slot)

    def namespace_chunks(self) -> Counter[bytes]:
        with self._lock:
            return Counter(namespace_of(key) for key in self._committed)

    def committed_keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._committed)

    def stats(self, tier: str) -> TierStats:
        with self._lock:
            pools = self._room.pool_usage()
            return TierStats(
                tier=tier,
                capacity_bytes=self.memory.num_extents * self.memory.extent_bytes,
                used_bytes=sum(u.used_bytes for u in pools.values()),
                chunks=len(self._committed),
                pools=pools,
                replicas=self.usage.stats(),
                counters=self._counters.snapshot(),
            )

    def close(self) -> None:
        """Stop hashing and unmap the arena (once)."""
        self._checksums.close()
        with self._lock:
            if not self._closed:
                self._closed = True
                self.memory.close()

    # -- what the room asks (`arena_room.SlotHolder`) -------------------------------------

    def evictable(self, slot: int) -> bool:
        return not self._dirty[slot] and self._table.refcount[slot] == 0

    def owner_number(self, slot: int) -> int:
        return self._owner[slot]

    def evict_slot(self, slot: int, reason: str) -> None:
        self._release_slot(slot, keep_extent=True)
        self._counters.add(f"evictions_{reason}", 1)

    def clear(self, slots: range, reason: str, owner: int | None) -> bool:
        state = self._table.state
        for slot in slots:
            if state[slot] == WRITING or (
                state[slot] == READY
                and (
                    self._dirty[slot]
                    or self._pinned[slot]
                    or self._table.refcount[slot]
                    or (owner is not None and self._owner[slot] != owner)
                )
            ):
                return False
        for slot in slots:
            if state[slot] == READY:
                self.evict_slot(slot, reason)
        return True

    # -- a slot's way back ----------------------------------------------------------------

    def _release_slot(self, slot: int, keep_extent: bool = False) -> None:
        """Return a READY or WRITING slot to its class's free list and bump its generation; an
        extent left with no slot in use goes back to the arena, unless ``keep_extent``."""
        cls = self._room.class_of(slot)
        key = self._keys[slot]
        q = self._owner[slot]
        if self._table.state[slot] == READY:
            assert key is not None
            if self._hidden[slot]:
                self._hidden[slot] = False
            else:
                self._unpublish(key)
            cls.policy.remove(slot)
            cls.retired.discard(slot)
            cls.ready -= 1
            self.usage.freed(q, cls.pool, cls.slot_bytes)
            if self._dirty[slot]:
                self._dirty[slot] = False
                cls.dirty_count -= 1
        elif key is not None and self._writing.pop(key, None) is not None:
            self.usage.unreserved(q, cls.pool, cls.slot_bytes)
            cls.blank -= is_blank(key)
        self._keys[slot] = None
        self._pinned[slot] = False
        self._checksums.forget(slot)
        self._table.bump_generation(slot)
        self._table.set_state(slot, FREE)
        self._room.free_slot(slot, cls, keep_extent)

    def _unpublish(self, key: ChunkKey) -> None:
        del self._committed[key]
        self.memory.index.remove(key)  # before the generation moves: see arena_index.py
        self._tell(False, [key])

    def _ref(self, key: ChunkKey, slot: int, nbytes: int) -> SlotRef:
        offset = self._room.slot_offset(slot)
        return SlotRef(key, slot, offset, nbytes, self._table.generation[slot])

    def _current(self, ref: SlotRef, state: int) -> bool:
        """Whether ``ref`` holds its slot (a blank one too: `kvtier.core.keys.may_name`)."""
        return (
            0 <= ref.slot < len(self._keys)
            and may_name(self._keys[ref.slot], ref.key)
            and self._table.state[ref.slot] == state
            and self._table.generation[ref.slot] == ref.generation
        )

    def _payload_checksum(self, ref: SlotRef) -> bytes:
        """The slot's bytes hashed in place in the mapping (the hash drops the GIL), over the
        length write-back copies."""
        nbytes = self._room.class_of(ref.slot).slot_bytes
        return blockfmt.payload_checksum(self.memory.view(self._room.slot_offset(ref.slot), nbytes))
