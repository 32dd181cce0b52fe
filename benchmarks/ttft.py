"""Time to first token with kvtier, against recompute, vLLM's prefix cache and ExampleConnector.

Usage: ``python -m benchmarks.ttft [--quick] [--json] [--block-size N] [--blocks-per-chunk A,B]``
``[--connector-extra JSON] [--cache-dir DIR]``

With ``--gpu`` it measures GPU<->arena copy bandwidth instead (needs a CUDA device):
``python -m benchmarks.ttft --gpu [--quick] [--json]``

The model is built locally into ``--cache-dir`` (tests/fixtures/models.py,
``build_benchmark_llama``: 12 layers, hidden 768, 8 heads, 4 KV heads, head_dim 64, bf16, random
weights); nothing is downloaded. Every engine is an in-process vLLM engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, with the same KV size, block size and batch limit (a
whole prompt in one step), and is shut down before the next one starts. Prompts are random token
ids, 3600 tokens each, all distinct; every case times the same prompts.

A TTFT is the wall time of one ``llm.generate()`` of one prompt with ``max_tokens=1``. Every
engine first serves an untimed warm-up prompt down the same path as its timed ones, then times
each prompt (5; 3 with ``--quick``) in up to 3 passes (2 with ``--quick``), emptying vLLM's
prefix cache (``reset_prefix_cache``) between passes so the same prompts take the same path
again; each figure is the median over all of them. Every hit case checks the output's
``num_cached_tokens`` against the longest hit its path can give (3584 of 3600 tokens: the last
token is always computed and hits are whole blocks or chunks), and vLLM's external-hit counter
(``external_hit_tokens``) tells a connector hit from a local one.

- ``cold_ms``: a prompt not in the engine's prefix cache, no connector.
- ``gpu_prefix_hit_ms``: the same prompts again in that engine, after all the cold ones of the
  pass (so their KV is not in the CPU caches): vLLM's own prefix cache. The floor.
- ``arena_hit_ms``: kvtierd runs as a subprocess (``python -m kvtier.cli serve``), a new one for
  each ``blocks_per_chunk`` tried, and engines use the connector in sidecar mode. Engine 1
  computes and stores the prompts; engine 2, fresh, loads them from the daemon's arena. Measured
  for each ``blocks_per_chunk`` (``blocks_per_chunk`` rows); the headline is the one with the
  fastest arena hit, or the fewest blocks per chunk within ``SAME_WITHIN`` of it (finer chunks
  serve more of a partly shared prompt, and a sliding window skips more of them).
- ``lmdb_cold_hit_ms``: admin ``drain`` and ``evict(tier="cpu")`` leave the chunks in LMDB only;
  before each timed prompt the LMDB data file is fsynced and dropped from the page cache
  (``posix_fadvise(DONTNEED)``); engine 3, fresh, loads them (its workers read them from
  LMDB's map, ``lmdb_loads``). One pass only: pages read through an LMDB mapping (kvtierd's, the
  engine's) stay mapped there, and mapped pages are not dropped
  (``lmdb_resident_before_load``: share of data.mdb cached before a load, mostly chunks already
  loaded). ``lmdb_read_in_vs_prompt_kv``: bytes of data.mdb a
  load brought into the page cache (mincore before and after) over the prompt's KV bytes; about
  1 when the load really read from disk. ``disk_cold_read_ms`` is the floor for that: one
  sequential cold read of a prompt's KV bytes from a plain file on the same file system.
- ``example_connector_warm_ms``, ``example_connector_cold_ms``: vLLM's ``ExampleConnector`` (one
  safetensors file per layer and prompt) stores in one engine and loads in a fresh one with its
  files in the page cache, then in another fresh one with them dropped before each prompt.
- ``miss_path_overhead``: elapsed time of a batch generate (8 distinct prompts of 512 tokens,
  32 output tokens each, so every lookup misses and every chunk is stored) with the connector in
  embedded mode over the time without a connector, with the fastest ``blocks_per_chunk``: the
  mean of per-engine medians over engines run without, with, with, without (then the mirror of
  that in full mode), so that a steady drift of the machine's speed cancels.
  ``lmdb_bytes_grown_while_timed``: how much the embedded LMDB file grew during the timed
  batches of each engine with the connector, i.e. whether chunks were written to LMDB in the
  engine's process while it was timed (the connector's ``write_through``, or write-back once a
  slot class runs short of clean slots). ``outputs_match`` compares the greedy tokens with and
  without. ``--connector-extra`` adds settings to every KVTierConnector configuration.

The ratios are of medians. The run's files (LMDB, ExampleConnector's storage) go to a new
directory under ``--cache-dir``, which must be on a disk-backed file system for the cold cases to
mean anything (``storage_fs``); arenas go to /dev/shm. ``other_processes_cpu_share`` is the CPU
time other processes used during the run over the machine's capacity: on a shared machine every
figure above is only as good as that is low.

GPU variant (``--gpu``): a kvtier arena (CpuTier in /dev/shm) is registered with
``cudaHostRegister``; blocks of 64 KiB to 4 MiB of a working set (512 MiB with ``--quick``,
1 GiB otherwise) are copied one ``copy_(non_blocking=True)`` per block on a dedicated stream,
GPU->arena into reserved slots (GPU blocks in shuffled order, as a paged cache hands them out)
and arena->GPU from leased slots, timed with CUDA events, against one cudaMemcpyAsync of the
whole working set between a pinned host buffer and the device, timed right before. The headline
``gpu_to_arena_vs_peak`` and ``arena_to_gpu_vs_peak`` are at 1 MiB blocks (``--gpu-block-kib``):
16 pages of 64 KiB, which the arena stores contiguously.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from benchmarks import hybrid_ttft
from benchmarks.harness.cases import Case, Sample
from benchmarks.harness.cli import MODEL_CACHE, log_progress
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import LMDB_BUDGET, KiB, MiB, extent_for, round_up
from benchmarks.harness.system import (
    PAGE,
    CpuShare,
    cold_read_ms,
    drop_page_cache,
    resident,
)
from benchmarks.harness.targets import judged, ok_or_missed
from benchmarks.ttft_cases import (
    FULL,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    PROMPT_TOKENS,
    QUICK,
    Mode,
    example_connector,
    first_token,
    headline_blocks_per_chunk,
    kvtier,
    local,
    miss,
)
from benchmarks.ttft_gpu import gpu_main
from benchmarks.ttft_report import report, table
from tests.fixtures import engines, models

log = logging.getLogger("kvtier.bench")


class Bench:
    def __init__(
        self,
        mode: Mode,
        cache_dir: Path,
        block_size: int,
        bpcs: Sequence[int],
        connector_extra: dict[str, Any] | None = None,
    ) -> None:
        self.mode = mode
        self.connector_extra = dict(connector_extra or {})
        self.block_size = block_size
        self.bpcs = list(bpcs)
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = cache_dir
        self.tokenizer = tokenizer = models.build_tokenizer(cache_dir)
        self.model = models.build_benchmark_llama(cache_dir, tokenizer_dir=tokenizer)
        self.vocab = vocab = models.vocab_size_of(self.model)
        self.root = Path(tempfile.mkdtemp(prefix="ttft-", dir=cache_dir))
        self.shm_prefix = f"/dev/shm/kvtier-ttft-{os.getpid()}"
        self.shm_paths: list[Path] = []
        self.engine_starts: list[float] = []
        self.phases: dict[str, float] = {}
        # one warm-up prompt, then the timed ones; every case uses these same prompts
        self.warmup, *self.prompts = models.shared_prefix_prompts(
            mode.prompts + 1,
            vocab_size=vocab,
            prefix_len=PROMPT_TOKENS,
            suffix_len=0,
            num_prefixes=mode.prompts + 1,
            seed=11,
        )
        self.kv_per_token = self._kv_bytes_per_token()
        self.cold_tokens: list[int] = []
        self.cases: dict[str, Case] = {}
        self.per_bpc: dict[int, dict[str, Any]] = {}
        self.miss: dict[str, Any] = {}
        self.disk_ms = float("nan")
        self.example_bytes = 0
        self.other_cpu = float("nan")
        self.hybrid: dict[str, Any] = {}

    def _kv_bytes_per_token(self) -> int:
        config = json.loads((self.model / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        # K and V, bf16
        return int(config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 2)

    def shm(self, name: str) -> Path:
        path = Path(f"{self.shm_prefix}-{name}")
        self.shm_paths.append(path)
        return path

    def chunk_bytes(self, bpc: int) -> int:
        return self.kv_per_token * self.block_size * bpc

    def full_hit(self, unit_tokens: int) -> int:
        """Tokens a whole-unit hit covers: the last prompt token is always computed."""
        return (PROMPT_TOKENS - 1) // unit_tokens * unit_tokens

    # -- engines ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def engine(
        self,
        connector: dict[str, Any] | None = None,
        *,
        model: Path | None = None,
        dtype: str = "bfloat16",
    ) -> Iterator[Any]:
        started = time.perf_counter()
        llm = engines.make_llm(
            model or self.model,
            kv_transfer_config=connector,
            dtype=dtype,
            block_size=self.block_size,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=MAX_MODEL_LEN,
            enable_prefix_caching=True,
        )
        self.engine_starts.append(time.perf_counter() - started)
        try:
            yield llm
        finally:
            engines.shutdown_llm(llm)
            del llm
            gc.collect()

    def first_token(self, llm: Any, prompt: Sequence[int]) -> Sample:
        return first_token(llm, prompt)

    def from_files(
        self, llm: Any, prompt: Sequence[int], case: Case, files: Sequence[Path], drop: bool
    ) -> None:
        """Time one prompt whose hit is read from ``files``; record what was in the page cache
        before and what the load read in."""
        if drop:
            drop_page_cache(files)
        before, pages = resident(files)
        case.samples.append(self.first_token(llm, prompt))
        after, _ = resident(files)
        case.resident.append(before / pages if pages else 0.0)
        case.read_in.append((after - before) * PAGE)

    def compute(self, llm: Any, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill each prompt once (so a connector stores it), one request at a time."""
        for prompt in prompts:
            self.first_token(llm, prompt)

    def rounds(self, llm: Any) -> Iterator[int]:
        """Passes over the prompts; before each pass after the first, vLLM's prefix cache is
        emptied so that the same prompts take the same path again."""
        for r in range(self.mode.rounds):
            if r and not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
            yield r

    def sidecar(self, daemon: Kvtierd, bpc: int) -> dict[str, Any]:
        return self.kvtier_connector(
            {"mode": "sidecar", "socket_path": str(daemon.socket_path), "blocks_per_chunk": bpc}
        )

    def embedded(self, n: int, bpc: int, arena_bytes: int) -> dict[str, Any]:
        """The connector in embedded mode, with a new arena and LMDB environment."""
        config = self.root / f"embedded-{n}.yaml"
        tree = {
            "arena": {
                "path": str(self.shm(f"embedded-{n}")),
                "size_bytes": arena_bytes,
                "extent_bytes": extent_for(self.chunk_bytes(bpc)),
                "min_slot_bytes": 64 * KiB,
            },
            "lmdb": {"path": str(self.root / f"embedded-{n}-lmdb"), "budget_bytes": LMDB_BUDGET},
        }
        config.write_text(yaml.safe_dump(tree))
        return self.kvtier_connector({"kvtier_config": str(config), "blocks_per_chunk": bpc})

    def kvtier_connector(self, extra: dict[str, Any]) -> dict[str, Any]:
        return kvtier_connector({**extra, **self.connector_extra}, recompute_failed_loads=False)

    # -- all --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        share = CpuShare()
        kv = self.full_hit(self.block_size) * self.kv_per_token
        self.disk_ms = cold_read_ms(self.root / "disk-baseline", kv)
        log.info("cold read of %d MiB: %.1f ms", kv >> 20, self.disk_ms)
        log.info("cold and vLLM prefix-cache hits")
        local(self)
        mark = self.phase(started, "baseline_and_local_s")
        log.info("ExampleConnector")
        example_connector(self)
        mark = self.phase(mark, "example_connector_s")
        daemons = []
        for bpc in self.bpcs:
            log.info(
                "kvtier, blocks_per_chunk %d (%d KiB chunks)", bpc, self.chunk_bytes(bpc) >> 10
            )
            # a daemon of its own per chunk size: pages an earlier case's daemon mapped from its
            # LMDB file stay cached, and a shared one slowed later cases' cold loads
            extent = extent_for(self.chunk_bytes(bpc))
            tokens = self.block_size * bpc
            chunks = (len(self.prompts) + 1) * (self.full_hit(tokens) // tokens)
            per_extent = extent // self.chunk_bytes(bpc)
            arena_bytes = round_up(-(-chunks // per_extent) * extent + 2 * extent, 256 * MiB)
            (self.root / f"bpc{bpc}").mkdir()
            daemon = Kvtierd(self.root / f"bpc{bpc}", self.shm(f"bpc{bpc}"), arena_bytes, extent)
            daemons.append(daemon)
            try:
                daemon.start()
                kvtier(self, daemon, bpc)
            finally:
                daemon.stop()
        mark = self.phase(mark, "kvtier_s")
        best = headline_blocks_per_chunk(list(self.per_bpc.values()))
        log.info("miss path, blocks_per_chunk %d", best)
        miss(self, best)
        mark = self.phase(mark, "miss_path_s")
        log.info("hybrid KV-cache groups, blocks_per_chunk %d", best)
        self.hybrid = hybrid_ttft.run(self, best)
        self.phase(mark, "hybrid_s")
        self.phases["total_s"] = time.perf_counter() - started
        self.other_cpu = share.others()
        return report(self, best, daemons)

    def phase(self, since: float, name: str) -> float:
        now = time.perf_counter()
        self.phases[name] = now - since
        return now

    def close(self) -> None:
        for path in self.shm_paths:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def parse_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and chunk sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=MODEL_CACHE,
        help="where the model is built and the run's files go (a disk-backed file system)",
    )
    parser.add_argument("--block-size", type=int, default=models.BLOCK_SIZE)
    parser.add_argument(
        "--blocks-per-chunk",
        type=parse_list,
        help="comma-separated values to try (default: chunks of "
        f"{', '.join(map(str, QUICK.chunk_tokens))} tokens with --quick, "
        f"{', '.join(map(str, FULL.chunk_tokens))} otherwise)",
    )
    parser.add_argument(
        "--connector-extra",
        type=json.loads,
        default={},
        help="JSON merged into every KVTierConnector kv_connector_extra_config, e.g. "
        "'{\"write_through\": false}'",
    )
    parser.add_argument(
        "--hybrid-only",
        action="store_true",
        help="only the hybrid case, at the first --blocks-per-chunk",
    )
    parser.add_argument("--gpu", action="store_true", help="GPU<->arena copy bandwidth instead")
    parser.add_argument("--gpu-block-kib", type=int, default=1024, help="headline GPU block size")
    args = parser.parse_args(argv)
    log_progress(log, "kvtier_vllm")
    mode = QUICK if args.quick else FULL
    if args.gpu:
        if args.gpu_block_kib <= 0 or args.gpu_block_kib % 64:
            parser.error("--gpu-block-kib must be a positive multiple of 64")
        return gpu_main(mode, args.gpu_block_kib * KiB, args.json)
    bpcs = args.blocks_per_chunk or [
        t // args.block_size for t in mode.chunk_tokens if t % args.block_size == 0
    ]
    if not bpcs or min(bpcs) < 1:
        parser.error("no blocks_per_chunk to try: give --blocks-per-chunk")
    # vLLM reads these when it is first imported and logs to stdout by default
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    bench = Bench(mode, args.cache_dir, args.block_size, bpcs, args.connector_extra)
    try:
        engines.apply_engine_env(engines.engine_env(bench.root / "engine"))
        if args.hybrid_only:
            result = hybrid_ttft.run(bench, bpcs[0])
            result["targets_met"] = judged(result, hybrid_ttft.TARGETS)
        else:
            result = bench.run()
    finally:
        bench.close()
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.hybrid_only:
        print("\n".join(hybrid_ttft.table(result)))
        for key, (op, bound) in hybrid_ttft.TARGETS.items():
            verdict = ok_or_missed(result["targets_met"][key])
            print(f"{key:42}{result[key]:8.3f}  {op} {bound:g}  {verdict}")
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
