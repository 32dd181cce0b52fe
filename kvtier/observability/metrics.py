"""Prometheus metrics of kvtierd: the collector that reads the TierManager, the sessions and the
data plane's `Telemetry` at scrape time, and the registry that serves them.

Every metric is built against a registry passed in (no module-level Prometheus registry), so
tests and several daemons in one process never share state. The metrics themselves are
declared in `kvtier.observability.metric_specs`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvtier import __version__
from kvtier.core.keys import Pool
from kvtier.core.protocol import TierCode
from kvtier.observability.metric_specs import info_family, metric_family
from kvtier.observability.telemetry import telemetry_of
from kvtier.tiering.manager import ManagerStats, TierManager

CPU, LMDB, OBJECT = (code.tier for code in TierCode)


class TierCollector(Collector):
    def __init__(self, manager: TierManager, session_counts: Callable[[], tuple[int, int, int]]):
        self.manager = manager
        self.session_counts = session_counts
        self.telemetry = telemetry_of(manager)

    def collect(self) -> Iterator[Metric]:
        build = info_family("build")
        build.add_metric([], {"version": __version__})
        yield build
        stats = self.manager.stats()
        yield from self._tiers(stats)
        yield from self._space(stats)
        yield from self._lookups()
        yield from self._transfers(stats)
        yield from self._queues(stats)
        yield from self._sessions()
        yield from self._integrity()
        yield from self._object_store(stats)
        yield from self._drafts(stats)
        yield from self._costs()

    def _tiers(self, stats: ManagerStats) -> Iterator[Metric]:
        config = self.manager.config
        families = {
            name: metric_family(name)
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
        policy = info_family("eviction_policy")
        policy.add_metric([], {"tier": CPU, "policy": config.arena.eviction_policy})
        if self.manager.lmdb is not None:
            policy.add_metric([], {"tier": LMDB, "policy": config.lmdb.eviction_policy})
            families["tier_high_water_ratio"].add_metric([LMDB], config.lmdb.high_water)
        for name, tier in stats.tiers.items():
            families["tier_capacity_bytes"].add_metric([name], tier.capacity_bytes)
            for pool, usage in tier.pools.items():
                families["tier_used_bytes"].add_metric([name, pool], usage.used_bytes)
                families["tier_chunks"].add_metric([name, pool], usage.chunks)
                if name == CPU:
                    families["pool_capacity_bytes"].add_metric([name, pool], usage.capacity_bytes)
            for (replica, pool), usage in tier.replicas.items():
                labels = [name, replica, pool]
                families["replica_used_bytes"].add_metric(labels, usage.used_bytes)
                families["replica_chunks"].add_metric(labels, usage.chunks)
                if name == CPU:
                    families["replica_quota_bytes"].add_metric(labels, usage.capacity_bytes)
            counters = tier.counters
            # capacity is the reason every tier has; show it even before the first eviction
            evicted = [e for e in counters if e.startswith("evictions_")]
            reasons = {"capacity"} | {e.removeprefix("evictions_") for e in evicted}
            for reason in sorted(reasons):
                families["evictions"].add_metric([name, reason], counters[f"evictions_{reason}"])
            by_pool = {pool: counters[f"corrupt:{pool}"] for pool in Pool}
            for pool, value in by_pool.items():  # every pool from the start, so increase() sees 0
                families["integrity_failures"].add_metric([name, pool], value)
            if unknown := counters["corrupt"] - sum(by_pool.values()):  # no pool known (objects)
                families["integrity_failures"].add_metric([name, ""], unknown)
            families["store_rejected_chunks"].add_metric([name], counters["store_rejected"])
            for event, value in sorted(counters.items()):
                families["tier_events"].add_metric([name, event], max(0, value))
        yield policy
        yield from families.values()
        live = self.manager.cpu.live_counts()
        for name, key in (
            ("arena_slot_classes", "slot_classes"),
            ("arena_free_extents", "free_extents"),
            ("namespaces", "namespaces"),
        ):
            family = metric_family(name)
            family.add_metric([], live[key])
            yield family

    def _space(self, stats: ManagerStats) -> Iterator[Metric]:
        """Writes lmdb and the event log refused for want of space; dead readers cleared."""
        if LMDB not in stats.tiers:
            return
        counters = stats.tiers[LMDB].counters
        full = metric_family("disk_full_errors")
        full.add_metric(["lmdb"], counters["disk_full"])
        if OBJECT in stats.tiers:
            full.add_metric(["events"], stats.tiers[OBJECT].counters["event_log_disk_full"])
        stale = metric_family("lmdb_stale_readers")
        stale.add_metric([], counters["stale_readers"])
        yield full
        yield stale

    def _lookups(self) -> Iterator[Metric]:
        lookups = metric_family("lookup_chunks")
        hits = metric_family("hit_chunks")
        verified = metric_family("verified_chunks")
        for key, value in sorted(self.telemetry.counts().items()):
            if key[0] == "lookup":
                lookups.add_metric(list(key[1:]), value)
            elif key[0] == "verified":
                verified.add_metric(list(key[1:]), value)
            elif key[0] == "hit" and key[1] in self.manager.tiers:
                hits.add_metric(list(key[1:]), value)
        yield lookups
        yield hits
        yield verified

    def _transfers(self, stats: ManagerStats) -> Iterator[Metric]:
        counts = self.telemetry.counts()
        manager = stats.counters
        obj = stats.tiers[OBJECT].counters if OBJECT in stats.tiers else Counter()
        cpu = stats.tiers[CPU].counters
        nbytes = metric_family("transfer_bytes")
        chunks = metric_family("transfer_chunks")
        failures = metric_family("transfer_failures")
        requests = metric_family("requests")
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
            skipped = metric_family("writeback_skipped_chunks")
            skipped.add_metric([], cpu["writeback_skipped"])
            yield skipped
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
        depth = metric_family("queue_depth_chunks")
        capacity = metric_family("queue_capacity_chunks")
        dropped = metric_family("queue_dropped_chunks")
        if manager.lmdb is not None and manager.promoter is not None:
            depth.add_metric(["writeback"], manager.cpu.writeback_pending())
            capacity.add_metric(["writeback"], config.manager.writeback_queue_chunks)
            depth.add_metric(["promote"], manager.promoter.pending())
            capacity.add_metric(["promote"], config.manager.promote_queue_chunks)
            dropped.add_metric(["promote"], stats.counters["promotions_dropped"])
            held = metric_family("promotion_held_chunks")
            held.add_metric([], manager.promoter.held())
            holds = metric_family("promotion_holds")
            for outcome in ("deferred", "expired"):
                holds.add_metric([outcome], stats.counters[f"promotion_holds_{outcome}"])
            yield from (held, holds)
        if manager.uploader is not None and manager.object is not None:
            depth.add_metric(["upload"], manager.uploader.pending())
            capacity.add_metric(["upload"], config.object.upload_queue_chunks)
            dropped.add_metric(["upload"], manager.object.counters.snapshot()["uploads_dropped"])
        yield from (depth, capacity, dropped)

    def _integrity(self) -> Iterator[Metric]:
        integrity = self.manager.integrity
        reports = metric_family("integrity_reports")
        for (tier, result), value in integrity.report_counts().items():
            reports.add_metric([tier, result], value)
        yield reports
        unhealthy = integrity.unhealthy()
        healthy = metric_family("tier_healthy")
        for tier in self.manager.tiers:
            healthy.add_metric([tier], int(tier not in unhealthy))
        yield healthy

    def _sessions(self) -> Iterator[Metric]:
        values = self.session_counts()
        for name, value in zip(("sessions", "leases", "reservations"), values, strict=True):
            family = metric_family(name)
            family.add_metric([], value)
            yield family

    def _object_store(self, stats: ManagerStats) -> Iterator[Metric]:
        store = self.manager.object
        if store is None:
            return
        info = info_family("object_store")
        info.add_metric([], {"url": store.backend.url, "principal": store.principal})
        yield info
        healthy = metric_family("object_store_healthy")
        healthy.add_metric([], int(store.healthy))
        yield healthy
        learned = metric_family("object_store_learned_bytes")
        theirs = stats.tiers[OBJECT].learned if OBJECT in stats.tiers else {}
        for pool in Pool:  # every pool from the start, like the tiers' own usage
            learned.add_metric([pool], theirs[pool].used_bytes if pool in theirs else 0)
        yield learned
        state = store.breaker.state
        breaker = metric_family("object_store_breaker_state")
        for name in ("closed", "open", "half_open"):
            breaker.add_metric([name], int(state == name))
        yield breaker
        counts = store.counters.snapshot()
        plain = {
            "object_store_uploads": counts["objects_uploaded"],
            "object_store_probes": counts["probes"],
            "object_store_probe_timeouts": stats.counters["probes_over_budget"],
            "object_store_probe_misses": stats.counters["probe_misses"],
            "object_store_probe_miss_seconds": stats.counters["probe_miss_us"] / 1e6,
            "object_store_retries": counts["retries"],
            "object_store_unknown_format": counts["unknown_format"],
            "object_store_upload_seconds": counts["upload_seconds_us"] / 1e6,
            "object_store_upload_races_lost": counts["upload_races_lost"],
            "object_store_owned_bytes": store.budget.used(),
        }
        for name, value in plain.items():
            family = metric_family(name)
            family.add_metric([], value)
            yield family
        errors = metric_family("object_store_request_errors")
        for result, counter in (
            ("error", "request_errors"),
            ("credential", "credential_errors"),
            ("rejected", "breaker_rejected"),
            ("invalid", "requests_rejected"),
        ):
            errors.add_metric([result], counts[counter])
        yield errors

    def _drafts(self, stats: ManagerStats) -> Iterator[Metric]:
        info = info_family("draft_revision")
        chunks = metric_family("draft_revision_chunks")
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
        swaps = metric_family("draft_swaps")
        swaps.add_metric([], stats.counters["draft_swaps"])
        yield swaps

    def _costs(self) -> Iterator[Metric]:
        costs = self.manager.costs.snapshot()
        per_chunk = metric_family("load_per_chunk_seconds")
        per_byte = metric_family("load_per_byte_seconds")
        for tier, c in costs.tiers.items():
            if c.samples:  # an estimate of nothing would read as free
                per_chunk.add_metric([tier, "mean"], c.seconds_per_chunk)
                per_chunk.add_metric([tier, "spread"], c.seconds_per_chunk_spread)
                per_byte.add_metric([tier, "mean"], c.seconds_per_byte)
                per_byte.add_metric([tier, "spread"], c.seconds_per_byte_spread)
        prefill = metric_family("prefill_per_token_seconds")
        if costs.prefill_samples:
            prefill.add_metric(["mean"], costs.prefill_seconds_per_token)
            prefill.add_metric(["spread"], costs.prefill_spread)
        fit = metric_family("prefill_fit_seconds")
        if costs.prefill_fit is not None:
            fit.add_metric(["step"], costs.prefill_fit.per_step)
            fit.add_metric(["token"], costs.prefill_fit.per_token)
        load_fit = metric_family("load_fit_seconds")
        for tier, c in costs.tiers.items():
            if c.load_fit is not None:
                load_fit.add_metric([tier, "load"], c.load_fit.per_load)
                load_fit.add_metric([tier, "chunk"], c.load_fit.per_chunk)
        yield per_chunk
        yield per_byte
        yield prefill
        yield fit
        yield load_fit
        totals = self.manager.costs.totals()
        chunks, seconds = metric_family("loaded_chunks"), metric_family("load_seconds")
        for tier, tally in totals.loads.items():
            chunks.add_metric([tier], tally.chunks)
            seconds.add_metric([tier], tally.seconds)
        tokens, prefill_s = metric_family("prefill_tokens"), metric_family("prefill_seconds")
        tokens.add_metric([], totals.prefill_tokens)
        prefill_s.add_metric([], totals.prefill_seconds)
        yield from (chunks, seconds, tokens, prefill_s)


def build_registry(
    manager: TierManager, session_counts: Callable[[], tuple[int, int, int]]
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCollector(manager, session_counts))
    return registry
