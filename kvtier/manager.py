"""TierManager: the one place where tiers are composed.

- ``lookup`` answers with the longest present prefix and the tier of each of its chunks;
- stores are reserve -> write (into the arena slot) -> commit, or abort; uncommitted chunks are
  invisible;
- ``load`` leases arena chunks, promoting lmdb chunks into the arena first;
- committed arena chunks are written back to lmdb by a background thread before they can be
  evicted (write-back), or right after commit (write-through); the data plane never waits on it;
- with an object store, chunks written to lmdb are uploaded from a bounded queue, object chunks are
  promoted on request, and a lookup probes the store for chunks other nodes uploaded, waiting no
  longer than ``object.lookup_budget_ms``;
- draft pools are versioned: a new draft revision (an admin swap, or an engine registering one)
  becomes current, the old revision's chunks are evicted first and, after
  ``manager.draft_grace_s``, deleted from every tier. Target chunks are never touched.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from kvtier.config import Admission, DemoteMode, KVTierConfig
from kvtier.counters import Counters
from kvtier.errors import ConfigError, InvalidRequestError, KVTierError, UnknownPoolError
from kvtier.journal import ChunkEvents, Journal
from kvtier.keys import NAMESPACE_BYTES, ChunkKey, NamespaceSpec, Pool
from kvtier.pools import PoolRegistry
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.cpu import CpuTier, SlotRef
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.tier import REMOTE_REPLICA, FetchedChunk, ObjectTier
from kvtier.tiers.objstore.uploader import Uploader

log = logging.getLogger(__name__)

_STOP = (ChunkKey(b""), "")  # wakes the promoter to stop

TIER_CPU = "cpu"
TIER_LMDB = "lmdb"
TIER_OBJECT = "object"
# One byte per chunk in lookup answers; the values are those of the wire's Tier enum.
TIER_CODES = {TIER_CPU: 1, TIER_LMDB: 2, TIER_OBJECT: 3}
TIER_NAMES = {code: name for name, code in TIER_CODES.items()}
_CPU = TIER_CODES[TIER_CPU]
_LMDB = TIER_CODES[TIER_LMDB]
_OBJECT = TIER_CODES[TIER_OBJECT]
_PROBE_MISS_TTL_S = 10.0  # a chunk another node uploads after a miss is found this much later
_MAX_TRACKED = 1 << 17  # bound on per-key bookkeeping (probe misses, hit counts)
_DRAFT_GC_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int
    """Length of the longest prefix of the asked keys present in some tier."""
    tier_codes: bytes
    """Tier of each of those ``hits`` chunks (the fastest one holding it), a `TIER_CODES` value
    per byte: compact for batches of thousands."""
    pending: bool = False
    """The object store is still being probed past ``hits``: asking again may find more."""

    @property
    def tiers(self) -> list[str]:
        return [TIER_NAMES[c] for c in self.tier_codes]


def arena_hit(result: LookupResult) -> int:
    """How many chunks a lookup found, when the arena holds every one of them; else 0 (part
    of the hit is still to be promoted, and leases now would only be given back)."""
    codes = result.tier_codes
    return len(codes) if not codes.strip(bytes([_CPU])) else 0


@dataclass(slots=True)
class ManagerStats:
    tiers: dict[str, TierStats]
    counters: Counter[str] = field(default_factory=Counter)
    """lookups, lookup_chunks, hit_chunks_<tier>, promotions, promotion_failed, ..."""


@dataclass(frozen=True, slots=True)
class DraftState:
    """Where one draft pool stands, as engines follow it."""

    revision: str
    swapping: bool = False
    """A swap has begun and not been committed: the draft's weights are in flux, so engines
    neither load nor store its chunks."""
    epoch: int = 0
    """Bumped by every begin and every change of revision, so a client sees A -> B -> A."""


@dataclass(frozen=True, slots=True)
class DraftRevision:
    """One revision of a draft pool, and the chunks each tier holds of it."""

    model: str
    draft_model: str
    revision: str
    namespace: bytes
    current: bool
    chunks: dict[str, int]


@dataclass
class _Lineage:
    """Every revision of one draft pool (same model, layout, dtype, shard, tenant)."""

    model: str
    draft_model: str
    current: str
    namespaces: dict[str, bytes]
    retired_at: dict[str, float] = field(default_factory=dict)
    """Revision -> when it stopped being current (monotonic); deleted after the grace."""
    swap_id: str = ""
    swap_revision: str = ""
    epoch: int = 0


class TierManager:
    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        self.registry = PoolRegistry()
        self.cpu = CpuTier(config.arena, self.registry)
        self.lmdb: LmdbTier | None = None
        try:
            if config.lmdb.enabled:
                self.lmdb = LmdbTier(config.lmdb, self.registry)
        except BaseException:
            self.cpu.close()
            raise
        self.object: ObjectTier | None = None
        self.uploader: Uploader | None = None
        if config.object.url is not None:
            if self.lmdb is None:
                self.cpu.close()
                raise ConfigError("object.url", "the object tier needs the lmdb tier enabled")
            try:
                self.object = ObjectTier(config.object, self.registry)
            except BaseException:
                self.lmdb.close()
                self.cpu.close()
                raise
            self.uploader = Uploader(
                self.object, self.lmdb.copy_encoded, config.object, self.object.counters
            )
            if config.object.admission is Admission.ALL:
                lmdb_tier, registry = self.lmdb, self.registry
                # uploads queued or failed when the process last stopped
                self.uploader.resume(
                    lambda limit: lmdb_tier.newest_chunks(limit, REMOTE_REPLICA),
                    lambda: [reg.namespace for reg in registry.registrations()],
                )
        self._downloads = ThreadPoolExecutor(config.object.download_concurrency, "kvtier-download")
        self._probes: dict[ChunkKey, Future[bool]] = {}
        self._probe_misses: dict[ChunkKey, float] = {}
        self._fetching: set[str] = set()
        self._hit_counts: Counter[ChunkKey] = Counter()
        self._object_lock = threading.Lock()
        self.journal = Journal()
        for local in (self.cpu, self.lmdb):
            if local is not None:
                local.journal = self.journal
        self.cpu.track_dirty(self.lmdb is not None)
        self._write_through = config.manager.demote_mode is DemoteMode.WRITE_THROUGH
        self.cpu.set_clean_reserve(1.0 if self._write_through else config.manager.clean_reserve)
        self._counters = Counters()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._promotions: queue.Queue[tuple[ChunkKey, str]] = queue.Queue(
            config.manager.promote_queue_chunks
        )
        self._promoting: set[ChunkKey] = set()
        self._drafts: dict[bytes, _Lineage] = {}
        self._draft_lock = threading.Lock()
        self._next_draft_gc = 0.0
        self._threads: list[threading.Thread] = []
        if self.lmdb is not None:
            for target, name in (
                (self._writeback_loop, "kvtier-writeback"),
                (self._promote_loop, "kvtier-promote"),
            ):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    @property
    def tiers(self) -> dict[str, Tier]:
        tiers: dict[str, Tier] = {TIER_CPU: self.cpu}
        if self.lmdb is not None:
            tiers[TIER_LMDB] = self.lmdb
        if self.object is not None:
            tiers[TIER_OBJECT] = self.object
        return tiers

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        """Register a namespace and its chunk size; returns the 16-byte namespace."""
        registration = self.registry.register(spec, chunk_bytes)
        self.cpu.accept(registration)  # refuse now what the arena could never hold
        if spec.pool is Pool.DRAFT:
            self._draft_registered(spec, registration.namespace)
        return registration.namespace

    # -- draft revisions ------------------------------------------------------------------

    def _draft_registered(self, spec: NamespaceSpec, namespace: bytes) -> None:
        """The last revision registered is current: an engine that swapped its draft by
        itself registers the new one."""
        assert spec.draft_model is not None
        lineage = spec.draft_lineage()
        revision = spec.draft_revision or ""
        with self._draft_lock:
            known = self._drafts.get(lineage)
            if known is None:
                self._drafts[lineage] = _Lineage(
                    spec.model, spec.draft_model, revision, {revision: namespace}
                )
                return
            known.namespaces.setdefault(revision, namespace)
            if revision != known.current:
                self._switch(known, revision)

    def _switch(self, lineage: _Lineage, revision: str) -> None:
        old = lineage.current
        lineage.retired_at[old] = time.monotonic()
        lineage.retired_at.pop(revision, None)
        lineage.current = revision
        lineage.epoch += 1
        self._counters.add("draft_swaps", 1)
        retiring: list[LmdbTier | CpuTier] = (
            [self.cpu] if self.lmdb is None else [self.cpu, self.lmdb]
        )
        for tier in retiring:
            if old in lineage.namespaces:
                tier.retire(lineage.namespaces[old])
            tier.retire(lineage.namespaces[revision], retired=False)

    def begin_draft_swap(self, revision: str, draft_model: str = "") -> tuple[str, str]:
        """Start switching the draft pools (of ``draft_model``, or all) to ``revision``; until
        `commit_draft_swap`, engines neither load nor store draft chunks. Returns the swap id and
        the revision in use before."""
        if not revision:
            raise InvalidRequestError("a draft swap needs a revision")
        with self._draft_lock:
            lineages = [
                lin
                for lin in self._drafts.values()
                if not draft_model or lin.draft_model == draft_model
            ]
            if not lineages:
                raise UnknownPoolError(
                    "no engine has registered a draft pool"
                    + (f" of {draft_model!r}" if draft_model else "")
                    + " with this daemon; start one with speculative decoding first"
                )
            swap_id = uuid.uuid4().hex
            for lin in lineages:  # a begin never committed is superseded, not stuck
                lin.swap_id, lin.swap_revision = swap_id, revision
                lin.epoch += 1
            previous = sorted({lin.current for lin in lineages})
        return swap_id, ",".join(previous)

    def commit_draft_swap(self, swap_id: str) -> str:
        """Make the revision given at `begin_draft_swap` current; returns it."""
        with self._draft_lock:
            lineages = [lin for lin in self._drafts.values() if swap_id and lin.swap_id == swap_id]
            if not lineages:
                raise InvalidRequestError(f"no draft swap {swap_id!r} is under way")
            revision = lineages[0].swap_revision
            for lin in lineages:
                now = lin.namespaces[lin.current]
                spec = self.registry.spec_of(now)
                reg = self.registry.get(now)
                assert spec is not None
                assert reg is not None
                new = self.registry.register(spec.with_draft_revision(revision), reg.chunk_bytes)
                self.cpu.accept(new)
                lin.namespaces.setdefault(revision, new.namespace)
                lin.swap_id = lin.swap_revision = ""
                if revision != lin.current:
                    self._switch(lin, revision)
                else:
                    lin.epoch += 1
        return revision

    def draft_states(self) -> dict[bytes, DraftState]:
        """Each draft pool's state, by `NamespaceSpec.draft_lineage`."""
        with self._draft_lock:
            return {
                key: DraftState(lin.current, bool(lin.swap_id), lin.epoch)
                for key, lin in self._drafts.items()
            }

    def draft_revisions(self) -> list[DraftRevision]:
        """Every draft revision still known, with its chunks per tier."""
        counts: dict[str, Counter[bytes]] = {TIER_CPU: self.cpu.namespace_chunks()}
        if self.lmdb is not None:
            counts[TIER_LMDB] = self.lmdb.namespace_chunks()
        if self.object is not None:
            counts[TIER_OBJECT] = Counter(
                k[:NAMESPACE_BYTES] for k in list(self.object.index.chunks)
            )
        out = []
        with self._draft_lock:
            for lin in self._drafts.values():
                for revision, ns in lin.namespaces.items():
                    chunks = {tier: held[ns] for tier, held in counts.items()}
                    out.append(
                        DraftRevision(
                            lin.model,
                            lin.draft_model,
                            revision,
                            ns,
                            revision == lin.current,
                            chunks,
                        )
                    )
        return out

    def gc_draft_revisions(self, grace_s: float | None = None) -> int:
        """Delete, from every tier, the chunks of draft revisions retired longer than the
        grace ago; returns how many went."""
        grace = self.config.manager.draft_grace_s if grace_s is None else grace_s
        now = time.monotonic()
        due: list[bytes] = []
        with self._draft_lock:
            for lin in self._drafts.values():
                for revision, since in list(lin.retired_at.items()):
                    if now - since >= grace:
                        del lin.retired_at[revision]
                        due.append(lin.namespaces.pop(revision))
        dropped = 0
        for namespace in due:
            for tier in self.tiers.values():
                dropped += tier.evict(namespace=namespace)
            self.cpu.retire(namespace, retired=False)
            if self.lmdb is not None:
                self.lmdb.retire(namespace, retired=False)
        self._counters.add("draft_gc_chunks", dropped)
        return dropped

    # -- lookup ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        if keys:
            self.registry.resolve(keys[0])
        in_cpu = self.cpu.contains(keys)
        try:
            in_arena = in_cpu.index(False)
        except ValueError:
            in_arena = len(keys)
        codes = bytearray(bytes([_CPU]) * in_arena)  # the common case: a prefix all in the arena
        pending = False
        if in_arena < len(keys) and self.lmdb is not None:
            self._extend_codes(keys, in_cpu, codes)
            if self.object is not None and len(codes) < len(keys):
                pending = self._probe_past(keys, in_cpu, codes)
                if self.uploader is not None:  # what misses is stored next: its order packs it
                    first = max(0, len(codes) - 1)
                    self.uploader.follows(keys[first : first + 8192])
        counters = self._counters
        counters.add("lookups", 1)
        counters.add("lookup_chunks", len(keys))
        n_cpu = codes.count(_CPU)
        n_object = codes.count(_OBJECT)
        counters.add("hit_chunks_cpu", n_cpu)
        counters.add("hit_chunks_lmdb", len(codes) - n_cpu - n_object)
        counters.add("hit_chunks_object", n_object)
        return LookupResult(len(codes), bytes(codes), pending)

    def lookup_then_load(
        self, keys: Sequence[ChunkKey], replica: str = "default"
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """A lookup that also leases the found chunks when the arena holds them all: a hit
        served from the arena then takes one call."""
        result = self.lookup(keys)
        return result, self.load(keys[: arena_hit(result)], replica)

    def _extend_codes(self, keys: Sequence[ChunkKey], in_cpu: list[bool], codes: bytearray) -> None:
        """Append the tier of each key from ``len(codes)`` on, up to the first one nowhere."""
        assert self.lmdb is not None
        in_lmdb = self.lmdb.__contains__
        # an unhealthy store (identity or breaker) is left out: its chunks are misses until then
        store = self.object
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

    # -- object store ---------------------------------------------------------------------

    def _probe_past(self, keys: Sequence[ChunkKey], in_cpu: list[bool], codes: bytearray) -> bool:
        """Probe the store for objects other nodes uploaded, starting at the first key found
        nowhere, within the lookup budget. Found chunks land in lmdb and extend ``codes``.
        Returns True when a probe is still running at the deadline."""
        assert self.object is not None
        if not self.object.principal_resolved.is_set():
            return True  # the identity is still being resolved at start: ask again, not a miss
        cfg = self.config.object
        deadline = time.monotonic() + cfg.lookup_budget_ms / 1000.0
        for _ in range(cfg.probe_chunks):
            if len(codes) >= len(keys) or not self.object.healthy:
                return False
            found = self._probe(keys[len(codes)], deadline)
            if found is None:
                return True
            if not found:
                return False
            before = len(codes)
            self._extend_codes(keys, in_cpu, codes)
            if len(codes) == before:
                return False
        return False

    def _probe(self, key: ChunkKey, deadline: float) -> bool | None:
        """Whether an object starting at ``key`` exists (its chunks are then in lmdb); None
        when the answer did not come before ``deadline``."""
        now = time.monotonic()
        with self._object_lock:
            if self._probe_misses.get(key, 0.0) > now:
                return False
            future = self._probes.get(key)
            if future is None:
                future = self._downloads.submit(self._probe_job, key)
                self._probes[key] = future
        try:
            return future.result(timeout=max(0.0, deadline - now))
        except FutureTimeout:
            self._counters.add("probes_over_budget", 1)
            return None

    def _probe_job(self, key: ChunkKey) -> bool:
        assert self.object is not None
        found = False
        try:
            chunks = self.object.probe(key)
            if chunks:
                self._keep_fetched(chunks)
                found = True
        except KVTierError as exc:
            log.debug("probe of %s failed: %s", key.hex(), exc)
        finally:
            with self._object_lock:
                self._probes.pop(key, None)
                if not found:
                    if len(self._probe_misses) > _MAX_TRACKED:
                        self._probe_misses.clear()
                    self._probe_misses[key] = time.monotonic() + _PROBE_MISS_TTL_S
        return found

    def _keep_fetched(self, chunks: Sequence[FetchedChunk]) -> None:
        assert self.lmdb is not None
        self.lmdb.put_many([(c.key, c.payload) for c in chunks], REMOTE_REPLICA)

    def _fetch_objects(self, keys: Sequence[ChunkKey], replica: str) -> int:
        """Queue downloads of the objects holding ``keys`` into lmdb and the arena."""
        assert self.object is not None
        wanted: dict[str, list[ChunkKey]] = {}
        for key in keys:
            loc = self.object.index.get(key)
            if loc is not None:
                wanted.setdefault(loc.obj, []).append(key)
        queued = 0
        for name, group in wanted.items():
            with self._object_lock:
                if name in self._fetching:
                    continue
                self._fetching.add(name)
            self._downloads.submit(self._fetch_job, name, group, replica)
            queued += len(group)
        return queued

    def _fetch_job(self, name: str, keys: list[ChunkKey], replica: str) -> None:
        assert self.object is not None
        try:
            chunks = self.object.fetch(name)
            if chunks:
                self._keep_fetched(chunks)
                for key in keys:
                    self._promote(key, replica, lease=False)
                self._counters.add("promotions_object", len(keys))
        except KVTierError as exc:
            self._counters.add("promotion_failed", len(keys))
            log.debug("download of %s failed: %s", name, exc)
        except Exception:  # never let a mover die silently
            self._counters.add("promotion_errors", 1)
            log.exception("download of %s failed", name)
        finally:
            with self._object_lock:
                self._fetching.discard(name)

    def _count_hits(self, keys: Sequence[ChunkKey], replica: str) -> None:
        """Admission by hits: offer a chunk for upload once it was loaded often enough."""
        if self.uploader is None or self.config.object.admission is not Admission.HITS:
            return
        threshold = self.config.object.admission_min_hits
        hot = []
        with self._object_lock:
            if len(self._hit_counts) > _MAX_TRACKED:
                self._hit_counts.clear()
            for key in keys:
                self._hit_counts[key] += 1
                if self._hit_counts[key] == threshold:
                    hot.append(key)
        if hot:
            self.uploader.offer(hot, replica)

    # -- store ----------------------------------------------------------------------------

    def reserve(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Arena slots to write; None where the chunk exists, is in flight, or has no room.
        The keys of one call are taken as consecutive chunks of one prefix, in order: only such
        runs share an object in the store."""
        if self.uploader is not None:
            self.uploader.follows(keys)
        if self.lmdb is not None:
            present = self.lmdb.contains(keys)
            if any(present):  # already kept on disk: do not copy it again
                out: list[SlotRef | None] = [None] * len(keys)
                todo = [i for i, p in enumerate(present) if not p]
                for i, ref in zip(
                    todo, self.cpu.reserve([keys[i] for i in todo], replica), strict=True
                ):
                    out[i] = ref
                return out
        return self.cpu.reserve(keys, replica)

    def commit(self, refs: Sequence[SlotRef]) -> int:
        done = self.cpu.commit(refs)
        if done and self.lmdb is not None:
            self._wake.set()
        return done

    def abort(self, refs: Sequence[SlotRef]) -> None:
        self.cpu.abort(refs)

    # -- load -----------------------------------------------------------------------------

    def load(self, keys: Sequence[ChunkKey], replica: str = "default") -> list[SlotRef | None]:
        """Leases on arena slots holding each key, promoting from lmdb where needed.

        None where a key is nowhere, or failed verification (it is then quarantined).
        """
        leases = self.cpu.lease(keys)
        if self.lmdb is None:
            return leases
        for i, lease in enumerate(leases):
            if lease is None:
                leases[i] = self._promote(keys[i], replica)
        self._count_hits(
            [k for k, ref in zip(keys, leases, strict=True) if ref is not None], replica
        )
        return leases

    def promote(self, keys: Sequence[ChunkKey], replica: str = "default") -> int:
        """Queue lmdb and object chunks for promotion into the arena, without waiting; returns
        how many were queued. A later lookup finds them in the arena."""
        if self.lmdb is None:
            return 0
        queued = 0
        in_cpu = self.cpu.contains(keys)
        remote: list[ChunkKey] = []
        for key, cached in zip(keys, in_cpu, strict=True):
            if cached or key in self._promoting:
                continue
            if key not in self.lmdb:
                if self.object is not None and key in self.object:
                    remote.append(key)
                continue
            try:
                self._promotions.put_nowait((key, replica))
            except queue.Full:
                self._counters.add("promotions_dropped", 1)
                break
            self._promoting.add(key)
            queued += 1
        if remote:
            queued += self._fetch_objects(remote, replica)
        return queued

    def _promote_loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._promotions.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            key, replica = item
            try:
                self._promote(key, replica, lease=False)
            except Exception:  # never let the mover die silently
                self._counters.add("promotion_errors", 1)
                log.exception("promotion failed")
            finally:
                self._promoting.discard(key)

    def _promote(self, key: ChunkKey, replica: str, lease: bool = True) -> SlotRef | None:
        assert self.lmdb is not None
        if not self.lmdb.contains([key])[0]:
            return None
        (ref,) = self.cpu.reserve([key], replica)
        if ref is None:  # no room, or another caller is promoting it right now
            self._counters.add("promotion_failed", 1)
            return None
        if not self.lmdb.read_into(key, self.cpu.view(ref)):
            self.cpu.abort([ref])
            self._counters.add("promotion_failed", 1)
            return None
        self.cpu.commit([ref], clean=True, lease=lease)
        self._counters.add("promotions", 1)
        return ref

    def release(self, refs: Sequence[SlotRef]) -> None:
        self.cpu.release(refs)

    def chunk_events(self, cursor: int, limit: int = 4096) -> ChunkEvents:
        """Chunks that entered or left the arena and lmdb since ``cursor`` (-1: from now)."""
        return self.journal.since(cursor, limit)

    # -- write-back -----------------------------------------------------------------------

    def _writeback_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                while self._writeback_batch(everything=self._write_through):
                    pass
                if time.monotonic() >= self._next_draft_gc:
                    self._next_draft_gc = time.monotonic() + _DRAFT_GC_EVERY_S
                    self.gc_draft_revisions()
            except Exception:  # never let the mover die silently
                self._counters.add("writeback_errors", 1)
                log.exception("write-back batch failed")

    def _writeback_batch(self, everything: bool) -> int:
        assert self.lmdb is not None
        refs = self.cpu.take_dirty(self.config.manager.writeback_batch_chunks, everything)
        if not refs:
            return 0
        ok = False
        changed: set[ChunkKey] = set()
        try:
            by_owner: dict[str, list[SlotRef]] = {}
            for ref in refs:
                by_owner.setdefault(self.cpu.owner_of(ref), []).append(ref)
            for owner, group in by_owner.items():
                # the encoder's checksum of what it stores is compared with the commit's
                stored, differ = self.lmdb.put_many_checked(
                    [(r.key, self.cpu.view(r), self.cpu.commit_checksum(r)) for r in group], owner
                )
                changed.update(differ)
                if self.uploader is not None and self.config.object.admission is Admission.ALL:
                    self.uploader.offer(
                        [r.key for r, done in zip(group, stored, strict=True) if done], owner
                    )
            ok = True
        finally:
            self.cpu.writeback_done(refs, ok, changed)
        return len(refs)

    def flush(self, timeout: float = 30.0) -> bool:
        """Write every dirty arena chunk to lmdb; True when none is left."""
        if self.lmdb is None:
            return True
        deadline = time.monotonic() + timeout
        while self.cpu.writeback_pending():
            if not self._writeback_batch(everything=True):
                time.sleep(0.001)  # the rest is in flight on the write-back thread
            if time.monotonic() > deadline:
                return False
        return True

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
            raise ValueError(f"unknown tier {tier!r}; known: {sorted(self.tiers)}")
        if tier == TIER_CPU:
            self.flush()
        # the object store is shared by the fleet: only an explicit tier="object" touches it
        names = [tier] if tier is not None else [n for n in self.tiers if n != TIER_OBJECT]
        return {
            name: self.tiers[name].evict(pool=pool, namespace=namespace, replica=replica)
            for name in names
        }

    def flush_uploads(self, timeout: float = 30.0) -> bool:
        """Wait until every queued upload is done; True when none is left."""
        return self.uploader is None or self.uploader.wait_idle(timeout)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        self.cpu.set_quota(replica, pool, nbytes)

    def stats(self) -> ManagerStats:
        return ManagerStats(
            tiers={name: tier.stats() for name, tier in self.tiers.items()},
            counters=self._counters.snapshot(),
        )

    def close(self, flush_timeout: float = 30.0) -> None:
        """Write back what the arena holds, then close every tier."""
        try:
            if self.lmdb is not None and not self.flush(flush_timeout):
                log.error(
                    "closing with %d arena chunks not written back to lmdb",
                    self.cpu.writeback_pending(),
                )
        finally:
            self._stop.set()
            self._wake.set()
            with contextlib.suppress(queue.Full):
                self._promotions.put_nowait(_STOP)  # wake the promoter now
            for thread in self._threads:
                thread.join()
            if self.uploader is not None:
                self.uploader.close(flush_timeout)
            self._downloads.shutdown(wait=True, cancel_futures=True)
            if self.object is not None:
                self.object.close()
            if self.lmdb is not None:
                self.lmdb.close()
            self.cpu.close()
