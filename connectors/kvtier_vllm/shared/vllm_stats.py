"""What both connectors' figures inside vLLM share: counts summed over workers and steps, and
the class hooks vLLM builds a connector's stats and /metrics with (`build_kv_connector_stats`,
`build_ec_connector_stats`, `build_prom_metrics`), which only construct the connector's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Counted(Protocol):
    data: dict[str, Any]


C = TypeVar("C", bound=Counted)


def cleared(stats: Counted) -> None:
    """A stats object's ``reset``: its counts start again from none."""
    stats.data = {}


def summed(stats: C, other: Counted) -> C:
    """A stats object's ``aggregate``: ``other``'s counts (another worker's, or step's) added
    to its own."""
    for key, value in other.data.items():
        stats.data[key] = stats.data.get(key, 0) + value
    return stats


def stats_hook(stats: Callable[..., T]) -> Any:
    """vLLM's stats hook for a connector: ``stats`` over a copy of the data it hands back."""

    def build(cls: type, data: dict[str, Any] | None = None) -> T:
        return stats(data=dict(data or {}))

    return classmethod(build)


def prom_metrics_hook(
    metrics: Callable[[Any, dict[Any, Any], list[str], dict[int, list[object]]], T],
) -> Any:
    """vLLM's /metrics hook for a connector: ``metrics`` built with what vLLM passes (its config,
    metric types, label names and each engine's label values)."""

    def build(
        cls: type,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> T:
        return metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    return classmethod(build)
