"""Write-back: committed arena chunks reach lmdb (and, when every chunk is admitted, the upload
queue) from a thread of their own, before the arena may evict them, or right after their commit
in write-through mode. The data plane never waits on it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.core.config import Admission, DemoteMode, KVTierConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.priority import enter_background
from kvtier.core.protocol import SlotRef
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.uploader import Uploader

log = logging.getLogger(__name__)

PRESSED_S = 10.0
"""After a store is refused for want of a clean slot, how long write-back keeps every chunk
written (about a round of prefills): a refused store is a later miss, dearer than the writing."""


class WriteBack:
    def __init__(
        self,
        cpu: CpuTier,
        lmdb: LmdbTier,
        uploader: Uploader | None,
        config: KVTierConfig,
        counters: Counters,
        between_batches: Callable[[], None],
        skip: Callable[[bytes], bool] = lambda namespace: False,
        writes: Callable[[], bool] = lambda: True,
    ) -> None:
        """``between_batches`` runs on the write-back thread each time it has caught up; chunks
        of a namespace ``skip`` names (quarantined), and every chunk while ``writes()`` is false
        (lmdb is unhealthy), are marked written without being written: the arena keeps them as
        a cache, evicted as clean ones are, so it never fills with chunks it cannot write; they
        count as ``writeback_skipped``, never as written."""
        self._skip = skip
        self._writes = writes
        self._cpu = cpu
        self._lmdb = lmdb
        self._upload = uploader if config.object.admission is Admission.ALL else None
        self._batch_chunks = config.manager.writeback_batch_chunks
        self._counters = counters
        self._between_batches = between_batches
        self._write_through = config.manager.demote_mode is DemoteMode.WRITE_THROUGH
        cpu.track_dirty(True)
        cpu.set_clean_reserve(1.0 if self._write_through else config.manager.clean_reserve)
        self._idle: Callable[[], bool] = lambda: False
        self._pressed_until = 0.0
        # held while a batch holds its chunks' slots, so an admin eviction can wait for it
        self._batching = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-writeback", daemon=True)
        self._thread.start()

    def write_all_when(self, idle: Callable[[], bool]) -> None:
        """While ``idle()`` is true (no engine is running a request), write every dirty chunk,
        not only what the clean reserve needs: the CPU time is nobody's then."""
        self._idle = idle

    def wake(self) -> None:
        """Chunks were committed: write-through writes them now."""
        self._wake.set()

    def _loop(self) -> None:
        enter_background()
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                # stores refused lately: the reserve does not keep up with them, so every
                # dirty chunk is written, busy engines or not, until none was for a while
                if self._cpu.take_refused():
                    self._counters.add("writeback_pressed", 1)
                    self._pressed_until = time.monotonic() + PRESSED_S
                pressed = self._write_through or time.monotonic() < self._pressed_until
                # asked again each batch: an engine that starts a request stops the writing
                while self._batch(everything=pressed or self._idle()):
                    pass
                self._between_batches()
            except Exception:  # never let the mover die silently
                self._counters.add("writeback_errors", 1)
                log.exception("write-back batch failed")

    def paused(self) -> threading.Lock:
        """Held, no batch is in flight: the arena's chunks are leased by clients only."""
        return self._batching

    def _batch(self, everything: bool) -> int:
        with self._batching:
            return self._write_batch(everything)

    def _write_batch(self, everything: bool) -> int:
        cpu = self._cpu
        refs = cpu.take_dirty(self._batch_chunks, everything)
        if not refs:
            return 0
        ok = False
        changed: set[ChunkKey] = set()
        skipped: set[ChunkKey] = set()
        try:
            by_owner: dict[str, list[SlotRef]] = {}
            writes = self._writes()
            for ref in refs:
                if writes and not self._skip(namespace_of(ref.key)):
                    by_owner.setdefault(cpu.owner_of(ref), []).append(ref)
                else:
                    skipped.add(ref.key)
            for owner, group in by_owner.items():
                # the encoder's checksum of what it stores is compared with the commit's
                stored, differ = self._lmdb.put_many_checked(
                    [(r.key, cpu.view(r), cpu.commit_checksum(r)) for r in group], owner
                )
                changed.update(differ)
                if self._upload is not None:
                    self._upload.offer(
                        [r.key for r, done in zip(group, stored, strict=True) if done], owner
                    )
            ok = True
        finally:
            cpu.writeback_done(refs, ok, changed, skipped)
        return len(refs)

    def flush(self, timeout: float = 30.0) -> bool:
        """Write every dirty arena chunk to lmdb; True when none is left."""
        deadline = time.monotonic() + timeout
        while self._cpu.writeback_pending():
            if not self._batch(everything=True):
                time.sleep(0.001)  # the rest is in flight on the write-back thread
            if time.monotonic() > deadline:
                return False
        return True

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
