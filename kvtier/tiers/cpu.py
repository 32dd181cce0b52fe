"""The cpu tier: chunks in slots of the shared-memory arena, and the verbs that move them.

A slot moves FREE -> WRITING (reserved) -> READY (committed, visible) -> FREE, and its
generation is bumped each time it is freed, so a stale reservation or lease is recognised
instead of trusted. Which slot a chunk gets, and which chunk makes room, is `cpu_slots`' part.

A dirty chunk's payload checksum (xxh3-128) is taken as it is committed, in the process that owns
the tiers (`kvtier.tiers.commit_checksums`); write-back drops a chunk whose bytes changed since,
and the next owner of a killed one's arena keeps only chunks that still match theirs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence

from kvtier.core.config import ArenaConfig
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import SlotRef, TierCode, TierStats, UsageStats
from kvtier.tiers.commit_checksums import ChecksumLedger, ledger_path
from kvtier.tiers.cpu_slots import ArenaSlots
from kvtier.tiers.slots import READY, WRITING

log = logging.getLogger(__name__)


class CpuTier(ArenaSlots):
    name = TierCode.CPU.tier
    persistent = False

    def __init__(self, config: ArenaConfig, registry: PoolRegistry) -> None:
        super().__init__(config, registry)
        if config.commit_checksum:
            ledger = ChecksumLedger.create(config.path, len(self._key))
            self._checksums.keep_in(ledger, self._span)
        else:  # a predecessor's would speak for an arena it no longer describes
            ledger_path(config.path).unlink(missing_ok=True)

    def _span(self, slot: int) -> tuple[int, int]:
        """Where this process placed ``slot``: (offset, nbytes)."""
        return self.memory.slot_offset(slot), self._class_of(slot).slot_bytes

    # -- the store path: reserve -> write -> commit | abort -------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Reserve a slot per key. None for a key that is present, in flight, or has no room."""
        # validate the batch before changing it; a namespace expired while idle comes back
        regs = [self.registry.resolve(k, use=True) for k in keys]
        out: list[SlotRef | None] = []
        now = time.monotonic()
        with self._lock:
            q = self._replica(replica)
            for key, reg in zip(keys, regs, strict=True):
                if key in self._index or key in self._writing:
                    self._counters.add("store_duplicate", 1)
                    out.append(None)
                    continue
                cls = self._class_for(reg)
                cls.last_used = now
                slot = self._allocate(cls, q)
                if slot is None:
                    self._counters.add("store_rejected", 1)
                    self._refused += 1
                    out.append(None)
                    continue
                self._key[slot] = key
                self._owner[slot] = q
                self._writing[key] = slot
                self._inflight[(q, cls.pool)] += cls.slot_bytes
                self._slots.set_state(slot, WRITING)
                out.append(self._ref(key, slot, reg.chunk_bytes))
        return out

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
                cls = self._class_of(slot)
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
        now = time.monotonic()
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is None:
                    self._counters.add("misses", 1)
                    out.append(None)
                    continue
                cls = self._class_of(slot)
                self._slots.add_ref(slot, 1)
                cls.policy.access(slot)
                cls.last_used = now
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
                # slots held for loads are neither free nor evictable
                held = self._held_slots(cls.pool, cls.slot_bytes)
                while cls.dirty and len(out) < limit:
                    clean_or_free = capacity - cls.dirty_count - held
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

    def count_duplicates(self, n: int) -> None:
        """Stores of chunks a tier below holds already, refused before they reached the arena:
        duplicates as much as those the arena holds."""
        self._counters.add("store_duplicate", n)

    def take_refused(self) -> int:
        """Stores refused for want of a free or clean slot since last asked: the clean reserve
        was too small for the stores coming in, and each one refused is a later miss."""
        with self._lock:
            refused, self._refused = self._refused, 0
        return refused

    def count_held(self, held_slots: Callable[[str, int], int]) -> None:
        """How many slots of a pool's class (its pool, its slot bytes) are held for loads
        (promoted ahead of them): write-back keeps its clean reserve beside them."""
        self._held_slots = held_slots

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
                    cls = self._class_of(slot)
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
        self._counters.add(f"corrupt:{cls.pool}", 1)
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
