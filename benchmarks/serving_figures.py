"""The serving benchmark's figures: a case's outcome, a level's summary (hits by round, TTFT of
later rounds, where the time to first token went), no-reuse ratios, kvtier's own time, and the
profiler's step shares."""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.system import process_cpu_seconds
from benchmarks.serving_cases import (
    HEADLINE_CONCURRENCY,
    PROFILE_ANSWER_TOKENS,
    PROFILE_ROUNDS,
    PROFILE_USERS,
    Case,
)
from kvtier.bench import LevelResult, WorkloadSpec
from kvtier.bench.stats import Percentiles
from kvtier.bench.trace import load_trace, step_shares
from tests.fixtures.servers import VllmServer

log = logging.getLogger("kvtier.bench.serving")

Level = Callable[[VllmServer, str | None, WorkloadSpec, int, int, int, int], LevelResult]
"""Runs one level: server, its kvtierd's metrics, workload, concurrency, requests, index,
warm-up requests."""

PHASE_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5]
PHASE_BUCKETS += [2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0, 480.0, 1920.0, 7680.0]
"""Bounds of vLLM's request-phase and TTFT histograms on the benchmark's servers: its default
phase buckets start at 0.3 s, too coarse for a p90 of a first token's parts."""
TTFT_PARTS_SCOPE = (
    "whole level: every round, each user's first (a cold prefill) included, since users' "
    "rounds overlap; mean exact, p90 interpolated within the histogram's buckets"
)


def histogram_args() -> list[str]:
    """vLLM's arguments for `PHASE_BUCKETS`."""
    families = ("request_latency", "time_to_first_token")
    return ["--custom-histogram-buckets", json.dumps(dict.fromkeys(families, PHASE_BUCKETS))]


@dataclass(frozen=True)
class Pair:
    """A server's level and the reference's of the same prompts beside it."""

    server: LevelResult
    alone: LevelResult
    cpu_s: float
    """kvtierd's CPU seconds during the server's level (NaN without kvtierd)."""

    @property
    def ratio(self) -> float:
        """The server's output tokens/s over the reference's; NaN unless both ran whole."""
        whole = all(lv.ok == lv.requests and lv.output_tps for lv in (self.server, self.alone))
        return self.server.output_tps / self.alone.output_tps if whole else math.nan


@dataclass
class Outcome:
    case: Case
    start_s: float = math.nan
    wall_s: float = math.nan
    multi_round: list[LevelResult] = field(default_factory=list)
    no_reuse: list[LevelResult] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    log_tail: str = ""
    log_path: str = ""
    daemon_counters: dict[str, int] = field(default_factory=dict)
    """kvtierd's counters over the multi-round levels (moves, promotions, evictions)."""
    load_decisions: dict[str, float] = field(default_factory=dict)
    """The connector's load-decision counters over the multi-round levels."""
    daemon_cpu_s: list[float] = field(default_factory=list)
    """kvtierd's CPU seconds during each multi-round level (NaN without kvtierd)."""
    page_cache_drops: int = 0
    """Page-cache drops during its levels (below the arena, on the GPU-ratio model)."""
    prefill: dict[str, float] = field(default_factory=dict)
    """The engine's prefill time per token (``Plan.measure_prefill``)."""
    pairs: list[Pair] = field(default_factory=list)
    """Its multi-round levels beside vLLM alone's (benchmarks/serving_pairs.py), where paired."""

    def at(self, concurrency: int) -> LevelResult | None:
        return next((lv for lv in self.multi_round if lv.concurrency == concurrency), None)

    def daemon_cpu_share(self, concurrency: int) -> float | None:
        """kvtierd's CPU time over the multi-round level at ``concurrency``'s wall time, a share
        of one core; None without kvtierd or that level."""
        for level, cpu_s in zip(self.multi_round, self.daemon_cpu_s, strict=False):
            if level.concurrency == concurrency and level.duration_s and not math.isnan(cpu_s):
                return cpu_s / level.duration_s
        return None


def by_round(level: LevelResult) -> list[float | None]:
    """Per round: cached tokens the server reported over prompt tokens sent."""
    out: list[float | None] = []
    for r in range(max((rec.round for rec in level.records), default=-1) + 1):
        recs = [rec for rec in level.records if rec.round == r and rec.ok]
        sent = sum(rec.prompt_len for rec in recs)
        cached = [rec.cached_tokens for rec in recs if rec.cached_tokens is not None]
        out.append(sum(cached) / sent if sent and cached else None)
    return out


def later_rounds_ttft(level: LevelResult) -> dict[str, float]:
    """TTFT over the rounds after each user's first: those a cache can serve (a first round
    is a cold prefill for every server, a quarter of multi-round requests)."""
    later = Percentiles.of([r.ttft_s for r in level.records if r.ok and r.round > 0])
    return {"ttft_p50_s_later_rounds": later.p50, "ttft_p99_s_later_rounds": later.p99}


def summary(level: LevelResult) -> dict[str, Any]:
    server = level.server
    return {
        "concurrency": level.concurrency,
        "requests": level.requests,
        "ok": level.ok,
        "errors": level.errors,
        "error_messages": level.error_messages[:3],
        "duration_s": level.duration_s,
        "output_tps": level.output_tps,
        "output_tps_per_user": level.output_tps_per_user,
        "ttft_p50_s": level.ttft_s.p50,
        "ttft_p90_s": level.ttft_s.p90,
        "ttft_p99_s": level.ttft_s.p99,
        "itl_p50_s": level.itl_s.p50,
        "itl_p99_s": level.itl_s.p99,
        "latency_p50_s": level.latency_s.p50,
        "prompt_tokens": level.prompt_tokens,
        "cached_tokens_reported": level.cached_tokens,
        "cached_share_by_round": by_round(level),
        **later_rounds_ttft(level),
        "hit_ratio": server.hit_ratio,
        "hit_ratio_by_source": server.hit_ratio_by_source,
        "prompt_tokens_cached_by_source": server.cached_tokens_by_source,
        "prompt_tokens_by_source": server.prompt_tokens_by_source,
        "connector_chunks": server.connector_chunks,
        "verify_draws": server.verify_draws,
        "realized_sample_rate": server.realized_sample_rate,
        "daemon_hit_ratio": server.daemon_hit_ratio,
        "daemon_lookup_chunks": server.daemon_lookup_chunks,
        "daemon_hit_chunks_by_tier": server.daemon_hit_chunks_by_tier,
        "ttft_parts": server.ttft_parts,
        "kvtier_hook_ms_per_request": hook_ms_per_request(level),
    }


@dataclass(frozen=True)
class Ratios:
    """A server's no-reuse throughput over vLLM alone's in the same cycle, one per cycle."""

    values: list[float]

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def se(self) -> float | None:
        """The mean's standard error."""
        n = len(self.values)
        return statistics.stdev(self.values) / math.sqrt(n) if n > 1 else None


def no_reuse_ratios(cycles: list[dict[str, float]], name: str) -> Ratios:
    """Cycles where both levels ran whole count; a cycle missing either is left out."""
    values = [
        row[name] / row["vllm"]
        for row in cycles
        if row.get("vllm") and name in row and not math.isnan(row[name] + row["vllm"])
    ]
    return Ratios(values)


def daemon_cpu_seconds(daemon: Kvtierd | None) -> float:
    """kvtierd's CPU time so far; NaN without one."""
    if daemon is None or daemon.proc is None:
        return math.nan
    return process_cpu_seconds(daemon.proc.pid)


def kvtier_time(level: LevelResult, daemon_cpu_s: float) -> dict[str, float]:
    """What kvtier itself took during a level, as shares of its wall time: vLLM's engine loop
    inside kvtier's hooks (``hooks``; 0 for a server without kvtier; also in milliseconds per
    request, which a faster or slower model does not change) and kvtierd's CPU, a share of one
    core (``kvtierd_cpu``; NaN without kvtierd)."""
    wall = level.duration_s or math.nan
    hooks = sum(level.server.connector_hook_seconds.values())
    return {
        "hooks": hooks / wall,
        "hooks_ms_per_request": 1000 * hooks / level.ok if level.ok else math.nan,
        "kvtierd_cpu": daemon_cpu_s / wall,
    }


def hook_ms_per_request(level: LevelResult) -> dict[str, float]:
    """Milliseconds per successful request vLLM's engine loop spent in each of kvtier's hooks
    during ``level``, the dearest first."""
    by_hook = sorted(level.server.connector_hook_seconds.items(), key=lambda h: -h[1])
    return {hook: 1000 * s / max(level.ok, 1) for hook, s in by_hook}


def describe_kvtier_time(level: LevelResult, daemon_cpu_s: float) -> str:
    """``kvtier_time``'s figures for ``level`` in words, with each hook's part."""
    if not level.server.connector_hook_seconds:
        return "kvtier's own time: none (no kvtier hook ran)"
    cost = kvtier_time(level, daemon_cpu_s)
    hooks = ", ".join(f"{hook} {ms:.2f}" for hook, ms in hook_ms_per_request(level).items())
    return (
        f"kvtier's own time: hooks {100 * cost['hooks']:.2f}% of the level "
        f"({cost['hooks_ms_per_request']:.1f} ms per request: {hooks}), "
        f"kvtierd {100 * cost['kvtierd_cpu']:.2f}% of a core"
    )


def mean_cost(costs: list[dict[str, float]], what: str) -> float | None:
    values = [c[what] for c in costs if c.get(what) is not None and not math.isnan(c[what])]
    return statistics.fmean(values) if values else None


def profiler_args(trace_dir: Path) -> list[str]:
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_activities": ["CPU"],
        "torch_profiler_with_stack": True,
        "torch_profiler_use_gzip": False,
        "ignore_frontend": True,
    }
    return ["--profiler-config", json.dumps(config)]


def profile_level(
    level: Level,
    workload: Callable[..., WorkloadSpec],
    trace_dir: Path,
    server: VllmServer,
    metrics_url: str | None,
) -> dict[str, Any]:
    """One short multi-round level under vLLM's torch profiler, and the step shares of its
    trace (`read_profile`), with the level's summary."""
    spec = workload(rounds=PROFILE_ROUNDS, answer_tokens=PROFILE_ANSWER_TOKENS)
    server.post("/start_profile")
    try:
        requests = PROFILE_USERS * PROFILE_ROUNDS
        profiled = level(server, metrics_url, spec, HEADLINE_CONCURRENCY, requests, 900, 0)
    finally:
        server.post("/stop_profile", timeout=600)
    best = read_profile(trace_dir)
    if "error" in best:
        return best
    best["level"] = summary(profiled)
    log.info(
        "profile: kvtier %.1f%% of step time (%s), model forward %.1f%%, %d steps",
        100 * best["kvtier_step_share"],
        best["kvtier_ranges"],
        100 * best["model_step_share"],
        best["steps"],
    )
    return best


def read_profile(trace_dir: Path) -> dict[str, Any]:
    """The step shares of the trace with the most steps under ``trace_dir``, once the profiler
    has written it; an ``error`` instead when none shows steps."""
    deadline = time.monotonic() + 120
    traces: list[Path] = []
    while time.monotonic() < deadline:
        traces = sorted(p for p in trace_dir.rglob("*.json*") if p.is_file())
        if traces and all(_settled(p) for p in traces):
            break
        time.sleep(1)
    if not traces:
        return {"error": f"no trace written under {trace_dir}"}
    best: dict[str, Any] = {}
    for path in traces:
        try:
            shares = step_shares(load_trace(path))
        except (OSError, ValueError) as exc:
            log.warning("cannot read trace %s: %s", path, exc)
            continue
        if shares["steps"] and (not best or shares["steps"] > best["steps"]):
            best = {**shares, "trace": str(path), "trace_bytes": path.stat().st_size}
    if not best:
        return {"error": f"no step annotations in {[str(p) for p in traces]}"}
    return best


def _settled(path: Path) -> bool:
    """A trace file the profiler has finished writing (its size holds still for a second)."""
    size = path.stat().st_size
    time.sleep(1.0)
    return size > 0 and path.stat().st_size == size
