"""The serving benchmark's report: its figures as one result, the tables that print them, and the
page and plot a full run writes under docs/."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import serving_gpu_ratio
from benchmarks.harness.sizes import MiB
from benchmarks.harness.targets import met as target_met
from benchmarks.serving_cases import (
    ARENA_BYTES,
    BLOCK_SIZE,
    HEADLINE_CONCURRENCY,
    LMDB_BACKED,
    LMDB_FP8_BACKED,
    LMDB_INT8_BACKED,
    MORE_HBM,
    NO_REUSE_CASES,
    OBJECT_BACKED,
    OBJECT_FP8_BACKED,
    PAST_THE_ARENA,
    ROUNDS,
    SPEC_TOKENS,
    TARGETS,
    USERS,
)
from benchmarks.serving_figures import (
    TTFT_PARTS_SCOPE,
    Outcome,
    later_rounds_ttft,
    mean_cost,
    no_reuse_ratios,
    summary,
)
from benchmarks.serving_servers import OBJECT_STORE_SETUP
from kvtier.bench import LevelResult

if TYPE_CHECKING:
    from benchmarks.serving import Bench


def result_of(
    bench: Bench,
    outcomes: dict[str, Outcome],
    cycles: list[dict[str, float]],
    gpu_ratios: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's figures: the headline ratios against their targets (the GPU-ratio model's
    with ``gpu_ratios``, the ratios measured), each server's levels, and the settings it ran
    with."""
    c = HEADLINE_CONCURRENCY

    def mr(name: str) -> LevelResult | None:
        outcome = outcomes.get(name)
        return outcome.at(c) if outcome else None

    def ratio(a: float | None, b: float | None) -> float | None:
        if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
            return None
        return a / b

    def tps(name: str) -> float | None:
        level = mr(name)
        return level.output_tps if level and level.ok else None

    def ttft(name: str, p: str) -> float | None:
        level = mr(name)
        return getattr(level.ttft_s, p) if level and level.ok else None

    def later(name: str, p: str) -> float | None:
        level = mr(name)
        return later_rounds_ttft(level)[f"ttft_{p}_s_later_rounds"] if level else None

    nr_side = no_reuse_ratios(cycles, "kvtier_sidecar")
    nr_emb = no_reuse_ratios(cycles, "kvtier_embedded")
    profile = outcomes["kvtier_sidecar"].profile if "kvtier_sidecar" in outcomes else {}
    headline: dict[str, Any] = {
        "throughput_vs_vllm_alone": ratio(tps("kvtier_sidecar"), tps("vllm")),
        "ttft_p50_vs_vllm_alone": ratio(ttft("kvtier_sidecar", "p50"), ttft("vllm", "p50")),
        "ttft_p99_vs_vllm_alone": ratio(ttft("kvtier_sidecar", "p99"), ttft("vllm", "p99")),
        "no_reuse_throughput_vs_vllm_alone": nr_side.mean,
        "no_reuse_throughput_vs_vllm_alone_embedded": nr_emb.mean,
        "spec_throughput_vs_vllm_alone_spec": ratio(tps("kvtier_sidecar_spec"), tps("vllm_spec")),
        "throughput_vs_example_connector": ratio(tps("kvtier_sidecar"), tps("example_connector")),
        "capture_throughput_vs_kvtier_embedded": ratio(
            tps("kvtier_embedded_capture"), tps("kvtier_embedded")
        ),
        "kvtier_step_share": profile.get("kvtier_step_share"),
        "throughput_vs_vllm_alone_embedded": ratio(tps("kvtier_embedded"), tps("vllm")),
        "ttft_p50_vs_vllm_alone_embedded": ratio(
            ttft("kvtier_embedded", "p50"), ttft("vllm", "p50")
        ),
        "ttft_p99_vs_vllm_alone_embedded": ratio(
            ttft("kvtier_embedded", "p99"), ttft("vllm", "p99")
        ),
        "ttft_p50_vs_vllm_alone_later_rounds": ratio(
            later("kvtier_sidecar", "p50"), later("vllm", "p50")
        ),
        "ttft_p99_vs_vllm_alone_later_rounds": ratio(
            later("kvtier_sidecar", "p99"), later("vllm", "p99")
        ),
        "throughput_vs_offloading_connector": ratio(
            tps("kvtier_sidecar"), tps("offloading_connector")
        ),
        "lmdb_backed_vs_arena_backed": ratio(tps(LMDB_BACKED.name), tps("kvtier_sidecar")),
        "object_backed_vs_arena_backed": ratio(tps(OBJECT_BACKED.name), tps("kvtier_sidecar")),
        "lmdb_fp8_backed_vs_arena_backed": ratio(tps(LMDB_FP8_BACKED.name), tps("kvtier_sidecar")),
        "lmdb_int8_backed_vs_arena_backed": ratio(
            tps(LMDB_INT8_BACKED.name), tps("kvtier_sidecar")
        ),
        "object_fp8_backed_vs_arena_backed": ratio(
            tps(OBJECT_FP8_BACKED.name), tps("kvtier_sidecar")
        ),
        "throughput_vs_more_hbm": ratio(tps("kvtier_sidecar"), tps(MORE_HBM.name)),
        "past_the_arena": {
            name: {
                "output_tps": tps(name),
                "ttft_p50_s": ttft(name, "p50"),
                "ttft_p99_s": ttft(name, "p99"),
                "ttft_p50_s_later_rounds": later(name, "p50"),
                "hit_chunks_by_tier": (level := mr(name))
                and level.server.daemon_hit_chunks_by_tier,
            }
            for name in PAST_THE_ARENA
            if mr(name) is not None
        },
        "no_reuse_se": {"sidecar": nr_side.se, "embedded": nr_emb.se},
        "no_reuse_second_vllm_alone": no_reuse_ratios(cycles, "vllm_b").mean,
        "no_reuse_cycles": cycles,
        "no_reuse_error": bench.no_reuse.error or None,
        "no_reuse_hook_share": mean_cost(bench.no_reuse.costs.get("kvtier_sidecar", []), "hooks"),
        "no_reuse_hook_share_embedded": mean_cost(
            bench.no_reuse.costs.get("kvtier_embedded", []), "hooks"
        ),
        "no_reuse_kvtierd_cpu_share": mean_cost(
            bench.no_reuse.costs.get("kvtier_sidecar", []), "kvtierd_cpu"
        ),
        "no_reuse_kvtier_time": bench.no_reuse.costs,
    }
    if bench.sizes.gpu_ratio:
        headline.update(
            serving_gpu_ratio.headline(outcomes, cycles, c, bench.policies, gpu_ratios or {})
        )
    targets = {}
    for key, (op, bound) in TARGETS.items():
        value = headline[key]
        met = None if value is None else target_met(value, op, bound)
        targets[key] = {"value": value, "target": f"{op} {bound:g}", "met": met}
    servers = {}
    for name, o in outcomes.items():
        servers[name] = {
            "label": o.case.label,
            "start_s": o.start_s,
            "wall_s": o.wall_s,
            "error": o.error or None,
            "log": o.log_path or str(bench.servers.root / name / "server.log"),
            "multi_round": [summary(lv) for lv in o.multi_round],
            "daemon_counters": o.daemon_counters,
            "load_decisions": o.load_decisions,
            "page_cache_drops": o.page_cache_drops,
            "no_reuse": [summary(lv) for lv in o.no_reuse],
        }
        if o.error:
            servers[name]["log_tail"] = o.log_tail
    return {
        "mode": bench.mode.name,
        "headline_concurrency": c,
        **headline,
        "targets": targets,
        "profile": profile,
        "servers": servers,
        "settings": {
            "model": bench.model.name,
            "model_label": bench.sizes.label,
            "load_policies": bench.policies,
            "draft": bench.draft.name,
            "kv_cache_bytes": bench.sizes.kv_cache_bytes,
            "max_model_len": bench.sizes.max_model_len,
            "block_size": BLOCK_SIZE,
            "blocks_per_chunk": bench.bpc,
            "arena_bytes": ARENA_BYTES,
            "object_store": OBJECT_STORE_SETUP,
            "working_set_bytes": bench.servers.working_set_bytes,
            "multi_round": {
                "users": USERS * bench.sizes.level_scale,
                "doc_tokens": bench.sizes.doc_tokens,
                "question_tokens": bench.sizes.question_tokens,
                "answer_tokens": bench.sizes.answer_tokens,
                "rounds": ROUNDS,
                "working_set_tokens": USERS * bench.workload().longest_request(),
                "concurrency": list(bench.concurrency),
            },
            "no_reuse": {
                "cycles": bench.mode.no_reuse_cycles,
                "requests": bench.no_reuse.requests,
                "backlog_requests": bench.no_reuse.backlog,
            },
            "connector_extra": bench.connector_extra,
            "speculative_tokens": SPEC_TOKENS,
            "run_dir": str(bench.servers.root),
            "ttft_parts": TTFT_PARTS_SCOPE,
        },
        "_outcomes": outcomes,
    }


# -- output -----------------------------------------------------------------------------------


def _f(value: Any, fmt: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def _ms(seconds: float | None, fmt: str = ".0f") -> str:
    return _f(None if seconds is None else seconds * 1e3, fmt)


def _pct3(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


def tables(result: dict[str, Any]) -> str:
    lines = [
        f"## Multi-round ({result['settings']['multi_round']['users']} users x "
        f"{ROUNDS} rounds, working set {result['settings']['multi_round']['working_set_tokens']}"
        f" tokens, KV cache {result['settings']['kv_cache_bytes'] / MiB:.0f} MiB; "
        f"{result['settings']['model']}: {result['settings']['model_label']})",
        "",
        "| server | conc | out tok/s | tok/s/user | TTFT p50 ms | TTFT p99 ms | TTFT p50/p99 ms, "
        "rounds 2-4 | ITL p50 ms | hit ratio | kvtierd hit ratio | ok/sent |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["servers"].values():
        if s["error"]:
            lines.append(f"| {s['label']} | - | failed: {s['error'][:160]} | | | | | | | | |")
            continue
        for lv in s["multi_round"]:
            lines.append(
                f"| {s['label']} | {lv['concurrency']} | {_f(lv['output_tps'], '.1f')} | "
                f"{_f(lv['output_tps_per_user'], '.2f')} | {_ms(lv['ttft_p50_s'], '.0f')} | "
                f"{_ms(lv['ttft_p99_s'], '.0f')} | "
                f"{_ms(lv['ttft_p50_s_later_rounds'], '.0f')}/"
                f"{_ms(lv['ttft_p99_s_later_rounds'], '.0f')} | "
                f"{_ms(lv['itl_p50_s'], '.1f')} | "
                f"{_pct(lv['hit_ratio'])} | {_pct(lv['daemon_hit_ratio'])} | "
                f"{lv['ok']}/{lv['requests']} |"
            )
    lines += ttft_parts_table(result)
    lines += past_the_arena_table(result)
    if "gpu_ratio_targets" in result:
        lines += serving_gpu_ratio.tables(result)
    lines += ["", *no_reuse_table(result)]
    if "gpu_ratio_targets" in result:
        return "\n".join(lines)  # its own targets stand for the present model's
    lines += ["", "## Ratios", "", "| ratio | value | target | met |", "|---|---:|---:|---|"]
    for key, t in result["targets"].items():
        met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {key} | {_f(t['value'], '.3f')} | {t['target']} | {met} |")
    for key in (
        "throughput_vs_vllm_alone_embedded",
        "ttft_p50_vs_vllm_alone_embedded",
        "ttft_p99_vs_vllm_alone_embedded",
        "ttft_p50_vs_vllm_alone_later_rounds",
        "ttft_p99_vs_vllm_alone_later_rounds",
        "throughput_vs_offloading_connector",
        "throughput_vs_more_hbm",
        "kvtier_step_share",
    ):
        lines.append(f"| {key} | {_f(result.get(key), '.3f')} | | |")
    profile = result.get("profile") or {}
    if profile.get("steps"):
        lines += [
            "",
            f"Profile ({profile['kvtier_ranges']}): {profile['steps']} steps, "
            f"{profile['step_time_s']:.2f} s of step time, model forward "
            f"{profile['model_step_share']:.1%}, kvtier {profile['kvtier_step_share']:.1%} "
            f"({profile['kvtier_outside_steps_s']:.3f} s of kvtier outside steps).",
        ]
    return "\n".join(lines)


TTFT_PARTS = (("queue", "queue"), ("load_wait", "kvtier load wait"), ("prefill", "prefill"))
TTFT_PARTS += (("ttft", "TTFT"),)


def _mode_loads(server: dict[str, Any], mode: str) -> str:
    """The loads ``server``'s connector granted in ``mode`` over its levels ("-": none)."""
    loads = (server.get("load_decisions") or {}).get(f"vllm:kvtier_load_modes_total{{mode={mode}}}")
    return f"{loads:.0f}" if loads else "-"


def ttft_parts_table(result: dict[str, Any]) -> list[str]:
    """Per server at the headline concurrency: the mean and p90 of each part of a request's
    time to first token, from the engine's histograms."""
    rows = []
    for s in result["servers"].values():
        level = next(
            (lv for lv in s["multi_round"] if lv["concurrency"] == HEADLINE_CONCURRENCY), None
        )
        parts = level["ttft_parts"] if level else {}
        if parts:
            cells = [
                f"{_ms(p.get('mean_s'))}/{_ms(p.get('p90_s'))}" if p else "-"
                for p in (parts.get(part) for part, _ in TTFT_PARTS)
            ]
            requests = int((parts.get("ttft") or {}).get("requests") or 0)
            modes = [_mode_loads(s, mode) for mode in ("sync", "async")]
            cells.append("/".join(modes) if any(m != "-" for m in modes) else "-")
            rows.append(f"| {s['label']} | {requests} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        f"## Where the time to first token goes (concurrency {HEADLINE_CONCURRENCY}; "
        f"{result['settings']['ttft_parts']})",
        "",
        "Queue: arrival in the engine to first scheduled (an async load's wait lies inside it); "
        "kvtier load wait: over the requests that loaded a hit, first ask to the load landing; "
        "prefill: first scheduled to first token (a sync load's copy lies inside it); TTFT as "
        "vLLM's front end measures it; loads: the hits granted in each mode over the levels "
        "(`vllm:kvtier_load_modes_total`).",
        "",
        "| server | requests | "
        + " | ".join(f"{label} mean/p90 ms" for _, label in TTFT_PARTS)
        + " | loads sync/async |",
        "|---|---:|" + "---:|" * (len(TTFT_PARTS) + 1),
        *rows,
    ]


def past_the_arena_table(result: dict[str, Any]) -> list[str]:
    """The servers whose tiers hold less than the working set, beside the one whose arena holds
    it all and vLLM alone with the KV cache that holds it."""
    past = result.get("past_the_arena") or {}
    if not past:
        return []
    base = (past.get("kvtier_sidecar") or {}).get("output_tps")
    working_set = result["settings"]["working_set_bytes"]
    lines = [
        "",
        f"## Past the arena (concurrency {HEADLINE_CONCURRENCY}; working set "
        f"{working_set / MiB:.0f} MiB of chunks)",
        "",
        "| server | out tok/s | vs arena-backed | TTFT p50 ms | TTFT p99 ms | "
        "TTFT p50 ms, rounds 2-4 | kvtierd hits by tier (chunks) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in past.items():
        tiers = row.get("hit_chunks_by_tier") or {}
        lines.append(
            f"| {result['servers'][name]['label']} | {_f(row['output_tps'], '.1f')} | "
            f"{_f(row['output_tps'] / base if base and row['output_tps'] else None, '.3f')} | "
            f"{_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} | "
            f"{_ms(row['ttft_p50_s_later_rounds'])} | "
            + (", ".join(f"{t} {int(n)}" for t, n in sorted(tiers.items())) or "-")
            + " |"
        )
    if "object_store" in result["settings"]:
        lines += ["", f"Object store: {result['settings']['object_store']}."]
    return lines


def no_reuse_table(result: dict[str, Any]) -> list[str]:
    """Each cycle's output tokens/s by server, then each kvtier mode's ratios."""
    settings = result["settings"]["no_reuse"]
    lines = [
        f"## No reuse (every prompt unique, concurrency {HEADLINE_CONCURRENCY}, all servers up "
        f"at once, {settings['requests']} measured requests per level)",
        "",
    ]
    if result["no_reuse_error"]:
        lines += [f"Not measured: {result['no_reuse_error']}", ""]
    cycles = result["no_reuse_cycles"]
    names = [n for n in NO_REUSE_CASES if any(n in row for row in cycles)]
    if not cycles:
        return lines
    labels = [NO_REUSE_CASES[n].label for n in names]
    lines += [
        "| cycle | " + " | ".join(f"{label} tok/s" for label in labels) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i, row in enumerate(cycles):
        lines.append(f"| {i} | " + " | ".join(_f(row.get(n), ".1f") for n in names) + " |")
    lines += [
        "",
        "| over vLLM alone | cycles | mean | se | min | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names[1:]:
        ratios = no_reuse_ratios(cycles, name)
        values = ratios.values or [math.nan]
        lines.append(
            f"| {NO_REUSE_CASES[name].label} | {len(ratios.values)} | {_f(ratios.mean, '.3f')} | "
            f"{_f(ratios.se, '.3f')} | {_f(min(values), '.3f')} | {_f(max(values), '.3f')} |"
        )
    costs = result["no_reuse_kvtier_time"]
    if any(costs.get(name) for name in ("kvtier_embedded", "kvtier_sidecar")):
        lines += [
            "",
            "| kvtier's own time, mean over levels | levels | vLLM inside kvtier's hooks, "
            "share of wall time | the same, ms per request | kvtierd CPU, share of a core |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in ("kvtier_embedded", "kvtier_sidecar"):
            if costs.get(name):
                lines.append(
                    f"| {NO_REUSE_CASES[name].label} | {len(costs[name])} | "
                    f"{_pct3(mean_cost(costs[name], 'hooks'))} | "
                    f"{_f(mean_cost(costs[name], 'hooks_ms_per_request'), '.1f')} | "
                    f"{_pct3(mean_cost(costs[name], 'kvtierd_cpu'))} |"
                )
    return lines


def clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def write_docs(result: dict[str, Any], docs: Path) -> None:
    from kvtier.bench.plot import Curve, save_plot

    docs.mkdir(parents=True, exist_ok=True)
    curves = []
    for o in result["_outcomes"].values():
        levels = o.multi_round
        if not levels:
            continue
        curves.append(
            Curve(
                o.case.label,
                [lv.concurrency for lv in levels],
                [lv.output_tps for lv in levels],
                [lv.output_tps_per_user for lv in levels],
                [lv.ttft_s.p50 for lv in levels],
                [lv.ttft_s.p99 for lv in levels],
            )
        )
    if curves:
        save_plot(curves, docs / "serving.png")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [
        "# Whole-server benchmark: vLLM alone, kvtier, vLLM's connectors",
        "",
        f"`python -m benchmarks.serving` ({result['mode']} run, {stamp}, "
        f"{result['wall_s'] / 60:.0f} min; other processes used "
        f"{result['other_processes_cpu_share']:.0%} of the CPUs). What is measured and how: the "
        "docstring of benchmarks/serving.py.",
        "",
        "![throughput vs interactivity, TTFT vs concurrency](serving.png)",
        "",
        tables(result),
        "",
    ]
    (docs / "serving.md").write_text("\n".join(text))
