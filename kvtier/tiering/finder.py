"""A lookup's search through the tiers: the tier of each chunk of the longest stored prefix, the
arena first, then lmdb, then the object store (probed for what other nodes uploaded, within
``object.lookup_budget_ms``, or not waited for at all by a lookup that must not wait). A tier
that is unhealthy (`kvtier.tiering.health`) is left out: its chunks are misses while it is."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvtier.core.costs import LMDB, OBJECT
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import LookupResult, TierCode
from kvtier.tiering.health import TierHealth
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.fetch import ObjectFetcher
from kvtier.tiers.objstore.tier import ObjectTier
from kvtier.tiers.objstore.uploader import Uploader

_CPU = int(TierCode.CPU)
_LMDB = int(TierCode.LMDB)
_OBJECT = int(TierCode.OBJECT)


class Finder:
    def __init__(
        self,
        cpu: CpuTier,
        lmdb: LmdbTier | None,
        store: ObjectTier | None,
        fetcher: ObjectFetcher | None,
        uploader: Uploader | None,
        health: TierHealth,
    ) -> None:
        self._cpu = cpu
        self._lmdb = lmdb
        self._store = store
        self._fetcher = fetcher
        self._uploader = uploader
        self._health = health

    def find(self, keys: Sequence[ChunkKey], probe_wait: bool = True) -> LookupResult:
        """``probe_wait``: wait for a probe of the object store up to the lookup budget;
        without it, answer with what the arena and lmdb hold, the probe left running
        (``pending``)."""
        in_cpu = self._cpu.contains(keys)
        try:
            in_arena = in_cpu.index(False)
        except ValueError:
            in_arena = len(keys)
        codes = bytearray(bytes([_CPU]) * in_arena)  # the common case: a prefix all in the arena
        pending = False
        if in_arena < len(keys) and self._lmdb is not None and self._health.serves(LMDB):
            from_store = self._store is not None and self._health.serves(OBJECT)
            extend = partial(self._extend, keys, in_cpu, codes, from_store)
            extend()
            if self._fetcher is not None and len(codes) < len(keys):
                if from_store:
                    pending = self._fetcher.probe_past(keys, codes, extend, probe_wait)
                if self._uploader is not None:  # what misses is stored next: its order packs it
                    first = max(0, len(codes) - 1)
                    self._uploader.follows(keys[first : first + 8192])
        return LookupResult(len(codes), bytes(codes), pending)

    def _extend(
        self,
        keys: Sequence[ChunkKey],
        in_cpu: list[bool],
        codes: bytearray,
        from_store: bool,
    ) -> None:
        """Append the tier of each key from ``len(codes)`` on, up to the first one nowhere."""
        assert self._lmdb is not None
        in_lmdb = self._lmdb.__contains__
        # a store whose identity or breaker is unhealthy is left out too, until it is not
        store = self._store if from_store else None
        in_object = store.__contains__ if store is not None and store.healthy else None
        for i in range(len(codes), len(keys)):
            if in_cpu[i]:
                codes.append(_CPU)
            elif in_lmdb(keys[i]):
                codes.append(_LMDB)
            elif in_object is not None and in_object(keys[i]):
                codes.append(_OBJECT)
            else:
                break
