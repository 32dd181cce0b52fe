"""What each tier's load and a recompute cost on a GPU node, for the fleet simulation: this
machine's measured efficiencies (each tier's throughput against the raw limit it runs on, from
`benchmarks/tiers.py` and `benchmarks/objstore.py`) applied to the published limits of a GPU
node, named below with their sources. Where a figure is an assumption rather than a published
limit, it says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# -- the GPU node -------------------------------------------------------------------------------

GPU_FIGURES: dict[str, tuple[float, str]] = {
    "model_params": (8.03e9, "Llama-3.1-8B: 8.03 B parameters (its model card)"),
    "kv_bytes_per_token": (
        131072.0,
        "Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes",
    ),
    "gpu_bf16_flops": (989e12, "H100 SXM dense bf16 tensor throughput (NVIDIA H100 datasheet)"),
    "prefill_mfu": (0.5, "assumed: half the tensor peak in prefill"),
    "pcie_bytes_per_s": (64e9, "H100 SXM host link, PCIe Gen5 x16: 64 GB/s a direction"),
    "nvme_bytes_per_s": (6.9e9, "a PCIe Gen4 data-centre NVMe drive's sequential read"),
    "network_bytes_per_s": (12.5e9, "assumed: 100 Gb/s from each node to the object store"),
    "object_latency_s": (
        0.03,
        "S3 first byte: AWS's S3 performance guidance puts small requests' median latency in "
        "the tens of milliseconds",
    ),
    "decode_s_per_token": (0.025, "assumed: a 25 ms decode step at the batch an engine runs"),
    "request_latency_s": (
        0.025,
        "assumed: one engine step (a decode step's time) that every request waits past its "
        "loads and prefill: the step in flight when it arrives, scheduling, the API server",
    ),
    "block_tokens": (16, "vLLM's default KV cache block size on CUDA (`--block-size`)"),
    "gpu_cache_bytes": (40e9, "assumed: 40 GB of an 80 GB H100 left to the prefix cache"),
    "arena_bytes": (512e9, "assumed: 512 GB of pinned host memory per 8-GPU node"),
    "lmdb_bytes": (4e12, "assumed: 4 TB of NVMe per node for lmdb"),
}

# -- this machine -------------------------------------------------------------------------------

MEASURED_HERE: dict[str, tuple[float, str]] = {
    "arena_load_vs_memcpy": (1.05, "benchmarks/tiers.py --quick, 2026-12-05"),
    "lmdb_read_in_vs_prompt_kv": (1.21, "benchmarks/ttft.py, 2026-12-04 (1.19 to 1.23)"),
    "download_vs_raw_boto3": (0.98, "benchmarks/objstore.py --quick, 2026-12-05"),
}
"""Efficiencies measured here, each against the raw limit in the same run; a JSON file from the
benchmark (`--measured`) replaces them."""


@dataclass(frozen=True)
class NodeCosts:
    """Seconds, per chunk of ``chunk_tokens``."""

    chunk_tokens: int
    chunk_bytes: int
    prefill_s_per_token: float
    load_s_per_chunk: dict[str, float]
    """cpu: from the arena; lmdb: read from lmdb's map, then copied; object: downloaded into lmdb,
    then as lmdb."""
    load_latency_s: dict[str, float]
    """Paid once per request that loads from the tier."""
    decode_s_per_token: float
    upload_delay_s: float
    """From a chunk's store to its object being readable by other nodes."""
    request_latency_s: float = 0.0
    """What every request waits past its loads and prefill before its first token is out (the
    engine is not busy for it)."""
    probe_miss_s: float = 0.0
    """What a lookup waits to hear that the object store holds none of a prompt's chunks past
    those the tiers hold (a probe that finds nothing): before its loads and prefill."""

    def load_s(self, tier: str, chunks: int) -> float:
        if chunks <= 0:
            return 0.0
        return self.load_latency_s.get(tier, 0.0) + chunks * self.load_s_per_chunk[tier]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measured(paths: list[Path]) -> dict[str, float]:
    values = {name: value for name, (value, _) in MEASURED_HERE.items()}
    for path in paths:
        found = json.loads(path.read_text())
        values.update({k: float(found[k]) for k in MEASURED_HERE if k in found})
    return values


def gpu_node(chunk_tokens: int = 256, here: dict[str, float] | None = None) -> NodeCosts:
    g = {name: value for name, (value, _) in GPU_FIGURES.items()}
    m = here or measured([])
    chunk_bytes = int(chunk_tokens * g["kv_bytes_per_token"])
    # an efficiency past 1 (the tier beat this machine's memcpy) is taken as 1 on the link
    copy = chunk_bytes / (g["pcie_bytes_per_s"] * min(1.0, m["arena_load_vs_memcpy"]))
    read = chunk_bytes * m["lmdb_read_in_vs_prompt_kv"] / g["nvme_bytes_per_s"]
    download = chunk_bytes / (g["network_bytes_per_s"] * min(1.0, m["download_vs_raw_boto3"]))
    return NodeCosts(
        chunk_tokens=chunk_tokens,
        chunk_bytes=chunk_bytes,
        prefill_s_per_token=2 * g["model_params"] / (g["gpu_bf16_flops"] * g["prefill_mfu"]),
        load_s_per_chunk={"cpu": copy, "lmdb": read + copy, "object": download + read + copy},
        load_latency_s={"object": g["object_latency_s"]},
        decode_s_per_token=g["decode_s_per_token"],
        upload_delay_s=2.0,
        request_latency_s=g["request_latency_s"],
        # a miss is a GET the store answers with 404: one round trip, as a hit's first byte
        probe_miss_s=g["object_latency_s"],
    )


def capacities(costs: NodeCosts) -> dict[str, int]:
    """Chunks each level holds: per engine (gpu), per node (arena, lmdb)."""
    g = {name: value for name, (value, _) in GPU_FIGURES.items()}
    return {
        "gpu": int(g["gpu_cache_bytes"] // costs.chunk_bytes),
        "arena": int(g["arena_bytes"] // costs.chunk_bytes),
        "lmdb": int(g["lmdb_bytes"] // costs.chunk_bytes),
    }


def with_upload_delay(costs: NodeCosts, seconds: float) -> NodeCosts:
    return replace(costs, upload_delay_s=seconds)
