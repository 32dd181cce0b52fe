"""The connector's transfer seconds on their way from the workers to a reader: summed over ranks
by vLLM's output aggregator, over steps by its log line, counted by its Prometheus logger in this
process's registry, and read there whole by the tests' and benchmarks' `counter`."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from kvtier_vllm.kv.connector_stats import KVTierPromMetrics, KVTierStats
from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.reader import get_metrics_snapshot
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from tests.fixtures.engines import counter, untimed_transfers

MiB = 2**20
RANKS = 2
STEPS = 3
RANK_BYTES = 92 * MiB // STEPS  # each rank's part of a step's loads
RANK_SECONDS = 0.0625


@pytest.fixture
def vllm_registry() -> Iterator[None]:
    """vLLM's series in the process's registry, where its Prometheus logger counts; none left
    behind for an engine started later in this process."""
    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()


def step_output(stats: KVTierStats) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
    )


def test_load_seconds_reach_the_reader_whole_summed_over_ranks_and_steps(
    vllm_registry: None,
) -> None:
    types = {cls: cls for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["e"], {0: ["0"]})
    aggregator = KVOutputAggregator(expected_finished_count=RANKS)
    logged = KVConnectorLogging(None)
    logged.connector_cls = SimpleNamespace(build_kv_connector_stats=lambda data: KVTierStats(data))
    for _ in range(STEPS):
        ranks = []
        for _ in range(RANKS):
            stats = KVTierStats()
            stats.record("load", "target", RANK_BYTES, RANK_SECONDS, True)
            stats.record("store", "target", RANK_BYTES, RANK_SECONDS / 2, True)
            ranks.append(step_output(stats))
        output = aggregator.aggregate(ranks)
        assert output is not None
        assert output.kv_connector_output is not None
        reported = output.kv_connector_output.kv_connector_stats
        assert reported is not None
        prom.observe(reported.to_dict())
        logged.observe(reported.to_dict())

    llm = SimpleNamespace(get_metrics=get_metrics_snapshot)  # what `LLM.get_metrics` reads
    loaded_s = counter(llm, "vllm:kvtier_transfer_seconds", direction="load")
    assert loaded_s == pytest.approx(STEPS * RANKS * RANK_SECONDS)  # under 1 s: 0 if truncated
    stored_s = counter(llm, "vllm:kvtier_transfer_seconds", direction="store")
    assert stored_s == pytest.approx(STEPS * RANKS * RANK_SECONDS / 2)
    assert (
        counter(llm, "vllm:kvtier_transfer_bytes", direction="load") == STEPS * RANKS * RANK_BYTES
    )
    assert untimed_transfers(llm) == []
    # the log line's rate: every rank's bytes over every rank's seconds
    assert logged.transfer_stats_accumulator is not None
    line = logged.transfer_stats_accumulator.reduce()
    assert line["kvtier_load_GBps"] == round(RANK_BYTES / RANK_SECONDS / 1e9, 2)


def test_bytes_without_seconds_are_found_untimed(vllm_registry: None) -> None:
    types = {cls: cls for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["e"], {0: ["0"]})
    stats = KVTierStats()
    stats.record("load", "draft", MiB, 0.0, True)
    stats.record("load", "target", MiB, 0.001, True)
    prom.observe(stats.data)
    llm = SimpleNamespace(get_metrics=get_metrics_snapshot)
    assert untimed_transfers(llm) == [("load", "draft")]
