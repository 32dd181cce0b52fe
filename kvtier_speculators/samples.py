"""Training samples by their token ids: which captured request holds a sample's states, and
reading them with the chunks many samples share (a system prompt) read once.

A sample is found by the references (`kvtier.hidden.reader.HiddenStatesRef`) the capturing
engines stored as manifests beside the states, not by recomputing the engine's block hashes:
those are seeded per engine unless ``PYTHONHASHSEED`` is fixed, while a manifest names its
token ids, and any node of the fleet lists them from its lmdb or the object store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey, make_key
from kvtier.hidden.reader import HiddenStates, HiddenStatesReader, HiddenStatesRef, assemble


class ChunkCache:
    """Chunk payloads by key, the least recently used dropped first past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._chunks: OrderedDict[ChunkKey, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, key: ChunkKey) -> bytes | None:
        payload = self._chunks.get(key)
        if payload is not None:
            self._chunks.move_to_end(key)
        return payload

    def put(self, key: ChunkKey, payload: bytes) -> None:
        if len(payload) > self.max_bytes:
            return  # it would push out everything else and still not fit
        self.drop([key])
        self._chunks[key] = payload
        self.nbytes += len(payload)
        while self.nbytes > self.max_bytes:
            _, oldest = self._chunks.popitem(last=False)
            self.nbytes -= len(oldest)

    def drop(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            payload = self._chunks.pop(key, None)
            if payload is not None:
                self.nbytes -= len(payload)


@dataclass
class SampleReader:
    """Reads references through ``reader``, taking from ``cache`` the chunks it holds and
    reading the others once each, however many times a reference names them."""

    reader: HiddenStatesReader
    cache: ChunkCache
    chunks_read: int = 0
    """Chunks read from the tiers: what the cache did not hold."""

    def load(self, ref: HiddenStatesRef) -> HiddenStates:
        keys = ref.keys()
        found = {k: p for k in keys if (p := self.cache.get(k)) is not None}
        wanted = list(
            dict.fromkeys(h for h, k in zip(ref.chunks, keys, strict=True) if k not in found)
        )
        for chunk_hash, payload in zip(wanted, self.reader.read_chunks(ref, wanted), strict=True):
            key = make_key(ref.namespace, chunk_hash)
            found[key] = payload
            self.cache.put(key, payload)
        self.chunks_read += len(wanted)
        return assemble(ref, [found[k] for k in keys])

    def forget(self, ref: HiddenStatesRef) -> None:
        """Drop ``ref``'s chunks from the cache (the tiers keep them)."""
        self.cache.drop(ref.keys())


@dataclass
class SampleIndex:
    """The captured requests of one hidden pool by their token ids. A sample it does not know
    lists the pool's manifests again (the new ones only), at most every ``refresh_s``."""

    list_keys: Callable[[], Sequence[ChunkKey]]
    """The keys of the pool's manifest parts the tiers hold now."""
    read_refs: Callable[[Sequence[ChunkKey]], Iterable[HiddenStatesRef]]
    """The references whose manifests are among some of those keys."""
    refresh_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _refs: dict[tuple[int, ...], HiddenStatesRef] = field(default_factory=dict, init=False)
    _seen: set[ChunkKey] = field(default_factory=set, init=False)
    _listed_at: float | None = field(default=None, init=False)

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, ref: HiddenStatesRef) -> None:
        if ref.token_ids is not None:
            self._refs[ref.token_ids] = ref

    def find(self, token_ids: Sequence[int]) -> HiddenStatesRef | None:
        ids = tuple(int(i) for i in token_ids)
        if ids not in self._refs and self._due():
            self.refresh()
        return self._refs.get(ids)

    def refresh(self) -> None:
        self._listed_at = self.clock()
        new = [k for k in self.list_keys() if k not in self._seen]
        for ref in self.read_refs(new):
            self.add(ref)
        self._seen.update(new)

    def _due(self) -> bool:
        return self._listed_at is None or self.clock() - self._listed_at >= self.refresh_s
