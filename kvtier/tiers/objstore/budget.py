"""This node's share of the object store: the bytes of the objects it uploaded, plus the bytes
reserved for its uploads in flight, held to ``object.budget_bytes``.

Objects the node learned of from others (probes, fetches, ``warmup --object-index``) are
knowledge, not budget: never counted, never evicted here. Room is made under one lock, and an
upload reserves its bytes before it is sent, so concurrent uploads never count the same free
room twice. An object pinned by any node (`FleetPins`) is never evicted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvtier.core.counters import Counters
from kvtier.tiers.objstore.index import ObjectIndex
from kvtier.tiers.objstore.pins import FleetPins

log = logging.getLogger("kvtier.tiers.objstore.tier")


class StoreBudget:
    def __init__(
        self,
        limit: int | None,
        index: ObjectIndex,
        pins: FleetPins,
        delete: Callable[[Sequence[str]], bool],
        counters: Counters,
    ) -> None:
        self.limit = limit
        self._index = index
        self._pins = pins
        self._delete = delete
        self._counters = counters
        self._lock = threading.Lock()
        self._reserved = 0

    @property
    def reserved(self) -> int:
        with self._lock:
            return self._reserved

    def used(self) -> int:
        """Bytes of this node's objects in the store, and of its uploads in flight."""
        with self._lock:
            return self._index.owned_bytes() + self._reserved

    def reserve(self, nbytes: int) -> bool:
        """Make room for an upload of ``nbytes`` and hold it until `release`; False when
        there is none (what is left is pinned, in flight, or could not be deleted)."""
        if self.limit is None:
            return True
        if nbytes > self.limit:
            return False
        with self._lock:
            used = self._index.owned_bytes() + self._reserved
            if used + nbytes > self.limit:
                used = self._evict(used + nbytes - self.limit, used)
            if used + nbytes > self.limit:
                return False
            self._reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """An upload ended: indexed (its object now counts as owned) or given up."""
        if self.limit is None:
            return
        with self._lock:
            self._reserved -= nbytes

    def _evict(self, needed: int, used: int) -> int:
        """Delete this node's least recently used unpinned objects until ``needed`` bytes are
        freed; returns what is used after. Called with the lock held."""
        pins = self._pins.cached()
        if pins is None:
            return used  # other nodes' pins unknown: nothing is safe to delete
        freed = 0
        for name, entry in self._index.owned_oldest_first():
            if freed >= needed:
                break
            if name in pins.objects or not pins.chunks.isdisjoint(entry.keys):
                continue
            if not self._delete([name]):
                break  # the store refuses: the next upload tries again
            freed += entry.size
            dropped = self._index.drop_object(name)
            self._counters.add("evictions_capacity", len(dropped))
        return used - freed
