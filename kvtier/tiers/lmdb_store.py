"""The lmdb tier's environment as it opens and keeps it: the environment itself (set aside
when unreadable, see `kvtier.tiers.lmdb_env`), its databases, the in-memory index read from
them, and the small records kept beside the chunks. `lmdb_tier.LmdbTier` writes and reads
chunks over it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import lmdb

from kvtier.core.config import LMDBConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey
from kvtier.core.lmdb_space import Space
from kvtier.core.memory import keep_freed_pages
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.base import Tier
from kvtier.tiers.lmdb_env import (
    DATA_FILE,
    MAP_HEADROOM,
    adopt_map_size,
    budget,
    open_or_set_aside,
    prepare_dir,
    walk,
)
from kvtier.tiers.lmdb_index import Entry, lru_key, read_index
from kvtier.tiers.lmdb_reader import DATABASES

log = logging.getLogger("kvtier.tiers.lmdb_tier")  # the tier's logger, which operators filter on


class LmdbStore(Tier):
    """The environment, databases and index under `lmdb_tier.LmdbTier`."""

    def __init__(self, config: LMDBConfig, registry: PoolRegistry) -> None:
        super().__init__(registry)
        self.config = config
        prepare_dir(config.path)
        if config.keep_freed_pages:
            keep_freed_pages()
        self.budget = budget(config)
        self._high = int(self.budget * config.high_water)
        self._low = int(self.budget * config.low_water)
        self._map_size = self.budget + self.budget // 4 + MAP_HEADROOM
        self._lock = threading.Lock()
        self._index: dict[ChunkKey, Entry] = {}
        self._pinned_keys: set[ChunkKey] = set()
        self._touched: dict[ChunkKey, None] = {}
        self._retired: set[bytes] = set()  # old draft revisions: evicted before anything else
        self._scratch = bytearray()
        self._counters = Counters()
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
        self._track_access = config.eviction_policy == "lru"

    def _load(self, env: lmdb.Environment) -> None:
        self.env = env
        self._open_dbs()
        walk(env, (self._chunks, self._lru))
        self._index, self._pinned_keys = read_index(env, self._meta, self._pins)
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
        self._chunks, self._lru, self._meta, self._pins, self._records = (
            self.env.open_db(name) for name in DATABASES
        )

    def records(self) -> dict[bytes, bytes]:
        """The small records kept beside the chunks (quarantines), by key."""
        with self.env.begin(db=self._records) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}

    def write_record(self, key: bytes, value: bytes | None) -> None:
        """Keep ``value`` under ``key`` (None: drop it), flushed at once: a record is rare and
        must outlive a crash as the chunks it speaks of do."""
        with self.env.begin(write=True, db=self._records) as txn:
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
        self.env.sync(True)

    def _adopt_map_size(self) -> None:
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

    def _set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> None:
        with self._lock:
            updates: dict[ChunkKey, Entry] = {}
            with self.env.begin(write=True) as txn:
                for key in keys:
                    if pinned:
                        txn.put(key, b"", db=self._pins)
                    else:
                        txn.delete(key, db=self._pins)
                    entry = self._index.get(key)
                    if entry is None or entry.pinned == pinned:
                        continue
                    if pinned:
                        txn.delete(lru_key(entry.tick, key), db=self._lru)
                        entry = replace(entry, pinned=True)
                    else:
                        entry = replace(entry, pinned=False, tick=self._tick())
                        txn.put(lru_key(entry.tick, key), b"", db=self._lru)
                    txn.put(key, entry.pack(), db=self._meta)
                    updates[key] = entry
            if pinned:
                self._pinned_keys.update(keys)
            else:
                self._pinned_keys.difference_update(keys)
            self._apply(updates)
