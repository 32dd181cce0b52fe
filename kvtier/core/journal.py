"""Chunks entering and leaving the arena and lmdb, in order: what an engine's KV events tell
routers about the tiers below its GPU.

A bounded window: a reader that falls further behind than ``capacity`` events learns how many it
lost instead of stalling the tiers.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from kvtier.core.keys import ChunkKey

DEFAULT_CAPACITY = 1 << 16


class ChunkEvent(NamedTuple):
    stored: bool
    """True: the tier holds the chunk now; False: it let go of it."""
    tier: str
    key: ChunkKey


class ChunkEvents(NamedTuple):
    events: list[ChunkEvent]
    cursor: int
    """Where to ask from next."""
    lost: int
    """Events that left the window before they were asked for."""


class Journal:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._events: deque[ChunkEvent] = deque(maxlen=capacity)
        self._end = 0  # sequence number of the next event
        self._lock = threading.Lock()

    def record(self, stored: bool, tier: str, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._events.append(ChunkEvent(stored, tier, key))
                self._end += 1

    def since(self, cursor: int, limit: int) -> ChunkEvents:
        """At most ``limit`` events from ``cursor`` on; a negative cursor means from now."""
        with self._lock:
            start = self._end - len(self._events)
            if cursor < 0:
                return ChunkEvents([], self._end, 0)
            first = max(cursor, start)
            count = max(0, min(limit, self._end - first))
            events = list(itertools.islice(self._events, first - start, first - start + count))
            return ChunkEvents(events, first + count, max(0, start - cursor))
