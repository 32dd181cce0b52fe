"""What a dead owner's arena still holds, for its successor to keep.

An arena is shared memory: it outlives a process that is killed. vLLM kills its engine process
at once on SIGTERM (``shutdown_timeout`` 0, its default) and after a grace period otherwise, so
embedded mode's last committed chunks are often in the arena only, and a daemon killed with
SIGKILL leaves the same. The next owner at the path maps the old file before it takes the path
over (`ArenaMemory.create` unlinks it; the mapping stays valid), and writes each committed chunk
of a namespace to lmdb once that namespace is registered again (its chunk size and layout come
from the registration).

A chunk is read only where the key index names it, its slot is READY and its size is the
registration's: the owner published it there after its bytes were written and removes the entry
before the slot can be written again, so such a slot holds what was committed. An entry the
owner was rewriting when it died (odd sequence) is skipped.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from kvtier.core.errors import KVTierError
from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey
from kvtier.tiers.arena import ArenaMemory, SlotState
from kvtier.tiers.lmdb_tier import LmdbTier

log = logging.getLogger(__name__)

_BATCH = 64  # chunks per lmdb transaction


class StaleArena:
    """The committed chunks of a dead owner's arena file, by namespace."""

    def __init__(self, memory: ArenaMemory) -> None:
        self._memory = memory
        self._chunks: dict[bytes, list[tuple[ChunkKey, int]]] = defaultdict(list)
        seen: set[bytes] = set()
        for key, slot in memory.index.entries():
            if key in seen or slot >= len(memory.state):
                continue
            if memory.state[slot] != SlotState.READY or memory.slot_bytes(slot) == 0:
                continue
            seen.add(key)
            self._chunks[key[:NAMESPACE_BYTES]].append((ChunkKey(key), slot))

    @classmethod
    def at(cls, path: Path) -> StaleArena | None:
        """The arena file at ``path`` when its owner is gone (nobody holds its lock) and it holds
        committed chunks; None otherwise. Read-only: the file is left where it is."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # its owner is alive: ArenaMemory.create refuses the path
        fcntl.flock(fd, fcntl.LOCK_UN)  # the successor takes the path over with its own lock
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            memory = ArenaMemory(path, fd, mm, owner=False)
        except (OSError, ValueError, KVTierError) as exc:  # not an arena, or another version
            os.close(fd)
            log.warning("arena: %s left by a dead owner cannot be read: %s", path, exc)
            return None
        stale = cls(memory)
        if not stale.namespaces():
            stale.close()
            return None
        return stale

    def namespaces(self) -> list[bytes]:
        """Namespaces with chunks still to be kept."""
        return [ns for ns, chunks in self._chunks.items() if chunks]

    def take(self, namespace: bytes, chunk_bytes: int) -> Iterator[tuple[ChunkKey, memoryview]]:
        """Each committed chunk of ``namespace`` whose slot holds ``chunk_bytes``; a namespace
        is taken once."""
        memory = self._memory
        for key, slot in self._chunks.pop(namespace, []):
            if memory.slot_bytes(slot) >= chunk_bytes:
                yield key, memory.view(memory.slot_offset(slot), chunk_bytes)

    def close(self) -> None:
        self._chunks.clear()
        self._memory.close()


def keep(
    stale: StaleArena | None, lmdb: LmdbTier | None, namespace: bytes, chunk_bytes: int
) -> StaleArena | None:
    """Write a namespace just registered from a dead owner's arena to lmdb; returns the stale
    arena, or None once nothing is left in it (it is then closed)."""
    if stale is None or lmdb is None:
        return stale
    kept = 0
    batch: list[tuple[ChunkKey, memoryview]] = []
    for item in stale.take(namespace, chunk_bytes):
        batch.append(item)
        if len(batch) == _BATCH:
            kept += sum(lmdb.put_many(batch))
            batch.clear()
    if batch:
        kept += sum(lmdb.put_many(batch))
    if kept:
        log.info(
            "arena: kept %d chunks of namespace %s that the previous owner left in the arena",
            kept,
            namespace.hex(),
        )
    if stale.namespaces():
        return stale
    stale.close()
    return None
