"""Promotion: lmdb chunks copied up into the arena, at once for a lease that needs them, or
queued for a thread of their own when an engine asks ahead (a later lookup finds them there)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence

from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier

log = logging.getLogger(__name__)

_STOP = (ChunkKey(b""), "")  # wakes the promoter to stop


class Promoter:
    def __init__(self, cpu: CpuTier, lmdb: LmdbTier, queue_chunks: int, counters: Counters):
        self._cpu = cpu
        self._lmdb = lmdb
        self._counters = counters
        self._queue: queue.Queue[tuple[ChunkKey, str]] = queue.Queue(queue_chunks)
        self._queued: set[ChunkKey] = set()
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

    def queue(self, keys: Sequence[ChunkKey], replica: str) -> int:
        """Queue lmdb chunks for the promoting thread, without waiting; returns how many were
        queued (none once the queue is full)."""
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
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            key, replica = item
            try:
                self.promote(key, replica, lease=False)
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
