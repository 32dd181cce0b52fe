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
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import SlotRef, TierCode, TierStats, UsageStats
from kvtier.tiers.base import Tier
from kvtier.tiers.commit_checksums import ChecksumLedger, ledger_path
from kvtier.tiers.cpu_slots import ArenaSlots
from kvtier.tiers.slots import READY, WRITING

log = logging.getLogger(__name__)


class CpuTier(Tier):
    """The verbs over the slot bookkeeping it holds (`cpu_slots.ArenaSlots`, ``slots``)."""

    name = TierCode.CPU.tier
    persistent = False

    def __init__(self, config: ArenaConfig, registry: PoolRegistry) -> None:
        super().__init__(registry)
        self.config = config
        self.slots = ArenaSlots(config, registry, self._tell)
        self.memory = self.slots.memory
        self._track_dirty = False
        self._clean_reserve = 0.2
        self._held_slots: Callable[[str, int], int] = lambda pool, slot_bytes: 0
        self._closed = False
        if config.commit_checksum:
            ledger = ChecksumLedger.create(config.path, len(self.slots.keys))
            self.slots.checksums.keep_in(ledger, self._span)
        else:  # a predecessor's would speak for an arena it no longer describes
            ledger_path(config.path).unlink(missing_ok=True)

    def track_dirty(self, enabled: bool) -> None:
        """Mark committed chunks dirty until `writeback_done`; set when a next tier exists."""
        self._track_dirty = enabled

    def accept(self, reg: Registration) -> None:
        """Check that the arena can hold this pool's chunks (raises `PoolLayoutError`)."""
        self.slots.accept(reg)

    def expire_idle(self) -> None:
        """Expire idle namespaces, then forget the slot classes none uses any more."""
        self.slots.expire_idle()

    def live_counts(self) -> dict[str, int]:
        """Slot classes and namespaces in use now, and extents no class holds."""
        return self.slots.live_counts()

    def pool_capacity_bytes(self, pool: str) -> int:
        return self.slots.pool_capacity_bytes(pool)

    def quota_bytes(self, replica: str, pool: str) -> int:
        return self.slots.quota_bytes(replica, pool)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        self.slots.set_quota(replica, pool, nbytes)

    def _span(self, slot: int) -> tuple[int, int]:
        """Where this process placed ``slot``: (offset, nbytes)."""
        return self.memory.slot_offset(slot), self.slots.class_of(slot).slot_bytes

    # -- the store path: reserve -> write -> commit | abort -------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Reserve a slot per key. None for a key that is present, in flight, or has no room."""
        # validate the batch before changing it; a namespace expired while idle comes back
        regs = [self.registry.resolve(k, use=True) for k in keys]
        out: list[SlotRef | None] = []
        now = time.monotonic()
        with self.slots.lock:
            q = self.slots.replica(replica)
            for key, reg in zip(keys, regs, strict=True):
                if key in self.slots.committed or key in self.slots.writing:
                    self.slots.counters.add("store_duplicate", 1)
                    out.append(None)
                    continue
                cls = self.slots.class_for(reg)
                cls.last_used = now
                slot = self.slots.allocate(cls, q)
                if slot is None:
                    self.slots.counters.add("store_rejected", 1)
                    self.slots.refused += 1
                    out.append(None)
                    continue
                self.slots.keys[slot] = key
                self.slots.owner[slot] = q
                self.slots.writing[key] = slot
                self.slots.inflight[(q, cls.pool)] += cls.slot_bytes
                self.slots.table.set_state(slot, WRITING)
                out.append(self.slots.ref(key, slot, reg.chunk_bytes))
        return out

    def commit(self, refs: Sequence[SlotRef], *, clean: bool = False, lease: bool = False) -> int:
        """Publish written slots; ``clean`` marks them as already held by the next tier, and
        ``lease`` takes a read lease on each in the same step (release it with `release`)."""
        done = 0
        committed: list[ChunkKey] = []
        hashing = self._track_dirty and not clean and self.config.commit_checksum
        with self.slots.lock:
            for ref in refs:
                if not self.slots.current(ref, WRITING):
                    self.slots.counters.add("commit_stale", 1)
                    continue
                slot = ref.slot
                cls = self.slots.class_of(slot)
                del self.slots.writing[ref.key]
                self.slots.inflight[(self.slots.owner[slot], cls.pool)] -= cls.slot_bytes
                self.slots.committed[ref.key] = slot
                self.slots.table.set_state(slot, READY)
                self.memory.index.insert(ref.key, slot)
                cls.ready += 1
                self.slots.used[(self.slots.owner[slot], cls.pool)] += cls.slot_bytes
                self.slots.chunks[(self.slots.owner[slot], cls.pool)] += 1
                if ref.key in self.slots.pinned_keys:
                    self.slots.pinned[slot] = True
                else:
                    cls.policy.insert(slot, self.slots.owner[slot])
                    if self.slots.retired and namespace_of(ref.key) in self.slots.retired:
                        cls.retired.add(slot)
                if self._track_dirty and not clean:
                    self.slots.dirty[slot] = True
                    cls.dirty_count += 1
                    cls.dirty.append((slot, ref.generation))
                    if hashing:
                        self.slots.checksums.later(ref)
                if lease:
                    self.slots.table.add_ref(slot, 1)
                self.slots.counters.add("stores", 1)
                done += 1
                committed.append(ref.key)
            self._tell(True, committed)
        return done

    def abort(self, refs: Sequence[SlotRef], counter: str = "store_aborted") -> int:
        """Free reserved slots; returns how many were still reserved. ``counter`` names the
        event counted for each."""
        done = 0
        with self.slots.lock:
            for ref in refs:
                if self.slots.current(ref, WRITING):
                    self.slots.release_slot(ref.slot)
                    self.slots.counters.add(counter, 1)
                    done += 1
        return done

    # -- the load path: lease -> read -> release ------------------------------------------

    def lease(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        """A refcounted read lease per present key; a leased slot is never freed."""
        out: list[SlotRef | None] = []
        now = time.monotonic()
        with self.slots.lock:
            for key in keys:
                slot = self.slots.committed.get(key)
                if slot is None:
                    self.slots.counters.add("misses", 1)
                    out.append(None)
                    continue
                cls = self.slots.class_of(slot)
                self.slots.table.add_ref(slot, 1)
                cls.policy.access(slot)
                cls.last_used = now
                self.slots.counters.add("hits", 1)
                out.append(self.slots.ref(key, slot, cls.slot_bytes))
        return out

    def release(self, refs: Sequence[SlotRef], counter: str = "") -> None:
        """End leases; ``counter`` names an event counted for each (none when empty)."""
        with self.slots.lock:
            for ref in refs:
                if self.slots.current(ref, READY) and self.slots.table.refcount[ref.slot] > 0:
                    if counter:
                        self.slots.counters.add(counter, 1)
                    self.slots.table.add_ref(ref.slot, -1)
                    if self.slots.hidden[ref.slot] and self.slots.table.refcount[ref.slot] == 0:
                        self.slots.release_slot(ref.slot)
                else:
                    self.slots.counters.add("release_stale", 1)

    def owner_of(self, ref: SlotRef) -> str:
        return self.slots.replica_names[self.slots.owner[ref.slot]]

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
        with self.slots.lock:
            for cls in self.slots.classes.values():
                capacity = (cls.extents + self.slots.growable_extents(cls)) * cls.per_extent
                # slots held for loads are neither free nor evictable
                held = self._held_slots(cls.pool, cls.slot_bytes)
                while cls.dirty and len(out) < limit:
                    clean_or_free = capacity - cls.dirty_count - held
                    if not everything and clean_or_free >= reserve * capacity:
                        break
                    slot, gen = cls.dirty.popleft()
                    key = self.slots.keys[slot]
                    if (
                        key is None
                        or not self.slots.dirty[slot]
                        or self.slots.table.generation[slot] != gen
                    ):
                        continue  # freed or re-used since it was queued
                    self.slots.table.add_ref(slot, 1)
                    out.append(self.slots.ref(key, slot, cls.slot_bytes))
        return out

    def set_clean_reserve(self, share: float) -> None:
        self._clean_reserve = share

    def count_duplicates(self, n: int) -> None:
        """Stores of chunks a tier below holds already, refused before they reached the arena:
        duplicates as much as those the arena holds."""
        self.slots.counters.add("store_duplicate", n)

    def take_refused(self) -> int:
        """Stores refused for want of a free or clean slot since last asked: the clean reserve
        was too small for the stores coming in, and each one refused is a later miss."""
        with self.slots.lock:
            refused, self.slots.refused = self.slots.refused, 0
        return refused

    def count_held(self, held_slots: Callable[[str, int], int]) -> None:
        """How many slots of a pool's class (its pool, its slot bytes) are held for loads
        (promoted ahead of them): write-back keeps its clean reserve beside them."""
        self._held_slots = held_slots

    def writeback_pending(self) -> int:
        with self.slots.lock:
            return sum(c.dirty_count for c in self.slots.classes.values())

    def commit_checksum(self, ref: SlotRef) -> bytes | None:
        """The payload checksum taken when the chunk of a write-back lease was committed; None
        when none is taken (`ArenaConfig.commit_checksum` off). A chunk written back before the
        hashing thread reached it is hashed now."""
        return self.slots.checksums.of(
            ref, take_now=self._track_dirty and self.config.commit_checksum
        )

    def writeback_done(
        self, refs: Sequence[SlotRef], ok: bool, changed: Collection[ChunkKey] = ()
    ) -> None:
        """End write-back leases; a failed write leaves the chunk clean-but-arena-only. Chunks
        in ``changed`` no longer matched their commit checksum: they are dropped."""
        with self.slots.lock:
            for ref in refs:
                if not self.slots.current(ref, READY):
                    continue
                slot = ref.slot
                self.slots.table.add_ref(slot, -1)
                if self.slots.dirty[slot]:
                    self.slots.dirty[slot] = False
                    cls = self.slots.class_of(slot)
                    cls.dirty_count -= 1
                if ref.key in changed:
                    self._drop_changed(ref)
                    continue
                self.slots.counters.add("writeback_ok" if ok else "writeback_failed", 1)

    def _drop_changed(self, ref: SlotRef) -> None:
        """Drop a chunk whose bytes changed after its commit: lookups miss it from now on; a
        leased slot leaves the index now and is freed when its last lease ends."""
        slot = ref.slot
        cls = self.slots.class_of(slot)
        log.error(
            "arena: chunk %s (pool %s, replica %s) changed after it was committed: its "
            "checksum no longer matches; dropped, not written back",
            ref.key.hex(),
            cls.pool,
            self.slots.replica_names[self.slots.owner[slot]],
        )
        self.slots.counters.add("corrupt", 1)
        self.slots.counters.add(f"corrupt:{cls.pool}", 1)
        self.slots.checksums.forget(slot)
        if self.slots.table.refcount[slot] == 0:
            self.slots.release_slot(slot)
            return
        self.slots.unpublish(ref.key)
        self.slots.hidden[slot] = True
        cls.policy.remove(slot)
        cls.retired.discard(slot)

    # -- the Tier contract ----------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return list(map(self.slots.committed.__contains__, keys))

    def put(self, key: ChunkKey, payload: memoryview | bytes, replica: str = "default") -> bool:
        self._check_payload(key, len(payload))
        (ref,) = self.reserve([key], replica)
        if ref is None:
            return key in self.slots.committed
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
        with self.slots.lock:
            for key in keys:
                slot = self.slots.committed.get(key)
                if slot is not None and self.slots.table.refcount[slot] == 0:
                    self.slots.release_slot(slot)
                    dropped += 1
        return dropped

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        with self.slots.lock:
            for key in keys:
                self.slots.pinned_keys.add(key)
                slot = self.slots.committed.get(key)
                if slot is not None and not self.slots.pinned[slot]:
                    self.slots.pinned[slot] = True
                    self.slots.class_of(slot).policy.remove(slot)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self.slots.lock:
            for key in keys:
                self.slots.pinned_keys.discard(key)
                slot = self.slots.committed.get(key)
                if slot is not None and self.slots.pinned[slot]:
                    self.slots.pinned[slot] = False
                    self.slots.class_of(slot).policy.insert(slot, self.slots.owner[slot])

    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        dropped = 0
        with self.slots.lock:
            q = self.slots.replicas.get(replica) if replica is not None else None
            if replica is not None and q is None:
                return 0
            for key, slot in list(self.slots.committed.items()):
                if self.slots.pinned[slot] or self.slots.table.refcount[slot] != 0:
                    continue
                if pool is not None and self.slots.class_of(slot).pool != pool:
                    continue
                if namespace is not None and namespace_of(key) != namespace:
                    continue
                if q is not None and self.slots.owner[slot] != q:
                    continue
                self.slots.release_slot(slot)
                dropped += 1
            self.slots.counters.add("evictions_admin", dropped)
        return dropped

    def retire(self, namespace: bytes) -> None:
        """Mark a namespace's chunks (an old draft revision) to be evicted before any other."""
        self._mark_retired(namespace, True)

    def reinstate(self, namespace: bytes) -> None:
        """Make a retired namespace current again (a swap back)."""
        self._mark_retired(namespace, False)

    def _mark_retired(self, namespace: bytes, retired: bool) -> None:
        with self.slots.lock:
            if retired:
                self.slots.retired.add(namespace)
            else:
                self.slots.retired.discard(namespace)
            for key, slot in self.slots.committed.items():
                if namespace_of(key) == namespace and not self.slots.pinned[slot]:
                    cls = self.slots.class_of(slot)
                    (cls.retired.add if retired else cls.retired.discard)(slot)

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks held per namespace."""
        with self.slots.lock:
            return Counter(namespace_of(key) for key in self.slots.committed)

    def stats(self) -> TierStats:
        with self.slots.lock:
            pools: dict[str, UsageStats] = {}
            for cls in self.slots.classes.values():
                usage = pools.setdefault(cls.pool, UsageStats())
                usage.used_bytes += cls.ready * cls.slot_bytes
                usage.chunks += cls.ready
            for name in pools:
                pools[name].capacity_bytes = self.pool_capacity_bytes(name)
            replicas = {
                (self.slots.replica_names[q], pool): UsageStats(
                    used_bytes=used,
                    chunks=self.slots.chunks[(q, pool)],
                    capacity_bytes=self.quota_bytes(self.slots.replica_names[q], pool),
                )
                # a replica that has emptied stays, at zero, so its quota stays in view
                for (q, pool), used in self.slots.used.items()
            }
            used = sum(u.used_bytes for u in pools.values())
            return TierStats(
                tier=self.name,
                capacity_bytes=self.memory.num_extents * self.memory.extent_bytes,
                used_bytes=used,
                chunks=len(self.slots.committed),
                pools=pools,
                replicas=replicas,
                counters=self.slots.counters.snapshot(),
            )

    def close(self) -> None:
        self.slots.checksums.close()
        with self.slots.lock:
            if not self._closed:
                self._closed = True
                self.memory.close()
