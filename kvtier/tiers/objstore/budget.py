"""This node's share of the object store: the bytes of the objects it uploaded, plus the bytes
reserved for its uploads in flight, held to ``object.budget_bytes``.

Objects the node learned of from others (probes, fetches, ``warmup --object-index``) are
knowledge, not budget: never counted, never evicted here. Room is made under one lock, and an
upload reserves its bytes before it is sent, so concurrent uploads never count the same free
room twice; the reservation turns into the indexed object in one step (`Reservation.settle`),
so nothing is counted twice or missed. An object pinned by any node (`FleetPins`) is never
evicted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

from kvtier.core.counters import Counters
from kvtier.tiers.objstore.index import ObjectIndex
from kvtier.tiers.objstore.pins import FleetPins

log = logging.getLogger("kvtier.tiers.objstore.tier")
T = TypeVar("T")


class Reservation:
    """Room held for one upload; released when its block ends unless settled first."""

    def __init__(self, budget: StoreBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self._open = True

    def settle(self, record: Callable[[], T]) -> T:
        """Run ``record`` (the index write that makes the object count as owned) and release
        the room as one step, whether it succeeds or raises."""
        with self._budget.counted:
            try:
                return record()
            finally:
                self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self._budget.unreserve(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._budget.counted:
            self._close()


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
        self._making_room = threading.Lock()
        """Held while room is made: one upload at a time evicts, then reserves."""
        self.counted = threading.RLock()
        """Held while what is used is read or changes hands (reserved -> indexed); briefly."""
        self._reserved = 0

    @property
    def reserved(self) -> int:
        with self.counted:
            return self._reserved

    def used(self) -> int:
        """Bytes of this node's objects in the store, of its uploads in flight, and of those
        in flight when it last stopped, until found (`orphans.Orphans.resolve`)."""
        with self.counted:
            return self._index.owned_bytes() + self._index.intents.orphan_bytes() + self._reserved

    def reserve(self, nbytes: int) -> Reservation | None:
        """Make room for an upload of ``nbytes`` and hold it; None when there is none (what
        is left is pinned, in flight, or could not be deleted)."""
        if self.limit is None:  # unbounded: counted only for the gauge
            with self.counted:
                self._reserved += nbytes
            return Reservation(self, nbytes)
        if nbytes > self.limit:
            return None
        with self._making_room:
            used = self.used()
            if used + nbytes > self.limit:
                used = self._evict(used + nbytes - self.limit, used)
                if used + nbytes > self.limit:
                    return None
            with self.counted:
                self._reserved += nbytes
        return Reservation(self, nbytes)

    def unreserve(self, nbytes: int) -> None:
        with self.counted:
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
