"""The daemon benchmark's report: the samples of every chunk size, a run's figures against their
targets, and the table that prints them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.daemon_settings import BATCH, CHUNK_SIZES, STORE_BATCH, STORE_CHUNK, TARGETS
from benchmarks.harness.sizes import MiB
from benchmarks.harness.stats import geomeans_across, medians_by_chunk_size
from benchmarks.harness.targets import judged, judged_cell, stated

if TYPE_CHECKING:
    from benchmarks.daemon import Bench


def result_of(bench: Bench) -> dict[str, Any]:
    """The run's figures: per chunk size and their geometric means, lookups, the store path,
    calls per chunk, the daemon's start and stop, and the targets."""
    per_size = medians_by_chunk_size(bench.samples)
    out: dict[str, Any] = {
        "mode": bench.mode.name,
        "chunk_sizes_bytes": list(CHUNK_SIZES),
        "working_set_bytes": bench.total,
        "repetitions": bench.mode.reps,
        "chunks_per_call": BATCH,
        "lookup_runs_per_round": bench.mode.lookup_runs,
        "store_commit_keys_per_call": STORE_BATCH,
        "store_commit_chunk_bytes": STORE_CHUNK,
        "store_commit_repetitions": bench.mode.store_reps,
    }
    out.update(geomeans_across(per_size))
    out.update(bench.figures)
    chunks = bench.rpc["chunks"]
    out["rpc_per_chunk_store"] = bench.rpc["store_calls"] / chunks
    out["rpc_per_chunk_load"] = bench.rpc["load_calls"] / chunks
    out["rpc_per_chunk"] = max(out["rpc_per_chunk_store"], out["rpc_per_chunk_load"])
    out["per_chunk_size"] = per_size
    out["daemon"] = bench.daemon_figures
    out["targets"] = stated(TARGETS)
    out["targets_met"] = judged(out, TARGETS)
    bench.phases["total_s"] = sum(bench.phases.values())
    out["elapsed_s"] = bench.phases
    return out


SIZE_ROWS = (
    ("memcpy_gbps", "memcpy, client A", "GB/s"),
    ("arena_store_gbps", "arena store, client A", "GB/s"),
    ("arena_load_gbps", "arena load, client B", "GB/s"),
    ("arena_transfer_gbps", "A -> B, slower side", "GB/s"),
    ("arena_transfer_serial_gbps", "A -> B, both phases", "GB/s"),
    ("arena_store_vs_memcpy", "arena store / memcpy", "x"),
    ("arena_load_vs_memcpy", "arena load / memcpy", "x"),
    ("cross_process_arena_vs_memcpy", "A -> B / memcpy", "x"),
    ("arena_store_no_checksum_gbps", "arena store, no checksum", "GB/s"),
    ("commit_checksum_arena_store_ratio", "store, checksum / none", "x"),
)
ROWS = (
    ("lookup_8192_keys_p50_us", "lookup 8192 keys, p50", "us", ".0f"),
    ("lookup_8192_keys_p99_us", "lookup 8192 keys, p99", "us", ".0f"),
    ("lookup_8192_keys_mean_us", "lookup 8192 keys, mean", "us", ".0f"),
    ("lookup_1_key_p50_us", "lookup 1 key, p50", "us", ".0f"),
    ("store_commit_chunks_per_s", "reserve + commit", "chunks/s", ".0f"),
    ("store_commit_chunks_per_s_no_checksum", "same, no checksum", "chunks/s", ".0f"),
    ("commit_checksum_store_ratio", "same, checksum / none", "x", ".3f"),
    ("rpc_per_chunk_store", "calls per chunk, store", "", ".4f"),
    ("rpc_per_chunk_load", "calls per chunk, load", "", ".4f"),
    ("rpc_per_chunk", "calls per chunk", "", ".4f"),
)


def target_cell(result: dict[str, Any], key: str) -> str:
    return judged_cell(TARGETS, result["targets_met"], key)


def table(result: dict[str, Any]) -> str:
    sizes = list(result["per_chunk_size"])
    head = f"{'':34}" + "".join(f"{s:>9}" for s in sizes) + f"{'overall':>9}  target"
    lines = [
        f"kvtierd data plane, {result['mode']} mode: {result['working_set_bytes'] // MiB} MiB "
        f"working set, {result['repetitions']} repetitions, {result['chunks_per_call']} chunks "
        "per call, medians",
        head,
        "-" * len(head),
    ]
    for key, label, unit in SIZE_ROWS:
        cells = "".join(f"{result['per_chunk_size'][s][key]:9.2f}" for s in sizes)
        lines.append(
            f"{label + ' (' + unit + ')':34}{cells}{result[key]:9.2f}  {target_cell(result, key)}"
        )
    for key, label, unit, fmt in ROWS:
        name = f"{label} ({unit})" if unit else label
        value = format(result[key], fmt)
        lines.append(f"{name:34}{'':{9 * len(sizes)}}{value:>9}  {target_cell(result, key)}")
    daemon = result["daemon"]
    lines.append(
        f"kvtierd: ready in {daemon['start_s']:.2f} s, exited {daemon['exit_code']} "
        f"{daemon['shutdown_s']:.2f} s after SIGTERM"
    )
    lines.append(f"elapsed: {result['elapsed_s']['total_s']:.1f} s")
    return "\n".join(lines)
