"""The encoder cache's figures inside vLLM: its log line (ECConnectorStats) and its /metrics,
every series under ``pool="encoder"``.

The scheduler side counts lookups, stores and verifications; the workers' bytes and load
seconds reach it in their step reports (vLLM collects no worker stats for encoder-cache
connectors on every model runner), so the scheduler side reports everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier_vllm.encoder.scheduler import ECCounters
from kvtier_vllm.shared.vllm_compat import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)
from kvtier_vllm.shared.vllm_stats import cleared, summed

POOL = "encoder"
ITEM_RESULTS = {
    "hits": "hit",
    "misses": "miss",
    "promotions": "promoted",
    "stores": "stored",
    "sampled": "sampled",
    "load_failed": "load_failed",
}
"""Counters of items, by the ``result`` label each is counted under."""
BYTES = {"loaded_bytes": "load", "stored_bytes": "store"}
VERIFY = {"compared": "compared", "mismatched": "mismatch"}


@dataclass
class KVTierECStats(ECConnectorStats):
    reset = cleared
    aggregate = summed

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        asked = data.get("hits", 0) + data.get("misses", 0)
        seconds = data.get("load_seconds", 0.0)
        return {
            "kvtier_encoder_hits": int(data.get("hits", 0)),
            "kvtier_encoder_hit_rate": round(data.get("hits", 0) / asked, 3) if asked else 0.0,
            "kvtier_encoder_load_MiB": round(data.get("loaded_bytes", 0) / 2**20, 2),
            "kvtier_encoder_load_GBps": (
                round(data.get("loaded_bytes", 0) / seconds / 1e9, 2) if seconds else 0.0
            ),
            "kvtier_encoder_store_MiB": round(data.get("stored_bytes", 0) / 2**20, 2),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Deltas:
    """What changed in the counters since the last take."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, counters: ECCounters) -> KVTierECStats | None:
        now = counters.as_dict()
        delta = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        return KVTierECStats(data=delta) if delta else None


class KVTierECPromMetrics(ECConnectorPromMetrics):
    """``vllm:kvtier_encoder_*`` in vLLM's own /metrics, labelled ``pool="encoder"``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        base = [*self._labelnames, "pool"]
        counter: Any = self._counter_cls
        self._items = counter(
            name="vllm:kvtier_encoder_items_total",
            documentation="Encoder outputs, by result: hit (loaded instead of encoded), miss, "
            "promoted (from lmdb or the object store, the request waiting), stored, sampled "
            "(a hit encoded anyway and compared), load_failed (its request failed).",
            labelnames=[*base, "result"],
        )
        self._bytes = counter(
            name="vllm:kvtier_encoder_bytes_total",
            documentation="Bytes of encoder outputs copied between vLLM's encoder cache and "
            "kvtier's arena.",
            labelnames=[*base, "direction"],
        )
        self._seconds = counter(
            name="vllm:kvtier_encoder_load_seconds_total",
            documentation="Seconds the workers spent reading encoder outputs from the arena.",
            labelnames=base,
        )
        self._verify = counter(
            name="vllm:kvtier_encoder_verify_total",
            documentation="Sampled encoder hits compared with the output computed in their "
            "place: compared, and mismatch (the namespace is quarantined).",
            labelnames=[*base, "result"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key in ITEM_RESULTS:
                self._items.labels(*labels, POOL, ITEM_RESULTS[key]).inc(value)
            elif key in BYTES:
                self._bytes.labels(*labels, POOL, BYTES[key]).inc(value)
            elif key in VERIFY:
                self._verify.labels(*labels, POOL, VERIFY[key]).inc(value)
            elif key == "load_seconds":
                self._seconds.labels(*labels, POOL).inc(value)
