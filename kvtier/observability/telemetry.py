"""What only the data plane sees, recorded for metrics: lookups and hits per pool and replica,
bytes moved for engines, call latencies and the draft revisions registered.

One `Telemetry` per manager (`telemetry_of`), held weakly so it dies with the manager. Replica
ids are chosen by engines; past `MAX_REPLICAS` distinct ones, the rest count as ``other``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvtier.core.costs import OBJECT
from kvtier.core.keys import NAMESPACE_BYTES, NamespaceSpec, Pool, namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import LookupResult, SlotRef, hits_by_tier
from kvtier.observability.metric_specs import histogram
from kvtier.tiering.manager import TierManager

MAX_REPLICAS = 64
MAX_DRAFTS = 16
OTHER = "other"


class Telemetry:
    """What the data plane records for metrics; thread-safe and cheap per call."""

    def __init__(self, registry: PoolRegistry) -> None:
        self._pools = registry
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, ...]] = Counter()
        self._replicas: set[str] = set()
        self._drafts: dict[tuple[str, str], str] = {}
        self.request_seconds = histogram("request_duration_seconds")
        self.transfer_seconds = histogram("transfer_duration_seconds")

    def counts(self) -> Counter[tuple[str, ...]]:
        with self._lock:
            return Counter(self._counts)

    def drafts(self) -> dict[tuple[str, str], str]:
        with self._lock:
            return dict(self._drafts)

    def _replica(self, replica: str) -> str:
        """Bounds the replica label's values, whatever engines call themselves."""
        if replica in self._replicas:
            return replica
        with self._lock:
            if len(self._replicas) >= MAX_REPLICAS:
                return OTHER
            self._replicas.add(replica)
        return replica

    def _pool(self, namespace: bytes) -> str:
        reg = self._pools.get(namespace)
        return reg.pool if reg is not None else "unknown"

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        started = time.perf_counter()
        result = "error"
        try:
            yield
            result = "ok"
        finally:
            self.request_seconds.labels(op).observe(time.perf_counter() - started)
            with self._lock:
                self._counts["requests", op, result] += 1

    def looked_up(
        self,
        replica: str,
        packed: bytes,
        key_bytes: int,
        result: LookupResult,
        verify: bool = False,
        again: bool = False,
    ) -> None:
        """Count one lookup's chunks and hits per pool; ``packed`` holds the keys asked for,
        ``result`` the tier of each hit of the prefix found. ``verify``: the request is
        sampled for verification, and what it found is counted as verified, not as hits.
        ``again``: a request asking again while it waits counts only the hits a probe brought
        from the object store since (`LookupResult.from_store`)."""
        if not packed:
            return
        tier_codes, from_store = result.tier_codes, result.from_store
        replica = self._replica(replica)
        keys = np.frombuffer(packed, np.uint8).reshape(-1, key_bytes)[:, :NAMESPACE_BYTES]
        if (keys == keys[0]).all():  # the usual case: one pool per call
            groups = [(bytes(keys[0]), len(keys), tier_codes)]
        else:
            names, inverse = np.unique(keys, axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            codes = np.frombuffer(tier_codes, np.uint8)
            groups = [
                (
                    bytes(name),
                    int(np.count_nonzero(inverse == i)),
                    codes[inverse[: len(codes)] == i].tobytes(),
                )
                for i, name in enumerate(names)
            ]
        with self._lock:
            for namespace, asked, hits in groups:
                pool = self._pool(namespace)
                fetched = min(from_store, len(hits))
                from_store -= fetched
                if again:
                    self._counts["hit", OBJECT, pool, replica] += fetched
                    continue
                self._counts["lookup", pool, replica] += asked
                if verify:
                    self._counts["verified", pool, replica] += len(hits)
                    continue
                for tier, n in hits_by_tier(hits, fetched).items():
                    self._counts["hit", tier, pool, replica] += n

    def moved(self, direction: str, refs: Sequence[SlotRef], done: int, seconds: float) -> None:
        """Chunks an engine stored (``done`` of ``refs`` committed) or leased (``refs``)."""
        if not refs or not done:
            return
        nbytes = 0
        for ref in refs:
            reg = self._pools.get(namespace_of(ref.key))
            nbytes += reg.chunk_bytes if reg is not None else 0
        if done != len(refs):  # some refs were stale: count their average size
            nbytes = nbytes * done // len(refs)
        self.transfer_seconds.labels(direction).observe(seconds)
        with self._lock:
            self._counts["bytes", direction] += nbytes
            self._counts["chunks", direction] += done

    def registered(self, spec: NamespaceSpec) -> None:
        if spec.pool is not Pool.DRAFT or spec.draft_model is None:
            return
        name = (spec.model, spec.draft_model)
        revision = spec.draft_revision or ""
        with self._lock:
            known = self._drafts.get(name)
            if known == revision:
                return
            if known is not None:
                self._counts["draft_swaps",] += 1
            elif len(self._drafts) >= MAX_DRAFTS:
                self._drafts.pop(next(iter(self._drafts)))
            self._drafts.pop(name, None)
            self._drafts[name] = revision


_telemetry: weakref.WeakKeyDictionary[TierManager, Telemetry] = weakref.WeakKeyDictionary()
_telemetry_lock = threading.Lock()


def telemetry_of(manager: TierManager) -> Telemetry:
    """The one `Telemetry` of a manager, shared by its data plane and its collector."""
    with _telemetry_lock:
        found = _telemetry.get(manager)
        if found is None:
            found = _telemetry[manager] = Telemetry(manager.registry)
        return found
