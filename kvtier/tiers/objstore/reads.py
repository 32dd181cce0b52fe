"""The object tier's reads: a chunk's range, or a whole object, verified as it arrives. A
corrupt object is deleted, counted and answered as a miss; one in a format this build does not
read is left for the nodes that do; one deleted behind this node's back is forgotten."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core import blockfmt
from kvtier.core.config import ObjectStoreConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import (
    ChunkFormatError,
    ObjectNotFoundError,
    ObjectStoreError,
    UnknownVersionError,
)
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.base import check_payload
from kvtier.tiers.objstore.backend import ObjectBackend
from kvtier.tiers.objstore.index import REMOTE_REPLICA, ChunkLocation, IndexWriteError, ObjectIndex
from kvtier.tiers.objstore.lineage import Lineage
from kvtier.tiers.objstore.naming import object_name
from kvtier.tiers.objstore.resilience import RequestGuard

# the tier's logger, which operators filter on
log = logging.getLogger("kvtier.tiers.objstore.tier")


@dataclass(frozen=True, slots=True)
class FetchedChunk:
    key: ChunkKey
    payload: memoryview
    """Verified; valid as long as the fetched object's buffer is referenced."""


class ObjectReads:
    """Reads over the guarded backend into the index; corrupt objects go through ``lineage``
    (deleted with their companions, announced)."""

    def __init__(
        self,
        config: ObjectStoreConfig,
        registry: PoolRegistry,
        backend: ObjectBackend,
        guard: RequestGuard,
        index: ObjectIndex,
        lineage: Lineage,
        counters: Counters,
    ) -> None:
        self.config = config
        self.registry = registry
        self.backend = backend
        self.guard = guard
        self.index = index
        self.lineage = lineage
        self.counters = counters

    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        loc = self.index.get(key)
        if loc is None:
            self.counters.add("misses", 1)
            return False
        if not self.guard.breaker.admit_peek():  # fail fast while the breaker is open
            self.counters.add("misses", 1)
            self.counters.add("misses_unhealthy", 1)
            return False
        try:
            value = self.guard.call(
                lambda: self.backend.get(loc.obj, loc.offset, loc.length),
                self.config.request_timeout_s,
            )
            blockfmt.decode_into(value, key, dst)
        except ObjectNotFoundError:  # deleted behind our back (gc, another node)
            self.counters.add("misses", 1)
            self.index.drop_object(loc.obj)
            return False
        except ObjectStoreError:
            self.counters.add("misses", 1)
            return False
        except UnknownVersionError as exc:
            self.unknown_format(loc.obj, exc)
            return False
        except ChunkFormatError as exc:
            self.quarantine(loc.obj, exc)
            return False
        self.index.touch(loc.obj)
        self.counters.add("hits", 1)
        self.counters.add("download_bytes", len(value))
        return True

    def fetch(self, name: str, hits: bool = True) -> list[FetchedChunk] | None:
        """GET a whole object and verify every chunk in it; None when it does not exist or is
        corrupt (then deleted). Indexes what it found, counted as hits unless ``hits`` is
        False. Raises `ObjectStoreError` when the store cannot answer."""
        try:
            body = self.guard.call(lambda: self.backend.get(name), self.config.request_timeout_s)
        except ObjectNotFoundError:
            self.index.drop_object(name)
            return None
        try:
            chunks = blockfmt.split(body)
            if not chunks or object_name(self.registry, chunks[0][0]) != name:
                raise ChunkFormatError(f"object {name} does not start with the chunk it names")
            regs = [check_payload(self.registry, key, len(payload)) for key, payload, _ in chunks]
        except UnknownVersionError as exc:
            self.unknown_format(name, exc)
            return None
        except (ChunkFormatError, ValueError, KeyError) as exc:  # incl. a foreign namespace
            self.quarantine(name, exc)
            return None
        self.counters.add("download_bytes", len(body))
        if name not in self.index.objects:
            locations = []
            offset = 0
            for (key, _, length), reg in zip(chunks, regs, strict=True):
                locations.append(
                    (key, ChunkLocation(name, offset, length, reg.pool, REMOTE_REPLICA))
                )
                offset += length
            self.remember(name, len(body), locations)
        self.index.touch(name)
        if hits:
            self.counters.add("hits", len(chunks))
        return [FetchedChunk(key, payload) for key, payload, _ in chunks]

    def remember(
        self, name: str, size: int, locations: Sequence[tuple[ChunkKey, ChunkLocation]]
    ) -> bool:
        """Index an object learned from the store (another node's, as far as this one knows);
        False when the index cannot take it: it is only knowledge, a later read finds it."""
        try:
            self.index.add(name, size, locations, owned=False)
        except IndexWriteError as exc:
            log.warning("%s", exc)
            self.counters.add("index_full", 1)
            return False
        return True

    def unknown_format(self, name: str, reason: Exception) -> None:
        """An object in a chunk format this build does not read (a newer node wrote it, in a
        rolling upgrade): a miss, counted, and left in the store for the nodes that read it."""
        log.info("object %s: %s; a miss here, left in the store", name, reason)
        self.counters.add("misses", 1)
        self.counters.add("unknown_format", 1)
        self.index.drop_object(name)

    def quarantine(self, name: str, reason: Exception) -> None:
        log.error("object %s failed verification (%s); deleting it", name, reason)
        self.counters.add("corrupt", 1)
        self.index.drop_object(name)
        self.lineage.delete_objects([name])
