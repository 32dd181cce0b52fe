"""Loads leased in lmdb: chunks an engine reads from lmdb's map itself (`kvtier.tiers.lmdb_reader`),
kept from eviction from when the lease is granted until it is released, so that the read finds
them. The lease's ref names no arena slot (`kvtier.core.protocol.in_lmdb`); its generation is the
lease's own number, so each is told apart from every other."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import LMDB_SLOT, SlotRef, in_lmdb


class LmdbLoads:
    def __init__(
        self, touch: Callable[[ChunkKey], bool], registry: PoolRegistry, counters: Counters
    ) -> None:
        self._touch = touch
        """Whether lmdb holds a key, moving it up the eviction order (`LmdbTier.touch`)."""
        self._registry = registry
        self._counters = counters
        self._held: Counter[ChunkKey] = Counter()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def lease(self, key: ChunkKey) -> SlotRef | None:
        """A lease on ``key`` for a load from lmdb; None where lmdb does not hold it."""
        nbytes = self._registry.resolve(key).chunk_bytes
        with self._lock:
            if not self._touch(key):
                return None
            self._held[key] += 1
            self._counters.add("load_leases", 1)  # as `read_into` counts hits and touches
            return SlotRef(key, LMDB_SLOT, 0, nbytes, next(self._ids))

    def release(self, refs: Sequence[SlotRef]) -> None:
        with self._lock:
            for ref in refs:
                if in_lmdb(ref) and self._held[ref.key] > 0:
                    self._held[ref.key] -= 1
                    if not self._held[ref.key]:
                        del self._held[ref.key]

    def __contains__(self, key: object) -> bool:
        """Whether a load holds ``key`` now (eviction passes it over)."""
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)
