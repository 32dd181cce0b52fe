"""The whole set of metrics kvtierd exports, declared once in `METRICS`, and the empty
families and histograms built from those declarations.

Label values come from small fixed sets (tier, pool, replica, op, result, direction, reason,
queue, state, policy); a key or request id never becomes one.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

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
    _spec(
        "gauge",
        "tier_used_bytes",
        "tier pool",
        "Bytes held, per tier and pool; in the object store, those of the objects this node "
        "uploaded (its budget's).",
    ),
    _spec(
        "gauge",
        "tier_chunks",
        "tier pool",
        "Chunks held, per tier and pool; in the object store, this node's own.",
    ),
    _spec("gauge", "pool_capacity_bytes", "tier pool", "Share of the arena each pool may fill."),
    _spec("gauge", "arena_slot_classes", "", "Arena slot classes in use (arena.max_slot_classes)."),
    _spec("gauge", "arena_free_extents", "", "Arena extents no slot class holds."),
    _spec("gauge", "namespaces", "", "Namespaces in use (server.max_namespaces)."),
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
        "Chunks lookups found, by the fastest tier holding each (with the arena hits engines "
        "answered from its key index, as they report them); summed over tier, all hits. Counted "
        "as answered, before any load: a hit the engine then recomputes (its load failed, as "
        "vllm:kvtier_transfer_errors_total counts, or recomputing was cheaper) still counts.",
    ),
    _spec(
        "counter",
        "verified_chunks",
        "pool replica",
        "Chunks lookups found for requests sampled for verification: the engine computes them "
        "and compares, and serves none, so they are not in hit_chunks.",
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
        "counter",
        "writeback_skipped_chunks",
        "",
        "Chunks write-back left unwritten (lmdb unhealthy, or their namespace quarantined): "
        "kept in the arena only, as a cache; not counted as demoted.",
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
        "tier pool",
        "Chunks that failed verification, kvtierd's own checks and engines' reports it "
        "confirmed; each was deleted and answered as a miss. pool is empty where no registered "
        "pool names the chunk (an object of several chunks, a namespace not registered since "
        "kvtierd started).",
    ),
    _spec(
        "counter",
        "integrity_reports",
        "tier result",
        "Chunks engines reported failing their verification, by what kvtierd found checking "
        "them: confirmed (failed here too: dropped, and counted in integrity_failures), refused "
        "(sound: kept), gone (no longer held), foreign (of pools the engine has not registered), "
        "unchecked (the queue of reports to check was full).",
    ),
    _spec(
        "gauge",
        "tier_healthy",
        "tier",
        "0 while integrity_failures of the tier within manager.integrity_window_s reach "
        "manager.integrity_unhealthy_failures (kvtier health names it NOT_SERVING; lmdb and "
        "the object store are neither read nor written meanwhile); else 1.",
    ),
    _spec("counter", "store_rejected_chunks", "tier", "Stores refused for want of room."),
    _spec(
        "counter",
        "disk_full_errors",
        "store",
        "Writes refused for want of space (no space left on the disk, or a map still full once "
        "dead readers were cleared and room made), by store: lmdb, events (the event log). "
        "Each takes writes again by itself once space returns.",
    ),
    _spec(
        "counter",
        "lmdb_stale_readers",
        "",
        "Reader slots of dead processes cleared from lmdb's lock file: a reader killed inside "
        "a read keeps LMDB from reusing pages until its slot is cleared.",
    ),
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
    _spec(
        "gauge",
        "promotion_held_chunks",
        "",
        "Chunks promoted ahead of a load and held in the arena until its lease takes them "
        "(manager.promote_hold_s).",
    ),
    _spec(
        "counter",
        "promotion_holds",
        "outcome",
        "Promotions ahead of a load, by outcome: deferred (the held share was full: left in "
        "lmdb, the engine asks again) or expired (no lease took the chunk in time).",
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
    _spec(
        "gauge",
        "object_store_learned_bytes",
        "pool",
        "Bytes of chunks in the shared store that other nodes uploaded and this one learned of "
        '(probes, fetches, warmup): not its own, so not in tier_used_bytes{tier="object"}.',
    ),
    _spec("counter", "object_store_probes", "", "Probes for objects other nodes uploaded."),
    _spec(
        "counter",
        "object_store_probe_timeouts",
        "",
        "Probes still running when a lookup's budget ran out.",
    ),
    _spec(
        "counter",
        "object_store_probe_misses",
        "",
        "Probes that found nothing (the store holds no such object, or the request failed).",
    ),
    _spec(
        "counter",
        "object_store_probe_miss_seconds",
        "",
        "Time lookups waited to hear of those misses, from the ask (queueing behind downloads "
        "included): over object_store_probe_misses, what a miss costs a request.",
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
    _spec(
        "counter",
        "object_store_upload_races_lost",
        "",
        "Uploads that found their name taken by another node's object (written first): served "
        "from that object, the chunks it lacks uploaded under their own name; not failures.",
    ),
    _spec(
        "gauge",
        "object_store_owned_bytes",
        "",
        "Bytes of the objects this node uploaded and of its uploads in flight: what "
        "object.budget_bytes holds (objects learned from other nodes are not counted).",
    ),
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
    # measured costs (`kvtier locate`)
    _spec(
        "gauge",
        "load_per_chunk_seconds",
        "tier stat",
        "Seconds a chunk takes to load from each tier (stat mean or spread: decaying over the "
        "last loads). cpu and lmdb are timed by the engines; object from download start to lmdb.",
    ),
    _spec(
        "gauge",
        "load_per_byte_seconds",
        "tier stat",
        "Seconds per byte of a load from each tier (stat mean or spread).",
    ),
    _spec(
        "gauge",
        "prefill_per_token_seconds",
        "stat",
        "The engines' measured seconds per token of steps where prefill dominates (stat mean or "
        "spread): what recomputing a prefix costs.",
    ),
    _spec(
        "gauge",
        "prefill_fit_seconds",
        "part",
        "The engines' prefill steps fitted as a fixed part (part step: seconds every step pays) "
        "plus a part per token (part token: what one token more costs, what a hit saves); "
        "decaying least squares, shown once steps of different lengths were timed. The mean "
        "per token above counts short steps' fixed part as their tokens'.",
    ),
    _spec(
        "gauge",
        "load_fit_seconds",
        "tier part",
        "Each tier's loads fitted as a fixed part (part load: seconds every load pays, an "
        "object's first byte) plus a part per chunk (part chunk); decaying least squares, "
        "shown once loads of different lengths were timed. What the engines price a hit's "
        "load at against its recompute.",
    ),
    _spec(
        "counter",
        "loaded_chunks",
        "tier",
        "Chunks whose load was timed, by tier: with load_seconds, the mean cost over any window "
        "(the gauges above weigh the last loads most).",
    ),
    _spec("counter", "load_seconds", "tier", "Time those loads took."),
    _spec(
        "counter",
        "prefill_tokens",
        "",
        "Tokens of the engines' timed prefill steps: with prefill_seconds, the mean seconds per "
        "token over any window.",
    ),
    _spec("counter", "prefill_seconds", "", "Time those steps took."),
)
SPECS = {spec.name: spec for spec in METRICS}


def metric_family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family for a declared metric; undeclared names are a bug."""
    spec = SPECS[f"kvtier_{name}"]
    labels = list(spec.labels)
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=labels)
    raise ValueError(f"{spec.name} is a {spec.kind}")


def info_family(name: str) -> InfoMetricFamily:
    spec = SPECS[f"kvtier_{name}"]
    if spec.kind != "info":
        raise ValueError(f"{spec.name} is a {spec.kind}")
    return InfoMetricFamily(spec.name, spec.help)  # every label goes into the value dict


def histogram(name: str) -> Histogram:
    spec = SPECS[f"kvtier_{name}"]
    return Histogram(
        spec.name, spec.help, list(spec.labels), registry=None, buckets=LATENCY_BUCKETS
    )
