"""Promotion: lmdb chunks copied up into the arena, at once for a lease that needs them, or
queued for a thread of their own when an engine asks ahead (a later lookup finds them there).

A chunk promoted ahead of its load is held (leased by the promoter) until the load's lease takes
it, or for ``manager.promote_hold_s``: in an arena smaller than what the engines are about to
load, one request's promotions would otherwise evict another's before either loads, and both
promote again, over and over. Holds take at most ``manager.promote_hold_share`` of a pool, so
stores always find room."""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence

from kvtier.core.config import ManagerConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey
from kvtier.core.priority import enter_background
from kvtier.core.protocol import SlotRef
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier

log = logging.getLogger(__name__)

_STOP = (ChunkKey(b""), "")  # wakes the promoter to stop


class Promoter:
    def __init__(self, cpu: CpuTier, lmdb: LmdbTier, config: ManagerConfig, counters: Counters):
        self._cpu = cpu
        self._lmdb = lmdb
        self._counters = counters
        self._queue: queue.Queue[tuple[ChunkKey, str]] = queue.Queue(config.promote_queue_chunks)
        self._queued: set[ChunkKey] = set()
        self._hold_s = config.promote_hold_s
        self._hold_share = config.promote_hold_share
        self._holds: dict[ChunkKey, tuple[SlotRef, float]] = {}
        """Per chunk held, its hold and when the hold ends."""
        self._held_bytes: dict[str, int] = {}
        """Per pool, bytes held."""
        self._holds_lock = threading.Lock()
        cpu.count_held(self.held_slots)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-promote", daemon=True)
        self._thread.start()

    def promote(self, key: ChunkKey, replica: str, lease: bool = True) -> SlotRef | None:
        """Copy one lmdb chunk into the arena now; with ``lease``, leased to the caller. None
        where it is not in lmdb, the arena has no room, another caller is promoting it, or it
        failed verification."""
        if not self._lmdb.contains([key])[0]:
            return None
        cpu = self._cpu
        (ref,) = cpu.reserve([key], replica)
        if ref is None:  # no room, or another caller is promoting it right now
            self._counters.add("promotion_failed", 1)
            return None
        if not self._lmdb.read_into(key, cpu.view(ref)):
            cpu.abort([ref])
            self._counters.add("promotion_failed", 1)
            return None
        cpu.commit([ref], clean=True, lease=lease)
        self._counters.add("promotions", 1)
        return ref

    def promote_ahead(self, key: ChunkKey, replica: str) -> None:
        """Promote a chunk a load will lease soon, held for it (see the module's docstring).
        Past the hold share it is left in lmdb: promoted unheld into a full arena, it would
        only evict a chunk another load waits for, and be evicted in turn."""
        if self._hold_s <= 0:
            self.promote(key, replica, lease=False)
            return
        reg = self._cpu.registry.resolve(key)
        with self._holds_lock:
            held = self._held_bytes.get(reg.pool, 0)
            room = self._hold_share * self._cpu.pool_capacity_bytes(reg.pool) - held
            if key in self._holds or room < reg.chunk_bytes:
                self._counters.add("promotion_holds_deferred", 1)
                return
            self._held_bytes[reg.pool] = held + reg.chunk_bytes  # taken before the copy
        ref = self.promote(key, replica, lease=True)
        with self._holds_lock:
            if ref is None or key in self._holds:
                self._held_bytes[reg.pool] -= reg.chunk_bytes
            else:
                self._holds[key] = (ref, time.monotonic() + self._hold_s)
                return
        if ref is not None:
            self._cpu.release([ref])

    def claimed(self, keys: Sequence[ChunkKey]) -> None:
        """Leases took these chunks: their holds end."""
        if not self._holds:
            return
        with self._holds_lock:
            ended = [hold for key in keys if (hold := self._holds.pop(key, None)) is not None]
            self._unhold(ended)
        self._cpu.release([ref for ref, _ in ended])

    def expire(self, now: float | None = None) -> int:
        """End the holds whose time is up (and all of them with ``now`` = inf); returns how many."""
        now = time.monotonic() if now is None else now
        with self._holds_lock:
            ended = [(k, hold) for k, hold in self._holds.items() if hold[1] <= now]
            for key, _ in ended:
                del self._holds[key]
            self._unhold([hold for _, hold in ended])
        if ended:
            self._counters.add("promotion_holds_expired", len(ended))
            self._cpu.release([ref for _, (ref, _) in ended])
        return len(ended)

    def _unhold(self, ended: Sequence[tuple[SlotRef, float]]) -> None:
        for ref, _ in ended:
            reg = self._cpu.registry.resolve(ref.key)  # as promote_ahead counted it
            self._held_bytes[reg.pool] -= reg.chunk_bytes

    def held(self) -> int:
        """Chunks held for loads."""
        return len(self._holds)

    def held_slots(self, pool: str, slot_bytes: int) -> int:
        """Slots of ``slot_bytes`` a pool's holds take (one chunk size per pool, as a rule)."""
        return self._held_bytes.get(pool, 0) // slot_bytes

    def queue(self, keys: Sequence[ChunkKey], replica: str) -> int:
        """Queue lmdb chunks for the promoting thread, without waiting; returns how many were
        queued (none once the queue is full). Their reads from disk start at once, all
        together, where the thread would fault them in one after another."""
        self._lmdb.read_ahead([k for k in keys if k not in self._queued])
        queued = 0
        for key in keys:
            if key in self._queued:
                continue
            try:
                self._queue.put_nowait((key, replica))
            except queue.Full:
                self._counters.add("promotions_dropped", 1)
                break
            self._queued.add(key)
            queued += 1
        return queued

    def pending(self) -> int:
        """Chunks queued and not promoted yet."""
        return self._queue.qsize()

    def _loop(self) -> None:
        enter_background()
        while not self._stop.is_set():
            self.expire()
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            key, replica = item
            try:
                self.promote_ahead(key, replica)
            except Exception:  # never let the mover die silently
                self._counters.add("promotion_errors", 1)
                log.exception("promotion failed")
            finally:
                self._queued.discard(key)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)  # wake it now
        self._thread.join()
        self.expire(math.inf)
