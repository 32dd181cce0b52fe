"""The cpu tier: chunks in slots of the shared-memory arena.

Each pool gets one slot size class per chunk size; a class grows by whole extents up to its pool's
share of the arena, so a small draft pool wastes nothing on target-sized slots. A slot moves
FREE -> WRITING (reserved) -> READY (committed, visible) -> FREE, and its generation is bumped
each time it is freed, so a stale reservation or lease is recognised instead of trusted.

Eviction takes the best victim of a replica over its quota first, else the best victim of any
replica, by the configured policy. Slots that are leased, pinned or not yet written to the next
tier (dirty) are never evicted.

A dirty chunk's payload checksum (xxh3-128) is taken as it is committed, in the process that owns
the tiers (`kvtier.tiers.commit_checksums`); write-back drops a chunk whose bytes changed since.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Collection, Sequence

import psutil

from kvtier.core import blockfmt
from kvtier.core.config import ArenaConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import CapacityError, PoolLayoutError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import SlotRef, TierCode, TierStats, UsageStats
from kvtier.tiers.arena import ArenaMemory, resolve_group
from kvtier.tiers.base import Tier
from kvtier.tiers.commit_checksums import CommitChecksums
from kvtier.tiers.eviction import make_policy
from kvtier.tiers.slots import FREE, READY, WRITING, SlotClass, SlotTable, default_arena_size

log = logging.getLogger(__name__)

_SCAN_LIMIT = 256  # slots inspected per queue when looking for a victim


class CpuTier(Tier):
    name = TierCode.CPU.tier
    persistent = False

    def __init__(self, config: ArenaConfig, registry: PoolRegistry) -> None:
        super().__init__(registry)
        self.config = config
        if config.size_bytes is None:
            size = default_arena_size(config.auto_fraction, config.path.parent)
        else:
            size = int(config.size_bytes)
        self._check_memory(size)
        self.memory = ArenaMemory.create(
            config.path,
            size,
            config.extent_bytes,
            config.min_slot_bytes,
            config.prefault,
            mode=config.file_mode,
            gid=resolve_group(config.group, "arena.group"),
        )
        mem = self.memory
        n = mem.num_extents * mem.max_slots_per_extent
        self._slots = SlotTable(mem)
        self._lock = threading.RLock()
        self._free_extents = list(range(mem.num_extents - 1, -1, -1))
        self._classes: dict[tuple[str, int], SlotClass] = {}
        self._class_of_extent: list[SlotClass | None] = [None] * mem.num_extents
        self._policy_node = [0] * n  # slot -> its node in its class's eviction policy
        self._index: dict[ChunkKey, int] = {}  # committed chunks
        self._writing: dict[ChunkKey, int] = {}  # reserved, not yet committed
        self._key: list[ChunkKey | None] = [None] * n
        self._owner = [0] * n
        self._dirty = [False] * n
        self._pinned = [False] * n
        self._pinned_keys: set[ChunkKey] = set()
        self._hidden = [False] * n  # dropped while leased: out of the index, freed on release
        self._replicas: dict[str, int] = {}
        self._replica_names: list[str] = []
        self._used: Counter[tuple[int, str]] = Counter()  # (replica, pool) -> bytes
        self._inflight: Counter[tuple[int, str]] = Counter()  # reserved, not committed
        self._chunks: Counter[tuple[int, str]] = Counter()  # (replica, pool) -> chunks
        self._quota_override: dict[tuple[str, str], int] = {}
        self._retired: set[bytes] = set()  # namespaces whose chunks go first
        self._counters = Counters()
        self._checksums = CommitChecksums(
            n,
            self._lock,
            lambda ref: self._current(ref, READY),
            self._payload_checksum,
            self._counters,
        )
        self._track_dirty = False
        self._clean_reserve = 0.2
        self._closed = False
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

    def track_dirty(self, enabled: bool) -> None:
        """Mark committed chunks dirty until `writeback_done`; set when a next tier exists."""
        self._track_dirty = enabled

    def _replica(self, name: str) -> int:
        q = self._replicas.get(name)
        if q is None:
            q = self._replicas[name] = len(self._replica_names)
            self._replica_names.append(name)
        return q

    def accept(self, reg: Registration) -> None:
        """Check that the arena can hold this pool's chunks (raises `PoolLayoutError`)."""
        with self._lock:
            self._class_for(reg)

    def _class_for(self, reg: Registration) -> SlotClass:
        cls = self._classes.get((reg.pool, reg.chunk_bytes))
        if cls is None:
            if reg.pool not in self.config.pools:
                known = sorted(self.config.pools)
                raise PoolLayoutError(f"pool {reg.pool!r} has no arena budget; configured: {known}")
            if reg.chunk_bytes > self.memory.extent_bytes:
                raise PoolLayoutError(
                    f"chunks of {reg.chunk_bytes} bytes exceed arena.extent_bytes "
                    f"({self.memory.extent_bytes}); raise arena.extent_bytes"
                )
            if reg.chunk_bytes < self.memory.extent_bytes // self.memory.max_slots_per_extent:
                raise PoolLayoutError(
                    f"chunks of {reg.chunk_bytes} bytes are below arena.min_slot_bytes"
                )
            if len(self._classes) >= self.config.max_slot_classes:
                raise CapacityError(
                    f"the arena has {len(self._classes)} slot classes, the most "
                    f"arena.max_slot_classes allows; a pool of {reg.chunk_bytes}-byte chunks "
                    "needs one more: raise arena.max_slot_classes"
                )
            policy = make_policy(self.config.eviction_policy, self._policy_node)
            per_extent = self.memory.extent_bytes // reg.chunk_bytes
            cls = self._classes[(reg.pool, reg.chunk_bytes)] = SlotClass(
                reg.pool, reg.chunk_bytes, policy, per_extent
            )
        return cls

    def pool_capacity_bytes(self, pool: str) -> int:
        share = self.config.pools[pool].max_share
        return max(1, int(self.memory.num_extents * share)) * self.memory.extent_bytes

    def quota_bytes(self, replica: str, pool: str) -> int:
        override = self._quota_override.get((replica, pool))
        if override is not None:
            return override
        return int(self.pool_capacity_bytes(pool) * self.config.pools[pool].replica_share)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        with self._lock:
            if nbytes is None:
                self._quota_override.pop((replica, pool), None)
            else:
                self._quota_override[(replica, pool)] = nbytes

    # -- allocation and eviction ----------------------------------------------------------

    def _growable_extents(self, cls: SlotClass) -> int:
        """Extents ``cls`` may still take: free ones, within its pool's share."""
        pool_extents = sum(c.extents for c in self._classes.values() if c.pool == cls.pool)
        limit = self.pool_capacity_bytes(cls.pool) // self.memory.extent_bytes
        return max(0, min(len(self._free_extents), limit - pool_extents))

    def _grow(self, cls: SlotClass) -> bool:
        if not self._growable_extents(cls):
            return False
        extent = self._free_extents.pop()
        self.memory.extent_slot_bytes[extent] = cls.slot_bytes
        self._class_of_extent[extent] = cls
        cls.extents += 1
        first = self.memory.slot_id(extent, 0)
        cls.free.extend(range(first + cls.per_extent - 1, first - 1, -1))
        cls.policy.add_slots(range(first, first + cls.per_extent))
        return True

    def _evictable(self, slot: int) -> bool:
        return not self._dirty[slot] and self._slots.refcount[slot] == 0

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
            if self._evictable(slot) and (q is None or self._owner[slot] == q):
                self._counters.add("retired_evicted", 1)
                return slot, reason
        return None

    def _victim(self, cls: SlotClass) -> tuple[int, str] | None:
        retired = self._retired_victim(cls, None, "capacity")
        if retired is not None:
            return retired
        over = []
        for name, q in self._replicas.items():
            excess = self._used[(q, cls.pool)] - self.quota_bytes(name, cls.pool)
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
        name = self._replica_names[q]
        held = self._used[(q, cls.pool)] + self._inflight[(q, cls.pool)]
        return held + cls.slot_bytes > self.quota_bytes(name, cls.pool)

    def _allocate(self, cls: SlotClass, q: int) -> int | None:
        if cls.free or self._grow(cls):
            return cls.free.pop()
        if self._over_quota(q, cls):
            # a replica at its quota makes room from its own chunks only, or stores nothing
            victim = self._retired_victim(cls, q, "quota")
            if victim is None:
                slot = self._first_victim(cls, q)
                victim = None if slot is None else (slot, "quota")
                if victim is None:
                    self._counters.add("store_over_quota", 1)
        else:
            victim = self._victim(cls)
        if victim is None:
            return None
        slot, reason = victim
        self._release_slot(slot)
        self._counters.add(f"evictions_{reason}", 1)
        return cls.free.pop()

    def _release_slot(self, slot: int) -> None:
        """Return a READY or WRITING slot to its class's free list and bump its generation."""
        mem = self.memory
        cls = self._class_of_extent[slot // mem.max_slots_per_extent]
        assert cls is not None
        key = self._key[slot]
        if self._slots.state[slot] == READY:
            assert key is not None
            if self._hidden[slot]:
                self._hidden[slot] = False
            else:
                self._unpublish(key)
            cls.policy.remove(slot)
            cls.retired.discard(slot)
            cls.ready -= 1
            self._used[(self._owner[slot], cls.pool)] -= cls.slot_bytes
            self._chunks[(self._owner[slot], cls.pool)] -= 1
            if self._dirty[slot]:
                self._dirty[slot] = False
                cls.dirty_count -= 1
        elif key is not None and self._writing.pop(key, None) is not None:
            self._inflight[(self._owner[slot], cls.pool)] -= cls.slot_bytes
        self._key[slot] = None
        self._pinned[slot] = False
        self._checksums.forget(slot)
        self._slots.bump_generation(slot)
        self._slots.set_state(slot, FREE)
        cls.free.append(slot)

    def _unpublish(self, key: ChunkKey) -> None:
        del self._index[key]
        self.memory.index.remove(key)  # before the generation moves: see arena_index.py
        self._tell(False, [key])

    def _ref(self, key: ChunkKey, slot: int, nbytes: int) -> SlotRef:
        mem = self.memory
        return SlotRef(key, slot, mem.slot_offset(slot), nbytes, self._slots.generation[slot])

    def _current(self, ref: SlotRef, state: int) -> bool:
        return (
            0 <= ref.slot < len(self._key)
            and self._key[ref.slot] == ref.key
            and self._slots.state[ref.slot] == state
            and self._slots.generation[ref.slot] == ref.generation
        )

    # -- the store path: reserve -> write -> commit | abort -------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Reserve a slot per key. None for a key that is present, in flight, or has no room."""
        regs = [self.registry.resolve(k) for k in keys]  # validate the batch before changing it
        out: list[SlotRef | None] = []
        with self._lock:
            q = self._replica(replica)
            for key, reg in zip(keys, regs, strict=True):
                if key in self._index or key in self._writing:
                    self._counters.add("store_duplicate", 1)
                    out.append(None)
                    continue
                cls = self._class_for(reg)
                slot = self._allocate(cls, q)
                if slot is None:
                    self._counters.add("store_rejected", 1)
                    out.append(None)
                    continue
                self._key[slot] = key
                self._owner[slot] = q
                self._writing[key] = slot
                self._inflight[(q, cls.pool)] += cls.slot_bytes
                self._slots.set_state(slot, WRITING)
                out.append(self._ref(key, slot, reg.chunk_bytes))
        return out

    def _payload_checksum(self, ref: SlotRef) -> bytes:
        """The slot's bytes hashed in place in the mapping (the hash drops the GIL), over the
        length write-back copies."""
        nbytes = self._class_of(ref.slot).slot_bytes
        return blockfmt.payload_checksum(
            self.memory.view(self.memory.slot_offset(ref.slot), nbytes)
        )

    def commit(self, refs: Sequence[SlotRef], *, clean: bool = False, lease: bool = False) -> int:
        """Publish written slots; ``clean`` marks them as already held by the next tier, and
        ``lease`` takes a read lease on each in the same step (release it with `release`)."""
        done = 0
        committed: list[ChunkKey] = []
        hashing = self._track_dirty and not clean and self.config.commit_checksum
        with self._lock:
            for ref in refs:
                if not self._current(ref, WRITING):
                    self._counters.add("commit_stale", 1)
                    continue
                slot = ref.slot
                cls = self._class_of_extent[slot // self.memory.max_slots_per_extent]
                assert cls is not None
                del self._writing[ref.key]
                self._inflight[(self._owner[slot], cls.pool)] -= cls.slot_bytes
                self._index[ref.key] = slot
                self._slots.set_state(slot, READY)
                self.memory.index.insert(ref.key, slot)
                cls.ready += 1
                self._used[(self._owner[slot], cls.pool)] += cls.slot_bytes
                self._chunks[(self._owner[slot], cls.pool)] += 1
                if ref.key in self._pinned_keys:
                    self._pinned[slot] = True
                else:
                    cls.policy.insert(slot, self._owner[slot])
                    if self._retired and namespace_of(ref.key) in self._retired:
                        cls.retired.add(slot)
                if self._track_dirty and not clean:
                    self._dirty[slot] = True
                    cls.dirty_count += 1
                    cls.dirty.append((slot, ref.generation))
                    if hashing:
                        self._checksums.later(ref)
                if lease:
                    self._slots.add_ref(slot, 1)
                self._counters.add("stores", 1)
                done += 1
                committed.append(ref.key)
            self._tell(True, committed)
        return done

    def abort(self, refs: Sequence[SlotRef], counter: str = "store_aborted") -> int:
        """Free reserved slots; returns how many were still reserved. ``counter`` names the
        event counted for each."""
        done = 0
        with self._lock:
            for ref in refs:
                if self._current(ref, WRITING):
                    self._release_slot(ref.slot)
                    self._counters.add(counter, 1)
                    done += 1
        return done

    # -- the load path: lease -> read -> release ------------------------------------------

    def lease(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        """A refcounted read lease per present key; a leased slot is never freed."""
        out: list[SlotRef | None] = []
        mem = self.memory
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is None:
                    self._counters.add("misses", 1)
                    out.append(None)
                    continue
                cls = self._class_of_extent[slot // mem.max_slots_per_extent]
                assert cls is not None
                self._slots.add_ref(slot, 1)
                cls.policy.access(slot)
                self._counters.add("hits", 1)
                out.append(self._ref(key, slot, cls.slot_bytes))
        return out

    def release(self, refs: Sequence[SlotRef], counter: str = "") -> None:
        """End leases; ``counter`` names an event counted for each (none when empty)."""
        with self._lock:
            for ref in refs:
                if self._current(ref, READY) and self._slots.refcount[ref.slot] > 0:
                    if counter:
                        self._counters.add(counter, 1)
                    self._slots.add_ref(ref.slot, -1)
                    if self._hidden[ref.slot] and self._slots.refcount[ref.slot] == 0:
                        self._release_slot(ref.slot)
                else:
                    self._counters.add("release_stale", 1)

    def owner_of(self, ref: SlotRef) -> str:
        return self._replica_names[self._owner[ref.slot]]

    def view(self, ref: SlotRef) -> memoryview:
        return self.memory.view(ref.offset, ref.nbytes)

    # -- write-back support ---------------------------------------------------------------

    def take_dirty(self, limit: int, everything: bool) -> list[SlotRef]:
        """Lease up to ``limit`` dirty chunks, oldest first, from classes past their clean
        reserve (or all classes with ``everything``). The caller writes them to the next tier
        and calls `writeback_done`.

        A class's reserve is a share of the slots it can reach, free extents it may still take
        included: counted over the extents it holds, a growing class is always past it, and
        every store would be written back beside the engine's next forward."""
        out: list[SlotRef] = []
        reserve = self._clean_reserve
        with self._lock:
            for cls in self._classes.values():
                capacity = (cls.extents + self._growable_extents(cls)) * cls.per_extent
                while cls.dirty and len(out) < limit:
                    clean_or_free = capacity - cls.dirty_count
                    if not everything and clean_or_free >= reserve * capacity:
                        break
                    slot, gen = cls.dirty.popleft()
                    key = self._key[slot]
                    if key is None or not self._dirty[slot] or self._slots.generation[slot] != gen:
                        continue  # freed or re-used since it was queued
                    self._slots.add_ref(slot, 1)
                    out.append(self._ref(key, slot, cls.slot_bytes))
        return out

    def set_clean_reserve(self, share: float) -> None:
        self._clean_reserve = share

    def writeback_pending(self) -> int:
        with self._lock:
            return sum(c.dirty_count for c in self._classes.values())

    def commit_checksum(self, ref: SlotRef) -> bytes | None:
        """The payload checksum taken when the chunk of a write-back lease was committed; None
        when none is taken (`ArenaConfig.commit_checksum` off). A chunk written back before the
        hashing thread reached it is hashed now."""
        return self._checksums.of(ref, take_now=self._track_dirty and self.config.commit_checksum)

    def writeback_done(
        self, refs: Sequence[SlotRef], ok: bool, changed: Collection[ChunkKey] = ()
    ) -> None:
        """End write-back leases; a failed write leaves the chunk clean-but-arena-only. Chunks
        in ``changed`` no longer matched their commit checksum: they are dropped."""
        with self._lock:
            for ref in refs:
                if not self._current(ref, READY):
                    continue
                slot = ref.slot
                self._slots.add_ref(slot, -1)
                if self._dirty[slot]:
                    self._dirty[slot] = False
                    cls = self._class_of_extent[slot // self.memory.max_slots_per_extent]
                    assert cls is not None
                    cls.dirty_count -= 1
                if ref.key in changed:
                    self._drop_changed(ref)
                    continue
                self._counters.add("writeback_ok" if ok else "writeback_failed", 1)

    def _drop_changed(self, ref: SlotRef) -> None:
        """Drop a chunk whose bytes changed after its commit: lookups miss it from now on; a
        leased slot leaves the index now and is freed when its last lease ends."""
        slot = ref.slot
        cls = self._class_of(slot)
        log.error(
            "arena: chunk %s (pool %s, replica %s) changed after it was committed: its "
            "checksum no longer matches; dropped, not written back",
            ref.key.hex(),
            cls.pool,
            self._replica_names[self._owner[slot]],
        )
        self._counters.add("corrupt", 1)
        self._checksums.forget(slot)
        if self._slots.refcount[slot] == 0:
            self._release_slot(slot)
            return
        self._unpublish(ref.key)
        self._hidden[slot] = True
        cls.policy.remove(slot)
        cls.retired.discard(slot)

    # -- the Tier contract ----------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return list(map(self._index.__contains__, keys))

    def put(self, key: ChunkKey, payload: memoryview | bytes, replica: str = "default") -> bool:
        self._check_payload(key, len(payload))
        (ref,) = self.reserve([key], replica)
        if ref is None:
            return key in self._index
        self.view(ref)[:] = payload
        return self.commit([ref]) == 1

    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        (ref,) = self.lease([key])
        if ref is None:
            return False
        try:
            if len(dst) != ref.nbytes:
                raise ValueError(f"destination of {len(dst)} bytes for a {ref.nbytes}-byte chunk")
            dst[:] = self.view(ref)
        finally:
            self.release([ref])
        return True

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        dropped = 0
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is not None and self._slots.refcount[slot] == 0:
                    self._release_slot(slot)
                    dropped += 1
        return dropped

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._pinned_keys.add(key)
                slot = self._index.get(key)
                if slot is not None and not self._pinned[slot]:
                    self._pinned[slot] = True
                    self._class_of(slot).policy.remove(slot)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._pinned_keys.discard(key)
                slot = self._index.get(key)
                if slot is not None and self._pinned[slot]:
                    self._pinned[slot] = False
                    self._class_of(slot).policy.insert(slot, self._owner[slot])

    def _class_of(self, slot: int) -> SlotClass:
        cls = self._class_of_extent[slot // self.memory.max_slots_per_extent]
        assert cls is not None
        return cls

    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        dropped = 0
        with self._lock:
            q = self._replicas.get(replica) if replica is not None else None
            if replica is not None and q is None:
                return 0
            for key, slot in list(self._index.items()):
                if self._pinned[slot] or self._slots.refcount[slot] != 0:
                    continue
                if pool is not None and self._class_of(slot).pool != pool:
                    continue
                if namespace is not None and namespace_of(key) != namespace:
                    continue
                if q is not None and self._owner[slot] != q:
                    continue
                self._release_slot(slot)
                dropped += 1
            self._counters.add("evictions_admin", dropped)
        return dropped

    def retire(self, namespace: bytes) -> None:
        """Mark a namespace's chunks (an old draft revision) to be evicted before any other."""
        self._mark_retired(namespace, True)

    def reinstate(self, namespace: bytes) -> None:
        """Make a retired namespace current again (a swap back)."""
        self._mark_retired(namespace, False)

    def _mark_retired(self, namespace: bytes, retired: bool) -> None:
        with self._lock:
            if retired:
                self._retired.add(namespace)
            else:
                self._retired.discard(namespace)
            for key, slot in self._index.items():
                if namespace_of(key) == namespace and not self._pinned[slot]:
                    cls = self._class_of(slot)
                    (cls.retired.add if retired else cls.retired.discard)(slot)

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks held per namespace."""
        with self._lock:
            return Counter(namespace_of(key) for key in self._index)

    def stats(self) -> TierStats:
        with self._lock:
            pools: dict[str, UsageStats] = {}
            for cls in self._classes.values():
                usage = pools.setdefault(cls.pool, UsageStats())
                usage.used_bytes += cls.ready * cls.slot_bytes
                usage.chunks += cls.ready
            for name in pools:
                pools[name].capacity_bytes = self.pool_capacity_bytes(name)
            replicas = {
                (self._replica_names[q], pool): UsageStats(
                    used_bytes=used,
                    chunks=self._chunks[(q, pool)],
                    capacity_bytes=self.quota_bytes(self._replica_names[q], pool),
                )
                # a replica that has emptied stays, at zero, so its quota stays in view
                for (q, pool), used in self._used.items()
            }
            used = sum(u.used_bytes for u in pools.values())
            return TierStats(
                tier=self.name,
                capacity_bytes=self.memory.num_extents * self.memory.extent_bytes,
                used_bytes=used,
                chunks=len(self._index),
                pools=pools,
                replicas=replicas,
                counters=self._counters.snapshot(),
            )

    def close(self) -> None:
        self._checksums.close()
        with self._lock:
            if not self._closed:
                self._closed = True
                self.memory.close()
