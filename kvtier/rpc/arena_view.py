"""The client's view of kvtierd's arena: the shared memory mapped, where this host can read its
key index (`readable_here`), to answer which keys the arena holds without a call."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, cut_at_namespaces
from kvtier.core.protocol import IndexedRef
from kvtier.tiers.arena import ArenaAtPath
from kvtier.tiers.arena_index import readable_here


class ArenaView:
    """The arena at the path the session was last given, mapped once per path."""

    def __init__(self) -> None:
        self._arena: ArenaAtPath | None = None

    @property
    def mapped(self) -> bool:
        """False where the arena's key index cannot be read here: every lookup is a call."""
        return self._arena is not None

    def follow(self, path: Path) -> None:
        """Map the arena at ``path`` (a new session's may be another file)."""
        if readable_here() and (self._arena is None or self._arena.path != path):
            self._arena = ArenaAtPath(path, populate=False)

    def find(
        self, keys: Sequence[ChunkKey], quarantined: frozenset[bytes]
    ) -> list[IndexedRef] | None:
        """The slot of each key of the longest prefix the arena holds, from its key index, up to
        a namespace in ``quarantined``, as kvtierd's own lookup stops there; None where the
        index cannot be read here now (which says nothing of what the arena holds)."""
        if self._arena is None:
            return None
        if not keys:
            return []
        try:
            memory = self._arena.current()
        except KVTierError:
            return None
        refs = []
        for key in cut_at_namespaces(keys, quarantined):
            found = memory.find(key)
            if found is None:
                break
            slot, generation = found
            offset, nbytes = memory.slot_offset(slot), memory.slot_bytes(slot)
            refs.append(IndexedRef(key, slot, offset, nbytes, generation))
        return refs

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
