"""What this node knows to be in the object store: chunk -> (object, offset, length), kept in a
small LMDB environment so a restart does not upload or probe everything again.

Databases: ``chunks`` (key -> location), ``objects`` (name -> size, tick, owned), ``pins``
(keys), ``meta`` (this node's id); beside them, the uploads sent and not yet recorded
(`intents.UploadIntents`). Pins are this node's; they reach the other nodes' gc through an
object in the store (`pins.FleetPins`). An object is *owned* when this node uploaded it; the
others were learned (probed, fetched, listed) and are only knowledge: forgotten first when the
map is full, never counted in the store budget.
An in-memory mirror answers lookups; LMDB is written only after the store acknowledged an upload,
so the index may lack an object but never claims one that was not written. Objects deleted
behind our back (another node's gc) are found on read and dropped then.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvtier.core.keys import ChunkKey
from kvtier.tiers.objstore.intents import UploadIntents

_LOC = struct.Struct("<QQ")
_OBJ = struct.Struct("<QQ")
_OWNED = b"\x01"
"""Appended to an owned object's value; values written before ownership was kept lack the byte
and are judged by their chunks' replica."""
REMOTE_REPLICA = "remote"
"""Replica recorded for chunks found in the store rather than uploaded from here."""
_MAP_FULL_RETRIES = 4


class IndexWriteError(Exception):
    """The index could not record an object: its map is full of owned objects even after
    forgetting every learned one, or the disk failed."""


@dataclass(slots=True)
class ChunkLocation:
    obj: str
    offset: int
    length: int
    pool: str
    replica: str

    def pack(self) -> bytes:
        return (
            _LOC.pack(self.offset, self.length)
            + f"{self.obj}\0{self.pool}\0{self.replica}".encode()
        )

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkLocation:
        offset, length = _LOC.unpack_from(raw)
        obj, pool, replica = bytes(raw[_LOC.size :]).decode().split("\0")
        return cls(obj, offset, length, pool, replica)


@dataclass(slots=True)
class ObjectEntry:
    size: int
    tick: int
    keys: set[ChunkKey]
    owned: bool = False
    """Uploaded by this node: counted in its store budget, deleted by it."""


class ObjectIndex:
    def __init__(self, path: Path, map_bytes: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=map_bytes, max_dbs=4, sync=False, metasync=False)
        self._chunks = self.env.open_db(b"chunks")
        self._objects = self.env.open_db(b"objects")
        self._pins = self.env.open_db(b"pins")
        self._meta = self.env.open_db(b"meta")
        self._lock = threading.Lock()
        self.chunks: dict[ChunkKey, ChunkLocation] = {}
        self.objects: dict[str, ObjectEntry] = {}
        self.pins: set[ChunkKey] = set()
        self._tick = 0
        self._closed = False
        with self.env.begin() as txn:
            legacy: set[str] = set()
            for name, raw in txn.cursor(db=self._objects):
                size, tick = _OBJ.unpack_from(raw)
                owned = bytes(raw[_OBJ.size :]) == _OWNED
                self.objects[bytes(name).decode()] = ObjectEntry(size, tick, set(), owned)
                if len(raw) == _OBJ.size:
                    legacy.add(bytes(name).decode())
                self._tick = max(self._tick, tick)
            for key, raw in txn.cursor(db=self._chunks):
                loc = ChunkLocation.unpack(raw)
                entry = self.objects.get(loc.obj)
                if entry is not None:
                    self.chunks[ChunkKey(bytes(key))] = loc
                    entry.keys.add(ChunkKey(bytes(key)))
                    if loc.obj in legacy and loc.replica != REMOTE_REPLICA:
                        entry.owned = True
            self.pins = {ChunkKey(bytes(k)) for k, _ in txn.cursor(db=self._pins)}
        self._owned_bytes = sum(e.size for e in self.objects.values() if e.owned)
        self.intents = UploadIntents(path / "intents")

    def node_id(self, new: Callable[[], str]) -> str:
        """This node's name in the store, made by ``new`` once and kept with the index."""
        with self._lock, self.env.begin(write=True) as txn:
            raw = txn.get(b"node_id", db=self._meta)
            if raw is None:
                raw = new().encode()
                txn.put(b"node_id", raw, db=self._meta)
            return bytes(raw).decode()

    def __contains__(self, key: object) -> bool:
        return key in self.chunks

    def get(self, key: ChunkKey) -> ChunkLocation | None:
        return self.chunks.get(key)

    def add(
        self,
        name: str,
        size: int,
        locations: Sequence[tuple[ChunkKey, ChunkLocation]],
        owned: bool = False,
    ) -> None:
        """Record an object (``owned``: uploaded by this node). A full map is met by forgetting
        learned objects, least recently used first, each time in a transaction of its own;
        raises `IndexWriteError` when that is not enough or the disk fails."""
        for attempt in range(_MAP_FULL_RETRIES + 1):
            try:
                self._add(name, size, locations, owned)
                return
            except lmdb.MapFullError:
                if attempt == _MAP_FULL_RETRIES or not self._forget_learned(attempt):
                    raise IndexWriteError(
                        f"the object index is full of this node's objects ({name} not "
                        "recorded): raise object.index_map_bytes"
                    ) from None
            except lmdb.Error as exc:
                raise IndexWriteError(f"the object index failed to record {name}: {exc}") from exc

    def _add(
        self,
        name: str,
        size: int,
        locations: Sequence[tuple[ChunkKey, ChunkLocation]],
        owned: bool,
    ) -> None:
        with self._lock:
            known = self.objects.get(name)
            owned = owned or (known is not None and known.owned)
            tick = self._tick + 1
            with self.env.begin(write=True) as txn:
                value = _OBJ.pack(size, tick) + (_OWNED if owned else b"")
                txn.put(name.encode(), value, db=self._objects)
                for key, loc in locations:
                    txn.put(key, loc.pack(), db=self._chunks)
            # committed: only now does the mirror follow
            self._tick = tick
            entry = self.objects.setdefault(name, ObjectEntry(size, tick, set()))
            self._owned_bytes += (size if owned else 0) - (entry.size if entry.owned else 0)
            entry.size, entry.tick, entry.owned = size, tick, owned
            for key, loc in locations:
                self.chunks[key] = loc
                entry.keys.add(key)

    def _forget_learned(self, attempt: int) -> bool:
        """Forget the least recently used quarter of the learned objects holding no pinned
        chunk (all of them at the last attempt), in a transaction of its own; False when there
        were none."""
        with self._lock:
            learned = sorted(  # a pinned chunk's object stays: the pins name it
                (
                    n
                    for n, e in self.objects.items()
                    if not e.owned and self.pins.isdisjoint(e.keys)
                ),
                key=lambda n: self.objects[n].tick,
            )
        if not learned:
            return False
        if attempt < _MAP_FULL_RETRIES - 1:
            learned = learned[: max(16, len(learned) // 4)]
        with self._lock, self.env.begin(write=True) as txn:
            for name in learned:
                entry = self.objects.pop(name, None)
                txn.delete(name.encode(), db=self._objects)
                for key in entry.keys if entry is not None else ():
                    loc = self.chunks.get(key)
                    if loc is not None and loc.obj == name:
                        del self.chunks[key]
                        txn.delete(key, db=self._chunks)
        return True

    def claim(self, name: str) -> bool:
        """Count a learned object as this node's own (found to be an upload of its own whose
        answer was lost); False when the index cannot record it."""
        with self._lock:
            entry = self.objects.get(name)
            if entry is None or entry.owned:
                return entry is not None
            try:
                with self.env.begin(write=True) as txn:
                    value = _OBJ.pack(entry.size, entry.tick) + _OWNED
                    txn.put(name.encode(), value, db=self._objects)
            except lmdb.Error:
                return False
            entry.owned = True
            self._owned_bytes += entry.size
            return True

    def touch(self, name: str) -> None:
        """Mark an object used (in memory; the persisted order is that of uploads)."""
        with self._lock:
            entry = self.objects.get(name)
            if entry is not None:
                self._tick += 1
                entry.tick = self._tick

    def drop_keys(self, keys: Iterable[ChunkKey]) -> list[str]:
        """Forget chunks; returns the objects left holding no indexed chunk (to delete)."""
        emptied: list[str] = []
        with self._lock, self.env.begin(write=True) as txn:
            for key in keys:
                loc = self.chunks.pop(key, None)
                if loc is None:
                    continue
                txn.delete(key, db=self._chunks)
                entry = self.objects.get(loc.obj)
                if entry is None:
                    continue
                entry.keys.discard(key)
                if not entry.keys:
                    del self.objects[loc.obj]
                    self._owned_bytes -= entry.size if entry.owned else 0
                    txn.delete(loc.obj.encode(), db=self._objects)
                    emptied.append(loc.obj)
        return emptied

    def drop_object(self, name: str) -> list[ChunkKey]:
        """Forget an object and the chunks located in it; a chunk it shares with an object
        indexed later is located there and stays (forgetting it would empty that object and
        drop it from the count without deleting it)."""
        with self._lock, self.env.begin(write=True) as txn:
            gone = self.objects.pop(name, None)
            keys = sorted(gone.keys) if gone is not None else []
            for key in keys:
                loc = self.chunks.get(key)
                if loc is not None and loc.obj == name:
                    del self.chunks[key]
                    txn.delete(key, db=self._chunks)
            if gone is not None and gone.owned:
                self._owned_bytes -= gone.size
            txn.delete(name.encode(), db=self._objects)
        return keys

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> None:
        with self._lock, self.env.begin(write=True) as txn:
            for key in keys:
                if pinned:
                    txn.put(key, b"", db=self._pins)
                    self.pins.add(key)
                else:
                    txn.delete(key, db=self._pins)
                    self.pins.discard(key)

    def pinned(self, name: str) -> bool:
        entry = self.objects.get(name)
        return entry is not None and not self.pins.isdisjoint(entry.keys)

    def owned_oldest_first(self) -> list[tuple[str, ObjectEntry]]:
        """This node's objects, least recently used first."""
        with self._lock:
            owned = [(n, e) for n, e in self.objects.items() if e.owned]
        return sorted(owned, key=lambda item: item[1].tick)

    def owned_bytes(self) -> int:
        """Bytes of the objects this node uploaded (kept as they change: read per upload)."""
        with self._lock:
            return self._owned_bytes

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.env.sync(True)
        self.env.close()
