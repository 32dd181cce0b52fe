"""The arena's shared key index: which slot holds each committed chunk, readable without a call.

The arena's owner writes it whenever a chunk becomes visible or its slot is freed; any process
that maps the arena may read it. A lookup whose every chunk is in the arena then needs no round
trip to kvtierd, which costs a millisecond or more on a busy machine.

An open-addressing table (linear probing, backward-shift deletion) of 64-byte entries::

    seq u64 | slot u32 | key length u16 | 2 unused bytes | key (48 bytes)

The single writer makes ``seq`` odd, writes the entry, then makes it even again, so a reader that
sees the same even ``seq`` before and after reading an entry read it whole. A reader never
trusts more than that: it checks the slot's state and generation in the arena's slot table, and
the copy out of the slot is checked against that generation again after it is made. Anything in
motion reads as a miss, which sends the caller down the ordinary lookup.

Every process that maps the arena may write these words, so the owner never reads them back: it
keeps the table itself (each entry's key and slot, and the sequence it writes) in its own memory
and only copies entries out. Words a client scribbled mislead that client's readers at most,
never the owner's probes, and no loop over shared words runs past `MAX_PROBES` entries: a key
whose probe from its home would be longer is kept out of the shared table (a reader misses it
and asks kvtierd), so a reader stops after that many entries whatever the words hold.

The ordering this relies on (the writer's stores seen in program order by readers) holds on
x86-64; elsewhere `readable_here` is False and callers do not read the index.
"""

from __future__ import annotations

import platform
import struct

import numpy as np
import numpy.typing as npt
from xxhash import xxh3_64_intdigest

from kvtier.core.keys import MAX_CHUNK_HASH_BYTES, NAMESPACE_BYTES

ENTRY_BYTES = 64
KEY_BYTES = NAMESPACE_BYTES + MAX_CHUNK_HASH_BYTES
_KEY_AT = 16
_READY = 2  # SlotState.READY; arena.py imports this module
_HEAD = struct.Struct("<QQ")  # seq, meta
MAX_PROBES = 64
"""Entries a probe looks at, from a key's home on; the table is at most half full and keys
spread (every key byte counts), so a longer probe is all but unknown."""


def readable_here() -> bool:
    """Whether another process may read the index on this CPU architecture (x86-64's total
    store order); elsewhere it would need memory barriers that Python does not give."""
    return platform.machine().lower() in ("x86_64", "amd64")


def capacity_for(slots: int) -> int:
    """Entries for ``slots`` slots: a power of two, at most half full."""
    return 1 << max(10, (2 * slots - 1).bit_length())


def _home(key: bytes, mask: int) -> int:
    # every byte of the key counts: chunk hashes that differ in a few bytes (counters, short
    # hashes padded) still spread, where clusters would make each insert and removal O(n)
    return xxh3_64_intdigest(key) & mask


class ArenaIndex:
    """The table over ``buffer`` (``capacity`` entries); ``owner``: this process writes it."""

    def __init__(self, buffer: memoryview, offset: int, capacity: int) -> None:
        if capacity & (capacity - 1):
            raise ValueError("the index capacity must be a power of two")
        self.capacity = capacity
        self._mask = capacity - 1
        words = np.frombuffer(buffer, np.uint64, capacity * ENTRY_BYTES // 8, offset)
        words = words.reshape(capacity, ENTRY_BYTES // 8)
        self._seq: npt.NDArray[np.uint64] = words[:, 0]
        self._meta: npt.NDArray[np.uint64] = words[:, 1]  # slot | key length << 32; 0: empty
        raw = np.frombuffer(buffer, np.uint8, capacity * ENTRY_BYTES, offset)
        self._keys: npt.NDArray[np.uint8] = raw.reshape(capacity, ENTRY_BYTES)[:, _KEY_AT:]
        # readers go through the buffer itself: a numpy scalar read costs several times more
        self._buffer = buffer
        self._offset = offset
        # the owner's own copy of the table, the only one it reads
        self._where: dict[bytes, int] = {}
        """The entry of each key in the shared table."""
        self._held: dict[int, tuple[bytes, int]] = {}
        """What each taken entry holds: (key, slot)."""
        self._unlisted: dict[bytes, int] = {}
        """Keys past `MAX_PROBES` from their home: their slot, kept out of the shared table."""
        self._writes = 0
        """Entry writes so far: each ``seq`` the owner stores comes from it, never from the
        shared word, so a reader sees a new even ``seq`` after every write."""

    def __len__(self) -> int:
        return len(self._where) + len(self._unlisted)

    # -- the owner ------------------------------------------------------------------------

    def _begin(self, at: int) -> None:
        self._writes += 1
        self._seq[at] = 2 * self._writes - 1

    def _end(self, at: int) -> None:
        self._seq[at] = 2 * self._writes

    def _write(self, at: int, key: bytes, slot: int) -> None:
        self._held[at] = (key, slot)
        self._begin(at)
        self._keys[at, : len(key)] = np.frombuffer(key, np.uint8)
        self._meta[at] = slot | len(key) << 32
        self._end(at)

    def _clear(self, at: int) -> None:
        del self._held[at]
        self._begin(at)
        self._meta[at] = 0
        self._end(at)

    def insert(self, key: bytes, slot: int) -> None:
        if not 0 < len(key) <= KEY_BYTES:
            raise ValueError(f"an index key is 1..{KEY_BYTES} bytes")
        if key in self._unlisted:
            self._unlisted[key] = slot
            return
        at = self._where.get(key)
        if at is None:
            if len(self) >= self.capacity // 2:
                raise OverflowError("the arena index is full")  # sized for every slot: a bug
            home = _home(key, self._mask)
            at = home
            # ends within capacity // 2 + 1 steps: at most half the entries are taken
            while at in self._held:
                at = (at + 1) & self._mask
            if (at - home) & self._mask >= MAX_PROBES:
                self._unlisted[key] = slot
                return
            self._where[key] = at
        self._write(at, key, slot)

    def remove(self, key: bytes) -> None:
        if self._unlisted.pop(key, None) is not None:
            return
        hole = self._where.pop(key, None)
        if hole is None:
            return
        self._clear(hole)
        at = (hole + 1) & self._mask
        # shift the rest of the cluster back, so probes stop at the first empty entry; moving
        # an entry back shortens its probe, so it stays within MAX_PROBES
        while (held := self._held.get(at)) is not None:
            moved, slot = held
            home = _home(moved, self._mask)
            if (at - home) & self._mask >= (at - hole) & self._mask:
                self._write(hole, moved, slot)
                self._where[moved] = hole
                self._clear(at)
                hole = at
            at = (at + 1) & self._mask

    # -- any process ----------------------------------------------------------------------

    def find(self, key: bytes, state: memoryview, generation: memoryview) -> tuple[int, int] | None:
        """(slot, generation) of ``key`` if a READY slot holds it now, else None (also when an
        entry on the way is being written). ``state`` and ``generation`` are the arena's slot
        table as u32 and u64 views."""
        buffer, base, mask, read = self._buffer, self._offset, self._mask, _HEAD.unpack_from
        size = len(key)
        at = _home(key, mask)
        for _ in range(min(MAX_PROBES, self.capacity)):
            entry = base + at * ENTRY_BYTES
            before, meta = read(buffer, entry)
            if before & 1 or not meta:
                return None
            if meta >> 32 == size and buffer[entry + _KEY_AT : entry + _KEY_AT + size] == key:
                slot = meta & 0xFFFFFFFF
                if slot >= len(state) or state[slot] != _READY:
                    return None
                gen = generation[slot]
                # the entry unchanged since: the slot was not freed before gen was read
                return (slot, gen) if read(buffer, entry)[0] == before else None
            at = (at + 1) & mask
        return None
