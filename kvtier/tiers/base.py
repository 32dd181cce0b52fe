"""The contract every tier implements, and the stats it reports.

Invariants shared by all tiers (tests/contract checks them for each one):

- a key becomes visible only once its whole payload is stored (`put` returned True);
- `read_into` either fills the destination with exactly what was stored or reports a miss;
  a tier never hands out bytes that failed verification;
- a pinned chunk is never evicted; eviction follows the tier's named policy;
- a key whose namespace is not registered raises `UnknownPoolError`, and a payload of the
  wrong size raises `PayloadSizeError`, before anything is changed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvtier.core.errors import PayloadSizeError
from kvtier.core.journal import Journal
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.core.protocol import TierStats


def check_payload(registry: PoolRegistry, key: ChunkKey, nbytes: int) -> Registration:
    """The key's registration; raises `PayloadSizeError` when ``nbytes`` is not its chunk size."""
    reg = registry.resolve(key)
    if nbytes != reg.chunk_bytes:
        raise PayloadSizeError(
            f"payload of {nbytes} bytes for pool {reg.pool!r}, "
            f"which stores {reg.chunk_bytes}-byte chunks"
        )
    return reg


class Tier(ABC):
    """One storage medium holding verified chunks, keyed by `ChunkKey`."""

    name: str
    persistent: bool
    """Whether chunks survive a close and reopen."""

    def __init__(self, registry: PoolRegistry) -> None:
        self.registry = registry
        self.journal: Journal | None = None
        """Where chunks entering and leaving this tier are told, when someone listens."""

    def _tell(self, stored: bool, keys: Sequence[ChunkKey]) -> None:
        if self.journal is not None and keys:
            self.journal.record(stored, self.name, keys)

    def _check_payload(self, key: ChunkKey, nbytes: int) -> Registration:
        return check_payload(self.registry, key, nbytes)

    def corrupt_chunks(self) -> int:
        """Chunks that failed verification here since the tier opened (its ``corrupt`` count)."""
        return self.stats().counters["corrupt"]

    @abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key (no verification, no recency update)."""

    def locate(self, keys: Sequence[ChunkKey]) -> int:
        """Length of the prefix of ``keys`` present here."""
        n = 0
        for present in self.contains(keys):
            if not present:
                break
            n += 1
        return n

    @abstractmethod
    def put(self, key: ChunkKey, payload: memoryview | bytes, replica: str = "default") -> bool:
        """Store one chunk; False when the tier has no room now (counted, nothing changed)."""

    @abstractmethod
    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        """Copy a verified chunk into ``dst``; False on a miss or a failed verification."""

    @abstractmethod
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Drop chunks that are not in use; returns how many were dropped."""

    @abstractmethod
    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """Keep these keys from eviction, including ones stored later."""

    @abstractmethod
    def unpin(self, keys: Sequence[ChunkKey]) -> None: ...

    @abstractmethod
    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        """Drop every unpinned, unused chunk that matches all given filters."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    @abstractmethod
    def close(self) -> None: ...
