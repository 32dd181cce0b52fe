"""Transfer and draft statistics inside vLLM: its log line (KVConnectorStats) and its /metrics.

Workers count bytes, chunks and seconds per direction and pool; vLLM sums them across workers
and hands them to the logger and to `KVTierPromMetrics`. The scheduler side adds what only it
sees: speculative tokens proposed and accepted per draft revision and fill, draft fills, stale
draft chunks served, swaps, the current draft revision, and the bytes of sliding-window chunks
it did not store because no hit would read them, and its load decisions (load or recompute, per
tier) with the seconds they are expected to save. Both sides add the seconds vLLM spent inside
kvtier's hooks (`kvtier_vllm.shared.guard`). Label values come from fixed sets (hooks are named in
code), except draft revisions, which are bounded by `MAX_REVISIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.core.costs import TIERS
from kvtier_vllm.shared.guard import take_seconds
from kvtier_vllm.shared.vllm_compat import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from kvtier_vllm.shared.vllm_stats import cleared, summed

DIRECTIONS = ("load", "store")
FILLS = ("none", "previous", "zeros")
"""How a request's draft pages were set: loaded (none), or filled by policy."""
SWAP_SOURCES = ("admin", "fingerprint")
VERIFY_RESULTS = ("match", "mismatch", "unchecked")
"""Compared chunks: within verify_max_error, past it, or reused before they were compared."""
DRAW_OUTCOMES = ("sampled", "served")
"""What the verification sampler made of a request with a hit."""
ERROR_BUCKETS = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, float("inf"))
"""Upper bounds of the relative-error histogram's buckets."""
LOAD_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the load-wait histogram's buckets."""
POOLS = ("target", "draft", "hidden", "state")
DECISIONS = ("load", "recompute")
"""What `load_policy: measured` made of a run of a hit's chunks held in one tier."""
LOAD_MODES = ("sync", "async")
"""How a granted load ran: inside the step that schedules its request, or in the background."""
MAX_REVISIONS = 16
_SEP = "|"  # draft keys; revisions may hold dots, never this
OTHER = "other"


def _key(direction: str, pool: str, what: str) -> str:
    return f"{direction}.{pool}.{what}"


def spec_key(what: str, revision: str, fill: str) -> str:
    """``what``: drafted or accepted (speculative tokens)."""
    return _SEP.join(("spec", what, revision, fill))


@dataclass
class KVTierStats(KVConnectorStats):
    def record(self, direction: str, pool: str, nbytes: int, seconds: float, ok: bool) -> None:
        for what, value in (
            ("bytes", nbytes),
            ("chunks", 1),
            ("seconds", seconds),
            ("errors", 0 if ok else 1),
        ):
            key = _key(direction, pool, what)
            self.data[key] = self.data.get(key, 0) + value

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def spec(self, revision: str, fill: str, drafted: int, accepted: int) -> None:
        self.add(spec_key("drafted", revision, fill), drafted)
        self.add(spec_key("accepted", revision, fill), accepted)

    def fill(self, policy: str, chunks: int) -> None:
        self.add(_SEP.join(("fill", policy)), chunks)

    def stale(self, chunks: int) -> None:
        self.add(_SEP.join(("stale", "served")), chunks)

    def swap(self, source: str) -> None:
        self.add(_SEP.join(("swap", source)), 1)

    def window_skipped(self, pool: str, nbytes: int) -> None:
        """Bytes of sliding-window chunks left out: outside the window of every hit."""
        self.add(_SEP.join(("window", pool)), nbytes)

    def verified(self, pool: str, result: str, error: float | None) -> None:
        """A compared chunk; ``error``: its relative error, counted in its bucket."""
        self.add(_SEP.join(("verify", pool, result)), 1)
        if error is not None:
            bucket = next(i for i, bound in enumerate(ERROR_BUCKETS) if error <= bound)
            self.add(_SEP.join(("verify_error", pool, str(bucket))), 1)

    def drawn(self, sampled: bool) -> None:
        """The sampler drew for a request with a hit: verified (sampled) or served."""
        self.add(_SEP.join(("draw", "sampled" if sampled else "served")), 1)

    def load_decided(self, tier: str, decision: str, runs: int) -> None:
        """``runs`` runs of hits held in ``tier`` were loaded or recomputed (``decision``)."""
        self.add(_SEP.join(("decided", tier, decision)), runs)

    def load_saved(self, decision: str, seconds: float) -> None:
        """Seconds loading (or recomputing) instead of the other is expected to have saved."""
        self.add(_SEP.join(("saved", decision)), seconds)

    def load_moded(self, mode: str, loads: int) -> None:
        """``loads`` loads vLLM granted ran in ``mode`` (`LOAD_MODES`)."""
        self.add(_SEP.join(("mode", mode)), loads)

    def load_waited(self, seconds: float) -> None:
        """A request waited ``seconds`` from its first ask until its load landed; each wait
        keeps a key of its own until reported, so /metrics observes it exactly."""
        waits = sum(key.startswith("load_wait") for key in self.data)
        self.data[_SEP.join(("load_wait", str(waits)))] = seconds

    def hooks(self, seconds: dict[str, float]) -> None:
        """Seconds spent inside each of kvtier's hooks."""
        for hook, spent in seconds.items():
            self.add(_SEP.join(("hook", hook)), spent)

    def revision(self, revision: str) -> None:
        """The draft revision now current (a gauge: the last one reported wins)."""
        self.data[_SEP.join(("revision", revision))] = 1

    reset = cleared
    aggregate = summed

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for direction in DIRECTIONS:
            nbytes = sum(
                v for k, v in self.data.items() if k.startswith(direction) and k.endswith(".bytes")
            )
            seconds = sum(
                v
                for k, v in self.data.items()
                if k.startswith(direction) and k.endswith(".seconds")
            )
            out[f"kvtier_{direction}_MiB"] = round(nbytes / 2**20, 2)
            out[f"kvtier_{direction}_GBps"] = round(nbytes / seconds / 1e9, 2) if seconds else 0.0
        drafted = accepted = 0.0
        for key, value in self.data.items():
            parts = key.split(_SEP)
            if parts[0] == "spec":
                if parts[1] == "drafted":
                    drafted += value
                else:
                    accepted += value
            elif parts[0] == "window":
                out["kvtier_window_skipped_MiB"] = round(
                    out.get("kvtier_window_skipped_MiB", 0) + value / 2**20, 2
                )
            elif parts[0] == "fill":
                out[f"kvtier_draft_fill_{parts[1]}"] = (
                    out.get(f"kvtier_draft_fill_{parts[1]}", 0) + value
                )
        if drafted:
            out["kvtier_acceptance"] = round(accepted / drafted, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data  # a zero counted is still news: the series then exists


def take_report(stats: KVTierStats) -> tuple[KVTierStats | None, KVTierStats]:
    """What a side reports (``stats`` with the hook seconds due, None when that is nothing) and
    the stats it fills next."""
    stats.hooks(take_seconds(due=not stats.is_empty()))
    if stats.is_empty():
        return None, stats
    return stats, KVTierStats()


class KVTierPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvtier_transfer_*_total{direction, pool}` in vLLM's own /metrics."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = [*self._labelnames, "direction", "pool"]
        # named whole, so that the dashboards' tests find them in this source
        help_of = {
            "vllm:kvtier_transfer_bytes_total": "Bytes kvtier copied between vLLM's KV cache and "
            "its arena.",
            "vllm:kvtier_transfer_chunks_total": "Chunks kvtier copied between vLLM's KV cache "
            "and its arena, failed copies included.",
            "vllm:kvtier_transfer_seconds_total": "Seconds kvtier spent copying chunks (a load on "
            "a device until its copies landed, not only queued).",
            "vllm:kvtier_transfer_errors_total": "Chunk copies that failed (the blocks are "
            "recomputed).",
        }
        self._counters: dict[str, Any] = {
            name.removeprefix("vllm:kvtier_transfer_").removesuffix("_total"): self._counter_cls(
                name=name, documentation=doc, labelnames=labels
            )
            for name, doc in help_of.items()
        }

        base = self._labelnames
        self._spec: dict[str, Any] = {
            what: self._counter_cls(
                name=f"vllm:kvtier_spec_{what}_tokens_total",
                documentation=f"Speculative tokens {what}, per draft revision and per how the "
                "request's draft pages were set (none: loaded or computed; previous, zeros: "
                "filled).",
                labelnames=[*base, "draft_revision", "fill"],
            )
            for what in ("drafted", "accepted")
        }
        self._fills: Any = self._counter_cls(
            name="vllm:kvtier_draft_fill_chunks_total",
            documentation="Draft chunks of target hits filled instead of loaded, by fill.",
            labelnames=[*base, "policy"],
        )
        self._stale: Any = self._counter_cls(
            name="vllm:kvtier_stale_draft_chunks_served_total",
            documentation="Draft chunks of an older revision loaded as if current (0 is right).",
            labelnames=base,
        )
        self._swaps: Any = self._counter_cls(
            name="vllm:kvtier_draft_swaps_total",
            documentation="Draft revision changes this engine followed, by how it learned.",
            labelnames=[*base, "source"],
        )
        self._window: Any = self._counter_cls(
            name="vllm:kvtier_window_skipped_bytes_total",
            documentation="Bytes of sliding-window chunks not stored: outside the window of "
            "every hit, so storing every block of every group would have cost this much more.",
            labelnames=[*base, "pool"],
        )
        self._verified: Any = self._counter_cls(
            name="vllm:kvtier_verify_chunks_total",
            documentation="Chunks of sampled hits compared with the KV vLLM computed in their "
            "place: match, mismatch (the namespace is quarantined), or unchecked (the slot "
            "was reused first).",
            labelnames=[*base, "pool", "result"],
        )
        self._draws: Any = self._counter_cls(
            name="vllm:kvtier_verify_requests_total",
            documentation="Requests with a hit, drawn once each by the verification sampler: "
            "sampled (served as a miss and compared) or served. sampled over the sum is the "
            "realized verify_sample_rate.",
            labelnames=[*base, "outcome"],
        )
        self._hooks: Any = self._counter_cls(
            name="vllm:kvtier_hook_seconds_total",
            documentation="Seconds vLLM spent inside kvtier's connector hooks, per hook, summed "
            "over the scheduler and every worker. vLLM waits for each on its engine loop, so "
            "its rate is the share of serving time kvtier took (an upper bound with several "
            "workers, whose hooks run at once).",
            labelnames=[*base, "hook"],
        )
        self._decided: Any = self._counter_cls(
            name="vllm:kvtier_load_decisions_total",
            documentation="Runs of hits' chunks held in one tier that load_policy: measured "
            "loaded or recomputed: a hit loads the prefix expected to take less than "
            "recomputing it. A request is counted once, when its plan is final.",
            labelnames=[*base, "tier", "decision"],
        )
        self._saved: Any = self._counter_cls(
            name="vllm:kvtier_load_decision_saved_seconds_total",
            documentation="Seconds the load decisions are expected to have saved, by decision: "
            "load, against recomputing those runs; recompute, against loading them (what "
            "load_policy: always would have spent more), from kvtier's measured costs.",
            labelnames=[*base, "decision"],
        )
        self._modes: Any = self._counter_cls(
            name="vllm:kvtier_load_modes_total",
            documentation="Loads vLLM granted, by mode: sync (inside the step that schedules "
            "the request; every request of that step waits for it) or async (the request waits "
            "while the others run, a step at least). load_mode: auto chooses per load.",
            labelnames=[*base, "mode"],
        )
        histogram: Any = self._histogram_cls
        self._errors: Any = histogram(
            name="vllm:kvtier_verify_relative_error",
            documentation="Relative error of compared chunks (the norm of the difference over "
            "the norm of the recomputed KV, the worst layer; a state chunk's worst tensor); the "
            "sum adds bucket bounds.",
            labelnames=[*base, "pool"],
            buckets=list(ERROR_BUCKETS[:-1]),
        )
        self._load_waits: Any = histogram(
            name="vllm:kvtier_load_wait_seconds",
            documentation="Seconds a request with a hit waited for its KV, from its first ask "
            "to its first load landing: to the workers reporting it (async loads, inside "
            "vLLM's queue time) or to the step that schedules it (sync loads, whose copy is "
            "in vLLM's prefill time).",
            labelnames=base,
            buckets=list(LOAD_WAIT_BUCKETS),
        )
        gauge: Any = self._gauge_cls
        self._revision: Any = gauge(
            name="vllm:kvtier_draft_revision_info",
            documentation="1 for the draft revision in use.",
            labelnames=[*base, "draft_revision"],
            multiprocess_mode="mostrecent",
        )
        self._current: dict[int, str] = {}
        self._revisions: set[str] = set()

    def _bounded(self, revision: str) -> str:
        if revision not in self._revisions and len(self._revisions) >= MAX_REVISIONS:
            return OTHER
        self._revisions.add(revision)
        return revision

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, value in transfer_stats_data.items():
            if _SEP in key:
                self._observe_draft(engine_idx, engine_labels, key.split(_SEP), value)
                continue
            direction, pool, what = key.split(".")
            if value and what in self._counters:
                self._counters[what].labels(*engine_labels, direction, pool).inc(value)

    def _observe_draft(
        self, engine_idx: int, labels: list[str], parts: list[str], value: float
    ) -> None:
        kind = parts[0]
        if kind == "spec" and parts[1] in self._spec and parts[3] in FILLS:
            counter = self._spec[parts[1]].labels(*labels, self._bounded(parts[2]), parts[3])
            counter.inc(value)
        elif kind == "fill" and parts[1] in FILLS and value:
            self._fills.labels(*labels, parts[1]).inc(value)
        elif kind == "window" and parts[1] in POOLS and value:
            self._window.labels(*labels, parts[1]).inc(value)
        elif kind == "verify" and parts[1] in POOLS and parts[2] in VERIFY_RESULTS:
            self._verified.labels(*labels, parts[1], parts[2]).inc(value)
        elif kind == "verify_error" and parts[1] in POOLS:
            bound = ERROR_BUCKETS[int(parts[2])]
            observed = bound if bound != float("inf") else 10.0
            for _ in range(int(value)):
                self._errors.labels(*labels, parts[1]).observe(observed)
        elif kind == "draw" and parts[1] in DRAW_OUTCOMES:
            self._draws.labels(*labels, parts[1]).inc(value)
        elif kind == "decided" and parts[1] in TIERS and parts[2] in DECISIONS and value:
            self._decided.labels(*labels, parts[1], parts[2]).inc(value)
        elif kind == "saved" and parts[1] in DECISIONS and value > 0:
            self._saved.labels(*labels, parts[1]).inc(value)
        elif kind == "mode" and parts[1] in LOAD_MODES and value:
            self._modes.labels(*labels, parts[1]).inc(value)
        elif kind == "load_wait":
            self._load_waits.labels(*labels).observe(value)
        elif kind == "hook" and value:
            self._hooks.labels(*labels, parts[1]).inc(value)
        elif kind == "stale":
            self._stale.labels(*labels).inc(value)
        elif kind == "swap" and parts[1] in SWAP_SOURCES and value:
            self._swaps.labels(*labels, parts[1]).inc(value)
        elif kind == "revision":
            revision = self._bounded(parts[1])
            previous = self._current.get(engine_idx)
            if previous is not None and previous != revision:
                self._revision.labels(*labels, previous).set(0)
            self._revision.labels(*labels, revision).set(1)
            self._current[engine_idx] = revision
