"""The lmdb tier: verified chunks in one LMDB environment, with an LRU index kept inside LMDB.

Databases in the environment: ``chunks`` (key -> encoded chunk, see `kvtier.core.blockfmt`), and the
index records of `kvtier.tiers.lmdb_index`: ``lru``, ``meta`` and ``pins``.

The in-memory index follows LMDB only after a transaction commits, so an aborted write (map
full, disk full) leaves the two in agreement.

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
from dataclasses import replace

import lmdb

from kvtier.core import blockfmt
from kvtier.core.config import Durability, LMDBConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import ChunkFormatError, CorruptChunkError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import TierStats, UsageStats
from kvtier.tiers import lmdb_reader
from kvtier.tiers.base import Tier
from kvtier.tiers.lmdb_env import (
    UNREADABLE_ERRORS,
    move_aside,
)
from kvtier.tiers.lmdb_index import Entry, Pending, lru_key
from kvtier.tiers.lmdb_loads import LmdbLoads
from kvtier.tiers.lmdb_store import LmdbStore
from kvtier.tiers.lmdb_values import copy_encoded, copy_payload, verify, will_need

__all__ = ["UNREADABLE_ERRORS", "LmdbTier", "move_aside"]

log = logging.getLogger(__name__)

_MAX_PENDING_TOUCHES = 1 << 16


class LmdbTier(Tier):
    """The verbs over the environment and index it holds (`lmdb_store.LmdbStore`, ``store``)."""

    name = "lmdb"
    persistent = True

    def __init__(self, config: LMDBConfig, registry: PoolRegistry) -> None:
        super().__init__(registry)
        self.config = config
        self._counters = Counters()
        self.store = LmdbStore(config, self._counters)
        self.budget = self.store.budget
        self.space = self.store.space
        self.set_aside = self.store.set_aside
        """Where an unreadable environment found at open was moved to."""
        self._touched: dict[ChunkKey, None] = {}
        self._track_access = config.eviction_policy == "lru"
        self._scratch = bytearray()
        self.loads = LmdbLoads(self.touch, registry, self._counters)
        lmdb_reader.adopt(config.path, self.env, self.store.chunks)
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
        try:  # a full map or disk is counted there, and the chunks are not stored
            done = self.space.write(
                lambda: self._put_txn(values, replica), self._make_room, self.store.adopt_map_size
            )
        except lmdb.Error as exc:  # a failing disk: the chunks are just not stored
            log.error("lmdb: write failed, %d chunks not stored: %s", len(items), exc)
            done = None
        if done is None:
            self._counters.add("store_failed", len(items))
            return [False] * len(items), []
        return done

    def _make_room(self, tries: int) -> None:
        """Evict ``tries`` twentieths of the budget (down to the low-water mark at least), in a
        transaction of its own: LMDB reuses the pages it frees only once it has committed."""
        with self.store.lock:
            with self.env.begin(write=True) as txn:
                evicted = self._evict_for(
                    txn, self.store.high - self.store.used + tries * self.budget // 20
                )
            self._forget(evicted)

    def _forget(self, evicted: list[ChunkKey]) -> None:
        """Adopt the evictions of a committed transaction."""
        self.store.forget(evicted)
        self._tell(False, evicted)

    def _put_txn(self, values: list[Pending], replica: str) -> tuple[list[bool], list[ChunkKey]]:
        changed: list[ChunkKey] = []
        with self.store.lock:
            codec = self.config.codec
            new = {
                k: reg.descriptor.stored_size(len(p), codec)
                for k, p, reg, _ in values
                if k not in self.store.index
            }
            added: dict[ChunkKey, Entry] = {}
            with self.env.begin(write=True) as txn:
                touched = self._flush_touches(txn)  # recency first, so eviction sees it
                evicted = set(self._evict_for(txn, sum(new.values())))
                results = []
                uncodable = 0
                used = self.store.used - sum(self.store.index[k].nbytes for k in evicted)
                for key, payload, reg, expect in values:
                    if (key in self.store.index and key not in evicted) or key in added:
                        results.append(True)
                        continue
                    size = reg.descriptor.stored_size(len(payload), codec)
                    if used + size > self.budget:
                        results.append(False)
                        continue
                    try:
                        value = self._encode(key, payload, reg, expect)
                    except CorruptChunkError:
                        changed.append(key)
                        results.append(False)
                        continue
                    if value is None:  # a value no code stands for: not stored coded
                        uncodable += 1
                        results.append(False)
                        continue
                    used += size
                    txn.put(key, value, db=self.store.chunks)
                    pinned = key in self.store.pinned_keys
                    entry = Entry(self.store.tick(), size, pinned, reg.pool, replica)
                    txn.put(key, entry.pack(), db=self.store.meta)
                    if not pinned:
                        txn.put(lru_key(entry.tick, key), b"", db=self.store.lru)
                    added[key] = entry
                    results.append(True)
            # committed: only now does the in-memory index follow
            self.store.apply(touched)
            self._forget(list(evicted))
            self.store.apply(added)
            self._tell(True, list(added))
            self._counters.add("stores", len(added))
            self._counters.add("codec_refused", uncodable)
            self._counters.add("store_rejected", results.count(False) - len(changed) - uncodable)
        if self.config.sync_interval_s == 0 and self.config.durability is not Durability.FULL:
            self.env.sync(True)
        return results, changed

    def _encode(
        self, key: ChunkKey, payload: memoryview | bytes, reg: Registration, expect: bytes | None
    ) -> memoryview | None:
        """The encoded chunk (in ``lmdb.codec``) in one reused buffer (LMDB takes a single
        value); None where the codec cannot code it. Raises `CorruptChunkError` when ``expect``
        is given and the payload's checksum differs."""
        total = reg.descriptor.stored_size(len(payload), self.config.codec)
        if len(self._scratch) < total:
            self._scratch = bytearray(total)
        written = blockfmt.encode_into(
            self._scratch,
            key,
            reg.descriptor,
            payload,
            expect_checksum=expect,
            codec=self.config.codec,
        )
        return None if written is None else memoryview(self._scratch)[:written]

    def _evict_for(self, txn: lmdb.Transaction, incoming: int) -> list[ChunkKey]:
        # a chunk an engine reads from the map (`lmdb_loads`) stays
        return self.store.evict_for(txn, incoming, self.loads)

    # -- reads ----------------------------------------------------------------------------

    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        if key not in self.store.index:
            self._counters.add("misses", 1)
            return False
        try:
            found, failure = copy_payload(self.env, self.store.chunks, key, dst)
        except lmdb.MapResizedError:  # another process grew the map: adopt it and go on
            self.store.adopt_map_size()
            found, failure = copy_payload(self.env, self.store.chunks, key, dst)
        if not found:  # indexed but gone from LMDB: stop claiming it
            self._counters.add("misses", 1)
            self._drop([key], force=True)
            return False
        if failure is not None:
            self.quarantine(key, failure)
            return False
        self._counters.add("hits", 1)
        self.touch(key)
        return True

    def touch(self, key: ChunkKey) -> bool:
        """Whether lmdb holds ``key``, moved up the eviction order if so (it is being read)."""
        if key not in self.store.index:
            return False
        if self._track_access and len(self._touched) < _MAX_PENDING_TOUCHES:
            self._touched[key] = None
        return True

    def read_ahead(self, keys: Sequence[ChunkKey]) -> None:
        """Start reading these chunks from disk now (they are about to be promoted)."""
        try:
            will_need(self.env, self.store.chunks, [k for k in keys if k in self.store.index])
        except lmdb.Error as exc:  # a hint only: the reads themselves report failures
            log.debug("lmdb: read-ahead failed: %s", exc)

    def encoded_length(self, key: ChunkKey) -> int | None:
        """The stored chunk's size, header included (coded, in ``lmdb.codec``); None when absent."""
        entry = self.store.index.get(key)
        return None if entry is None else entry.nbytes

    def copy_encoded(self, key: ChunkKey, dst: memoryview) -> bool:
        """Copy the stored chunk, header included, verified, into ``dst`` (exactly its encoded
        size): what the object tier uploads, without decoding and encoding again. False when
        absent or corrupt (then quarantined)."""
        try:
            if not copy_encoded(self.env, self.store.chunks, key, dst):
                return False
        except ChunkFormatError as exc:
            self.quarantine(key, lmdb_reader.without_frames(exc))
            return False
        except lmdb.MapResizedError:  # another process grew the map: adopt it, try once more
            self.store.adopt_map_size()
            return self.copy_encoded(key, dst)
        return True

    def verify_chunk(self, key: ChunkKey) -> bool | None:
        """Verify one stored chunk in place: True if sound, False if it failed (it is then
        quarantined), None if absent."""
        try:
            failure = verify(self.env, self.store.chunks, key)
        except lmdb.MapResizedError:
            self.store.adopt_map_size()
            failure = verify(self.env, self.store.chunks, key)
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
        self._drop([key], force=True)

    def _flush_touches(self, txn: lmdb.Transaction) -> dict[ChunkKey, Entry]:
        """Move accessed chunks to the young end of the LRU index, inside ``txn``; returns the
        new entries for the caller to adopt once ``txn`` commits."""
        touched, self._touched = self._touched, {}
        updates: dict[ChunkKey, Entry] = {}
        for key in list(touched):  # one C-level copy: readers may still add to the old dict
            entry = self.store.index.get(key)
            if entry is None or entry.pinned:
                continue
            txn.delete(lru_key(entry.tick, key), db=self.store.lru)
            updates[key] = moved = replace(entry, tick=self.store.tick())
            txn.put(lru_key(moved.tick, key), b"", db=self.store.lru)
            txn.put(key, moved.pack(), db=self.store.meta)
        return updates

    # -- maintenance ----------------------------------------------------------------------

    def _background(self) -> None:
        """Sync every ``sync_interval_s``; clear dead readers' slots when due."""
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
        if self._touched:
            with self.store.lock:
                with self.env.begin(write=True) as txn:
                    touched = self._flush_touches(txn)
                self.store.apply(touched)
        self.env.sync(True)

    def _drop(self, keys: Sequence[ChunkKey], force: bool) -> int:
        dropped = self.store.drop(keys, force)
        self._tell(False, dropped)
        return len(dropped)

    # -- the Tier contract ----------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return list(map(self.store.index.__contains__, keys))

    def __contains__(self, key: object) -> bool:
        return key in self.store.index

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self._drop(keys, force=False)

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        self.store.set_pinned(keys, True)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.store.set_pinned(keys, False)

    def retire(self, namespace: bytes) -> None:
        """Evict a namespace's chunks (an old draft revision) before any other when room is
        needed."""
        with self.store.lock:
            self.store.retired.add(namespace)

    def reinstate(self, namespace: bytes) -> None:
        """Undo `retire` (a swap back)."""
        with self.store.lock:
            self.store.retired.discard(namespace)

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks held per namespace."""
        with self.store.lock:
            return Counter(namespace_of(key) for key in self.store.index)

    def keys(self) -> Iterator[ChunkKey]:
        return iter(list(self.store.index))

    def newest_chunks(self, limit: int, exclude_replica: str) -> list[tuple[ChunkKey, str]]:
        """Up to ``limit`` chunks with the replica that stored each, newest first, leaving out
        those stored by ``exclude_replica``."""
        found = heapq.nlargest(
            limit,
            (
                (entry.tick, key, entry.replica)
                for key, entry in list(self.store.index.items())  # one C-level copy: no lock held
                if entry.replica != exclude_replica
            ),
        )
        return [(key, replica) for _, key, replica in found]

    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        victims = [
            key
            for key, entry in list(self.store.index.items())
            if not entry.pinned
            and (pool is None or entry.pool == pool)
            and (namespace is None or namespace_of(key) == namespace)
            and (replica is None or entry.replica == replica)
        ]
        dropped = self._drop(victims, force=False)
        self._counters.add("evictions_admin", dropped)
        return dropped

    def stats(self) -> TierStats:
        pools: dict[str, UsageStats] = {}
        replicas: dict[tuple[str, str], UsageStats] = {}
        with self.store.lock:
            for entry in self.store.index.values():
                for usage in (
                    pools.setdefault(entry.pool, UsageStats()),
                    replicas.setdefault((entry.replica, entry.pool), UsageStats()),
                ):
                    usage.used_bytes += entry.nbytes
                    usage.chunks += 1
            return TierStats(
                tier=self.name,
                capacity_bytes=self.budget,
                used_bytes=self.store.used,
                chunks=len(self.store.index),
                pools=pools,
                replicas=replicas,
                counters=self._counters.snapshot(),
            )

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        lmdb_reader.disown(self.config.path)
        try:
            self.sync()
        finally:
            self.env.close()
