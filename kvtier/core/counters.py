"""Event counters shared between threads."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Named event counts whose increments are never lost between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)
