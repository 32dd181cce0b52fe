"""Eviction orders, pluggable by name.

One policy object orders the slots of one arena slot class. Slots sit in per-queue intrusive
doubly-linked lists (one queue per replica), so insert, access and remove are O(1) and allocate
nothing. ``rank`` makes candidates comparable across queues: lower goes first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar

_NIL = -1


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._next = [_NIL] * capacity
        self._prev = [_NIL] * capacity
        self._rank = [0] * capacity
        self._queue_of = [_NIL] * capacity
        self._heads: list[int] = []  # sentinel node ids, one per queue
        self._clock = 0

    def _sentinel(self, queue: int) -> int:
        while len(self._heads) <= queue:
            node = len(self._next)
            self._next.append(node)
            self._prev.append(node)
            self._rank.append(0)
            self._queue_of.append(_NIL)
            self._heads.append(node)
        return self._heads[queue]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _link_newest(self, slot: int, queue: int) -> None:
        head = self._sentinel(queue)
        last = self._prev[head]
        self._prev[slot], self._next[slot] = last, head
        self._next[last] = slot
        self._prev[head] = slot
        self._queue_of[slot] = queue

    def _unlink(self, slot: int) -> None:
        prev, nxt = self._prev[slot], self._next[slot]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._queue_of[slot] = _NIL

    def insert(self, slot: int, queue: int) -> None:
        self._rank[slot] = self._tick()
        self._link_newest(slot, queue)

    def remove(self, slot: int) -> None:
        if self._queue_of[slot] != _NIL:
            self._unlink(slot)

    def contains(self, slot: int) -> bool:
        return self._queue_of[slot] != _NIL

    @abstractmethod
    def access(self, slot: int) -> None:
        """Record a use of ``slot``."""

    def candidates(self, queue: int) -> Iterator[int]:
        """Slots of ``queue``, best victim first."""
        if queue >= len(self._heads):
            return
        head = self._heads[queue]
        node = self._next[head]
        while node != head:
            nxt = self._next[node]  # the caller may remove ``node``
            yield node
            node = nxt

    def rank(self, slot: int) -> int:
        return self._rank[slot]

    @property
    def queues(self) -> int:
        return len(self._heads)


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def access(self, slot: int) -> None:
        queue = self._queue_of[slot]
        if queue == _NIL:
            return
        self._unlink(slot)
        self._rank[slot] = self._tick()
        self._link_newest(slot, queue)


class FIFOPolicy(EvictionPolicy):
    """First stored, first evicted; accesses do not matter."""

    name = "fifo"

    def access(self, slot: int) -> None:
        return None


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    FIFOPolicy.name: FIFOPolicy,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(capacity)
