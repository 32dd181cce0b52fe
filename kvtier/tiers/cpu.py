"""The cpu tier: chunks in slots of the shared-memory arena, and the verbs that move them.

A slot moves FREE -> WRITING (reserved) -> READY (committed, visible) -> FREE, and its
generation is bumped each time it is freed, so a stale reservation or lease is recognised
instead of trusted. The tier opens the arena and asks; the slots' states, and which slot a
chunk gets and which chunk makes room, are `cpu_slots`' part.

A dirty chunk's payload checksum (xxh3-128) is taken as it is committed, in the process that owns
the tiers (`kvtier.tiers.commit_checksums`); write-back drops a chunk whose bytes changed since,
and the next owner of a killed one's arena keeps only chunks that still match theirs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence

import psutil

from kvtier.core.config import ArenaConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import CapacityError
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import SlotRef, TierCode, TierStats
from kvtier.tiers.arena import ArenaMemory, resolve_group
from kvtier.tiers.base import Tier
from kvtier.tiers.commit_checksums import ChecksumLedger, ledger_path
from kvtier.tiers.cpu_slots import ArenaSlots
from kvtier.tiers.slots import default_arena_size

log = logging.getLogger(__name__)


def open_arena(config: ArenaConfig) -> ArenaMemory:
    """Create the arena's file at its configured (or default) size."""
    if config.size_bytes is None:
        size = default_arena_size(config.auto_fraction, config.path.parent)
    else:
        size = int(config.size_bytes)
    total = psutil.virtual_memory().total
    if size > total:
        raise CapacityError(
            f"arena.size_bytes: {size} bytes exceeds this machine's {total} bytes of memory"
        )
    memory = ArenaMemory.create(
        config.path,
        size,
        config.extent_for(size),
        config.min_slot_bytes,
        config.prefault,
        mode=config.file_mode,
        gid=resolve_group(config.group, "arena.group"),
    )
    log.info(
        "arena %s: %.2f GiB, %d extents of %d MiB",
        config.path,
        memory.size / 2**30,
        memory.num_extents,
        memory.extent_bytes >> 20,
    )
    return memory


class CpuTier(Tier):
    """The verbs over the arena's slots (`cpu_slots.ArenaSlots`, ``slots``), which it asks."""

    name = TierCode.CPU.tier
    persistent = False

    def __init__(self, config: ArenaConfig, registry: PoolRegistry) -> None:
        super().__init__(registry)
        self.config = config
        self._counters = Counters()
        self.memory = open_arena(config)
        self.slots = ArenaSlots(config, registry, self.memory, self._tell, self._counters)
        self._track_dirty = False
        self._clean_reserve = 0.2
        self._held_slots: Callable[[str, int], int] = lambda pool, slot_bytes: 0
        if config.commit_checksum:
            self.slots.keep_checksums_in(ChecksumLedger.create(config.path, self.slots.slot_count))
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
        return self.slots.usage.pool_capacity_bytes(pool)

    def quota_bytes(self, replica: str, pool: str) -> int:
        return self.slots.usage.quota_bytes(replica, pool)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        self.slots.set_quota(replica, pool, nbytes)

    # -- the store path: reserve -> write -> commit | abort -------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Reserve a slot per key. None for a key that is present, in flight, or has no room."""
        # validate the batch before changing it; a namespace expired while idle comes back
        regs = [self.registry.resolve(k, use=True) for k in keys]
        return self.slots.reserve(keys, regs, replica)

    def commit(self, refs: Sequence[SlotRef], *, clean: bool = False, lease: bool = False) -> int:
        """Publish written slots; ``clean`` marks them as already held by the next tier, and
        ``lease`` takes a read lease on each in the same step (release it with `release`)."""
        return self.slots.commit(refs, dirty=self._track_dirty and not clean, lease=lease)

    def abort(self, refs: Sequence[SlotRef], counter: str = "store_aborted") -> int:
        """Free reserved slots; returns how many were still reserved. ``counter`` names the
        event counted for each."""
        return self.slots.abort(refs, counter)

    # -- the load path: lease -> read -> release ------------------------------------------

    def lease(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        """A refcounted read lease per present key; a leased slot is never freed."""
        return self.slots.lease(keys)

    def release(self, refs: Sequence[SlotRef], counter: str = "") -> None:
        """End leases; ``counter`` names an event counted for each (none when empty)."""
        self.slots.release(refs, counter)

    def owner_of(self, ref: SlotRef) -> str:
        return self.slots.usage.name_of(self.slots.owner_number(ref.slot))

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
        return self.slots.take_dirty(limit, everything, self._clean_reserve, self._held_slots)

    def set_clean_reserve(self, share: float) -> None:
        self._clean_reserve = share

    def count_duplicates(self, n: int) -> None:
        """Stores of chunks a tier below holds already, refused before they reached the arena:
        duplicates as much as those the arena holds."""
        self._counters.add("store_duplicate", n)

    def take_refused(self) -> int:
        """Stores refused for want of a free or clean slot since last asked: the clean reserve
        was too small for the stores coming in, and each one refused is a later miss."""
        return self.slots.take_refused()

    def count_held(self, held_slots: Callable[[str, int], int]) -> None:
        """How many slots of a pool's class (its pool, its slot bytes) are held for loads
        (promoted ahead of them): write-back keeps its clean reserve beside them."""
        self._held_slots = held_slots

    def writeback_pending(self) -> int:
        return self.slots.writeback_pending()

    def commit_checksum(self, ref: SlotRef) -> bytes | None:
        """The payload checksum taken when the chunk of a write-back lease was committed; None
        when none is taken (`ArenaConfig.commit_checksum` off). A chunk written back before the
        hashing thread reached it is hashed now."""
        return self.slots.commit_checksum(
            ref, take_now=self._track_dirty and self.config.commit_checksum
        )

    def writeback_done(
        self,
        refs: Sequence[SlotRef],
        ok: bool,
        changed: Collection[ChunkKey] = (),
        skipped: Collection[ChunkKey] = (),
    ) -> None:
        """End write-back leases; a failed write leaves the chunk clean-but-arena-only. Chunks
        in ``changed`` no longer matched their commit checksum: they are dropped. Chunks in
        ``skipped`` were left unwritten on purpose: clean, arena-only, counted apart."""
        self.slots.writeback_done(refs, ok, changed, skipped)

    # -- the Tier contract ----------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.slots.contains(keys)

    def put(self, key: ChunkKey, payload: memoryview | bytes, replica: str = "default") -> bool:
        self._check_payload(key, len(payload))
        (ref,) = self.reserve([key], replica)
        if ref is None:
            return self.slots.slot_of(key) is not None
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
        return self.slots.delete(keys)

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        self.slots.set_pinned(keys, True)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.slots.set_pinned(keys, False)

    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        return self.slots.evict(pool, namespace, replica)

    def retire(self, namespace: bytes) -> None:
        """Mark a namespace's chunks (an old draft revision) to be evicted before any other."""
        self.slots.mark_retired(namespace, True)

    def reinstate(self, namespace: bytes) -> None:
        """Make a retired namespace current again (a swap back)."""
        self.slots.mark_retired(namespace, False)

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks held per namespace."""
        return self.slots.namespace_chunks()

    def stats(self) -> TierStats:
        return self.slots.stats(self.name)

    def close(self) -> None:
        self.slots.close()
