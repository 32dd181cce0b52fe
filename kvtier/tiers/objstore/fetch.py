"""Chunks from the object store into lmdb, and from there into the arena.

- a lookup probes the store for objects other nodes uploaded, past the chunks it found, no longer
  than ``object.lookup_budget_ms`` (not at all for one that must not wait: the probe runs on, and
  a later lookup finds what it brought); what a probe finds is kept in lmdb;
- a promotion downloads the objects holding the chunks asked for, keeps them in lmdb and promotes
  them into the arena;
- `ObjectFetcher.keep` is what both, and warmup's fetch, do with downloaded chunks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.core.costs import OBJECT, LoadCosts
from kvtier.core.counters import Counters
from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey
from kvtier.core.priority import enter_background
from kvtier.core.protocol import TierCode
from kvtier.tiers.objstore.tier import REMOTE_REPLICA, FetchedChunk, ObjectTier

log = logging.getLogger(__name__)

_PROBE_MISS_TTL_S = 10.0  # a chunk another node uploads after a miss is found this much later
_MAX_TRACKED = 1 << 17  # bound on per-key bookkeeping (probe misses)
_OBJECT = int(TierCode.OBJECT)

Put = Callable[[Sequence[tuple[ChunkKey, memoryview]], str], object]
"""Stores chunks in lmdb for a replica (`LmdbTier.put_many`)."""
Promote = Callable[[ChunkKey, str], object]
"""Promotes a chunk held in lmdb into the arena, for a replica, without a lease."""


class ObjectFetcher:
    def __init__(
        self,
        tier: ObjectTier,
        put: Put,
        promote: Promote,
        counters: Counters,
        costs: LoadCosts | None = None,
    ) -> None:
        self.tier = tier
        self.costs = costs or LoadCosts()
        """Each download, timed to the chunks' arrival in lmdb: the object tier's cost."""
        self._put = put
        self._promote = promote
        self._counters = counters
        self._downloads = ThreadPoolExecutor(
            tier.config.download_concurrency, "kvtier-download", initializer=enter_background
        )
        self._probes: dict[ChunkKey, Future[bool]] = {}
        self._probe_misses: dict[ChunkKey, float] = {}
        self._probed: set[ChunkKey] = set()
        """Chunks a probe brought into lmdb that no lookup has counted as a hit yet."""
        self._indexed_hits: dict[ChunkKey, float] = {}
        """Chunks a lookup found in the store's index and counted as its hits, each with the
        time until which a probe bringing it is not counted again (bounded as the misses)."""
        self._fetching: set[str] = set()
        self._lock = threading.Lock()

    def keep(self, chunks: Sequence[FetchedChunk], started: float | None = None) -> None:
        """Store downloaded chunks in lmdb, as no local replica's; with ``started`` (when the
        download began, `time.perf_counter`), time the whole as a load from the object tier."""
        self._put([(c.key, c.payload) for c in chunks], REMOTE_REPLICA)
        if started is not None:
            nbytes = sum(len(c.payload) for c in chunks)
            self.costs.loaded(OBJECT, len(chunks), nbytes, time.perf_counter() - started)

    # -- probe ----------------------------------------------------------------------------

    def probe_past(
        self,
        keys: Sequence[ChunkKey],
        found: Sized,
        extend: Callable[[], object],
        wait: bool = True,
    ) -> bool:
        """Probe the store for objects other nodes uploaded, starting at the first key found
        nowhere (``keys[len(found)]``), within the lookup budget; without ``wait``, a probe not
        answered yet is left running, not waited for. Found chunks land in lmdb; ``extend``
        then grows ``found`` over what the tiers now hold. Returns True when a probe is still
        running at the deadline."""
        if not self.tier.principal_resolved.is_set():
            return True  # the identity is still being resolved at start: ask again, not a miss
        cfg = self.tier.config
        deadline = time.monotonic() + cfg.lookup_budget_ms / 1000.0 if wait else None
        for _ in range(cfg.probe_chunks):
            if len(found) >= len(keys) or not self.tier.healthy:
                return False
            there = self._probe(keys[len(found)], deadline)
            if there is None:
                return True
            if not there:
                return False
            before = len(found)
            extend()
            if len(found) == before:
                return False
        return False

    def claim(self, keys: Sequence[ChunkKey], tier_codes: bytes = b"") -> int:
        """How many of ``keys`` a probe brought from the store since a lookup last found them:
        hits served by the object tier, though lmdb holds them by the time they are found.
        ``tier_codes``: where the lookup found each key; one found in the store's index is
        counted as the store's there, so a probe still running for another key, and bringing
        it in the same object, does not make it the store's hit twice."""
        if _OBJECT in tier_codes:
            self._counted_in_index(keys, tier_codes)
        if not self._probed:
            return 0
        with self._lock:
            before = len(self._probed)
            self._probed.difference_update(keys)
            return before - len(self._probed)

    def _counted_in_index(self, keys: Sequence[ChunkKey], tier_codes: bytes) -> None:
        until = time.monotonic() + _PROBE_MISS_TTL_S
        with self._lock:
            if len(self._indexed_hits) > _MAX_TRACKED:
                self._indexed_hits.clear()
            for key, code in zip(keys, tier_codes, strict=False):
                if code == _OBJECT:
                    self._indexed_hits[key] = until

    def _probe(self, key: ChunkKey, deadline: float | None) -> bool | None:
        """Whether an object starting at ``key`` exists (its chunks are then in lmdb); None
        when the answer did not come before ``deadline``. With no ``deadline`` a probe not
        answered yet is not waited for: None at once, the probe runs on, over no budget."""
        now = time.monotonic()
        with self._lock:
            if self._probe_misses.get(key, 0.0) > now:
                return False
            future = self._probes.get(key)
            if future is None:
                future = self._downloads.submit(self._probe_job, key, time.perf_counter())
                self._probes[key] = future
        if deadline is None:
            return future.result() if future.done() else None
        try:
            return future.result(timeout=max(0.0, deadline - now))
        except FutureTimeout:
            self._counters.add("probes_over_budget", 1)
            return None

    def _probe_job(self, key: ChunkKey, asked: float) -> bool:
        """``asked``: when a lookup asked for the probe (`time.perf_counter`); a miss is timed
        from then, queueing behind downloads included: what the lookup waits to hear it."""
        found = False
        try:
            started = time.perf_counter()
            chunks = self.tier.probe(key)
            if chunks:
                self.keep(chunks, started)
                found = True
                now = time.monotonic()
                with self._lock:
                    if len(self._probed) > _MAX_TRACKED:
                        self._probed.clear()
                    fresh = (c.key for c in chunks if self._indexed_hits.pop(c.key, 0.0) < now)
                    self._probed.update(fresh)
        except KVTierError as exc:
            log.debug("probe of %s failed: %s", key.hex(), exc)
        finally:
            with self._lock:
                self._probes.pop(key, None)
                if not found:
                    if len(self._probe_misses) > _MAX_TRACKED:
                        self._probe_misses.clear()
                    self._probe_misses[key] = time.monotonic() + _PROBE_MISS_TTL_S
                    self._counters.add("probe_misses", 1)
                    self._counters.add("probe_miss_us", int((time.perf_counter() - asked) * 1e6))
        return found

    # -- fetch ----------------------------------------------------------------------------

    def fetch(self, keys: Sequence[ChunkKey], replica: str) -> int:
        """Queue downloads of the objects holding ``keys`` into lmdb and the arena; returns
        how many keys were queued."""
        wanted: dict[str, list[ChunkKey]] = {}
        for key in keys:
            loc = self.tier.index.get(key)
            if loc is not None:
                wanted.setdefault(loc.obj, []).append(key)
        queued = 0
        for name, group in wanted.items():
            with self._lock:
                if name in self._fetching:
                    continue
                self._fetching.add(name)
            self._downloads.submit(self._fetch_job, name, group, replica)
            queued += len(group)
        return queued

    def _fetch_job(self, name: str, keys: list[ChunkKey], replica: str) -> None:
        try:
            started = time.perf_counter()
            chunks = self.tier.fetch(name)
            if chunks:
                self.keep(chunks, started)
                for key in keys:
                    self._promote(key, replica)
                self._counters.add("promotions_object", len(keys))
        except KVTierError as exc:
            self._counters.add("promotion_failed", len(keys))
            log.debug("download of %s failed: %s", name, exc)
        except Exception:  # never let a mover die silently
            self._counters.add("promotion_errors", 1)
            log.exception("download of %s failed", name)
        finally:
            with self._lock:
                self._fetching.discard(name)

    def close(self) -> None:
        """Cancel queued downloads and wait for those running."""
        self._downloads.shutdown(wait=True, cancel_futures=True)
