"""kvtier's and the model's share of an engine's step time, from a torch profiler trace (the
Chrome-trace JSON vLLM's ``--profiler-config`` writes; gzipped or not).

A step is one of vLLM's per-step annotations (``execute_context_<n>(<tokens>)_generation_<n>
(<tokens>)``, around the worker's ``execute_model``). The model's time is vLLM's
``gpu_model_runner: forward`` range (recorded with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), or,
without it, the Python ``forward`` functions of ``vllm/model_executor/models/``. kvtier's time
is that of the ``kvtier:`` ranges the connector records, or, in a trace with none, that of the
Python functions of the ``kvtier_vllm`` package (a trace recorded with Python stacks). Times are
unions per thread, so nested ranges and functions count once, and only what lies inside steps
counts towards a share.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEP_PREFIX = "execute_context_"
FORWARD = "gpu_model_runner: forward"
KVTIER_RANGE = "kvtier:"
KVTIER_MODULE = "kvtier_vllm"
MODEL_CODE = "vllm/model_executor/models/"  # the model's forward, where vLLM names no range


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted unions."""
    total = 0.0
    i = j = 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        document = json.load(f)
    events = document.get("traceEvents", []) if isinstance(document, dict) else document
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def step_shares(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """kvtier's and the model's time within the engine's steps, per thread, from one trace."""
    by_thread: dict[tuple[Any, Any], dict[str, list[tuple[float, float]]]] = {}
    ranges_named = any(str(e.get("name", "")).startswith(KVTIER_RANGE) for e in events)
    forward_named = any(e.get("name") == FORWARD for e in events)
    kvtier_names: dict[str, float] = {}
    for e in events:
        name = str(e.get("name", ""))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        kind = None
        if name.startswith(STEP_PREFIX):
            kind = "step"
        elif name == FORWARD or (
            not forward_named
            and e.get("cat") == "python_function"
            and MODEL_CODE in name
            and name.endswith(": forward")
        ):
            kind = "forward"
        elif (
            name.startswith(KVTIER_RANGE)
            if ranges_named
            else e.get("cat") == "python_function" and KVTIER_MODULE in name
        ):
            kind = "kvtier"
        if kind is None:
            continue
        if kind == "kvtier":
            kvtier_names[name] = kvtier_names.get(name, 0.0) + float(e["dur"])
        slot = by_thread.setdefault((e.get("pid"), e.get("tid")), {})
        slot.setdefault(kind, []).append(span)
    step = forward = kvtier = kvtier_outside = 0.0
    steps = 0
    for kinds in by_thread.values():
        steps_u = _union(kinds.get("step", []))
        kv_u = _union(kinds.get("kvtier", []))
        steps += len(kinds.get("step", []))
        step += _length(steps_u)
        forward += _overlap(_union(kinds.get("forward", [])), steps_u)
        inside = _overlap(kv_u, steps_u)
        kvtier += inside
        kvtier_outside += _length(kv_u) - inside
    # the heaviest kvtier functions, top-level or not (for reading, not for the share)
    top = sorted(kvtier_names.items(), key=lambda kv: -kv[1])[:8]
    return {
        "kvtier_ranges": "kvtier_ranges" if ranges_named else "python_functions",
        "steps": steps,
        "step_time_s": step / 1e6,
        "model_forward_s": forward / 1e6,
        "kvtier_in_steps_s": kvtier / 1e6,
        "kvtier_outside_steps_s": kvtier_outside / 1e6,
        "kvtier_step_share": kvtier / step if step else math.nan,
        "model_step_share": forward / step if step else math.nan,
        "kvtier_heaviest_ms": {name: dur / 1e3 for name, dur in top},
    }
