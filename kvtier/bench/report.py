"""A run as a rich table, and as one JSON document (NaN written as null)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.bench.runner import LevelResult, RunResult


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def to_json(run: RunResult) -> str:
    return json.dumps(_clean(run.to_dict()), indent=2, allow_nan=False)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def _hits(level: LevelResult) -> str:
    server = level.server
    if server.hit_ratio is None:
        return "-"
    parts = [f"{server.hit_ratio:.1%}"]
    parts += [f"{k} {v:.1%}" for k, v in sorted(server.hit_ratio_by_source.items()) if v]
    if server.connector_chunks.get("load"):
        parts.append(f"(kvtier loaded {server.connector_chunks['load']:.0f} chunks)")
    if server.daemon_hit_ratio is not None:
        parts.append(f"kvtierd {server.daemon_hit_ratio:.1%}")
    return " ".join(parts)


def table(run: RunResult) -> Table:
    spec = run.config.workload
    title = f"{spec.kind} on {run.server.model} ({run.config.requests} requests per level)"
    t = Table(title=title, header_style="bold")
    header = (
        "conc",
        "ok/sent",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p99 ms",
        "E2E p50/p99 ms",
        "out tok/s",
        "tok/s/user",
        "req/s",
        "cache hits (by source)",
    )
    for column in header:
        t.add_column(column, justify="left" if column.startswith("cache") else "right")
    for level in run.levels:
        t.add_row(
            str(level.concurrency),
            f"{level.ok}/{level.requests}",
            "/".join(_ms(v) for v in (level.ttft_s.p50, level.ttft_s.p90, level.ttft_s.p99)),
            "/".join(_ms(v) for v in (level.itl_s.p50, level.itl_s.p99)),
            "/".join(_ms(v) for v in (level.latency_s.p50, level.latency_s.p99)),
            _num(level.output_tps),
            _num(level.output_tps_per_user),
            _num(level.requests_per_s, ".2f"),
            _hits(level),
        )
    return t


def print_report(run: RunResult, console: Console | None = None) -> None:
    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console = Console(highlight=False, width=200)  # a log file: keep rows on one line
    console.print(table(run))
    for level in run.levels:
        if level.errors or level.warmup_errors:
            messages: Sequence[str] = level.error_messages[:3]
            console.print(
                f"concurrency {level.concurrency}: {level.errors} of {level.requests} requests "
                f"failed ({level.warmup_errors} in warm-up)"
                + (f": {'; '.join(messages)}" if messages else ""),
                markup=False,
            )
