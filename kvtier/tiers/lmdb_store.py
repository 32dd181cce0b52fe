"""The lmdb tier's environment as it opens and keeps it: the environment itself (set aside
when unreadable, see `kvtier.tiers.lmdb_env`), its databases, the in-memory index read from
them, and the small records kept beside the chunks. `lmdb_tier.LmdbTier` writes and reads
chunks over it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Container, Sequence
from dataclasses import replace
from pathlib import Path

import lmdb

from kvtier.core.config import LMDBConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.lmdb_space import Space
from kvtier.core.memory import keep_freed_pages
from kvtier.tiers.lmdb_env import (
    DATA_FILE,
    MAP_HEADROOM,
    adopt_map_size,
    budget,
    open_or_set_aside,
    prepare_dir,
    walk,
)
from kvtier.tiers.lmdb_index import TICK_BYTES, Entry, lru_key, read_index
from kvtier.tiers.lmdb_reader import DATABASES

log = logging.getLogger("kvtier.tiers.lmdb_tier")  # the tier's logger, which operators filter on


class LmdbStore:
    """The environment, databases and index `lmdb_tier.LmdbTier` holds, and the transactions
    that change the index. Its lock guards the index; the methods here that change it take the
    lock or, with a transaction of the caller's, run under the caller's hold of it."""

    def __init__(self, config: LMDBConfig, counters: Counters) -> None:
        self.config = config
        prepare_dir(config.path)
        if config.keep_freed_pages:
            keep_freed_pages()
        self.budget = budget(config)
        self.high = int(self.budget * config.high_water)
        self.low = int(self.budget * config.low_water)
        self._map_size = self.budget + self.budget // 4 + MAP_HEADROOM
        self.lock = threading.Lock()
        self.index: dict[ChunkKey, Entry] = {}
        self.pinned_keys: set[ChunkKey] = set()
        self.retired: set[bytes] = set()  # old draft revisions: evicted before anything else
        self.counters = counters
        self._clock = 0
        self.env, aside = open_or_set_aside(config, self._map_size, self._load)
        self.set_aside: Path | None = aside
        """Where an unreadable environment found at open was moved to."""
        if self.set_aside is not None:
            self.counters.add("environments_set_aside", 1)
        self._open_dbs()  # the checked environment was reopened to write through its map
        self.space = Space(
            lambda: self.env,
            f"lmdb {config.path}",
            self.counters,
            reap_interval_s=config.reader_check_interval_s,
        )
        """Its writes: dead readers reaped, room made, a full disk counted (`full`)."""

    def _load(self, env: lmdb.Environment) -> None:
        self.env = env
        self._open_dbs()
        walk(env, (self.chunks, self.lru))
        self.index, self.pinned_keys = read_index(env, self.meta, self.pins)
        self._clock = max((e.tick for e in self.index.values()), default=0)
        self.used = sum(e.nbytes for e in self.index.values())
        log.info(
            "lmdb %s: %d chunks, %.2f GiB of %.2f GiB",
            self.config.path,
            len(self.index),
            self.used / 2**30,
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
            self.counters.add("preallocate_failed", 1)

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def apply(self, entries: dict[ChunkKey, Entry]) -> None:
        """Adopt entries written by a committed transaction."""
        for key, entry in entries.items():
            old = self.index.get(key)
            self.used += entry.nbytes - (old.nbytes if old is not None else 0)
            self.index[key] = entry

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> None:
        with self.lock:
            updates: dict[ChunkKey, Entry] = {}
            with self.env.begin(write=True) as txn:
                for key in keys:
                    if pinned:
                        txn.put(key, b"", db=self.pins)
                    else:
                        txn.delete(key, db=self.pins)
                    entry = self.index.get(key)
                    if entry is None or entry.pinned == pinned:
                        continue
                    if pinned:
                        txn.delete(lru_key(entry.tick, key), db=self.lru)
                        entry = replace(entry, pinned=True)
                    else:
                        entry = replace(entry, pinned=False, tick=self.tick())
                        txn.put(lru_key(entry.tick, key), b"", db=self.lru)
                    txn.put(key, entry.pack(), db=self.meta)
                    updates[key] = entry
            if pinned:
                self.pinned_keys.update(keys)
            else:
                self.pinned_keys.difference_update(keys)
            self.apply(updates)

    def forget(self, evicted: list[ChunkKey]) -> None:
        """Adopt the evictions of a committed transaction (the lock held)."""
        for key in evicted:
            self.used -= self.index.pop(key).nbytes
        self.counters.add("evictions_capacity", len(evicted))
        if self.retired:
            retired = sum(namespace_of(k) in self.retired for k in evicted)
            self.counters.add("retired_evicted", retired)

    def evict_for(
        self, txn: lmdb.Transaction, incoming: int, busy: Container[ChunkKey]
    ) -> list[ChunkKey]:
        """Delete oldest unpinned chunks, inside ``txn``, until ``incoming`` fits under the
        high-water mark (then down to the low-water mark); retired namespaces' go first, and
        chunks in ``busy`` (read from the map by an engine) are left."""
        if self.used + incoming <= self.high:
            return []
        target = min(self.low, self.high - incoming)
        freed = 0
        evicted: list[ChunkKey] = []
        if self.retired:
            for key, old in list(self.index.items()):
                if self.used - freed <= target:
                    return evicted
                if old.pinned or namespace_of(key) not in self.retired or key in busy:
                    continue
                txn.delete(lru_key(old.tick, key), db=self.lru)
                txn.delete(key, db=self.chunks)
                txn.delete(key, db=self.meta)
                freed += old.nbytes
                evicted.append(key)
        gone = set(evicted)
        cursor = txn.cursor(db=self.lru)
        for raw, _ in cursor:
            if self.used - freed <= target:
                break
            key = ChunkKey(bytes(raw[TICK_BYTES:]))
            if key in gone:  # a retired one, deleted above under an older tick
                cursor.delete()
                continue
            if key in busy:
                continue
            entry = self.index.get(key)
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
        with self.lock, self.env.begin(write=True) as txn:
            dropped = []
            for key in keys:
                entry = self.index.get(key)
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
            self.used -= self.index.pop(key).nbytes
        return dropped
