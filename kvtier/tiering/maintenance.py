"""Operations on everything a manager holds: drain, verify, warmup and gc.

The admin API streams them; in embedded mode they are called on the TierManager directly. The
streamed ones are generators of progress, so a caller can report as they go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvtier.core.errors import InvalidRequestError, TierNotConfiguredError, UnknownPoolError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import SlotRef, TierCode
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.catalog import Catalog, GcCounts, WarmupCounts
from kvtier.tiers.objstore.fetch import ObjectFetcher
from kvtier.tiers.objstore.tier import ObjectTier

PROGRESS_EVERY = 256
"""Chunks verified or promoted between two progress reports."""
WARMUP_REPLICA = "warmup"


@dataclass(frozen=True, slots=True)
class DrainResult:
    complete: bool
    """Every dirty arena chunk reached lmdb in time."""
    pending: int
    """Arena chunks still to be written back."""


@dataclass(frozen=True, slots=True)
class VerifyProgress:
    checked: int
    total: int
    corrupt: int
    """Chunks that failed verification (they are quarantined)."""
    done: bool = False


@dataclass(frozen=True, slots=True)
class WarmupProgress:
    objects: WarmupCounts
    """The object-store phases (index, fetch), as they stood at this report."""
    promoted: int = 0
    """Chunks put in the arena so far, of ``total``."""
    total: int = 0
    done: bool = False


class Maintenance:
    def __init__(
        self,
        *,
        cpu: CpuTier,
        lmdb: LmdbTier | None,
        store: ObjectTier | None,
        fetcher: ObjectFetcher | None,
        registry: PoolRegistry,
        flush: Callable[[float], bool],
        lease: Callable[[Sequence[ChunkKey], str], list[SlotRef | None]],
        release: Callable[[Sequence[SlotRef]], None],
    ) -> None:
        self._cpu = cpu
        self._lmdb = lmdb
        self._store = store
        self._fetcher = fetcher
        self._registry = registry
        self._flush = flush
        self._lease = lease
        self._release = release

    def drain(self, timeout: float) -> DrainResult:
        """Write every dirty arena chunk to lmdb, then sync lmdb."""
        complete = self._flush(timeout)
        if self._lmdb is not None:
            self._lmdb.sync()
        return DrainResult(complete, self._cpu.writeback_pending())

    def verify(self, tier: str = "") -> Iterator[VerifyProgress]:
        """Check every lmdb chunk; corrupt ones are quarantined."""
        if tier not in ("", TierCode.LMDB.tier):
            raise InvalidRequestError("only the lmdb tier stores checksummed chunks to verify")
        lmdb = self._lmdb
        keys = list(lmdb.keys()) if lmdb is not None else []
        corrupt = 0
        for i, key in enumerate(keys, 1):
            assert lmdb is not None
            if lmdb.verify_chunk(key) is False:
                corrupt += 1
            if i % PROGRESS_EVERY == 0 and i < len(keys):
                yield VerifyProgress(i, len(keys), corrupt)
        yield VerifyProgress(len(keys), len(keys), corrupt, done=True)

    def warmup(
        self,
        namespace: bytes | None = None,
        *,
        max_chunks: int = 0,
        object_index: bool = False,
        fetch: bool = False,
    ) -> Iterator[WarmupProgress]:
        """Promote lmdb chunks (of ``namespace``, or all) into the arena, at most
        ``max_chunks`` (0: all). First, with ``object_index``, rebuild the object index from a
        listing of the store; with ``fetch``, download the namespace's objects into lmdb."""
        objects = WarmupCounts()
        if object_index or fetch:
            catalog = self._catalog("warmup --object-index/--fetch")
            if fetch and namespace is not None and not self._known(namespace):
                # fetch would take a foreign namespace's objects for corrupt ones
                raise UnknownPoolError(
                    f"namespace {namespace.hex()} is not registered on this node; "
                    "start an engine that uses it before fetching its objects"
                )
            if object_index:
                for counts in catalog.rebuild_index(objects):
                    yield WarmupProgress(replace(counts))
            if fetch:
                assert self._fetcher is not None  # there with the object tier
                wanted = [namespace] if namespace is not None else self._registered()
                names = catalog.objects_of(wanted)
                for counts in catalog.fetch(names, self._fetcher.keep, self._in_lmdb, objects):
                    yield WarmupProgress(replace(counts))
        lmdb = self._lmdb
        keys = [
            k
            for k in (lmdb.keys() if lmdb is not None else ())
            if namespace is None or namespace_of(k) == namespace
        ]
        if max_chunks:
            keys = keys[:max_chunks]
        promoted = 0
        objects.phase = "promote"
        for start in range(0, len(keys), PROGRESS_EVERY):
            batch = [k for k in keys[start : start + PROGRESS_EVERY] if self._known(k)]
            leases = self._lease(batch, WARMUP_REPLICA)
            self._release([lease for lease in leases if lease is not None])
            promoted += sum(lease is not None for lease in leases)
            if start + PROGRESS_EVERY < len(keys):
                yield WarmupProgress(replace(objects), promoted, len(keys))
        yield WarmupProgress(replace(objects), promoted, len(keys), done=True)

    def gc(self, retention_s: float | None = None, dry_run: bool = False) -> Iterator[GcCounts]:
        """Delete objects older than ``retention_s`` (unset: ``object.retention_s``) from the
        store; ``dry_run`` only counts them."""
        catalog = self._catalog("gc")
        retention = catalog.tier.config.retention_s if retention_s is None else retention_s
        if not retention >= 0:  # also refuses NaN
            raise InvalidRequestError(f"retention_s must be >= 0, got {retention}")
        for counts in catalog.gc(retention, dry_run):
            yield replace(counts)

    def _catalog(self, what: str) -> Catalog:
        if self._store is None:
            raise TierNotConfiguredError(
                f"{what} needs the object tier, and this daemon has none: set object.url"
            )
        return Catalog(self._store)

    def _registered(self) -> list[bytes]:
        return [reg.namespace for reg in self._registry.registrations()]

    def _in_lmdb(self, key: ChunkKey) -> bool:
        return self._lmdb is not None and key in self._lmdb

    def _known(self, key: bytes) -> bool:
        """Chunks of pools no engine registered since start cannot be placed in the arena."""
        return self._registry.get(namespace_of(key)) is not None
