"""Prometheus metrics: the whole set kvtierd exports, declared once in `METRICS`.

Most values are read from the TierManager and the sessions at scrape time. What only the data
plane sees (lookups and hits per pool and replica, bytes moved for engines, call latencies, the
draft revisions registered) is recorded by a `Telemetry` object, one per manager; draft
revisions and swaps are the manager's own.

Every metric is built against a registry passed in (no module-level Prometheus registry), so
tests and several daemons in one process never share state; the one module-level map,
`telemetry_of`'s, holds each manager's `Telemetry` weakly and dies with the manager. Label
values come from small fixed sets (tier, pool, replica, op, result, direction, reason, queue,
state, policy); a key or request id never becomes one. Replica ids are chosen by engines; past
`MAX_REPLICAS` distinct ones, the rest count as ``other``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import numpy as np
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.keys import NAMESPACE_BYTES, NamespaceSpec, Pool
from kvtier.manager import ManagerStats, TierManager
from kvtier.pools import PoolRegistry
from kvtier.protocol import SlotRef, TierCode

MAX_REPLICAS = 64
MAX_DRAFTS = 16
OTHER = "other"
TIER_BY_CODE = {int(code): code.tier for code in TierCode}
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    """Without the ``_total``/``_info`` suffix Prometheus adds to counters and info metrics."""
    kind: str
    """gauge, counter, histogram or info."""
    labels: tuple[str, ...]
    help: str

    @property
    def exposed(self) -> str:
        """The name as scraped (and as queried, before a histogram's _bucket/_sum/_count)."""
        return self.name + {"counter": "_total", "info": "_info"}.get(self.kind, "")


def _spec(kind: str, name: str, labels: str, help: str) -> MetricSpec:
    return MetricSpec(f"kvtier_{name}", kind, tuple(labels.split()), help)


METRICS: tuple[MetricSpec, ...] = (
    _spec("info", "build", "version", "The kvtier version serving."),
    # capacity and use
    _spec("gauge", "tier_capacity_bytes", "tier", "Byte budget of each tier (0: unbounded)."),
    _spec("gauge", "tier_used_bytes", "tier pool", "Bytes held, per tier and pool."),
    _spec("gauge", "tier_chunks", "tier pool", "Chunks held, per tier and pool."),
    _spec("gauge", "pool_capacity_bytes", "tier pool", "Share of the arena each pool may fill."),
    _spec(
        "gauge",
        "tier_high_water_ratio",
        "tier",
        "Share of the budget past which the tier evicts (lmdb).",
    ),
    _spec("info", "eviction_policy", "tier policy", "The eviction policy of each tier."),
    _spec("gauge", "replica_used_bytes", "tier replica pool", "Bytes held per replica and pool."),
    _spec("gauge", "replica_chunks", "tier replica pool", "Chunks held per replica and pool."),
    _spec(
        "gauge",
        "replica_quota_bytes",
        "tier replica pool",
        "Arena quota per replica and pool; a replica over it is evicted first.",
    ),
    # lookups and hits
    _spec("counter", "lookup_chunks", "pool replica", "Chunks asked for in data-plane lookups."),
    _spec(
        "counter",
        "hit_chunks",
        "tier pool replica",
        "Chunks lookups found, by the fastest tier holding each; summed over tier, all hits.",
    ),
    # calls and transfers
    _spec("counter", "requests", "op result", "Data-plane calls, by outcome (ok, error)."),
    _spec("histogram", "request_duration_seconds", "op", "Time to serve one data-plane call."),
    _spec(
        "counter",
        "transfer_bytes",
        "direction",
        "Bytes moved: store (engine to arena), load (arena to engine), upload, download.",
    ),
    _spec(
        "counter",
        "transfer_chunks",
        "direction",
        "Chunks moved: store, load, demote (arena to lmdb), promote (into the arena), upload, "
        "download.",
    ),
    _spec(
        "counter",
        "transfer_failures",
        "direction",
        "Chunks that failed to move: demote, promote, upload.",
    ),
    _spec(
        "histogram",
        "transfer_duration_seconds",
        "direction",
        "Time the daemon took to make chunks loadable (load) or to publish them (store), per call.",
    ),
    # evictions and integrity
    _spec("counter", "evictions", "tier reason", "Chunks evicted, by reason."),
    _spec(
        "counter",
        "integrity_failures",
        "tier",
        "Chunks that failed verification; each was deleted and answered as a miss.",
    ),
    _spec("counter", "store_rejected_chunks", "tier", "Stores refused for want of room."),
    _spec(
        "counter",
        "tier_events",
        "tier event",
        "Every raw event counter of each tier, by its code name; for debugging.",
    ),
    # queues
    _spec("gauge", "queue_depth_chunks", "queue", "Chunks waiting: writeback, promote, upload."),
    _spec("gauge", "queue_capacity_chunks", "queue", "Bound of each queue."),
    _spec(
        "counter",
        "queue_dropped_chunks",
        "queue",
        "Work dropped because a queue was full (the chunks stay where they were).",
    ),
    # sessions
    _spec("gauge", "sessions", "", "Open data-plane sessions."),
    _spec("gauge", "leases", "", "Read leases held by sessions."),
    _spec("gauge", "reservations", "", "Slots reserved by sessions, not yet committed."),
    # object store and identity
    _spec("info", "object_store", "url principal", "The object store and the identity in use."),
    _spec(
        "gauge",
        "object_store_healthy",
        "",
        "1 once the identity is resolved and the store's last request succeeded; 0 (lookups "
        "miss it) from a failed request until a trial succeeds.",
    ),
    _spec(
        "gauge",
        "object_store_breaker_state",
        "state",
        "1 for the circuit breaker's current state (closed, open, half_open), else 0.",
    ),
    _spec("counter", "object_store_uploads", "", "Objects uploaded."),
    _spec("counter", "object_store_probes", "", "Probes for objects other nodes uploaded."),
    _spec(
        "counter",
        "object_store_probe_timeouts",
        "",
        "Probes still running when a lookup's budget ran out.",
    ),
    _spec(
        "counter",
        "object_store_request_errors",
        "result",
        "Failed requests: error (failed attempt), credential (identity refused), rejected "
        "(not sent, breaker open), invalid (refused for the request's own name or size; not "
        "held against the store).",
    ),
    _spec(
        "counter",
        "object_store_unknown_format",
        "",
        "Objects in a chunk format this build does not read (a newer node's): misses, left "
        "in the store.",
    ),
    _spec("counter", "object_store_retries", "", "Requests retried after a failure."),
    _spec("counter", "object_store_upload_seconds", "", "Time spent in successful uploads."),
    # draft models
    _spec(
        "info",
        "draft_revision",
        "model draft_model draft_revision",
        "The current draft revision of each target and draft model.",
    ),
    _spec(
        "counter",
        "draft_swaps",
        "",
        "Draft revision changes: admin draft-swap commits, and engines registering a new "
        "revision of a known draft pool.",
    ),
    _spec(
        "gauge",
        "draft_revision_chunks",
        "tier draft_model draft_revision",
        "Chunks held per draft revision; old revisions are evicted first and deleted after "
        "manager.draft_grace_s.",
    ),
)
SPECS = {spec.name: spec for spec in METRICS}


def _family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family for a declared metric; undeclared names are a bug."""
    spec = SPECS[f"kvtier_{name}"]
    labels = list(spec.labels)
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=labels)
    raise ValueError(f"{spec.name} is a {spec.kind}")


def _info(name: str) -> InfoMetricFamily:
    spec = SPECS[f"kvtier_{name}"]
    if spec.kind != "info":
        raise ValueError(f"{spec.name} is a {spec.kind}")
    return InfoMetricFamily(spec.name, spec.help)  # every label goes into the value dict


def _histogram(name: str) -> Histogram:
    spec = SPECS[f"kvtier_{name}"]
    return Histogram(
        spec.name, spec.help, list(spec.labels), registry=None, buckets=LATENCY_BUCKETS
    )


class Telemetry:
    """What the data plane records for metrics; thread-safe and cheap per call."""

    def __init__(self, registry: PoolRegistry) -> None:
        self._pools = registry
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, ...]] = Counter()
        self._replicas: set[str] = set()
        self._drafts: dict[tuple[str, str], str] = {}
        self.request_seconds = _histogram("request_duration_seconds")
        self.transfer_seconds = _histogram("transfer_duration_seconds")

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

    def looked_up(self, replica: str, packed: bytes, key_bytes: int, tier_codes: bytes) -> None:
        """Count one lookup's chunks and hits per pool; ``packed`` holds the keys asked for,
        ``tier_codes`` the tier of each hit of the prefix found."""
        if not packed:
            return
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
                self._counts["lookup", pool, replica] += asked
                for code, tier in TIER_BY_CODE.items():
                    self._counts["hit", tier, pool, replica] += hits.count(code)

    def moved(self, direction: str, refs: Sequence[SlotRef], done: int, seconds: float) -> None:
        """Chunks an engine stored (``done`` of ``refs`` committed) or leased (``refs``)."""
        if not refs or not done:
            return
        nbytes = 0
        for ref in refs:
            reg = self._pools.get(ref.key[:NAMESPACE_BYTES])
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


def _kvtier_version() -> str:
    try:
        return version("kvtier")
    except PackageNotFoundError:
        return "unknown"


class TierCollector(Collector):
    def __init__(self, manager: TierManager, session_counts: Callable[[], tuple[int, int, int]]):
        self.manager = manager
        self.session_counts = session_counts
        self.telemetry = telemetry_of(manager)
        self.version = _kvtier_version()

    def collect(self) -> Iterator[Metric]:
        build = _info("build")
        build.add_metric([], {"version": self.version})
        yield build
        stats = self.manager.stats()
        yield from self._tiers(stats)
        yield from self._lookups()
        yield from self._transfers(stats)
        yield from self._queues(stats)
        yield from self._sessions()
        yield from self._object_store(stats)
        yield from self._drafts(stats)

    def _tiers(self, stats: ManagerStats) -> Iterator[Metric]:
        config = self.manager.config
        families = {
            name: _family(name)
            for name in (
                "tier_capacity_bytes",
                "tier_used_bytes",
                "tier_chunks",
                "pool_capacity_bytes",
                "tier_high_water_ratio",
                "replica_used_bytes",
                "replica_chunks",
                "replica_quota_bytes",
                "evictions",
                "integrity_failures",
                "store_rejected_chunks",
                "tier_events",
            )
        }
        policy = _info("eviction_policy")
        policy.add_metric([], {"tier": "cpu", "policy": config.arena.eviction_policy})
        if self.manager.lmdb is not None:
            policy.add_metric([], {"tier": "lmdb", "policy": config.lmdb.eviction_policy})
            families["tier_high_water_ratio"].add_metric(["lmdb"], config.lmdb.high_water)
        for name, tier in stats.tiers.items():
            families["tier_capacity_bytes"].add_metric([name], tier.capacity_bytes)
            for pool, usage in tier.pools.items():
                families["tier_used_bytes"].add_metric([name, pool], usage.used_bytes)
                families["tier_chunks"].add_metric([name, pool], usage.chunks)
                if name == "cpu":
                    families["pool_capacity_bytes"].add_metric([name, pool], usage.capacity_bytes)
            for (replica, pool), usage in tier.replicas.items():
                labels = [name, replica, pool]
                families["replica_used_bytes"].add_metric(labels, usage.used_bytes)
                families["replica_chunks"].add_metric(labels, usage.chunks)
                if name == "cpu":
                    families["replica_quota_bytes"].add_metric(labels, usage.capacity_bytes)
            counters = tier.counters
            # capacity is the reason every tier has; show it even before the first eviction
            evicted = [e for e in counters if e.startswith("evictions_")]
            reasons = {"capacity"} | {e.removeprefix("evictions_") for e in evicted}
            for reason in sorted(reasons):
                families["evictions"].add_metric([name, reason], counters[f"evictions_{reason}"])
            families["integrity_failures"].add_metric([name], counters["corrupt"])
            families["store_rejected_chunks"].add_metric([name], counters["store_rejected"])
            for event, value in sorted(counters.items()):
                families["tier_events"].add_metric([name, event], max(0, value))
        yield policy
        yield from families.values()

    def _lookups(self) -> Iterator[Metric]:
        lookups = _family("lookup_chunks")
        hits = _family("hit_chunks")
        for key, value in sorted(self.telemetry.counts().items()):
            if key[0] == "lookup":
                lookups.add_metric(list(key[1:]), value)
            elif key[0] == "hit" and key[1] in self.manager.tiers:
                hits.add_metric(list(key[1:]), value)
        yield lookups
        yield hits

    def _transfers(self, stats: ManagerStats) -> Iterator[Metric]:
        counts = self.telemetry.counts()
        manager = stats.counters
        obj = stats.tiers["object"].counters if "object" in stats.tiers else Counter()
        cpu = stats.tiers["cpu"].counters
        nbytes = _family("transfer_bytes")
        chunks = _family("transfer_chunks")
        failures = _family("transfer_failures")
        requests = _family("requests")
        for key, value in sorted(counts.items()):
            if key[0] == "requests":
                requests.add_metric(list(key[1:]), value)
        for direction in ("store", "load"):
            nbytes.add_metric([direction], counts["bytes", direction])
            chunks.add_metric([direction], counts["chunks", direction])
        if self.manager.lmdb is not None:
            chunks.add_metric(["demote"], cpu["writeback_ok"])
            chunks.add_metric(["promote"], manager["promotions"] + manager["promotions_object"])
            failures.add_metric(["demote"], cpu["writeback_failed"] + manager["writeback_errors"])
            failures.add_metric(
                ["promote"], manager["promotion_failed"] + manager["promotion_errors"]
            )
        if self.manager.object is not None:
            nbytes.add_metric(["upload"], obj["upload_bytes"])
            nbytes.add_metric(["download"], obj["download_bytes"])
            chunks.add_metric(["upload"], obj["stores"])
            chunks.add_metric(["download"], obj["hits"])
            failures.add_metric(["upload"], obj["uploads_failed"])
        yield from (requests, nbytes, chunks, failures)
        for histogram in (self.telemetry.request_seconds, self.telemetry.transfer_seconds):
            for metric in histogram.collect():
                # the _created series would be one more name to document and nobody queries it
                metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
                yield metric

    def _queues(self, stats: ManagerStats) -> Iterator[Metric]:
        manager = self.manager
        config = manager.config
        depth = _family("queue_depth_chunks")
        capacity = _family("queue_capacity_chunks")
        dropped = _family("queue_dropped_chunks")
        if manager.lmdb is not None:
            depth.add_metric(["writeback"], manager.cpu.writeback_pending())
            capacity.add_metric(["writeback"], config.manager.writeback_queue_chunks)
            # the promotion queue has no public accessor; its length is what operators need
            depth.add_metric(["promote"], manager._promotions.qsize())
            capacity.add_metric(["promote"], config.manager.promote_queue_chunks)
            dropped.add_metric(["promote"], stats.counters["promotions_dropped"])
        if manager.uploader is not None and manager.object is not None:
            depth.add_metric(["upload"], manager.uploader.pending())
            capacity.add_metric(["upload"], config.object.upload_queue_chunks)
            dropped.add_metric(["upload"], manager.object.counters.snapshot()["uploads_dropped"])
        yield from (depth, capacity, dropped)

    def _sessions(self) -> Iterator[Metric]:
        values = self.session_counts()
        for name, value in zip(("sessions", "leases", "reservations"), values, strict=True):
            family = _family(name)
            family.add_metric([], value)
            yield family

    def _object_store(self, stats: ManagerStats) -> Iterator[Metric]:
        store = self.manager.object
        if store is None:
            return
        info = _info("object_store")
        info.add_metric([], {"url": store.backend.url, "principal": store.principal})
        yield info
        healthy = _family("object_store_healthy")
        healthy.add_metric([], int(store.healthy))
        yield healthy
        state = store.breaker.state
        breaker = _family("object_store_breaker_state")
        for name in ("closed", "open", "half_open"):
            breaker.add_metric([name], int(state == name))
        yield breaker
        counts = store.counters.snapshot()
        plain = {
            "object_store_uploads": counts["objects_uploaded"],
            "object_store_probes": counts["probes"],
            "object_store_probe_timeouts": stats.counters["probes_over_budget"],
            "object_store_retries": counts["retries"],
            "object_store_unknown_format": counts["unknown_format"],
            "object_store_upload_seconds": counts["upload_seconds_us"] / 1e6,
        }
        for name, value in plain.items():
            family = _family(name)
            family.add_metric([], value)
            yield family
        errors = _family("object_store_request_errors")
        for result, counter in (
            ("error", "request_errors"),
            ("credential", "credential_errors"),
            ("rejected", "breaker_rejected"),
            ("invalid", "requests_rejected"),
        ):
            errors.add_metric([result], counts[counter])
        yield errors

    def _drafts(self, stats: ManagerStats) -> Iterator[Metric]:
        info = _info("draft_revision")
        chunks = _family("draft_revision_chunks")
        current = set()
        held: Counter[tuple[str, str, str]] = Counter()
        for rev in self.manager.draft_revisions():
            if rev.current:
                current.add((rev.model, rev.draft_model, rev.revision))
            for tier, n in rev.chunks.items():
                held[tier, rev.draft_model, rev.revision] += n
        for model, draft_model, revision in sorted(current):
            info.add_metric(
                [], {"model": model, "draft_model": draft_model, "draft_revision": revision}
            )
        for labels, n in sorted(held.items()):
            chunks.add_metric(list(labels), n)
        yield info
        yield chunks
        swaps = _family("draft_swaps")
        swaps.add_metric([], stats.counters["draft_swaps"])
        yield swaps


def build_registry(
    manager: TierManager, session_counts: Callable[[], tuple[int, int, int]]
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCollector(manager, session_counts))
    return registry
