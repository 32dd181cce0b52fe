"""A load generator for OpenAI-compatible servers: ``kvtier bench serve`` and ``kvtier bench
plot``, and the same from Python.

Token-exact workloads (`workloads`) are streamed to ``/v1/completions`` (`client`) at a series
of concurrency levels (`runner`); each level is summarised (`stats`) with the server's own
counters scraped around it (`scrape`), then shown as a table or JSON (`report`) and plotted
(`plot`); `trace` reads kvtier's share of step time from a profiler trace. HTTP needs httpx
and plots need matplotlib: ``pip install 'kvtier[bench]'``.

From Python::

    from kvtier.bench import BenchConfig, WorkloadSpec, run_sweep

    config = BenchConfig(
        url="http://localhost:8000",
        workload=WorkloadSpec(kind="multi-round", doc_tokens=2048, rounds=4, seed=1),
        concurrency=(1, 4, 16),
        requests=64,
        warmup=8,
    )
    run = run_sweep(config)              # RunResult: config, server, levels
    for level in run.levels:             # LevelResult per concurrency level
        print(level.concurrency, level.ttft_s.p50, level.output_tps, level.server.hit_ratio)
    one = run_level(config, 8)           # a single level, checked against the server first

`run_sweep` and `run_level` raise `BenchError` before sending anything when the server is
unreachable or the workload does not fit its ``max_model_len``; requests that fail during a
level are counted in ``LevelResult.errors``, not raised. Inside an event loop, await
`run_sweep_async`. ``RunResult.to_dict()`` is the document ``--json`` prints, and
``plot.Curve.of_run``/``plot.save_plot`` draw runs together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.bench.errors import BenchError
from kvtier.bench.workloads import Session, WorkloadSpec

if TYPE_CHECKING:
    from kvtier.bench.runner import (
        BenchConfig,
        LevelResult,
        RequestRecord,
        RunResult,
        run_level,
        run_sweep,
        run_sweep_async,
    )

_RUNNER = {
    "BenchConfig",
    "LevelResult",
    "RequestRecord",
    "RunResult",
    "run_level",
    "run_sweep",
    "run_sweep_async",
}


def __getattr__(name: str) -> Any:
    # the runner needs httpx, which `kvtier bench plot` and the rest of kvtier do without
    if name in _RUNNER:
        from kvtier.bench import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BenchConfig",
    "BenchError",
    "LevelResult",
    "RequestRecord",
    "RunResult",
    "Session",
    "WorkloadSpec",
    "run_level",
    "run_sweep",
    "run_sweep_async",
]
