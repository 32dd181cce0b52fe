"""Namespaces quarantined because an engine found wrong KV in them: no lookup finds their chunks
and none is written back or uploaded, until an admin lifts the quarantine. Their chunks stay
where they are, so lifting it serves them again. With lmdb, quarantines are kept beside the chunks
they speak of and outlive a restart."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.core.keys import ChunkKey, cut_at_namespaces

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quarantine:
    namespace: bytes
    reason: str
    since_unix_s: float
    source: str = ""
    """Who found it: the engine (replica, engine id) or the process that reported it."""


RECORD_PREFIX = b"quarantine/"


class Records(Protocol):
    """Where quarantines are kept across restarts (the lmdb tier)."""

    def records(self) -> dict[bytes, bytes]: ...

    def write_record(self, key: bytes, value: bytes | None) -> None: ...


def _read(namespace: bytes, value: bytes) -> Quarantine:
    """A kept quarantine; one whose record cannot be read still holds, saying so."""
    try:
        record = json.loads(value)
        return Quarantine(
            namespace,
            str(record["reason"]),
            float(record["since_unix_s"]),
            str(record.get("source", "")),  # records kept before sources were
        )
    except (ValueError, KeyError, TypeError) as exc:
        return Quarantine(namespace, f"kept record unreadable ({exc}); lift it to serve it", 0.0)


class Quarantines:
    def __init__(self, kept: Records | None = None) -> None:
        self._lock = threading.Lock()
        self._kept = kept
        self._held: dict[bytes, Quarantine] = {}
        for key, value in (kept.records() if kept is not None else {}).items():
            if key.startswith(RECORD_PREFIX):
                namespace = key[len(RECORD_PREFIX) :]
                self._held[namespace] = _read(namespace, value)
        if self._held:
            log.warning(
                "%d namespaces stay quarantined from before the restart: %s",
                len(self._held),
                ", ".join(ns.hex() for ns in self._held),
            )
        self.namespaces: frozenset[bytes] = frozenset(self._held)
        """The quarantined namespaces, replaced (never changed) on each add or lift: read on
        every lookup without the lock."""

    def add(self, namespace: bytes, reason: str, source: str = "") -> bool:
        """Quarantine ``namespace``; False when it was already."""
        with self._lock:
            if namespace in self._held:
                return False
            held = self._held[namespace] = Quarantine(namespace, reason, time.time(), source)
            self.namespaces = frozenset(self._held)  # in force before it is written down
            self._keep(namespace, held)
        log.error("namespace %s quarantined by %s: %s", namespace.hex(), source or "?", reason)
        return True

    def lift(self, namespace: bytes) -> bool:
        with self._lock:
            lifted = self._held.pop(namespace, None) is not None
            self.namespaces = frozenset(self._held)
            if lifted:
                self._keep(namespace, None)
        if lifted:
            log.warning("namespace %s: quarantine lifted", namespace.hex())
        return lifted

    def _keep(self, namespace: bytes, held: Quarantine | None) -> None:
        """Write the change through; a quarantine holds in memory even when it cannot be kept
        (a full disk), since serving wrong KV is worse than forgetting it on a restart."""
        if self._kept is None:
            return
        value = None
        if held is not None:
            value = json.dumps(
                {"reason": held.reason, "since_unix_s": held.since_unix_s, "source": held.source}
            ).encode()
        try:
            self._kept.write_record(RECORD_PREFIX + namespace, value)
        except Exception:
            log.exception("namespace %s: the quarantine change is not kept", namespace.hex())

    def holds(self, namespace: bytes) -> bool:
        return namespace in self.namespaces

    def listed(self) -> list[Quarantine]:
        with self._lock:
            return list(self._held.values())

    def cut(self, keys: Sequence[ChunkKey]) -> Sequence[ChunkKey]:
        return cut_at_namespaces(keys, self.namespaces)
