"""The TTFT benchmark's report: the figures of a run as one result (its cases, ratios against
their targets, what each load read in) and the table that prints them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks import hybrid_ttft
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import MiB
from benchmarks.harness.stats import median
from benchmarks.harness.system import (
    fs_type,
)
from benchmarks.harness.targets import judged, ok_or_missed, stated
from benchmarks.ttft_cases import PROMPT_TOKENS, TARGETS

if TYPE_CHECKING:
    from benchmarks.ttft import Bench


def report(bench: Bench, best: int, daemons: list[Kvtierd]) -> dict[str, Any]:
    c = bench.cases
    arena, lmdb = c[f"arena_hit_bpc{best}"], c[f"lmdb_cold_hit_bpc{best}"]
    out: dict[str, Any] = {
        "mode": bench.mode.name,
        "model": bench.model.name,
        "prompt_tokens": PROMPT_TOKENS,
        "prompts": len(bench.prompts),
        "block_size": bench.block_size,
        "blocks_per_chunk_tried": bench.bpcs,
        "connector_extra": bench.connector_extra,
        "best_blocks_per_chunk": best,
        "kv_bytes_per_prompt": bench.full_hit(bench.block_size) * bench.kv_per_token,
        "cold_ms": c["cold"].ms,
        "gpu_prefix_hit_ms": c["gpu_prefix_hit"].ms,
        "arena_hit_ms": arena.ms,
        "lmdb_cold_hit_ms": lmdb.ms,
        "example_connector_warm_ms": c["example_connector_warm"].ms,
        "example_connector_cold_ms": c["example_connector_cold"].ms,
    }
    out["arena_hit_vs_gpu_prefix_hit"] = arena.ms / c["gpu_prefix_hit"].ms
    out["arena_hit_vs_example_connector"] = arena.ms / c["example_connector_warm"].ms
    out["lmdb_cold_hit_vs_example_connector_cold"] = lmdb.ms / c["example_connector_cold"].ms
    out["arena_hit_vs_cold"] = arena.ms / c["cold"].ms
    out["miss_path_overhead"] = bench.miss["overhead"]
    for key in hybrid_ttft.TARGETS:
        out[key] = bench.hybrid[key]
    out["targets"] = stated(TARGETS)
    out["targets_met"] = judged(out, TARGETS)
    hits = {
        "cold": c["cold"].hits_ok,
        "gpu_prefix_hit": c["gpu_prefix_hit"].hits_ok,
        "arena_hit": arena.hits_ok,
        "lmdb_cold_hit": lmdb.hits_ok,
        "example_connector_warm": c["example_connector_warm"].hits_ok,
        "example_connector_cold": c["example_connector_cold"].hits_ok,
        "miss_path_all_missed": bench.miss["cached_tokens"] == 0,
        **bench.hybrid["hits_ok"],
    }
    out["hits_ok"] = hits
    out["all_ok"] = all(hits.values()) and all(out["targets_met"].values())
    out["cases"] = {
        "cold": c["cold"].summary(),
        "gpu_prefix_hit": c["gpu_prefix_hit"].summary(bench.cold_tokens),
        "example_connector_warm": c["example_connector_warm"].summary(bench.cold_tokens),
        "example_connector_cold": c["example_connector_cold"].summary(bench.cold_tokens),
        **{
            name: case.summary(bench.cold_tokens)
            for name, case in c.items()
            if name.startswith(("arena_hit_bpc", "lmdb_cold_hit_bpc"))
        },
    }
    out["blocks_per_chunk"] = list(bench.per_bpc.values())
    out["miss_path"] = bench.miss
    out["hybrid"] = bench.hybrid
    kv = out["kv_bytes_per_prompt"]
    example_cold = c["example_connector_cold"]
    out["lmdb_read_in_vs_prompt_kv"] = median(lmdb.read_in) / kv
    out["example_connector_cold_read_in_vs_prompt_kv"] = median(example_cold.read_in) / kv
    out["lmdb_resident_before_load"] = median(lmdb.resident)
    out["example_connector_cold_resident_before_load"] = median(example_cold.resident)
    out["disk_cold_read_ms"] = bench.disk_ms
    out["example_connector_bytes"] = bench.example_bytes
    out["storage_dir"] = str(bench.root)
    out["storage_fs"] = fs_type(bench.root)
    out["kvtierd_start_s"] = max(d.start_s for d in daemons)
    out["kvtierd_exit_code"] = next((d.exit_code for d in daemons if d.exit_code), 0)
    out["engine_start_s"] = {
        "median": median(bench.engine_starts),
        "max": max(bench.engine_starts),
        "engines": len(bench.engine_starts),
    }
    out["elapsed_s"] = bench.phases
    out["other_processes_cpu_share"] = bench.other_cpu
    return out


def table(result: dict[str, Any]) -> str:
    best = result["best_blocks_per_chunk"]
    cases = result["cases"]
    lines = [
        f"kvtier TTFT, {result['mode']} mode: {result['prompts']} prompts of "
        f"{result['prompt_tokens']} tokens, block size {result['block_size']}, "
        f"{result['model']}, medians",
        f"{'case':34}{'TTFT ms':>9}  cached / expected",
        "-" * 70,
    ]
    rows = (
        ("cold", "cold"),
        ("gpu_prefix_hit", "gpu_prefix_hit"),
        (f"arena_hit_bpc{best}", f"arena_hit (blocks_per_chunk {best})"),
        (f"lmdb_cold_hit_bpc{best}", f"lmdb_cold_hit (blocks_per_chunk {best})"),
        ("example_connector_warm", "example_connector_warm"),
        ("example_connector_cold", "example_connector_cold"),
    )
    for key, label in rows:
        case = cases[key]
        cached = min(case["cached_tokens"], default=0)
        verdict = "ok" if case["hits_ok"] else "WRONG"
        lines.append(
            f"{label:34}{case['ttft_ms']:9.1f}  {cached} / {case['expected_cached_tokens']} "
            f"(min) {verdict}"
        )
    lines.append("")
    for key, (op, bound) in TARGETS.items():
        verdict = ok_or_missed(result["targets_met"][key])
        lines.append(f"{key:42}{result[key]:8.3f}  {op} {bound:g}  {verdict}")
    lines.append("")
    lines.append("blocks_per_chunk    chunk   arena hit ms   lmdb cold hit ms   chunks stored")
    for row in result["blocks_per_chunk"]:
        mark = "  fastest" if row["blocks_per_chunk"] == best else ""
        lines.append(
            f"{row['blocks_per_chunk']:16}{row['chunk_bytes'] / MiB:7.2f}M"
            f"{row['arena_hit_ms']:15.1f}"
            f"{row['lmdb_cold_hit_ms']:19.1f}{row['chunks_stored']:10}/{row['chunks_expected']}"
            f"{mark}"
        )
    lines.extend(hybrid_ttft.table(result["hybrid"]))
    miss = result["miss_path"]
    lines.append(
        f"miss path ({miss['batch']}): {miss['without_connector_tokens_per_s']:.0f} tok/s without, "
        f"{miss['with_connector_tokens_per_s']:.0f} tok/s with the connector; outputs match: "
        f"{miss['outputs_match']}; embedded LMDB grew "
        f"{', '.join(f'{n / MiB:.0f}' for n in miss['lmdb_bytes_grown_while_timed'])} MiB "
        "while timed"
    )
    lines.append(
        f"cold loads read from disk (page cache growth / prompt KV): lmdb "
        f"{result['lmdb_read_in_vs_prompt_kv']:.2f}, ExampleConnector "
        f"{result['example_connector_cold_read_in_vs_prompt_kv']:.2f}; plain cold read of a "
        f"prompt's KV ({result['kv_bytes_per_prompt'] / MiB:.0f} MiB, {result['storage_fs']}): "
        f"{result['disk_cold_read_ms']:.1f} ms"
    )
    starts = result["engine_start_s"]
    other = result["other_processes_cpu_share"]
    lines.append(
        f"engines: {starts['engines']}, start {starts['median']:.1f} s median; "
        f"other processes used {other:.0%} of the CPUs"
        f"{' (figures disturbed)' if other > 0.1 else ''}; "
        f"elapsed: {result['elapsed_s']['total_s']:.1f} s"
    )
    return "\n".join(lines)
