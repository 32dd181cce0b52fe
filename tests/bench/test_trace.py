"""kvtier's share of step time from a profiler trace: nested time counts once, only time inside
steps counts, and the connector's own ranges win over Python functions."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.trace import load_trace, step_shares


def ev(
    name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = 1
) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 7, "tid": tid}


def py(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return ev(name, ts, dur, "python_function", tid)


STEPS = [
    ev("execute_context_1(512)_generation_0(0)", 0, 1000),
    ev("execute_context_0(0)_generation_1(1)", 2000, 1000),
]


def test_python_functions_nested_count_once_and_only_inside_steps() -> None:
    events = [
        *STEPS,
        ev("gpu_model_runner: forward", 100, 800),
        py("connectors/kvtier_vllm/connector.py(146): start_load_kv", 0, 100),
        py("connectors/kvtier_vllm/kv/worker_side/worker.py(293): start_load_kv", 10, 80),  # nested
        py("connectors/kvtier_vllm/connector.py(165): wait_for_save", 2900, 200),  # half out
        py("connectors/kvtier_vllm/connector.py(176): get_finished", 1500, 50),  # between
        py("vllm/v1/worker/gpu_model_runner.py(10): execute_model", 0, 1000),
    ]
    shares = step_shares(events)
    assert shares["kvtier_ranges"] == "python_functions"
    assert shares["steps"] == 2
    assert shares["step_time_s"] == pytest.approx(2000e-6)
    assert shares["kvtier_in_steps_s"] == pytest.approx(200e-6)
    assert shares["kvtier_outside_steps_s"] == pytest.approx(150e-6)
    assert shares["kvtier_step_share"] == pytest.approx(0.1)
    assert shares["model_step_share"] == pytest.approx(0.4)


def test_connector_ranges_win_and_threads_stay_apart() -> None:
    events = [
        *STEPS,
        ev("kvtier:start_load_kv", 0, 300),
        ev("kvtier:wait_for_save", 2000, 100),
        py("connectors/kvtier_vllm/connector.py(146): start_load_kv", 0, 900),  # not counted
        ev("execute_context_0(0)_generation_1(1)", 0, 1000, tid=2),
        ev("kvtier:wait_for_save", 0, 100, tid=2),
    ]
    shares = step_shares(events)
    assert shares["kvtier_ranges"] == "kvtier_ranges"
    assert shares["steps"] == 3
    assert shares["kvtier_step_share"] == pytest.approx(500 / 3000)
    assert shares["model_forward_s"] == 0  # neither vLLM's range nor the model's functions


def test_model_forward_from_python_functions() -> None:
    events = [*STEPS, py("vllm/model_executor/models/llama.py(313): forward", 100, 500)]
    assert step_shares(events)["model_step_share"] == pytest.approx(0.25)


def test_no_steps_gives_no_share() -> None:
    shares = step_shares([py("connectors/kvtier_vllm/connector.py(1): f", 0, 10)])
    assert shares["steps"] == 0
    assert shares["kvtier_step_share"] != shares["kvtier_step_share"]  # NaN


@pytest.mark.parametrize("gz", [False, True])
def test_load_trace_keeps_complete_events(tmp_path: Path, gz: bool) -> None:
    document = {"traceEvents": [*STEPS, {"ph": "i", "name": "marker", "ts": 1}]}
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    text = json.dumps(document)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    assert [e["name"] for e in load_trace(path)] == [e["name"] for e in STEPS]
