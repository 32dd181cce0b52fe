"""Asynchronous uploads into the object tier.

Callers `offer` keys and never wait: a full queue drops the work and counts it (the chunks stay
in lmdb). A packer thread groups chunks into packs of about ``pack_target_bytes`` (or sends a
part-filled pack after ``pack_linger_ms``), and a pool of ``upload_concurrency`` threads uploads
them. Payloads are read from lmdb, verified, at upload time, so the queue holds keys only; they are
copied from lmdb already encoded, verified on the way.

A pack holds consecutive chunks of one prefix only: an object is named after its first chunk,
and another node finds it by probing for the first chunk of a prompt it lacks, so every run of a
prefix must start an object. Chunk keys do not say which chunk precedes them; callers do
(`follows`): the keys of one reserve, and the part of a lookup found nowhere (what the engine
computes and stores next), are consecutive chunks of one prompt. A chunk whose predecessor is not
the last chunk of an open pack starts a pack of its own.

After a restart, `resume` offers again, in the background and at a bounded rate, the chunks lmdb
holds and the index lacks: uploads queued or failed when the process stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from kvtier.core.config import ObjectStoreConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.priority import enter_background
from kvtier.tiers.objstore.tier import ObjectTier

log = logging.getLogger(__name__)


class EncodedSource(Protocol):
    """Where uploads come from (the lmdb tier): chunks in the chunk format, verified."""

    def encoded_length(self, key: ChunkKey) -> int | None:
        """The chunk's stored size, header included; None when it is not held."""
        ...

    def copy_encoded(self, key: ChunkKey, dst: memoryview) -> bool:
        """Copy the chunk into a buffer of its stored size; False when it is gone."""
        ...


_STOP = (ChunkKey(b""), "")
_MAX_FOLLOWS = 1 << 16  # bound on remembered predecessors; past it packs are only smaller
_MAX_OPEN_PACKS = 64
_RESUME_POLL_S = 1.0

Held = Callable[[int], list[tuple[ChunkKey, str]]]
"""Up to so many chunks held locally, newest first, with the replica that stored each; chunks
fetched from the store are left out."""


class _Pack:
    __slots__ = ("keys", "nbytes", "replica", "started")

    def __init__(self, key: ChunkKey, nbytes: int, replica: str) -> None:
        self.keys = [key]
        self.nbytes = nbytes
        self.replica = replica
        self.started = time.monotonic()


class Uploader:
    def __init__(
        self,
        tier: ObjectTier,
        source: EncodedSource,
        config: ObjectStoreConfig,
        counters: Counters,
    ) -> None:
        self.tier = tier
        self.source = source
        self.config = config
        self.counters = counters
        self._queue: queue.Queue[tuple[ChunkKey, str]] = queue.Queue(config.upload_queue_chunks)
        self._queued: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._slots = threading.Semaphore(config.upload_concurrency)
        self._pool = ThreadPoolExecutor(
            config.upload_concurrency, "kvtier-upload", initializer=enter_background
        )
        self._follows: dict[ChunkKey, ChunkKey] = {}  # key -> the chunk before it in its prompt
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._resumer: threading.Thread | None = None
        self._packer = threading.Thread(target=self._pack_loop, name="kvtier-packer", daemon=True)
        self._packer.start()

    def follows(self, keys: Sequence[ChunkKey]) -> None:
        """Record that ``keys`` are consecutive chunks of one prefix, in order."""
        if len(keys) < 2:
            return
        with self._lock:
            chain = self._follows
            if chain.get(keys[-1]) == keys[-2]:  # told already (a lookup asked again)
                return
            for before, key in itertools.pairwise(keys):
                if namespace_of(before) == namespace_of(key):
                    chain[key] = before
            while len(chain) > _MAX_FOLLOWS:  # oldest first: dicts keep insertion order
                del chain[next(iter(chain))]

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
        enter_background()
        target = int(self.config.pack_target_bytes)
        linger = self.config.pack_linger_ms / 1000.0
        open_packs: dict[ChunkKey, _Pack] = {}  # by last key
        while True:
            first = min((pack.started for pack in open_packs.values()), default=None)
            timeout = None if first is None else max(0.0, first + linger - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                for pack in open_packs.values():
                    self._submit(pack.keys, pack.replica)
                return
            if item is not None:
                try:
                    self._place(item, open_packs, target)
                except Exception:  # e.g. a namespace no longer registered: drop the chunk
                    self.counters.add("uploads_failed", 1)
                    log.exception("cannot pack chunk %s", item[0].hex())
                    self._done([item[0]], slot=False)
            now = time.monotonic()
            crowded = len(open_packs) > _MAX_OPEN_PACKS
            for tail, pack in list(open_packs.items()):
                if crowded or pack.started + linger <= now:
                    del open_packs[tail]
                    self._submit(pack.keys, pack.replica)

    def _place(
        self, item: tuple[ChunkKey, str], open_packs: dict[ChunkKey, _Pack], target: int
    ) -> None:
        """Append a chunk to the open pack it continues, or open one; send a full pack."""
        key, replica = item
        nbytes = self.tier.registry.resolve(key).chunk_bytes
        with self._lock:
            before = self._follows.pop(key, None)
        pack = open_packs.get(before) if before is not None else None
        if pack is not None and pack.replica == replica:
            del open_packs[pack.keys[-1]]
            pack.keys.append(key)
            pack.nbytes += nbytes
        else:
            pack = _Pack(key, nbytes, replica)
        if pack.nbytes >= target:
            self._submit(pack.keys, pack.replica)
        else:
            open_packs[key] = pack

    def _submit(self, keys: list[ChunkKey], replica: str) -> None:
        # bounds memory: at most upload_concurrency packs in flight
        while not self._slots.acquire(timeout=0.1):
            if self._closing.is_set():  # past the close's deadline: the next start offers them
                self._done(keys, slot=False)
                return
        with self._lock:
            self._in_flight += 1
        future: Future[None] = self._pool.submit(self._upload, keys, replica)
        future.add_done_callback(lambda _f: self._done(keys))

    def _upload(self, keys: list[ChunkKey], replica: str) -> None:
        try:
            todo = [k for k in keys if k not in self.tier]
            sizes = [self.source.encoded_length(k) for k in todo]
            body = bytearray(sum(size or 0 for size in sizes))
            view = memoryview(body)
            copied: list[ChunkKey] = []
            pieces: list[memoryview | bytes] = []
            in_place = True  # every piece is the bytes copied, back to back in body
            offset = 0
            for key, size in zip(todo, sizes, strict=True):
                piece = view[offset : offset + (size or 0)]
                if size is None or not self.source.copy_encoded(key, piece):
                    self.counters.add("uploads_source_missing", 1)
                    continue
                offset += size
                stored = self.tier.in_store_codec(key, piece)
                in_place = in_place and stored is piece
                if stored is None:
                    self.counters.add("uploads_codec_refused", 1)
                    continue
                copied.append(key)
                pieces.append(stored)
            # a chunk stored again in the store's codec is a buffer of its own: join them
            upload = view[:offset] if in_place else memoryview(b"".join(pieces))
            if copied and self.tier.put_encoded(copied, upload, replica) == 0:
                self.counters.add("uploads_failed", len(copied))
        except Exception:  # an upload thread must survive anything
            self.counters.add("uploads_failed", len(keys))
            log.exception("upload of %d chunks failed", len(keys))

    def _done(self, keys: list[ChunkKey], slot: bool = True) -> None:
        if slot:
            self._slots.release()
        with self._idle:
            if slot:
                self._in_flight -= 1
            self._queued.difference_update(keys)
            self._idle.notify_all()

    # -- after a restart ------------------------------------------------------------------

    def resume(self, held: Held, namespaces: Callable[[], Iterable[bytes]]) -> None:
        """Offer again, in the background, the chunks lmdb held at start and the index lacks: up
        to ``reupload_max_chunks`` of them, ``reupload_chunks_per_s`` at most, each namespace's
        once it is registered (a chunk cannot be named before). Only what was held at start:
        a chunk stored since is offered as it is written, and one deleted from the store since
        (`kvtier gc`) stays deleted."""
        if self.config.reupload_max_chunks <= 0 or self._resumer is not None:
            return
        self._resumer = threading.Thread(
            target=self._resume_loop, args=(held, namespaces), name="kvtier-reupload", daemon=True
        )
        self._resumer.start()

    def _resume_loop(self, held: Held, namespaces: Callable[[], Iterable[bytes]]) -> None:
        budget = self.config.reupload_max_chunks
        interval = 1.0 / self.config.reupload_chunks_per_s
        enter_background()
        room = max(1, self.config.upload_queue_chunks // 2)  # leave new chunks the other half
        try:
            waiting: dict[bytes, list[tuple[ChunkKey, str]]] = {}
            for key, replica in held(budget):
                if key not in self.tier:
                    waiting.setdefault(bytes(namespace_of(key)), []).append((key, replica))
            while waiting and budget > 0 and not self._stop.is_set():
                ready = [ns for ns in namespaces() if ns in waiting]
                for ns in ready:
                    for key, replica in waiting.pop(ns):
                        if budget <= 0 or self._stop.is_set():
                            break
                        if key in self.tier:
                            continue
                        while self._queue.qsize() >= room:
                            if self._stop.wait(0.05):
                                return
                        if self.offer([key], replica):
                            budget -= 1
                            self.counters.add("uploads_resumed", 1)
                        if self._stop.wait(interval):
                            return
                if not ready:
                    self._stop.wait(_RESUME_POLL_S)
        except Exception:  # a background scan must not take the process down
            log.exception("offering chunks not uploaded before the restart failed")
        if budget <= 0:
            log.warning(
                "offered %d chunks not uploaded before the restart (object.reupload_max_chunks); "
                "the rest stay in lmdb only",
                self.config.reupload_max_chunks,
            )

    def close(self, timeout: float) -> None:
        """Upload what is queued for up to ``timeout`` seconds, then stop."""
        self._stop.set()
        if self._resumer is not None:
            self._resumer.join(timeout=5.0)
        if not self.wait_idle(timeout):
            log.warning(
                "stopping with %d chunks not uploaded (they stay in lmdb, offered again at the "
                "next start)",
                self.pending(),
            )
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=1.0)
        self._packer.join(timeout=5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
