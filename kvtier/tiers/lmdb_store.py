"""The lmdb tier's environment as it opens and keeps it: the environment itself (set aside
when unreadable, see `kvtier.tiers.lmdb_env`), its databases, the in-memory index read from
them, the budget, and the small records kept beside the chunks; and every transaction over
them: a batch of chunks written with the evictions that make room, accesses moved up the LRU
index, pins, drops, and verified reads. `lmdb_tier.LmdbTier` asks; the in-memory index follows
LMDB only after a transaction commits, so an aborted write (map full, disk full) leaves the
two in agreement."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import replace
from pathlib import Path

import lmdb

from kvtier.core import blockfmt
from kvtier.core.config import Durability, LMDBConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import ChunkFormatError, CorruptChunkError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.lmdb_space import Space
from kvtier.core.memory import keep_freed_pages
from kvtier.core.pools import Registration
from kvtier.core.protocol import TierStats, UsageStats
from kvtier.tiers import lmdb_reader
from kvtier.tiers.lmdb_env import (
    DATA_FILE,
    MAP_HEADROOM,
    adopt_map_size,
    budget,
    open_or_set_aside,
    prepare_dir,
    walk,
)
from kvtier.tiers.lmdb_index import TICK_BYTES, Entry, Pending, lru_key, read_index
from kvtier.tiers.lmdb_reader import DATABASES
from kvtier.tiers.lmdb_values import copy_encoded, copy_payload, verify, will_need

log = logging.getLogger("kvtier.tiers.lmdb_tier")  # the tier's logger, which operators filter on

_MAX_PENDING_TOUCHES = 1 << 16

Busy = Container[ChunkKey]
"""Chunks an engine reads from the map (`lmdb_loads.LmdbLoads`): eviction leaves them."""


class LmdbStore:
    """The environment, databases and index `lmdb_tier.LmdbTier` asks, and the transactions
    over them. Its lock guards the index. ``tell`` hears of chunks arriving (True) and leaving
    (False); ``counters`` counts the events."""

    def __init__(
        self,
        config: LMDBConfig,
        counters: Counters,
        tell: Callable[[bool, Sequence[ChunkKey]], None],
    ) -> None:
        self.config = config
        self._tell = tell
        self._touched: dict[ChunkKey, None] = {}
        self._track_access = config.eviction_policy == "lru"
        self._scratch = bytearray()
        prepare_dir(config.path)
        if config.keep_freed_pages:
            keep_freed_pages()
        self.budget = budget(config)
        self.high = int(self.budget * config.high_water)
        self.low = int(self.budget * config.low_water)
        self._map_size = self.budget + self.budget // 4 + MAP_HEADROOM
        self._lock = threading.Lock()
        self._index: dict[ChunkKey, Entry] = {}
        self._pinned_keys: set[ChunkKey] = set()
        self._retired: set[bytes] = set()  # old draft revisions: evicted before anything else
        self._counters = counters
        self._clock = 0
        self.env, aside = open_or_set_aside(config, self._map_size, self._load)
        self.set_aside: Path | None = aside
        """Where an unreadable environment found at open was moved to."""
        if self.set_aside is not None:
            self._counters.add("environments_set_aside", 1)
        self._open_dbs()  # the checked environment was reopened to write through its map
        self.space = Space(
            lambda: self.env,
            f"lmdb {config.path}",
            self._counters,
            reap_interval_s=config.reader_check_interval_s,
        )
        """Its writes: dead readers reaped, room made, a full disk counted (`full`)."""
        lmdb_reader.adopt(config.path, self.env, self.chunks)

    def _load(self, env: lmdb.Environment) -> None:
        self.env = env
        self._open_dbs()
        walk(env, (self.chunks, self.lru))
        self._index, self._pinned_keys = read_index(env, self.meta, self.pins)
        self._clock = max((e.tick for e in self._index.values()), default=0)
        self._used = sum(e.nbytes for e in self._index.values())
        log.info(
            "lmdb %s: %d chunks, %.2f GiB of %.2f GiB",
            self.config.path,
            len(self._index),
            self._used / 2**30,
            self.budget / 2**30,
        )

    def _open_dbs(self) -> None:
        self.chunks, self.lru, self.meta, self.pins, self.records_db = (
            self.env.open_db(name) for name in DATABASES
        )

    def records(self) -> dict[bytes, bytes]:
        """The small records kept beside the chunks (quarantines), by key."""
        with self.env.begin(db=self.records_db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}

    def write_record(self, key: bytes, value: bytes | None) -> None:
        """Keep ``value`` under ``key`` (None: drop it), flushed at once: a record is rare and
        must outlive a crash as the chunks it speaks of do."""
        with self.env.begin(write=True, db=self.records_db) as txn:
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
        self.env.sync(True)

    def adopt_map_size(self) -> None:
        """Another process grew the map: adopt it (see `adopt_map_size`)."""
        if adopt_map_size(self.env, self.config.path / DATA_FILE) is not None:
            self._counters.add("preallocate_failed", 1)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _apply(self, entries: dict[ChunkKey, Entry]) -> None:
        """Adopt entries written by a committed transaction."""
        for key, entry in entries.items():
            old = self._index.get(key)
            self._used += entry.nbytes - (old.nbytes if old is not None else 0)
            self._index[key] = entry

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> None:
        with self._lock:
            updates: dict[ChunkKey, Entry] = {}
            with self.env.begin(write=True) as txn:
                for key in keys:
                    if pinned:
                        txn.put(key, b"", db=self.pins)
                    else:
                        txn.delete(key, db=self.pins)
                    entry = self._index.get(key)
                    if entry is None or entry.pinned == pinned:
                        continue
                    if pinned:
                        txn.delete(lru_key(entry.tick, key), db=self.lru)
                        entry = replace(entry, pinned=True)
                    else:
                        entry = replace(entry, pinned=False, tick=self._tick())
                        txn.put(lru_key(entry.tick, key), b"", db=self.lru)
                    txn.put(key, entry.pack(), db=self.meta)
                    updates[key] = entry
            if pinned:
                self._pinned_keys.update(keys)
            else:
                self._pinned_keys.difference_update(keys)
            self._apply(updates)

    def _forget(self, evicted: list[ChunkKey]) -> None:
        """Adopt the evictions of a committed transaction (the lock held)."""
        for key in evicted:
            self._used -= self._index.pop(key).nbytes
        self._counters.add("evictions_capacity", len(evicted))
        if self._retired:
            retired = sum(namespace_of(k) in self._retired for k in evicted)
            self._counters.add("retired_evicted", retired)
        self._tell(False, evicted)

    def _evict_for(self, txn: lmdb.Transaction, incoming: int, busy: Busy) -> list[ChunkKey]:
        """Delete oldest unpinned chunks, inside ``txn``, until ``incoming`` fits under the
        high-water mark (then down to the low-water mark); retired namespaces' go first, and
        chunks in ``busy`` (read from the map by an engine) are left."""
        if self._used + incoming <= self.high:
            return []
        target = min(self.low, self.high - incoming)
        freed = 0
        evicted: list[ChunkKey] = []
        if self._retired:
            for key, old in list(self._index.items()):
                if self._used - freed <= target:
                    return evicted
                if old.pinned or namespace_of(key) not in self._retired or key in busy:
                    continue
                txn.delete(lru_key(old.tick, key), db=self.lru)
                txn.delete(key, db=self.chunks)
                txn.delete(key, db=self.meta)
                freed += old.nbytes
                evicted.append(key)
        gone = set(evicted)
        cursor = txn.cursor(db=self.lru)
        for raw, _ in cursor:
            if self._used - freed <= target:
                break
            key = ChunkKey(bytes(raw[TICK_BYTES:]))
            if key in gone:  # a retired one, deleted above under an older tick
                cursor.delete()
                continue
            if key in busy:
                continue
            entry = self._index.get(key)
            cursor.delete()
            txn.delete(key, db=self.chunks)
            txn.delete(key, db=self.meta)
            if entry is not None:
                freed += entry.nbytes
                evicted.append(key)
        return evicted

    def drop(self, keys: Sequence[ChunkKey], force: bool) -> list[ChunkKey]:
        """Delete chunks that are not pinned (any, with ``force``, and their records even when
        not indexed); returns those the index held."""
        with self._lock, self.env.begin(write=True) as txn:
            dropped = []
            for key in keys:
                entry = self._index.get(key)
                if entry is None and not force:
                    continue
                if entry is not None and entry.pinned and not force:
                    continue
                txn.delete(key, db=self.chunks)
                txn.delete(key, db=self.meta)
                if entry is not None:
                    txn.delete(lru_key(entry.tick, key), db=self.lru)
                    dropped.append(key)
        for key in dropped:
            self._used -= self._index.pop(key).nbytes
        self._tell(False, dropped)
        return dropped

    # -- writes ---------------------------------------------------------------------------

    def write(
        self, values: Sequence[Pending], replica: str, busy: Busy
    ) -> tuple[list[bool], list[ChunkKey]]:
        """Store chunks in one transaction, evicting what makes room for them first (never
        one in ``busy``); returns whether each is stored, and the keys whose payload no longer
        matched its checksum (not stored)."""
        changed: list[ChunkKey] = []
        with self._lock:
            codec = self.config.codec
            new = {
                k: reg.descriptor.stored_size(len(p), codec)
                for k, p, reg, _ in values
                if k not in self._index
            }
            added: dict[ChunkKey, Entry] = {}
            with self.env.begin(write=True) as txn:
                touched = self._flush_touches(txn)  # recency first, so eviction sees it
                evicted = set(self._evict_for(txn, sum(new.values()), busy))
                results = []
                uncodable = 0
                used = self._used - sum(self._index[k].nbytes for k in evicted)
                for key, payload, reg, expect in values:
                    if (key in self._index and key not in evicted) or key in added:
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
                    txn.put(key, value, db=self.chunks)
                    pinned = key in self._pinned_keys
                    entry = Entry(self._tick(), size, pinned, reg.pool, replica)
                    txn.put(key, entry.pack(), db=self.meta)
                    if not pinned:
                        txn.put(lru_key(entry.tick, key), b"", db=self.lru)
                    added[key] = entry
                    results.append(True)
            # committed: only now does the in-memory index follow
            self._apply(touched)
            self._forget(list(evicted))
            self._apply(added)
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

    def make_room(self, tries: int, busy: Busy) -> None:
        """Evict ``tries`` twentieths of the budget (down to the low-water mark at least), in a
        transaction of its own: LMDB reuses the pages it frees only once it has committed."""
        with self._lock:
            with self.env.begin(write=True) as txn:
                incoming = self.high - self._used + tries * self.budget // 20
                evicted = self._evict_for(txn, incoming, busy)
            self._forget(evicted)

    def set_retired(self, namespace: bytes, retired: bool) -> None:
        """Have a namespace's chunks evicted before any other when room is needed, or not."""
        with self._lock:
            (self._retired.add if retired else self._retired.discard)(namespace)

    # -- accesses -------------------------------------------------------------------------

    def touch(self, key: ChunkKey) -> bool:
        """Whether lmdb holds ``key``, moved up the eviction order if so (it is being read)."""
        if key not in self._index:
            return False
        if self._track_access and len(self._touched) < _MAX_PENDING_TOUCHES:
            self._touched[key] = None
        return True

    def _flush_touches(self, txn: lmdb.Transaction) -> dict[ChunkKey, Entry]:
        """Move accessed chunks to the young end of the LRU index, inside ``txn``; returns the
        new entries for the caller to adopt once ``txn`` commits."""
        touched, self._touched = self._touched, {}
        updates: dict[ChunkKey, Entry] = {}
        for key in list(touched):  # one C-level copy: readers may still add to the old dict
            entry = self._index.get(key)
            if entry is None or entry.pinned:
                continue
            txn.delete(lru_key(entry.tick, key), db=self.lru)
            updates[key] = moved = replace(entry, tick=self._tick())
            txn.put(lru_key(moved.tick, key), b"", db=self.lru)
            txn.put(key, moved.pack(), db=self.meta)
        return updates

    def sync(self) -> None:
        """Apply recorded accesses to the LRU index and flush everything to disk."""
        if self._touched:
            with self._lock:
                with self.env.begin(write=True) as txn:
                    touched = self._flush_touches(txn)
                self._apply(touched)
        self.env.sync(True)

    # -- reads: each verified, in a short read transaction of its own ---------------------

    def copy_payload(self, key: ChunkKey, dst: memoryview) -> tuple[bool, ChunkFormatError | None]:
        """`lmdb_values.copy_payload`; a map another process grew is adopted first."""
        try:
            return copy_payload(self.env, self.chunks, key, dst)
        except lmdb.MapResizedError:
            self.adopt_map_size()
            return copy_payload(self.env, self.chunks, key, dst)

    def copy_encoded(self, key: ChunkKey, dst: memoryview) -> bool:
        """`lmdb_values.copy_encoded` (raising `ChunkFormatError`); a map another process grew
        is adopted first."""
        try:
            return copy_encoded(self.env, self.chunks, key, dst)
        except lmdb.MapResizedError:
            self.adopt_map_size()
            return self.copy_encoded(key, dst)

    def verify(self, key: ChunkKey) -> ChunkFormatError | bool | None:
        """`lmdb_values.verify`; a map another process grew is adopted first."""
        try:
            return verify(self.env, self.chunks, key)
        except lmdb.MapResizedError:
            self.adopt_map_size()
            return verify(self.env, self.chunks, key)

    def will_need(self, keys: Sequence[ChunkKey]) -> None:
        """Have the kernel read the stored chunks of ``keys`` ahead."""
        will_need(self.env, self.chunks, [k for k in keys if k in self._index])

    # -- the index, read ------------------------------------------------------------------

    @property
    def lock(self) -> threading.Lock:
        """Held by every transaction that changes the index: holding it holds writes off."""
        return self._lock

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def entry(self, key: ChunkKey) -> Entry | None:
        return self._index.get(key)

    def entries(self) -> list[tuple[ChunkKey, Entry]]:
        """Every stored chunk's entry, copied in one C-level step: no lock held."""
        return list(self._index.items())

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks held per namespace."""
        with self._lock:
            return Counter(namespace_of(key) for key in self._index)

    def stats(self, tier: str) -> TierStats:
        pools: dict[str, UsageStats] = {}
        replicas: dict[tuple[str, str], UsageStats] = {}
        with self._lock:
            for entry in self._index.values():
                for usage in (
                    pools.setdefault(entry.pool, UsageStats()),
                    replicas.setdefault((entry.replica, entry.pool), UsageStats()),
                ):
                    usage.used_bytes += entry.nbytes
                    usage.chunks += 1
            return TierStats(
                tier=tier,
                capacity_bytes=self.budget,
                used_bytes=self._used,
                chunks=len(self._index),
                pools=pools,
                replicas=replicas,
                counters=self._counters.snapshot(),
            )

    def close(self) -> None:
        """Stop sharing the environment with readers, flush it and close it."""
        lmdb_reader.disown(self.config.path)
        try:
            self.sync()
        finally:
            self.env.close()
