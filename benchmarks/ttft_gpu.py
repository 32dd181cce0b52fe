"""The TTFT benchmark's GPU variant: copies between GPU blocks and the arena against
``cudaMemcpyAsync`` from pinned memory, per block size."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.buffers import no_gc
from benchmarks.harness.cli import emit
from benchmarks.harness.sizes import KiB, MiB
from benchmarks.harness.stats import median
from benchmarks.harness.targets import Target, judged, ok_or_missed, stated
from benchmarks.ttft_cases import Mode
from kvtier.core.config import ArenaConfig
from kvtier.core.keys import NamespaceSpec, PageLayout, Pool, make_key
from kvtier.core.pools import PoolRegistry

log = logging.getLogger("kvtier.bench")

GPU_BLOCKS = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
GPU_EXTENT = 32 * MiB
GPU_TARGETS: dict[str, Target] = {
    "gpu_to_arena_vs_peak": (">=", 0.8),
    "arena_to_gpu_vs_peak": (">=", 0.8),
}


class NoGpuError(RuntimeError):
    pass


def gpu_spec(block_bytes: int) -> NamespaceSpec:
    # one layer of 16 tokens x 8 heads x (128 + 128) x bf16 is a 64 KiB page
    layout = PageLayout(
        tokens_per_block=16,
        blocks_per_chunk=max(1, block_bytes // (64 * KiB)),
        num_kv_heads=8,
        head_sizes=(128, 128),
        layer_names=("model.layers.0.self_attn.attn",),
    )
    return NamespaceSpec(
        model=f"bench-gpu-{block_bytes}",
        model_revision="r1",
        pool=Pool.TARGET,
        kv_dtype="bfloat16",
        layout=layout,
    )


class GpuBench:
    """Block copies between a CUDA device and a cudaHostRegister'ed kvtier arena."""

    def __init__(self, mode: Mode, headline_block: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise NoGpuError(
                "--gpu needs a CUDA device: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); nothing was measured"
            )
        from kvtier.tiers.cpu import CpuTier

        self.torch = torch
        self.mode = mode
        self.total = mode.gpu_working_set
        self.blocks = tuple(sorted({*GPU_BLOCKS, headline_block}))
        self.headline = headline_block
        self.device = torch.device("cuda")
        self.shm = Path(f"/dev/shm/kvtier-ttft-gpu-{os.getpid()}")
        self.registered = False
        registry = PoolRegistry()
        self.regs = {b: registry.register(gpu_spec(b), b) for b in self.blocks}
        # every block size keeps its own extents, so the arena holds one working set per size
        size = len(self.blocks) * self.total + 2 * GPU_EXTENT
        config = ArenaConfig(
            path=self.shm, size_bytes=size, extent_bytes=GPU_EXTENT, min_slot_bytes=64 * KiB
        )
        self.cpu = CpuTier(config, registry)
        try:
            memory = self.cpu.memory
            self.arena_bytes = memory.size
            self.arena = torch.frombuffer(memory.view(0, memory.size), dtype=torch.uint8)
            err = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), memory.size, 0)
            torch.cuda.check_error(err)
            self.registered = True
            self.pinned = torch.empty(self.total, dtype=torch.uint8, pin_memory=True)
            self.src = torch.randint(0, 256, (self.total,), dtype=torch.uint8, device=self.device)
            self.dst = torch.empty(self.total, dtype=torch.uint8, device=self.device)
            self.stream = torch.cuda.Stream()
        except BaseException:
            self.close()
            raise

    def timed(self, copies: Any) -> float:
        """Seconds between CUDA events around ``copies()`` on the dedicated stream."""
        torch = self.torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream), no_gc():
            start.record(self.stream)
            copies()
            end.record(self.stream)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def peak(self, to_host: bool) -> float:
        if to_host:
            return self.timed(lambda: self.pinned.copy_(self.src, non_blocking=True))
        return self.timed(lambda: self.dst.copy_(self.pinned, non_blocking=True))

    def run_block(self, block: int) -> dict[str, Any]:
        torch = self.torch
        n = self.total // block
        reg = self.regs[block]
        keys = [make_key(reg.namespace, i.to_bytes(32, "big")) for i in range(n)]
        # a paged cache hands out blocks in no particular order
        order = torch.randperm(n, generator=torch.Generator().manual_seed(block)).tolist()
        arena, src, dst = self.arena, self.src, self.dst
        d2h: list[float] = []
        h2d: list[float] = []
        ratio_d2h: list[float] = []
        ratio_h2d: list[float] = []
        for rep in range(self.mode.gpu_reps + 1):
            refs = self.cpu.reserve(keys)
            if any(ref is None for ref in refs):
                raise RuntimeError(f"the arena granted {sum(r is not None for r in refs)} of {n}")
            offsets = [ref.offset for ref in refs if ref is not None]

            def store(offsets: list[int] = offsets) -> None:
                for off, i in zip(offsets, order, strict=True):
                    arena[off : off + block].copy_(src[i * block : (i + 1) * block], True)

            peak_d2h = self.peak(to_host=True)
            t_d2h = self.timed(store)
            self.cpu.commit([ref for ref in refs if ref is not None])
            leases = self.cpu.lease(keys)
            if any(ref is None for ref in leases):
                raise RuntimeError("the arena lost chunks it committed")
            lease_offsets = [ref.offset for ref in leases if ref is not None]

            def load(offsets: list[int] = lease_offsets) -> None:
                for off, i in zip(offsets, order, strict=True):
                    dst[i * block : (i + 1) * block].copy_(arena[off : off + block], True)

            if rep == 0:
                dst.zero_()
            peak_h2d = self.peak(to_host=False)
            t_h2d = self.timed(load)
            if rep == 0 and not torch.equal(dst, src):
                raise RuntimeError("the round trip through the arena changed the bytes")
            self.cpu.release([ref for ref in leases if ref is not None])
            if self.cpu.delete(keys) != n:
                raise RuntimeError("the arena still holds leased chunks")
            if rep == 0:
                continue  # warm-up: extents assigned, copies and events initialised
            d2h.append(self.total / t_d2h / 1e9)
            h2d.append(self.total / t_h2d / 1e9)
            ratio_d2h.append(peak_d2h / t_d2h)
            ratio_h2d.append(peak_h2d / t_h2d)
        return {
            "block_bytes": block,
            "blocks": n,
            "gpu_to_arena_gbps": median(d2h),
            "arena_to_gpu_gbps": median(h2d),
            "gpu_to_arena_vs_peak": median(ratio_d2h),
            "arena_to_gpu_vs_peak": median(ratio_h2d),
        }

    def run(self) -> dict[str, Any]:
        torch = self.torch
        started = time.perf_counter()
        peaks_d2h = [self.total / self.peak(to_host=True) / 1e9 for _ in range(self.mode.gpu_reps)]
        peaks_h2d = [self.total / self.peak(to_host=False) / 1e9 for _ in range(self.mode.gpu_reps)]
        per_block = {f"{b >> 10}KiB": self.run_block(b) for b in self.blocks}
        head = per_block[f"{self.headline >> 10}KiB"]
        out: dict[str, Any] = {
            "mode": self.mode.name,
            "device": torch.cuda.get_device_name(self.device),
            "torch": torch.__version__,
            "working_set_bytes": self.total,
            "repetitions": self.mode.gpu_reps,
            "arena_bytes": self.arena_bytes,
            "arena_registered_pinned": bool(self.arena.is_pinned()),
            "peak_gpu_to_host_gbps": median(peaks_d2h),
            "peak_host_to_gpu_gbps": median(peaks_h2d),
            "headline_block_bytes": self.headline,
            "gpu_to_arena_gbps": head["gpu_to_arena_gbps"],
            "arena_to_gpu_gbps": head["arena_to_gpu_gbps"],
            "gpu_to_arena_vs_peak": head["gpu_to_arena_vs_peak"],
            "arena_to_gpu_vs_peak": head["arena_to_gpu_vs_peak"],
            "per_block": per_block,
        }
        out["targets"] = stated(GPU_TARGETS)
        out["targets_met"] = judged(out, GPU_TARGETS)
        out["elapsed_s"] = time.perf_counter() - started
        return out

    def close(self) -> None:
        torch = self.torch
        torch.cuda.synchronize()
        if self.registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr()))
            self.registered = False
        self.__dict__.pop("arena", None)
        gc.collect()  # the arena file cannot be unmapped while a tensor still views it
        self.cpu.close()
        self.shm.unlink(missing_ok=True)


def gpu_table(result: dict[str, Any]) -> str:
    lines = [
        f"GPU <-> kvtier arena, {result['mode']} mode on {result['device']}: "
        f"{result['working_set_bytes'] // MiB} MiB working set, {result['repetitions']} "
        "repetitions, medians",
        f"peak cudaMemcpyAsync, pinned buffer: GPU->host {result['peak_gpu_to_host_gbps']:.1f} "
        f"GB/s, host->GPU {result['peak_host_to_gpu_gbps']:.1f} GB/s; arena registered as "
        f"pinned: {result['arena_registered_pinned']}",
        f"{'block':>8}{'GPU->arena GB/s':>17}{'vs peak':>9}{'arena->GPU GB/s':>17}{'vs peak':>9}",
    ]
    for name, row in result["per_block"].items():
        lines.append(
            f"{name:>8}{row['gpu_to_arena_gbps']:17.1f}{row['gpu_to_arena_vs_peak']:9.2f}"
            f"{row['arena_to_gpu_gbps']:17.1f}{row['arena_to_gpu_vs_peak']:9.2f}"
        )
    for key, (op, bound) in GPU_TARGETS.items():
        verdict = ok_or_missed(result["targets_met"][key])
        head = result["headline_block_bytes"] >> 10
        lines.append(f"{key} ({head} KiB blocks): {result[key]:.2f}  {op} {bound:g}  {verdict}")
    return "\n".join(lines)


def gpu_main(mode: Mode, headline_block: int, as_json: bool) -> int:
    try:
        bench = GpuBench(mode, headline_block)
    except NoGpuError as exc:
        print(f"ttft.py --gpu: {exc}", file=sys.stderr)
        return 2
    try:
        result = bench.run()
    finally:
        bench.close()
    emit(result, as_json, lambda: gpu_table(result))
    return 0
