"""Transfer statistics inside vLLM: its log line (KVConnectorStats) and its /metrics.

Workers count bytes, chunks and seconds per direction and pool; vLLM sums them across workers
and hands them to the logger and to `KVTierPromMetrics`. Label values come from fixed sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

DIRECTIONS = ("load", "store")
_FIELDS = ("bytes", "chunks", "seconds", "errors")


def _key(direction: str, pool: str, what: str) -> str:
    return f"{direction}.{pool}.{what}"


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

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

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
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


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
        help_of = {
            "bytes": "Bytes kvtier copied between vLLM's KV cache and its arena.",
            "chunks": "Chunks kvtier copied between vLLM's KV cache and its arena.",
            "seconds": "Seconds kvtier spent copying chunks.",
            "errors": "Chunk copies that failed (the blocks are recomputed).",
        }
        self._counters: dict[str, Any] = {
            what: self._counter_cls(
                name=f"vllm:kvtier_transfer_{what}_total", documentation=doc, labelnames=labels
            )
            for what, doc in help_of.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, value in transfer_stats_data.items():
            direction, pool, what = key.split(".")
            if value and what in self._counters:
                self._counters[what].labels(*engine_labels, direction, pool).inc(value)
