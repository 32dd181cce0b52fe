"""Eviction orders, pluggable by name.

One policy object orders the slots of one arena slot class. Slots sit in per-queue intrusive
doubly-linked lists (one queue per replica), so insert, access and remove are O(1) and allocate
nothing. ``rank`` makes candidates comparable across queues: lower goes first.

A policy keeps nodes only for the slots its class owns, added an extent at a time with
`add_slots`, so a class that owns one extent of a large arena costs one extent's worth of
bookkeeping; `drop_slots` takes an extent's slots back when the class gives the extent up, and
their nodes serve the next extent it takes. ``node_of`` maps an arena slot to its node; it is
one list per arena, shared by the policies of its classes, each writing only the entries of the
slots it was given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

_NIL = -1


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, node_of: list[int]) -> None:
        self._node_of = node_of
        self._slot: list[int] = []  # node -> slot; _NIL for a queue's sentinel
        self._next: list[int] = []
        self._prev: list[int] = []
        self._rank: list[int] = []
        self._queue_of: list[int] = []
        self._heads: list[int] = []  # sentinel node ids, one per queue
        self._spare: list[int] = []  # nodes of slots given back, for the next extent's
        self._clock = 0

    def _new_node(self, slot: int) -> int:
        if self._spare:
            node = self._spare.pop()
            self._slot[node] = slot
            self._next[node] = self._prev[node] = node
            self._rank[node] = 0
            self._queue_of[node] = _NIL
            return node
        node = len(self._next)
        self._slot.append(slot)
        self._next.append(node)
        self._prev.append(node)
        self._rank.append(0)
        self._queue_of.append(_NIL)
        return node

    def add_slots(self, slots: Iterable[int]) -> None:
        """Give the policy the slots its class has just been given (an extent's)."""
        node_of = self._node_of
        for slot in slots:
            node_of[slot] = self._new_node(slot)

    def drop_slots(self, slots: Iterable[int]) -> None:
        """Take back the slots of an extent the class gave up; their nodes are reused."""
        for slot in slots:
            node = self._node_of[slot]
            if self._queue_of[node] != _NIL:
                self._unlink(node)
            self._slot[node] = _NIL
            self._spare.append(node)

    @property
    def nodes(self) -> int:
        """Nodes in use: the slots held, plus one per queue."""
        return len(self._next) - len(self._spare)

    def _sentinel(self, queue: int) -> int:
        while len(self._heads) <= queue:
            self._heads.append(self._new_node(_NIL))
        return self._heads[queue]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _link_newest(self, node: int, queue: int) -> None:
        head = self._sentinel(queue)
        last = self._prev[head]
        self._prev[node], self._next[node] = last, head
        self._next[last] = node
        self._prev[head] = node
        self._queue_of[node] = queue

    def _unlink(self, node: int) -> None:
        prev, nxt = self._prev[node], self._next[node]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._queue_of[node] = _NIL

    def insert(self, slot: int, queue: int) -> None:
        node = self._node_of[slot]
        self._rank[node] = self._tick()
        self._link_newest(node, queue)

    def remove(self, slot: int) -> None:
        node = self._node_of[slot]
        if self._queue_of[node] != _NIL:
            self._unlink(node)

    def contains(self, slot: int) -> bool:
        return self._queue_of[self._node_of[slot]] != _NIL

    @abstractmethod
    def access(self, slot: int) -> None:
        """Record a use of ``slot``."""

    def candidates(self, queue: int) -> Iterator[int]:
        """Slots of ``queue``, best victim first."""
        if queue >= len(self._heads):
            return
        head = self._heads[queue]
        slot_of, next_of = self._slot, self._next
        node = next_of[head]
        while node != head:
            nxt = next_of[node]  # the caller may remove ``node``
            yield slot_of[node]
            node = nxt

    def rank(self, slot: int) -> int:
        return self._rank[self._node_of[slot]]

    @property
    def queues(self) -> int:
        return len(self._heads)


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def access(self, slot: int) -> None:
        node = self._node_of[slot]
        queue = self._queue_of[node]
        if queue == _NIL:
            return
        self._unlink(node)
        self._rank[node] = self._tick()
        self._link_newest(node, queue)


class FIFOPolicy(EvictionPolicy):
    """First stored, first evicted; accesses do not matter."""

    name = "fifo"

    def access(self, slot: int) -> None:
        return None


POLICIES: dict[str, Callable[[list[int]], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    FIFOPolicy.name: FIFOPolicy,
}


def make_policy(name: str, node_of: list[int]) -> EvictionPolicy:
    """A policy by name over the arena slot -> node map ``node_of`` (see the module's text)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(node_of)
