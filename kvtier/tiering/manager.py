"""TierManager: the one place where tiers are composed.

- ``lookup`` answers with the longest present prefix and the tier of each of its chunks
  (``lookup_leasing`` also leases them when the arena holds them all);
- stores are reserve -> write into the slot -> commit, or abort; uncommitted chunks are unseen;
- ``lease`` leases arena chunks, promoting lmdb chunks into the arena first (or, for a client that
  reads lmdb's map itself, leasing them in lmdb);
- committed arena chunks are written back to lmdb by a background thread before they can be
  evicted (write-back), or right after commit (write-through); the data plane never waits on it;
- with an object store, chunks written to lmdb are uploaded from a bounded queue, object chunks are
  promoted on request, and a lookup probes the store for chunks other nodes uploaded (within
  ``object.lookup_budget_ms``; not waited for by one with ``probe_wait`` off), counted as object
  hits;
- draft pools are versioned: an old revision's chunks are evicted first, and deleted from every
  tier after ``manager.draft_grace_s``; target chunks are never touched;
- what a killed owner committed to the arena reaches lmdb once its namespace registers again;
- a stored tier unhealthy from chunks failing verification is neither read nor written while it is
  (`kvtier.tiering.health`).

The parts: `kvtier.tiering.finder` searches the tiers for a lookup, `kvtier.tiering.drafts` keeps
the draft revisions, `kvtier.tiers.objstore.fetch` probes and downloads objects,
`kvtier.tiering.maintenance` runs drain, verify, warmup and gc.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from kvtier.core.config import KVTierConfig
from kvtier.core.costs import LoadCosts
from kvtier.core.counters import Counters
from kvtier.core.errors import UnknownTierError
from kvtier.core.journal import ChunkEvents, Journal
from kvtier.core.keys import ChunkKey, NamespaceSpec, Pool, is_blank, namespaces_of
from kvtier.core.pools import PoolRegistry
from kvtier.core.priority import set_background_nice
from kvtier.core.protocol import (
    DraftRevision,
    DraftState,
    LookupResult,
    SlotRef,
    TierStats,
    in_lmdb,
    leasable_hit,
)
from kvtier.tiering.admission import HitAdmission
from kvtier.tiering.drafts import DraftRevisions
from kvtier.tiering.finder import Finder
from kvtier.tiering.health import TierHealth
from kvtier.tiering.integrity import IntegrityReports
from kvtier.tiering.locate import Location, locate
from kvtier.tiering.maintenance import DrainResult, Maintenance, VerifyProgress, WarmupProgress
from kvtier.tiering.object_side import open_object_side
from kvtier.tiering.promotion import Promoter
from kvtier.tiering.quarantine import Quarantines
from kvtier.tiering.writeback import WriteBack
from kvtier.tiers.arena_salvage import StaleArena, keep
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.catalog import GcCounts
from kvtier.tiers.objstore.fetch import ObjectFetcher
from kvtier.tiers.objstore.tier import ObjectTier
from kvtier.tiers.objstore.uploader import Uploader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ManagerStats:
    tiers: dict[str, TierStats]
    counters: Counter[str] = field(default_factory=Counter)
    """lookups, lookup_chunks, hit_chunks_<tier>, promotions, promotion_failed, ..."""


class TierManager:
    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        set_background_nice(config.manager.background_nice)  # before any mover starts
        self.registry = PoolRegistry(idle_s=config.server.namespace_idle_s)
        # read before the new arena takes the path: what a killed owner committed there
        self.stale = StaleArena.at(config.arena) if config.lmdb.enabled else None
        self.cpu = CpuTier(config.arena, self.registry)
        self.lmdb: LmdbTier | None = None
        try:
            if config.lmdb.enabled:
                self.lmdb = LmdbTier(config.lmdb, self.registry)
        except BaseException:
            self.cpu.close()
            raise
        try:
            self.objects = open_object_side(config, self.lmdb, self.registry)
        except BaseException:
            if self.lmdb is not None:
                self.lmdb.close()
            self.cpu.close()
            raise
        side = self.objects
        self.object: ObjectTier | None = side.tier if side else None
        self.uploader: Uploader | None = side.uploader if side else None
        self.admission: HitAdmission | None = side.admission if side else None
        self.quarantines = Quarantines(self.lmdb)
        self.journal = Journal()
        for local in (self.cpu, self.lmdb):
            if local is not None:
                local.journal = self.journal
        self._counters = Counters()
        self.costs = LoadCosts()
        """Measured load costs per tier and the engines' prefill time (`kvtier locate`)."""
        self.promoter: Promoter | None = None
        if self.lmdb is not None:
            self.promoter = Promoter(self.cpu, self.lmdb, config.manager, self._counters)
        self.fetcher: ObjectFetcher | None = None
        if self.object is not None and self.lmdb is not None:
            assert self.promoter is not None
            self.fetcher = ObjectFetcher(
                self.object,
                self.lmdb.put_many,
                self.promoter.promote_ahead,
                self._counters,
                self.costs,
            )
        self.drafts = DraftRevisions(
            self.registry,
            self.cpu,
            self.lmdb,
            list(self.tiers.values()),
            self._counters,
            config.manager.draft_grace_s,
        )
        self.maintenance = Maintenance(
            cpu=self.cpu,
            lmdb=self.lmdb,
            store=self.object,
            fetcher=self.fetcher,
            registry=self.registry,
            flush=self.flush,
            lease=self.lease,
            release=self.release,
        )
        self.integrity = IntegrityReports(self.tiers, self.lmdb, config.manager)
        self.health = TierHealth(self.integrity.unhealthy)
        """Which stored tiers are read and written now (unhealthy ones are not)."""
        self.finder = Finder(
            self.cpu, self.lmdb, self.object, self.fetcher, self.uploader, self.health
        )
        self.writeback: WriteBack | None = None
        if self.lmdb is not None:
            self.writeback = WriteBack(
                self.cpu,
                self.lmdb,
                self.uploader,
                config,
                self._counters,
                between_batches=self._between_writebacks,
                skip=self.quarantines.holds,
                writes=partial(self.health.serves, LmdbTier.name),
            )

    def _between_writebacks(self) -> None:
        self.drafts.gc_when_due()
        self.cpu.expire_idle()  # idle namespaces and slot classes

    @property
    def tiers(self) -> dict[str, Tier]:
        tiers: dict[str, Tier] = {CpuTier.name: self.cpu}
        if self.lmdb is not None:
            tiers[LmdbTier.name] = self.lmdb
        if self.object is not None:
            tiers[ObjectTier.name] = self.object
        return tiers

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        """Register a namespace and its chunk size; returns the 16-byte namespace."""
        registration = self.registry.register(spec, chunk_bytes)
        self.cpu.accept(registration)  # refuse now what the arena could never hold
        self.stale = keep(self.stale, self.lmdb, registration.namespace, chunk_bytes)
        if spec.pool is Pool.DRAFT:
            self.drafts.registered(spec, registration.namespace)
        return registration.namespace

    # -- draft revisions ------------------------------------------------------------------

    def begin_draft_swap(self, revision: str, draft_model: str = "") -> tuple[str, str]:
        """Start switching the draft pools (of ``draft_model``, or all) to ``revision``; until
        `commit_draft_swap`, engines neither load nor store draft chunks. Returns the swap id and
        the revision in use before."""
        return self.drafts.begin_swap(revision, draft_model)

    def commit_draft_swap(self, swap_id: str) -> str:
        """Make the revision given at `begin_draft_swap` current; returns it."""
        return self.drafts.commit_swap(swap_id)

    def draft_states(self) -> dict[bytes, DraftState]:
        """Each draft pool's state, by `NamespaceSpec.draft_lineage`."""
        return self.drafts.states()

    def draft_revisions(self) -> list[DraftRevision]:
        """Every draft revision still known, with its chunks per tier."""
        tiers: dict[str, CpuTier | LmdbTier | ObjectTier] = {CpuTier.name: self.cpu}
        tiers.update({t.name: t for t in (self.lmdb, self.object) if t is not None})
        return self.drafts.revisions({name: t.namespace_chunks() for name, t in tiers.items()})

    def gc_draft_revisions(self, grace_s: float | None = None) -> int:
        """Delete, from every tier, the chunks of draft revisions retired longer than the
        grace ago; returns how many went."""
        return self.drafts.gc(grace_s)

    # -- lookup ---------------------------------------------------------------------------

    def _check_pools(self, keys: Sequence[ChunkKey]) -> None:
        """Refuse a batch naming any unregistered namespace, before anything changes."""
        for namespace in namespaces_of(keys):
            self.registry.resolve(namespace, use=True)

    def _count_lookup(self, asked: int, result: LookupResult, verify: bool) -> None:
        counters = self._counters
        counters.add("lookups", 1)
        counters.add("lookup_chunks", asked)
        if verify:
            counters.add("verified_chunks", result.hits)
            return
        for tier, n in result.by_tier.items():
            counters.add(f"hit_chunks_{tier}", n)

    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        again: bool = False,
        verify: bool = False,
        probe_wait: bool = True,
    ) -> LookupResult:
        """The tier of each chunk of the longest stored prefix. ``again``: a request asking
        again while it waits, not counted as a lookup. ``verify``: a request sampled for
        verification, whose found chunks are counted as verified, not hits (none is served).
        ``probe_wait`` off: a probe of the object store is started or joined, not waited for
        (an engine's step asks so); the answer is ``pending`` while it runs."""
        keys = self.quarantines.cut(keys)
        self._check_pools(keys)
        result = self.finder.find(keys, probe_wait)
        if self.fetcher and not verify:  # what a probe brought counts once, as the store's
            claimed = self.fetcher.claim(keys[: result.hits], result.tier_codes)
            result = replace(result, from_store=claimed)
        if not again:
            self._count_lookup(len(keys), result, verify)
        elif result.from_store:
            self._counters.add("hit_chunks_object", result.from_store)
        return result

    def lookup_leasing(
        self,
        keys: Sequence[ChunkKey],
        replica: str = "default",
        *,
        again: bool = False,
        verify: bool = False,
        probe_wait: bool = True,
        in_lmdb: bool = False,
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """`lookup`, also leasing the found chunks when the arena holds them all (``in_lmdb``:
        the arena and lmdb between them, leased in lmdb where it holds them): a hit served
        from there then takes one call."""
        result = self.lookup(keys, again=again, verify=verify, probe_wait=probe_wait)
        leased = keys[: leasable_hit(result, in_lmdb)]
        return result, self.lease(leased, replica, in_lmdb=in_lmdb)

    # -- store ----------------------------------------------------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Arena slots to write; None where the chunk exists, is in flight, or has no room.
        The keys of one call are taken as consecutive chunks of one prefix, in order: only such
        runs share an object in the store."""
        if self.uploader is not None:
            self.uploader.follows([k for k in keys if not is_blank(k)])
        if self.lmdb is not None and self.health.serves(LmdbTier.name):
            present = self.lmdb.contains(keys)
            if any(present):  # already kept on disk: do not copy it again
                self.cpu.count_duplicates(sum(present))
                out: list[SlotRef | None] = [None] * len(keys)
                todo = [i for i, p in enumerate(present) if not p]
                for i, ref in zip(
                    todo, self.cpu.reserve([keys[i] for i in todo], replica), strict=True
                ):
                    out[i] = ref
                return out
        return self.cpu.reserve(keys, replica)

    def refuse_kept(self, refs: Sequence[SlotRef]) -> set[ChunkKey]:
        """Of slots reserved blank (`kvtier.core.keys.blank_key`) and named as they commit, free
        those whose chunk lmdb keeps, as `reserve` refuses it, counted as duplicates; returns
        their keys. The others' keys are taken as consecutive chunks of one prefix, as
        `reserve` takes its keys: their blank reservation could not tell."""
        kept: list[SlotRef] = []
        if refs and self.lmdb is not None and self.health.serves(LmdbTier.name):
            present = self.lmdb.contains([ref.key for ref in refs])
            kept = [ref for ref, k in zip(refs, present, strict=True) if k]
            self.cpu.abort(kept, "store_duplicate")
        refused = {ref.key for ref in kept}
        if self.uploader is not None:
            self.uploader.follows([ref.key for ref in refs if ref.key not in refused])
        return refused

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        """``lineages``: each chunk's encoded `kvtier.core.lineage.BlockLineage` (empty: none),
        kept for the object tier's announcements."""
        if lineages and self.objects is not None and self.objects.events is not None:
            self.objects.events.remember([r.key for r in refs], lineages)
        done = self.cpu.commit(refs)
        if done and self.writeback is not None:
            self.writeback.wake()
        return done

    def abort(self, refs: Sequence[SlotRef]) -> None:
        self.cpu.abort(refs)

    # -- lease ----------------------------------------------------------------------------

    def lease(
        self, keys: Sequence[ChunkKey], replica: str = "default", *, in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        """Leases on arena slots holding each key, promoting from lmdb where needed; with
        ``in_lmdb``, a chunk lmdb holds is leased there instead (`kvtier.tiers.lmdb_loads`).
        None where a key is nowhere, or failed verification (it is then quarantined)."""
        self._check_pools(keys)
        leases = self.cpu.lease(keys)
        if self.promoter is None or self.lmdb is None:
            return leases
        from_lmdb = self.health.serves(LmdbTier.name)  # else what the arena holds only
        for i, lease in enumerate(leases):
            if lease is None and from_lmdb:
                key = keys[i]
                leases[i] = (
                    self.lmdb.loads.lease(key) if in_lmdb else self.promoter.promote(key, replica)
                )
        leased = [k for k, ref in zip(keys, leases, strict=True) if ref is not None]
        self.promoter.claimed(leased)
        if self.admission is not None:
            self.admission.loaded(leased, replica)
        return leases

    def promote(self, keys: Sequence[ChunkKey], replica: str = "default") -> int:
        """Queue lmdb and object chunks for promotion into the arena, without waiting; returns
        how many were queued. A later lookup finds them in the arena."""
        self._check_pools(keys)
        if self.lmdb is None or self.promoter is None or not self.health.serves(LmdbTier.name):
            return 0
        local: list[ChunkKey] = []
        remote: list[ChunkKey] = []
        for key, cached in zip(keys, self.cpu.contains(keys), strict=True):
            if cached:
                continue
            if key in self.lmdb:
                local.append(key)
            elif self.object is not None and key in self.object:
                remote.append(key)
        queued = self.promoter.queue(local, replica)
        if remote and self.fetcher is not None and self.health.serves(ObjectTier.name):
            queued += self.fetcher.fetch(remote, replica)
        return queued

    def release(self, refs: Sequence[SlotRef]) -> None:
        if self.lmdb is not None and any(map(in_lmdb, refs)):
            self.lmdb.loads.release(refs)
            refs = [ref for ref in refs if not in_lmdb(ref)]
        self.cpu.release(refs)

    def chunk_events(self, cursor: int, limit: int = 4096) -> ChunkEvents:
        """Chunks that entered or left the arena and lmdb since ``cursor`` (-1: from now)."""
        return self.journal.since(cursor, limit)

    def flush(self, timeout: float = 30.0) -> bool:
        """Write every dirty arena chunk to lmdb; True when none is left."""
        return self.writeback is None or self.writeback.flush(timeout)

    # -- admin ----------------------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        for tier in self.tiers.values():
            tier.pin(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        for tier in self.tiers.values():
            tier.unpin(keys)

    def evict(
        self,
        tier: str | None = None,
        *,
        pool: str | None = None,
        namespace: bytes | None = None,
        replica: str | None = None,
    ) -> dict[str, int]:
        """Drop matching chunks from one tier, or from every local one (arena and lmdb).
        Arena chunks reach lmdb first."""
        if tier is not None and tier not in self.tiers:
            raise UnknownTierError(f"unknown tier {tier!r}; known: {sorted(self.tiers)}")
        if tier == CpuTier.name:
            self.flush()
        # the object store is shared by the fleet: only an explicit tier="object" touches it
        names = [tier] if tier is not None else [n for n in self.tiers if n != ObjectTier.name]
        # a write-back batch in flight holds its chunks: they are not a client's to keep
        with self.writeback.paused() if self.writeback is not None else contextlib.nullcontext():
            return {
                name: self.tiers[name].evict(pool=pool, namespace=namespace, replica=replica)
                for name in names
            }

    def flush_uploads(self, timeout: float = 30.0) -> bool:
        """Wait until every queued upload is done; True when none is left."""
        return self.uploader is None or self.uploader.wait_idle(timeout)

    def drain(self, timeout: float = 60.0) -> DrainResult:
        """Write every dirty arena chunk to lmdb, then sync lmdb."""
        return self.maintenance.drain(timeout)

    def verify(self, tier: str = "") -> Iterator[VerifyProgress]:
        """Check every lmdb chunk, quarantining corrupt ones; progress as it goes."""
        return self.maintenance.verify(tier)

    def warmup(
        self,
        namespace: bytes | None = None,
        *,
        max_chunks: int = 0,
        object_index: bool = False,
        fetch: bool = False,
    ) -> Iterator[WarmupProgress]:
        """Promote stored chunks into the arena (see `Maintenance.warmup`); progress as it goes."""
        return self.maintenance.warmup(
            namespace, max_chunks=max_chunks, object_index=object_index, fetch=fetch
        )

    def locate(
        self, model: str, block_hashes: Sequence[bytes], tenant: str = "default"
    ) -> Location:
        """Per tier, the prompt's leading tokens it holds and their expected load time."""
        snapshot = self.costs.snapshot()
        serves = self.health.serves
        return locate(self.registry, self.tiers, snapshot, model, block_hashes, tenant, serves)

    def gc(self, retention_s: float | None = None, dry_run: bool = False) -> Iterator[GcCounts]:
        """Delete objects past their retention from the store; progress as it goes."""
        return self.maintenance.gc(retention_s, dry_run)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        self.cpu.set_quota(replica, pool, nbytes)

    def stats(self) -> ManagerStats:
        tiers = {name: tier.stats() for name, tier in self.tiers.items()}
        return ManagerStats(tiers=tiers, counters=self._counters.snapshot())

    def close(self, flush_timeout: float = 30.0) -> None:
        """Write back what the arena holds, then close every tier."""
        try:
            if not self.flush(flush_timeout):
                log.error(
                    "closing with %d arena chunks not written back to lmdb",
                    self.cpu.writeback_pending(),
                )
        finally:
            self.integrity.close()
            if self.writeback is not None:
                self.writeback.stop()
            if self.promoter is not None:
                self.promoter.stop()
            if self.objects is not None:
                self.objects.close(flush_timeout)
            if self.fetcher is not None:
                self.fetcher.close()
            if self.object is not None:
                self.object.close()
            if self.lmdb is not None:
                self.lmdb.close()
            if self.stale is not None:
                self.stale.close()
            self.cpu.close()
