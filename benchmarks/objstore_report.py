"""The object benchmark's report: a run's figures against their targets, and the table that
prints them."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from benchmarks.harness.sizes import MiB
from benchmarks.harness.targets import judged, ok_or_missed, stated
from benchmarks.objstore_settings import CHUNK, LOOKUP_SLACK_MS, TARGETS

if TYPE_CHECKING:
    from benchmarks.objstore import Bench


def result_of(bench: Bench, lookups: dict[str, Any], phases: dict[str, float]) -> dict[str, Any]:
    """The run's figures: throughputs, ratios to boto3, CPU per MB, lookups, and the targets."""
    out: dict[str, Any] = {
        "mode": bench.mode.name,
        "object_bytes": bench.object_bytes,
        "chunk_bytes": CHUNK,
        "chunks_per_object": bench.chunks_per_object,
        "objects_per_repetition": bench.mode.objects,
        "upload_concurrency": bench.up_threads,
        "download_concurrency": bench.down_threads,
        "repetitions": bench.mode.reps,
    }
    cpu: dict[str, float] = {}
    server_cpu: dict[str, float] = {}
    for name, values in bench.samples.rates.items():
        if name.endswith("_server_cpu_ms_per_mb"):
            server_cpu[name.removesuffix("_server_cpu_ms_per_mb")] = statistics.median(values)
        elif name.endswith("_cpu_ms_per_mb"):
            cpu[name.removesuffix("_cpu_ms_per_mb")] = statistics.median(values)
        else:
            out[name] = statistics.median(values)
    for name, values in bench.samples.ratios.items():
        out[name] = statistics.median(values)
    out["client_cpu_ms_per_mb"] = cpu
    out["server_cpu_ms_per_mb"] = server_cpu
    out.update(lookups)
    targets = stated(TARGETS)
    met = judged(out, TARGETS)
    bound = lookups["lookup_budget_ms"] + LOOKUP_SLACK_MS
    targets["lookup_budget_p99_ms"] = f"<= {bound:g} (budget + {LOOKUP_SLACK_MS:g})"
    met["lookup_budget_p99_ms"] = bool(lookups["lookup_budget_p99_ms"] <= bound)
    out["targets"] = targets
    out["targets_met"] = met
    out["elapsed_s"] = phases
    return out


TRANSFER_ROWS = (
    ("raw_put", "boto3 put_object"),
    ("tier_put", "ObjectTier.put_pack"),
    ("uploader_put", "Uploader, offer until idle"),
    ("raw_get", "boto3 get_object"),
    ("tier_fetch", "ObjectTier.fetch"),
    ("raw_range_get", "boto3 get_object, 1-chunk range"),
    ("tier_read_into", "ObjectTier.read_into"),
)
RATIO_ROWS = (
    ("upload_vs_raw_boto3", "put_pack / put_object"),
    ("uploader_vs_raw_boto3", "Uploader / put_object"),
    ("download_vs_raw_boto3", "fetch / get_object"),
    ("read_into_vs_raw_range", "read_into / ranged get_object"),
)
LOOKUP_ROWS = (
    ("lookup_fast_store_p50_ms", "lookup, store answering, p50"),
    ("lookup_fast_store_p99_ms", "lookup, store answering, p99"),
    ("lookup_budget_p50_ms", "lookup, store delayed, p50"),
    ("lookup_budget_p99_ms", "lookup, store delayed, p99"),
    ("lookup_budget_max_ms", "lookup, store delayed, max"),
)


def table(result: dict[str, Any]) -> str:
    def target(key: str) -> str:
        if key not in result["targets"]:
            return ""
        return f"  {result['targets'][key]}  {ok_or_missed(result['targets_met'][key])}"

    lines = [
        f"kvtier object tier vs boto3 on moto, {result['mode']} mode: "
        f"{result['objects_per_repetition']} objects of {result['object_bytes'] // MiB} MiB "
        f"({result['chunks_per_object']} chunks of {result['chunk_bytes'] // MiB} MiB), "
        f"{result['upload_concurrency']} upload / {result['download_concurrency']} download "
        f"threads, {result['repetitions']} repetitions, medians",
    ]
    head = f"{'':36}{'MB/s':>8}{'client CPU':>12}{'moto CPU':>10}  (ms per MB)"
    lines += [head, "-" * len(head)]
    for key, label in TRANSFER_ROWS:
        lines.append(
            f"{label:36}{result[key + '_mbps']:8.0f}{result['client_cpu_ms_per_mb'][key]:12.2f}"
            f"{result['server_cpu_ms_per_mb'][key]:10.2f}"
        )
    lines.append("")
    for key, label in RATIO_ROWS:
        lines.append(f"{label + ' (x)':36}{result[key]:8.2f}{target(key)}")
    lines += [
        "",
        f"lookups of {result['lookup_keys']} keys, {result['lookups']} per series; the store "
        f"delayed by {result['lookup_store_delay_ms']:.0f} ms; object.lookup_budget_ms "
        f"{result['lookup_budget_ms']:g}; answered pending: "
        f"{result['lookup_pending_fraction']:.0%}",
    ]
    for key, label in LOOKUP_ROWS:
        lines.append(f"{label + ' (ms)':36}{result[key]:8.1f}{target(key)}")
    lines.append(f"elapsed: {result['elapsed_s']['total_s']:.1f} s")
    return "\n".join(lines)
