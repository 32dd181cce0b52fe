"""The lmdb tier: verified chunks in one LMDB environment, with an LRU index kept inside LMDB.

Databases in the environment: ``chunks`` (key -> encoded chunk, see `kvtier.core.blockfmt`), and the
index records of `kvtier.tiers.lmdb_index`: ``lru``, ``meta`` and ``pins``.

The tier asks; its store (`kvtier.tiers.lmdb_store`) owns the environment, the index and the
budget, and runs every transaction: the in-memory index follows LMDB only after a transaction
commits, so an aborted write (map full, disk full) leaves the two in agreement.

``durability`` decides what a commit waits for, and a background thread syncs every
``sync_interval_s`` whatever it is. A killed process leaves LMDB at its last commit, and every read
is verified, so a chunk is either whole and correct or absent. An OS crash or power loss is
another matter:

- ``fast`` (sync and metasync off): commits are not flushed. LMDB then promises nothing: the
  environment can be corrupt, not only short of its last commits.
- ``consistent`` (metasync off): each commit flushes its data pages but not the meta page; the
  crash can undo the last commits and leaves the environment readable.
- ``full``: each commit flushes both before it returns.

With ``fast``, data.mdb is preallocated to the whole map at open and writes go through LMDB's
map, a copy fewer; a file that cannot be preallocated keeps staged writes, as the other settings
do (see `kvtier.tiers.lmdb_env.open_environment`).

An environment found unreadable at open is moved aside and the tier starts empty (see
`kvtier.tiers.lmdb_env`). A reader killed inside its read, a full map or a full disk never stops
writes for good (`kvtier.core.lmdb_space`, the store's ``space``).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import lmdb

from kvtier.core.config import LMDBConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.core.priority import enter_background
from kvtier.core.protocol import TierStats
from kvtier.tiers import lmdb_reader
from kvtier.tiers.base import Tier
from kvtier.tiers.lmdb_env import (
    UNREADABLE_ERRORS,
    move_aside,
)
from kvtier.tiers.lmdb_loads import LmdbLoads
from kvtier.tiers.lmdb_store import LmdbStore

__all__ = ["UNREADABLE_ERRORS", "LmdbTier", "move_aside"]

log = logging.getLogger(__name__)


class LmdbTier(Tier):
    """The verbs over the environment and index it holds (`lmdb_store.LmdbStore`, ``store``),
    which it asks."""

    name = "lmdb"
    persistent = True

    def __init__(self, config: LMDBConfig, registry: PoolRegistry) -> None:
        super().__init__(registry)
        self.config = config
        self._counters = Counters()
        self.store = LmdbStore(config, self._counters, self._tell)
        self.budget = self.store.budget
        self.space = self.store.space
        self.set_aside = self.store.set_aside
        """Where an unreadable environment found at open was moved to."""
        self.loads = LmdbLoads(self.store.touch, registry, self._counters)
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        if config.sync_interval_s > 0 or config.reader_check_interval_s > 0:
            self._syncer = threading.Thread(
                target=self._background, name="kvtier-lmdb-sync", daemon=True
            )
            self._syncer.start()

    @property
    def env(self) -> lmdb.Environment:
        return self.store.env

    def records(self) -> dict[bytes, bytes]:
        """The small records kept beside the chunks (quarantines), by key."""
        return self.store.records()

    def write_record(self, key: bytes, value: bytes | None) -> None:
        """Keep ``value`` under ``key`` (None: drop it), flushed at once (`LmdbStore`)."""
        self.store.write_record(key, value)

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: ChunkKey, payload: memoryview | bytes, replica: str = "default") -> bool:
        return self.put_many([(key, payload)], replica)[0]

    def put_many(
        self, items: Sequence[tuple[ChunkKey, memoryview | bytes]], replica: str = "default"
    ) -> list[bool]:
        """Store chunks in one transaction; False for those that found no room."""
        return self.put_many_checked([(k, p, None) for k, p in items], replica)[0]

    def put_many_checked(
        self,
        items: Sequence[tuple[ChunkKey, memoryview | bytes, bytes | None]],
        replica: str = "default",
    ) -> tuple[list[bool], list[ChunkKey]]:
        """`put_many`, where each payload may come with the checksum it must still have (taken
        when it was committed to the arena). A payload that no longer matches is not stored.
        Returns whether each chunk is stored, and the keys that did not match."""
        regs = [self._check_payload(key, len(payload)) for key, payload, _ in items]
        values = [(k, p, reg, c) for (k, p, c), reg in zip(items, regs, strict=True)]
        # a chunk an engine reads from the map (`lmdb_loads`) stays
        try:  # a full map or disk is counted there, and the chunks are not stored
            done = self.space.write(
                lambda: self.store.write(values, replica, self.loads),
                lambda tries: self.store.make_room(tries, self.loads),
                self.store.adopt_map_size,
            )
        except lmdb.Error as exc:  # a failing disk: the chunks are just not stored
            log.error("lmdb: write failed, %d chunks not stored: %s", len(items), exc)
            done = None
        if done is None:
            self._counters.add("store_failed", len(items))
            return [False] * len(items), []
        return done

    # -- reads ----------------------------------------------------------------------------

    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        if key not in self.store:
            self._counters.add("misses", 1)
            return False
        found, failure = self.store.copy_payload(key, dst)
        if not found:  # indexed but gone from LMDB: stop claiming it
            self._counters.add("misses", 1)
            self.store.drop([key], force=True)
            return False
        if failure is not None:
            self.quarantine(key, failure)
            return False
        self._counters.add("hits", 1)
        self.store.touch(key)
        return True

    def touch(self, key: ChunkKey) -> bool:
        """Whether lmdb holds ``key``, moved up the eviction order if so (it is being read)."""
        return self.store.touch(key)

    def read_ahead(self, keys: Sequence[ChunkKey]) -> None:
        """Start reading these chunks from disk now (they are about to be promoted)."""
        try:
            self.store.will_need(keys)
        except lmdb.Error as exc:  # a hint only: the reads themselves report failures
            log.debug("lmdb: read-ahead failed: %s", exc)

    def encoded_length(self, key: ChunkKey) -> int | None:
        """The stored chunk's size, header included (coded, in ``lmdb.codec``); None when absent."""
        entry = self.store.entry(key)
        return None if entry is None else entry.nbytes

    def copy_encoded(self, key: ChunkKey, dst: memoryview) -> bool:
        """Copy the stored chunk, header included, verified, into ``dst`` (exactly its encoded
        size): what the object tier uploads, without decoding and encoding again. False when
        absent or corrupt (then quarantined)."""
        try:
            return self.store.copy_encoded(key, dst)
        except ChunkFormatError as exc:
            self.quarantine(key, lmdb_reader.without_frames(exc))
            return False

    def verify_chunk(self, key: ChunkKey) -> bool | None:
        """Verify one stored chunk in place: True if sound, False if it failed (it is then
        quarantined), None if absent."""
        failure = self.store.verify(key)
        if failure is None:
            return None
        if isinstance(failure, ChunkFormatError):
            self.quarantine(key, failure)
            return False
        return True

    def corrupt_chunks(self) -> int:
        return self._counters.snapshot()["corrupt"]  # stats() walks the whole index

    def quarantine(self, key: ChunkKey, reason: Exception) -> None:
        """Delete a chunk that failed verification and count it; it is never served."""
        log.error("lmdb: chunk %s failed verification (%s); deleted", key.hex(), reason)
        self._counters.add("corrupt", 1)
        if (registered := self.registry.get(namespace_of(key))) is not None:
            self._counters.add(f"corrupt:{registered.pool}", 1)  # else its pool is unknown
        self.store.drop([key], force=True)

    # -- maintenance ----------------------------------------------------------------------

    def _background(self) -> None:
        """Sync every ``sync_interval_s``; clear dead readers' slots when due."""
        enter_background()
        sync_every = self.config.sync_interval_s
        every = min(s for s in (sync_every, self.config.reader_check_interval_s) if s > 0)
        synced = time.monotonic()
        while not self._stop.wait(every):
            try:
                if sync_every > 0 and time.monotonic() - synced >= sync_every:
                    synced = time.monotonic()
                    self.sync()
                self.space.reap_if_due()
            except Exception:  # keep going; a dead thread would go unnoticed
                self._counters.add("sync_failed", 1)
                log.exception("lmdb: background sync failed")

    def sync(self) -> None:
        """Apply recorded accesses to the LRU index and flush everything to disk."""
        self.store.sync()

    # -- the Tier contract ----------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return list(map(self.store.__contains__, keys))

    def __contains__(self, key: object) -> bool:
        return key in self.store

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return len(self.store.drop(keys, force=False))

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        self.store.set_pinned(keys, True)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.store.set_pinned(keys, False)

    def retire(self, namespace: bytes) -> None:
        """Evict a namespace's chunks (an old draft revision) before any other when room is
        needed."""
        self.store.set_retired(namespace, True)

    def reinstate(self, namespace: bytes) -> None:
        """Undo `retire` (a swap back)."""
        self.store.set_retired(namespace, False)

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks held per namespace."""
        return self.store.namespace_chunks()

    def keys(self) -> Iterator[ChunkKey]:
        return iter([key for key, _ in self.store.entries()])

    def newest_chunks(self, limit: int, exclude_replica: str) -> list[tuple[ChunkKey, str]]:
        """Up to ``limit`` chunks with the replica that stored each, newest first, leaving out
        those stored by ``exclude_replica``."""
        found = heapq.nlargest(
            limit,
            (
                (entry.tick, key, entry.replica)
                for key, entry in self.store.entries()
                if entry.replica != exclude_replica
            ),
        )
        return [(key, replica) for _, key, replica in found]

    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        victims = [
            key
            for key, entry in self.store.entries()
            if not entry.pinned
            and (pool is None or entry.pool == pool)
            and (namespace is None or namespace_of(key) == namespace)
            and (replica is None or entry.replica == replica)
        ]
        dropped = len(self.store.drop(victims, force=False))
        self._counters.add("evictions_admin", dropped)
        return dropped

    def stats(self) -> TierStats:
        return self.store.stats(self.name)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        self.store.close()
