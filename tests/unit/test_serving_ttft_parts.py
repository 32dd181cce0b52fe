"""The serving benchmark's split of a request's time to first token: the table it prints per
server, and the finer histogram buckets its servers are started with."""

from __future__ import annotations

import json
from typing import Any

from vllm.config import ObservabilityConfig  # the benchmark's servers are vLLM's

from benchmarks.serving_cases import HEADLINE_CONCURRENCY
from benchmarks.serving_figures import PHASE_BUCKETS, TTFT_PARTS_SCOPE, histogram_args
from benchmarks.serving_report import ttft_parts_table


def server(label: str, concurrency: int, parts: dict[str, Any]) -> dict[str, Any]:
    return {"label": label, "multi_round": [{"concurrency": concurrency, "ttft_parts": parts}]}


def test_each_server_shows_the_mean_and_p90_of_each_part_in_ms() -> None:
    part = {"requests": 64.0, "mean_s": 0.0125, "p90_s": 0.04}
    kvtier = {"queue": part, "load_wait": part, "prefill": part, "ttft": part}
    alone = {"queue": part, "prefill": part, "ttft": part}  # no connector: no load wait
    modes = {"vllm:kvtier_load_modes_total{mode=sync}": 5.0}
    result = {
        "settings": {"ttft_parts": TTFT_PARTS_SCOPE},
        "servers": {
            "kvtier": {**server("kvtier", HEADLINE_CONCURRENCY, kvtier), "load_decisions": modes},
            "vllm": server("vLLM alone", HEADLINE_CONCURRENCY, alone),
            "other": server("other level", HEADLINE_CONCURRENCY + 1, kvtier),
        },
    }
    lines = ttft_parts_table(result)
    assert TTFT_PARTS_SCOPE in lines[1]
    rows = [line for line in lines if line.startswith("| kvtier") or line.startswith("| vLLM")]
    assert rows == [
        "| kvtier | 64 | 12/40 | 12/40 | 12/40 | 12/40 | 5/- |",
        "| vLLM alone | 64 | 12/40 | - | 12/40 | 12/40 | - |",
    ]
    assert not any("other level" in line for line in lines)  # not at the headline level


def test_no_table_without_histograms() -> None:
    result = {"settings": {}, "servers": {"v": server("v", HEADLINE_CONCURRENCY, {})}}
    assert ttft_parts_table(result) == []


def test_the_servers_phase_buckets_are_ones_vllm_takes() -> None:
    flag, value = histogram_args()
    assert flag == "--custom-histogram-buckets"
    config = ObservabilityConfig(custom_histogram_buckets=json.loads(value))
    assert config.custom_histogram_buckets == {
        "request_latency": PHASE_BUCKETS,
        "time_to_first_token": PHASE_BUCKETS,
    }
