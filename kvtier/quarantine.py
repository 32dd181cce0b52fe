"""Namespaces quarantined because an engine found wrong KV in them: no lookup finds their chunks
and none is written back or uploaded, until an admin lifts the quarantine. Their chunks stay
where they are, so lifting it serves them again."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey, namespace_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quarantine:
    namespace: bytes
    reason: str
    since_unix_s: float


class Quarantines:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[bytes, Quarantine] = {}
        self.namespaces: frozenset[bytes] = frozenset()
        """The quarantined namespaces, replaced (never changed) on each add or lift: read on
        every lookup without the lock."""

    def add(self, namespace: bytes, reason: str) -> bool:
        """Quarantine ``namespace``; False when it was already."""
        with self._lock:
            if namespace in self._held:
                return False
            self._held[namespace] = Quarantine(namespace, reason, time.time())
            self.namespaces = frozenset(self._held)
        log.error("namespace %s quarantined: %s", namespace.hex(), reason)
        return True

    def lift(self, namespace: bytes) -> bool:
        with self._lock:
            lifted = self._held.pop(namespace, None) is not None
            self.namespaces = frozenset(self._held)
        if lifted:
            log.warning("namespace %s: quarantine lifted", namespace.hex())
        return lifted

    def holds(self, namespace: bytes) -> bool:
        return namespace in self.namespaces

    def listed(self) -> list[Quarantine]:
        with self._lock:
            return list(self._held.values())

    def cut(self, keys: Sequence[ChunkKey]) -> Sequence[ChunkKey]:
        """The keys before the first one of a quarantined namespace: a prefix lookup stops there."""
        held = self.namespaces
        if not held:
            return keys
        for i, key in enumerate(keys):
            if namespace_of(key) in held:
                return keys[:i]
        return keys
