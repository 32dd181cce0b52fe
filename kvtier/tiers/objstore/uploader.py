"""Asynchronous uploads into the object tier.

Callers `offer` keys and never wait: a full queue drops the work and counts it (the chunks stay
in lmdb). A packer thread groups consecutive chunks of one namespace and owner into packs of about
``pack_target_bytes`` (or sends a part-filled pack after ``pack_linger_ms``), and a pool of
``upload_concurrency`` threads uploads them. Payloads are read from lmdb, verified, at upload time,
so the queue holds keys only; they are copied from lmdb already encoded, verified on the way.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier import blockfmt
from kvtier.config import ObjectStoreConfig
from kvtier.counters import Counters
from kvtier.keys import NAMESPACE_BYTES, ChunkKey
from kvtier.tiers.objstore.tier import ObjectTier

log = logging.getLogger(__name__)

CopyEncoded = Callable[[ChunkKey, memoryview], bool]
"""Copies a chunk, in the chunk format and verified, into a buffer of its encoded size; False
when it is gone."""

_STOP = (ChunkKey(b""), "")


class Uploader:
    def __init__(
        self, tier: ObjectTier, copy: CopyEncoded, config: ObjectStoreConfig, counters: Counters
    ) -> None:
        self.tier = tier
        self.copy = copy
        self.config = config
        self.counters = counters
        self._queue: queue.Queue[tuple[ChunkKey, str]] = queue.Queue(config.upload_queue_chunks)
        self._queued: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._slots = threading.Semaphore(config.upload_concurrency)
        self._pool = ThreadPoolExecutor(config.upload_concurrency, "kvtier-upload")
        self._packer = threading.Thread(target=self._pack_loop, name="kvtier-packer", daemon=True)
        self._packer.start()

    def offer(self, keys: Sequence[ChunkKey], replica: str) -> int:
        """Queue chunks for upload without waiting; returns how many were queued."""
        queued = 0
        for key in keys:
            with self._lock:
                if key in self._queued or key in self.tier:
                    continue
                self._queued.add(key)
            try:
                self._queue.put_nowait((key, replica))
            except queue.Full:
                with self._lock:
                    self._queued.discard(key)
                self.counters.add("uploads_dropped", len(keys) - queued)
                break
            queued += 1
        return queued

    def pending(self) -> int:
        with self._lock:
            return len(self._queued)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every offered chunk was uploaded or given up; True if so in time."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
        return True

    def _pack_loop(self) -> None:
        target = int(self.config.pack_target_bytes)
        linger = self.config.pack_linger_ms / 1000.0
        pack: list[ChunkKey] = []
        group: tuple[bytes, str] | None = None
        pack_bytes = 0
        started = 0.0
        while True:
            timeout = max(0.0, started + linger - time.monotonic()) if pack else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                if pack and group is not None:
                    self._submit(pack, group[1])
                return
            if item is not None:
                key, replica = item
                item_group = (key[:NAMESPACE_BYTES], replica)
                if pack and (item_group != group or pack_bytes >= target):
                    assert group is not None
                    self._submit(pack, group[1])
                    pack, pack_bytes = [], 0
                if not pack:
                    group, started = item_group, time.monotonic()
                pack.append(key)
                pack_bytes += self.tier.registry.resolve(key).chunk_bytes
                if pack_bytes < target:
                    continue
            if pack and group is not None:
                self._submit(pack, group[1])
                pack, pack_bytes = [], 0

    def _submit(self, keys: list[ChunkKey], replica: str) -> None:
        self._slots.acquire()  # bounds memory: at most upload_concurrency packs in flight
        with self._lock:
            self._in_flight += 1
        future: Future[None] = self._pool.submit(self._upload, keys, replica)
        future.add_done_callback(lambda _f: self._done(keys))

    def _upload(self, keys: list[ChunkKey], replica: str) -> None:
        try:
            todo = [k for k in keys if k not in self.tier]
            sizes = [blockfmt.encoded_size(self.tier.registry.resolve(k).chunk_bytes) for k in todo]
            body = bytearray(sum(sizes))
            view = memoryview(body)
            copied: list[ChunkKey] = []
            offset = 0
            for key, size in zip(todo, sizes, strict=True):
                if self.copy(key, view[offset : offset + size]):
                    copied.append(key)
                    offset += size
                else:
                    self.counters.add("uploads_source_missing", 1)
            if copied and self.tier.put_encoded(copied, view[:offset], replica) == 0:
                self.counters.add("uploads_failed", len(copied))
        except Exception:  # an upload thread must survive anything
            self.counters.add("uploads_failed", len(keys))
            log.exception("upload of %d chunks failed", len(keys))

    def _done(self, keys: list[ChunkKey]) -> None:
        self._slots.release()
        with self._idle:
            self._in_flight -= 1
            self._queued.difference_update(keys)
            self._idle.notify_all()

    def close(self, timeout: float) -> None:
        """Upload what is queued for up to ``timeout`` seconds, then stop."""
        if not self.wait_idle(timeout):
            log.warning("stopping with %d chunks not uploaded (they stay in lmdb)", self.pending())
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=1.0)
        self._packer.join(timeout=5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
