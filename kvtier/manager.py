"""TierManager: the one place where tiers are composed.

- ``lookup`` answers with the longest present prefix and the tier of each of its chunks;
- stores are reserve -> write (into the arena slot) -> commit, or abort; uncommitted chunks are
  invisible;
- ``load`` leases arena chunks, promoting lmdb chunks into the arena first;
- committed arena chunks are written back to lmdb by a background thread before they can be
  evicted (write-back), or right after commit (write-through); the data plane never waits on it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.config import DemoteMode, KVTierConfig
from kvtier.counters import Counters
from kvtier.keys import ChunkKey, NamespaceSpec
from kvtier.pools import PoolRegistry
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.cpu import CpuTier, SlotRef
from kvtier.tiers.lmdb_tier import LmdbTier

log = logging.getLogger(__name__)

_STOP = (ChunkKey(b""), "")  # wakes the promoter to stop

TIER_CPU = "cpu"
TIER_LMDB = "lmdb"
TIER_OBJECT = "object"
# One byte per chunk in lookup answers; the values are those of the wire's Tier enum.
TIER_CODES = {TIER_CPU: 1, TIER_LMDB: 2, TIER_OBJECT: 3}
TIER_NAMES = {code: name for name, code in TIER_CODES.items()}
_CPU = TIER_CODES[TIER_CPU]
_LMDB = TIER_CODES[TIER_LMDB]


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int
    """Length of the longest prefix of the asked keys present in some tier."""
    tier_codes: bytes
    """Tier of each of those ``hits`` chunks (the fastest one holding it), a `TIER_CODES` value
    per byte: compact for batches of thousands."""

    @property
    def tiers(self) -> list[str]:
        return [TIER_NAMES[c] for c in self.tier_codes]


@dataclass(slots=True)
class ManagerStats:
    tiers: dict[str, TierStats]
    counters: Counter[str] = field(default_factory=Counter)
    """lookups, lookup_chunks, hit_chunks_<tier>, promotions, promotion_failed, ..."""


class TierManager:
    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        self.registry = PoolRegistry()
        self.cpu = CpuTier(config.arena, self.registry)
        self.lmdb: LmdbTier | None = None
        try:
            if config.lmdb.enabled:
                self.lmdb = LmdbTier(config.lmdb, self.registry)
        except BaseException:
            self.cpu.close()
            raise
        self.cpu.track_dirty(self.lmdb is not None)
        self._write_through = config.manager.demote_mode is DemoteMode.WRITE_THROUGH
        self.cpu.set_clean_reserve(1.0 if self._write_through else config.manager.clean_reserve)
        self._counters = Counters()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._promotions: queue.Queue[tuple[ChunkKey, str]] = queue.Queue(
            config.manager.promote_queue_chunks
        )
        self._promoting: set[ChunkKey] = set()
        self._threads: list[threading.Thread] = []
        if self.lmdb is not None:
            for target, name in (
                (self._writeback_loop, "kvtier-writeback"),
                (self._promote_loop, "kvtier-promote"),
            ):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    @property
    def tiers(self) -> dict[str, Tier]:
        tiers: dict[str, Tier] = {TIER_CPU: self.cpu}
        if self.lmdb is not None:
            tiers[TIER_LMDB] = self.lmdb
        return tiers

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        """Register a namespace and its chunk size; returns the 16-byte namespace."""
        registration = self.registry.register(spec, chunk_bytes)
        self.cpu.accept(registration)  # refuse now what the arena could never hold
        return registration.namespace

    # -- lookup ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        if keys:
            self.registry.resolve(keys[0])
        in_cpu = self.cpu.contains(keys)
        try:
            in_arena = in_cpu.index(False)
        except ValueError:
            in_arena = len(keys)
        codes = bytearray(bytes([_CPU]) * in_arena)  # the common case: a prefix all in the arena
        if in_arena < len(keys) and self.lmdb is not None:
            in_lmdb = self.lmdb.__contains__
            for i in range(in_arena, len(keys)):
                if in_cpu[i]:
                    codes.append(_CPU)
                elif in_lmdb(keys[i]):
                    codes.append(_LMDB)
                else:
                    break
        counters = self._counters
        counters.add("lookups", 1)
        counters.add("lookup_chunks", len(keys))
        n_cpu = codes.count(_CPU)
        counters.add("hit_chunks_cpu", n_cpu)
        counters.add("hit_chunks_lmdb", len(codes) - n_cpu)
        return LookupResult(len(codes), bytes(codes))

    # -- store ----------------------------------------------------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Arena slots to write; None where the chunk exists, is in flight, or has no room."""
        if self.lmdb is not None:
            present = self.lmdb.contains(keys)
            if any(present):  # already kept on disk: do not copy it again
                out: list[SlotRef | None] = [None] * len(keys)
                todo = [i for i, p in enumerate(present) if not p]
                for i, ref in zip(
                    todo, self.cpu.reserve([keys[i] for i in todo], replica), strict=True
                ):
                    out[i] = ref
                return out
        return self.cpu.reserve(keys, replica)

    def commit(self, refs: Sequence[SlotRef]) -> int:
        done = self.cpu.commit(refs)
        if done and self.lmdb is not None:
            self._wake.set()
        return done

    def abort(self, refs: Sequence[SlotRef]) -> None:
        self.cpu.abort(refs)

    # -- load -----------------------------------------------------------------------------

    def load(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Leases on arena slots holding each key, promoting from lmdb where needed.

        None where a key is nowhere, or failed verification (it is then quarantined).
        """
        leases = self.cpu.lease(keys)
        if self.lmdb is None:
            return leases
        for i, lease in enumerate(leases):
            if lease is None:
                leases[i] = self._promote(keys[i], replica)
        return leases

    def promote(self, keys: Sequence[ChunkKey], replica: str = "default") -> int:
        """Queue lmdb chunks for promotion into the arena, without waiting; returns how many
        were queued. A later lookup finds them in the arena."""
        if self.lmdb is None:
            return 0
        queued = 0
        in_cpu = self.cpu.contains(keys)
        for key, cached in zip(keys, in_cpu, strict=True):
            if cached or key not in self.lmdb or key in self._promoting:
                continue
            try:
                self._promotions.put_nowait((key, replica))
            except queue.Full:
                self._counters.add("promotions_dropped", 1)
                break
            self._promoting.add(key)
            queued += 1
        return queued

    def _promote_loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._promotions.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            key, replica = item
            try:
                self._promote(key, replica, lease=False)
            except Exception:  # never let the mover die silently
                self._counters.add("promotion_errors", 1)
                log.exception("promotion failed")
            finally:
                self._promoting.discard(key)

    def _promote(self, key: ChunkKey, replica: str, lease: bool = True) -> SlotRef | None:
        assert self.lmdb is not None
        if not self.lmdb.contains([key])[0]:
            return None
        (ref,) = self.cpu.reserve([key], replica)
        if ref is None:  # no room, or another caller is promoting it right now
            self._counters.add("promotion_failed", 1)
            return None
        if not self.lmdb.read_into(key, self.cpu.view(ref)):
            self.cpu.abort([ref])
            self._counters.add("promotion_failed", 1)
            return None
        self.cpu.commit([ref], clean=True, lease=lease)
        self._counters.add("promotions", 1)
        return ref

    def release(self, refs: Sequence[SlotRef]) -> None:
        self.cpu.release(refs)

    # -- write-back -----------------------------------------------------------------------

    def _writeback_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                while self._writeback_batch(everything=self._write_through):
                    pass
            except Exception:  # never let the mover die silently
                self._counters.add("writeback_errors", 1)
                log.exception("write-back batch failed")

    def _writeback_batch(self, everything: bool) -> int:
        assert self.lmdb is not None
        refs = self.cpu.take_dirty(self.config.manager.writeback_batch_chunks, everything)
        if not refs:
            return 0
        ok = False
        try:
            by_owner: dict[str, list[SlotRef]] = {}
            for ref in refs:
                by_owner.setdefault(self.cpu.owner_of(ref), []).append(ref)
            for owner, group in by_owner.items():
                self.lmdb.put_many([(r.key, self.cpu.view(r)) for r in group], owner)
            ok = True
        finally:
            self.cpu.writeback_done(refs, ok)
        return len(refs)

    def flush(self, timeout: float = 30.0) -> bool:
        """Write every dirty arena chunk to lmdb; True when none is left."""
        if self.lmdb is None:
            return True
        deadline = time.monotonic() + timeout
        while self.cpu.writeback_pending():
            if not self._writeback_batch(everything=True):
                time.sleep(0.001)  # the rest is in flight on the write-back thread
            if time.monotonic() > deadline:
                return False
        return True

    # -- admin ----------------------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        for tier in self.tiers.values():
            tier.pin(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        for tier in self.tiers.values():
            tier.unpin(keys)

    def evict(
        self,
        tier: str | None = None,
        *,
        pool: str | None = None,
        namespace: bytes | None = None,
        replica: str | None = None,
    ) -> dict[str, int]:
        """Drop matching chunks from one tier, or all. Arena chunks reach lmdb first."""
        if tier is not None and tier not in self.tiers:
            raise ValueError(f"unknown tier {tier!r}; known: {sorted(self.tiers)}")
        if tier == TIER_CPU:
            self.flush()
        names = [tier] if tier is not None else list(self.tiers)
        return {
            name: self.tiers[name].evict(pool=pool, namespace=namespace, replica=replica)
            for name in names
        }

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        self.cpu.set_quota(replica, pool, nbytes)

    def stats(self) -> ManagerStats:
        return ManagerStats(
            tiers={name: tier.stats() for name, tier in self.tiers.items()},
            counters=self._counters.snapshot(),
        )

    def close(self, flush_timeout: float = 30.0) -> None:
        """Write back what the arena holds, then close every tier."""
        try:
            if self.lmdb is not None and not self.flush(flush_timeout):
                log.error(
                    "closing with %d arena chunks not written back to lmdb",
                    self.cpu.writeback_pending(),
                )
        finally:
            self._stop.set()
            self._wake.set()
            with contextlib.suppress(queue.Full):
                self._promotions.put_nowait(_STOP)  # wake the promoter now
            for thread in self._threads:
                thread.join()
            if self.lmdb is not None:
                self.lmdb.close()
            self.cpu.close()
