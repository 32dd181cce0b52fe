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
from kvtier.hidden.reader import (
    HiddenStates,
    HiddenStatesReader,
    HiddenStatesRef,
    assemble,
    manifest_name,
    manifest_spec,
)


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


MAX_SAMPLES = 4096
"""The samples an index knows by their token ids unless told otherwise."""


def manifest_key(ref: HiddenStatesRef, tenant: str = "default") -> ChunkKey:
    """The key of ``ref``'s manifest (its first part) in ``tenant``'s manifests of its pool."""
    return make_key(manifest_spec(ref.namespace, tenant).digest(), manifest_name(ref))


@dataclass
class SampleIndex:
    """The captured requests of one hidden pool by their token ids, at most ``max_samples`` of
    them, the least recently found dropped first. A sample it does not know lists the pool's
    manifests again (those not read yet, and those of dropped samples), at most every
    ``refresh_s`` unless it dropped one since its last listing: a dropped sample is looked up
    again, not taken for missing."""

    list_keys: Callable[[], Sequence[ChunkKey]]
    """The keys of the pool's manifest parts the tiers hold now."""
    read_refs: Callable[[Sequence[ChunkKey]], Iterable[HiddenStatesRef]]
    """The references whose manifests are among some of those keys."""
    key_of: Callable[[HiddenStatesRef], ChunkKey] = manifest_key
    """The key of a reference's manifest as ``list_keys`` names it: listed again once dropped."""
    refresh_s: float = 5.0
    max_samples: int = MAX_SAMPLES
    clock: Callable[[], float] = time.monotonic
    _refs: OrderedDict[tuple[int, ...], HiddenStatesRef] = field(
        default_factory=OrderedDict, init=False
    )
    _seen: set[ChunkKey] = field(default_factory=set, init=False)
    _listed_at: float | None = field(default=None, init=False)
    _dropped: bool = field(default=False, init=False)
    """Whether a reference was dropped since the last listing."""

    def __post_init__(self) -> None:
        if self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, not {self.max_samples}")

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, ref: HiddenStatesRef) -> None:
        if ref.token_ids is None:
            return
        self._refs[ref.token_ids] = ref
        self._refs.move_to_end(ref.token_ids)
        self._seen.add(self.key_of(ref))
        while len(self._refs) > self.max_samples:
            _, dropped = self._refs.popitem(last=False)
            self._seen.discard(self.key_of(dropped))  # read again by the next listing
            self._dropped = True

    def find(self, token_ids: Sequence[int]) -> HiddenStatesRef | None:
        ids = tuple(int(i) for i in token_ids)
        ref = self._refs.get(ids)
        if ref is None and self._due():
            ref = self.refresh(ids)
        if ref is not None:
            self.add(ref)  # the most recently found
        return ref

    def refresh(self, wanted: tuple[int, ...] | None = None) -> HiddenStatesRef | None:
        """Read the manifests listed since the last listing; the reference of ``wanted``
        tokens among them."""
        self._listed_at = self.clock()
        self._dropped = False
        new = [k for k in self.list_keys() if k not in self._seen]
        refs = list(self.read_refs(new))
        self._seen.update(new)
        found = None
        for ref in refs:
            self.add(ref)
            if ref.token_ids == wanted:
                found = ref
        return found

    def _due(self) -> bool:
        if self._listed_at is None or self._dropped:
            return True
        return self.clock() - self._listed_at >= self.refresh_s
