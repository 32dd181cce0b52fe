"""What a dead owner's arena still holds, for its successor to keep.

An arena is shared memory: it outlives a process that is killed. vLLM kills its engine process
at once on SIGTERM (``shutdown_timeout`` 0, its default) and after a grace period otherwise, so
embedded mode's last committed chunks are often in the arena only, and a daemon killed with
SIGKILL leaves the same. The next owner at the path maps the old file before it takes the path
over (`ArenaMemory.create` unlinks it; the mapping stays valid), and writes each committed chunk
of a namespace to lmdb once that namespace is registered again (its chunk size and layout come
from the registration).

Every client that maps the arena can write all of it, its tables and key index included, so
nothing in the file decides what is kept: the dead owner's own record does. That is its commit
checksum ledger (`commit_checksums.ChecksumLedger`, a file only its user can write), which names
each committed chunk with its slot, place, size and checksum. A chunk is kept only when its slot
has the registration's size in the ledger and in the arena's extent table, and its bytes, copied
out of the arena first, still match the checksum; anything else is refused and logged. A chunk
committed too shortly before the owner died to be hashed is not kept either.

The file itself is adopted only when it is this user's own with the configured mode (and group,
when one is configured); another is refused with a log line, and the successor starts a fresh
arena without reading it.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
from collections import Counter, defaultdict
from collections.abc import Iterator

from kvtier.core import blockfmt
from kvtier.core.config import ArenaConfig
from kvtier.core.errors import KVTierError
from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey
from kvtier.tiers.arena import ArenaMemory, resolve_group
from kvtier.tiers.commit_checksums import CommittedChunk, read_ledger
from kvtier.tiers.lmdb_tier import LmdbTier

log = logging.getLogger(__name__)

_BATCH = 64  # chunks per lmdb transaction
_BATCH_BYTES = 64 << 20  # and their copies' bytes, at most one chunk past it


def not_adoptable(st: os.stat_result, config: ArenaConfig) -> str | None:
    """Why an arena file with this status is not this kvtierd's to adopt; None when it is."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this process's {os.geteuid()}"
    if st.st_mode & 0o7777 != config.file_mode:
        return f"mode {st.st_mode & 0o7777:04o}, not the configured {config.file_mode:04o}"
    gid = resolve_group(config.group, "arena.group")
    if gid is not None and st.st_gid != gid:
        return f"group {st.st_gid}, not the configured {gid}"
    return None


class StaleArena:
    """The committed chunks of a dead owner's arena file, by namespace."""

    def __init__(self, memory: ArenaMemory, chunks: list[CommittedChunk]) -> None:
        self._memory = memory
        self._chunks: dict[bytes, list[CommittedChunk]] = defaultdict(list)
        for chunk in chunks:
            self._chunks[chunk.key[:NAMESPACE_BYTES]].append(chunk)
        self.refused: Counter[str] = Counter()
        """Chunks not kept, by reason: ``size`` (a slot of another size), ``changed`` (bytes
        that no longer match their commit checksum)."""

    @classmethod
    def at(cls, config: ArenaConfig) -> StaleArena | None:
        """The arena file at ``config.path`` when its owner is gone (nobody holds its lock), it
        is this user's own and its owner's ledger records committed chunks; None otherwise.
        Read-only: the file is left where it is."""
        path = config.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        why = not_adoptable(os.fstat(fd), config)
        if why is not None:
            os.close(fd)
            log.warning("arena: %s is not adopted (%s): a fresh arena replaces it", path, why)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # its owner is alive: ArenaMemory.create refuses the path
        fcntl.flock(fd, fcntl.LOCK_UN)  # the successor takes the path over with its own lock
        chunks = read_ledger(path)
        if not chunks:
            os.close(fd)
            if chunks is None:
                log.warning("arena: %s left no commit checksums: none of its chunks kept", path)
            return None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            memory = ArenaMemory(path, fd, mm, owner=False)
        except (OSError, ValueError, KVTierError) as exc:  # not an arena, or another version
            os.close(fd)
            log.warning("arena: %s left by a dead owner cannot be read: %s", path, exc)
            return None
        return cls(memory, chunks)

    def namespaces(self) -> list[bytes]:
        """Namespaces with chunks still to be kept."""
        return [ns for ns, chunks in self._chunks.items() if chunks]

    def take(self, namespace: bytes, chunk_bytes: int) -> Iterator[tuple[ChunkKey, bytes]]:
        """Each committed chunk of ``namespace`` whose slot holds ``chunk_bytes`` and whose
        bytes match its commit checksum, copied out of the arena; a namespace is taken once."""
        for chunk in self._chunks.pop(namespace, []):
            if not self._placed(chunk, chunk_bytes):
                self.refused["size"] += 1
                continue
            # a copy: whoever still maps the old file cannot change it after the check
            payload = bytes(self._memory.view(chunk.offset, chunk.nbytes))
            if len(payload) != chunk_bytes:  # past the end of the file
                self.refused["size"] += 1
                continue
            if blockfmt.payload_checksum(payload) != chunk.digest:
                self.refused["changed"] += 1
                continue
            yield chunk.key, payload

    def _placed(self, chunk: CommittedChunk, chunk_bytes: int) -> bool:
        """Whether the ledger's slot has the registration's size, and the arena's extent table
        gives the slot that size and puts it where the ledger does."""
        memory = self._memory
        if chunk.nbytes != chunk_bytes:
            return False
        if chunk.slot >= len(memory.state):
            return False
        try:
            sized = memory.slot_bytes(chunk.slot) == chunk_bytes
            placed = memory.slot_offset(chunk.slot) == chunk.offset
        except IndexError:
            return False
        return sized and placed

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
    batch: list[tuple[ChunkKey, bytes]] = []
    for item in stale.take(namespace, chunk_bytes):
        batch.append(item)
        if len(batch) == _BATCH or len(batch) * chunk_bytes >= _BATCH_BYTES:
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
    if stale.refused:
        log.warning(
            "arena: refused chunks of namespace %s that the previous owner left in the arena: "
            "%d in a slot of another size than its %d-byte chunks, %d changed since their commit",
            namespace.hex(),
            stale.refused["size"],
            chunk_bytes,
            stale.refused["changed"],
        )
        stale.refused.clear()
    if stale.namespaces():
        return stale
    stale.close()
    return None
