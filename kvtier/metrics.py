"""Prometheus metrics, read from the TierManager and sessions at scrape time.

Everything is built against a registry passed in (no module-level globals), so tests and several
daemons in one process never share state. Label values come from small fixed sets: tier, pool,
replica and the names of the tiers' event counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.manager import TierManager


class TierCollector(Collector):
    def __init__(self, manager: TierManager, session_counts: Callable[[], tuple[int, int, int]]):
        self.manager = manager
        self.session_counts = session_counts

    def collect(self) -> Iterator[Metric]:
        stats = self.manager.stats()
        capacity = GaugeMetricFamily(
            "kvtier_tier_capacity_bytes", "Byte budget of each tier.", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "kvtier_tier_used_bytes", "Bytes held, per tier and pool.", labels=["tier", "pool"]
        )
        chunks = GaugeMetricFamily(
            "kvtier_tier_chunks", "Chunks held, per tier and pool.", labels=["tier", "pool"]
        )
        replica_used = GaugeMetricFamily(
            "kvtier_replica_used_bytes",
            "Bytes held per replica and pool.",
            labels=["tier", "replica", "pool"],
        )
        replica_quota = GaugeMetricFamily(
            "kvtier_replica_quota_bytes",
            "Quota per replica and pool; a replica over it is evicted first.",
            labels=["tier", "replica", "pool"],
        )
        events = CounterMetricFamily(
            "kvtier_tier_events",
            "Events per tier (stores, hits, evictions, ...).",
            labels=["tier", "event"],
        )
        for name, tier in stats.tiers.items():
            capacity.add_metric([name], tier.capacity_bytes)
            for pool, usage in tier.pools.items():
                used.add_metric([name, pool], usage.used_bytes)
                chunks.add_metric([name, pool], usage.chunks)
            for (replica, pool), usage in tier.replicas.items():
                replica_used.add_metric([name, replica, pool], usage.used_bytes)
                if name == "cpu":
                    replica_quota.add_metric([name, replica, pool], usage.capacity_bytes)
            for event, value in sorted(tier.counters.items()):
                events.add_metric([name, event], max(0, value))
        yield from (capacity, used, chunks, replica_used, replica_quota, events)

        lookups = CounterMetricFamily(
            "kvtier_lookup_chunks", "Chunks asked for in lookups.", labels=[]
        )
        lookups.add_metric([], stats.counters["lookup_chunks"])
        hits = CounterMetricFamily(
            "kvtier_hit_chunks",
            "Chunks found by lookups, by the tier that held them.",
            labels=["tier"],
        )
        for tier_name in stats.tiers:
            hits.add_metric([tier_name], stats.counters[f"hit_chunks_{tier_name}"])
        yield from (lookups, hits)

        store = self.manager.object
        if store is not None:
            info = InfoMetricFamily(
                "kvtier_object_store", "The object store and the identity kvtier runs as."
            )
            info.add_metric([], {"url": store.backend.url, "principal": store.principal})
            yield info
            yield GaugeMetricFamily(
                "kvtier_object_store_healthy",
                "1 while the object store answers and the identity works; 0: lookups miss it.",
                value=int(store.healthy),
            )

        sessions, leases, reservations = self.session_counts()
        yield GaugeMetricFamily("kvtier_sessions", "Open data-plane sessions.", value=sessions)
        yield GaugeMetricFamily("kvtier_leases", "Read leases held by sessions.", value=leases)
        yield GaugeMetricFamily(
            "kvtier_reservations",
            "Slots reserved by sessions, not yet committed.",
            value=reservations,
        )


def build_registry(
    manager: TierManager, session_counts: Callable[[], tuple[int, int, int]]
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCollector(manager, session_counts))
    return registry
