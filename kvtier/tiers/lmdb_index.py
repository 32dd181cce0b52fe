"""The lmdb tier's index records: each chunk's entry in ``meta`` and its key in ``lru``."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import lmdb

from kvtier.core.keys import ChunkKey
from kvtier.core.pools import Registration

# ``meta``: key -> tick, encoded size, pinned flag, pool and owning replica;
# ``lru``: tick (8 bytes, big-endian) || key -> empty, oldest first, pinned chunks absent;
# ``pins``: pinned keys, including ones not stored yet.
_META = struct.Struct("<QQ?")
_TICK = struct.Struct(">Q")
TICK_BYTES = _TICK.size


@dataclass(slots=True)
class Entry:
    """What ``meta`` holds for a chunk: its LRU tick, encoded size, pinned flag, pool and the
    replica that stored it."""

    tick: int
    nbytes: int
    pinned: bool
    pool: str
    replica: str

    def pack(self) -> bytes:
        return (
            _META.pack(self.tick, self.nbytes, self.pinned)
            + f"{self.pool}\0{self.replica}".encode()
        )

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        tick, nbytes, pinned = _META.unpack_from(raw)
        pool, _, replica = bytes(raw[_META.size :]).decode().partition("\0")
        return cls(tick, nbytes, pinned, pool, replica)


Pending = tuple[ChunkKey, memoryview | bytes, Registration, bytes | None]
"""A chunk on its way in: key, payload, its pool and the checksum it must still have."""


def lru_key(tick: int, key: bytes) -> bytes:
    """The ``lru`` key: tick (big-endian, so oldest first) then the chunk key."""
    return _TICK.pack(tick) + key


def read_index(
    env: lmdb.Environment, meta: lmdb._Database, pins: lmdb._Database
) -> tuple[dict[ChunkKey, Entry], set[ChunkKey]]:
    """Every stored chunk's entry, and the pinned keys (stored or not)."""
    index: dict[ChunkKey, Entry] = {}
    with env.begin(db=meta) as txn:
        for key, raw in txn.cursor():
            index[ChunkKey(bytes(key))] = Entry.unpack(raw)
    with env.begin(db=pins) as txn:
        pinned = {ChunkKey(bytes(key)) for key, _ in txn.cursor()}
    return index, pinned
