"""The tier benchmark's report: the samples of every chunk size, a run's figures against their
targets, and the tables that print them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.harness.sizes import MiB
from benchmarks.harness.stats import geomeans_across, medians_by_chunk_size
from benchmarks.harness.targets import judged, judged_cell, stated
from benchmarks.tiers_settings import BATCH, CHUNK_SIZES, TARGETS

if TYPE_CHECKING:
    from benchmarks.tiers import Bench


def result_of(
    bench: Bench, lookup_us: float, lookup_arena_us: float, phases: dict[str, float]
) -> dict[str, Any]:
    """The run's figures: per chunk size and their geometric means, lookups, lmdb's size after
    two passes, and the targets."""
    per_size = medians_by_chunk_size(bench.samples)
    out: dict[str, Any] = {
        "mode": bench.mode.name,
        "lmdb_preallocate": bench.preallocate,
        "chunk_sizes_bytes": list(CHUNK_SIZES),
        "working_set_bytes": bench.total,
        "repetitions": bench.mode.reps,
        "chunks_per_txn": BATCH,
    }
    out.update(geomeans_across(per_size))
    out["lookup_8192_keys_us"] = lookup_us
    out["lookup_8192_keys_arena_only_us"] = lookup_arena_us
    out["lookup_runs"] = bench.mode.lookup_runs
    out["per_chunk_size"] = per_size
    # about one working set plus page overhead: the second pass reused the freed pages
    out["lmdb_env_bytes_after_two_passes"] = {
        f"{chunk // MiB}MiB": size for chunk, size in bench.env_bytes.items()
    }
    out["targets"] = stated(TARGETS)
    out["targets_met"] = judged(out, TARGETS)
    out["elapsed_s"] = phases
    return out


ROWS = (
    ("memcpy_gbps", "memcpy", "GB/s"),
    ("arena_store_gbps", "arena store", "GB/s"),
    ("arena_load_gbps", "arena load", "GB/s"),
    ("disk_write_gbps", "disk write, new file", "GB/s"),
    ("lmdb_write_gbps", "lmdb put_many, fresh env", "GB/s"),
    ("disk_overwrite_gbps", "disk overwrite", "GB/s"),
    ("lmdb_write_steady_gbps", "lmdb put_many, reused pages", "GB/s"),
    ("lmdb_hot_read_gbps", "lmdb read_into, hot", "GB/s"),
    ("verify_gbps", "blockfmt.decode", "GB/s"),
    ("arena_store_vs_memcpy", "arena store / memcpy", "x"),
    ("arena_load_vs_memcpy", "arena load / memcpy", "x"),
    ("lmdb_write_vs_disk", "lmdb write / disk write", "x"),
    ("lmdb_write_steady_vs_disk_overwrite", "lmdb steady / disk overwrite", "x"),
    ("lmdb_hot_read_vs_memcpy", "lmdb hot read / memcpy", "x"),
)


def table(result: dict[str, Any]) -> str:
    sizes = list(result["per_chunk_size"])
    head = f"{'':34}" + "".join(f"{s:>9}" for s in sizes) + f"{'overall':>9}  target"
    lines = [
        f"kvtier tiers, {result['mode']} mode: {result['working_set_bytes'] // MiB} MiB working "
        f"set, {result['repetitions']} repetitions, medians",
        head,
        "-" * len(head),
    ]
    for key, label, unit in ROWS:
        cells = "".join(f"{result['per_chunk_size'][s][key]:9.2f}" for s in sizes)
        target = judged_cell(TARGETS, result["targets_met"], key)
        lines.append(f"{label + ' (' + unit + ')':34}{cells}{result[key]:9.2f}  {target}")
    for key in ("lookup_8192_keys_us", "lookup_8192_keys_arena_only_us"):
        target = judged_cell(TARGETS, result["targets_met"], key)
        label = "lookup 8192 keys (us)" if key in TARGETS else "  with lmdb disabled (us)"
        lines.append(f"{label:34}{'':{9 * len(sizes)}}{result[key]:9.0f}  {target}")
    lines.append(f"elapsed: {result['elapsed_s']['total_s']:.1f} s")
    return "\n".join(lines)


DURABILITY_ROWS = (
    ("disk_write_gbps", "disk write, new file"),
    ("lmdb_write_fast_gbps", "lmdb durability: fast"),
    ("disk_write_synced_gbps", "disk write, fdatasync / 8 chunks"),
    ("lmdb_write_consistent_gbps", "lmdb durability: consistent"),
    ("lmdb_write_full_gbps", "lmdb durability: full"),
)


def durability_table(result: dict[str, Any]) -> str:
    sizes = list(result["per_chunk_size"])
    head = f"{'':36}" + "".join(f"{s:>20}" for s in sizes)
    lines = [
        f"lmdb durability, {result['mode']} mode: {result['working_set_bytes'] // MiB} MiB "
        f"working set, {result['repetitions']} repetitions, GB/s median [min-max], "
        "x: median ratio to the disk baseline timed right before",
        head,
        "-" * len(head),
    ]
    for key, label in DURABILITY_ROWS:
        cells = ""
        for size in sizes:
            row = result["per_chunk_size"][size]
            cells += f"{row[key]:7.2f} [{row[key + '_min']:.2f}-{row[key + '_max']:.2f}]".rjust(20)
        lines.append(f"{label:36}{cells}")
    for name in ("fast", "consistent", "full"):
        ratio = next(k for k in result if k.startswith(f"lmdb_write_{name}_vs_"))
        cells = "".join(f"{result['per_chunk_size'][s][ratio]:19.2f}x" for s in sizes)
        lines.append(f"{ratio.removeprefix('lmdb_write_'):36}{cells}")
    lines.append(f"elapsed: {result['elapsed_s']['total_s']:.1f} s")
    return "\n".join(lines)
