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
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import hybrid_ttft
from benchmarks.harness.buffers import no_gc
from benchmarks.harness.cases import Case, Sample, delta
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import LMDB_BUDGET, GiB, KiB, MiB, extent_for, round_up
from benchmarks.harness.stats import median
from benchmarks.harness.system import (
    PAGE,
    CpuShare,
    cold_read_ms,
    drop_page_cache,
    fs_type,
    resident,
)
from benchmarks.harness.targets import Target, judged, ok_or_missed, stated
from kvtier.core.config import ArenaConfig
from kvtier.core.keys import NamespaceSpec, PageLayout, Pool, make_key
from kvtier.core.pools import PoolRegistry
from tests.fixtures import engines, models

log = logging.getLogger("kvtier.bench")

PROMPT_TOKENS = 3600
MAX_MODEL_LEN = 4096
KV_CACHE_BYTES = 512 * MiB
MISS_PROMPTS = 8
MISS_PROMPT_TOKENS = 512
MISS_OUTPUT_TOKENS = 32
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
SAME_WITHIN = 0.05
"""Arena hits this close are the same on this machine (its noise between runs)."""


def headline_blocks_per_chunk(rows: list[dict[str, Any]]) -> int:
    """The fewest blocks per chunk whose arena hit is within `SAME_WITHIN` of the fastest."""
    fastest = min(r["arena_hit_ms"] for r in rows)
    same = [r for r in rows if r["arena_hit_ms"] <= fastest * (1 + SAME_WITHIN)]
    return int(min(r["blocks_per_chunk"] for r in same))


LOAD_COUNTERS = (
    "lookups",
    "hit_chunks_cpu",
    "hit_chunks_lmdb",
    "promotions",
    "promotion_failed",
    "promotions_dropped",
    "cpu.hits",
    "cpu.misses",
    "cpu.writeback_ok",
)

TARGETS: dict[str, Target] = {
    "arena_hit_vs_gpu_prefix_hit": ("<=", 1.2),
    "arena_hit_vs_example_connector": ("<=", 0.9),
    "lmdb_cold_hit_vs_example_connector_cold": ("<=", 1.0),
    "arena_hit_vs_cold": ("<=", 0.05),
    "miss_path_overhead": ("<=", 1.02),
    **hybrid_ttft.TARGETS,
}
GPU_TARGETS: dict[str, Target] = {
    "gpu_to_arena_vs_peak": (">=", 0.8),
    "arena_to_gpu_vs_peak": (">=", 0.8),
}


@dataclass(frozen=True)
class Mode:
    name: str
    prompts: int
    rounds: int
    """Passes over the prompts in each engine whose path can be repeated (all but LMDB)."""
    chunk_tokens: tuple[int, ...]
    """Chunk sizes tried, in tokens; blocks_per_chunk is each over the block size."""
    miss_reps: int
    miss_engines: tuple[bool, ...]
    """Per engine of the miss-path case: whether it runs the connector."""
    gpu_working_set: int
    gpu_reps: int


ABBA = (False, True, True, False)
QUICK = Mode("quick", 3, 2, (128, 512), 2, ABBA, 512 * MiB, 5)
FULL = Mode("full", 5, 3, (32, 128, 512), 3, ABBA + ABBA[::-1], 1 * GiB, 11)


# -- engines and timing -----------------------------------------------------------------------


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
        params = engines.greedy(1)
        before = engines.counter_value(llm, EXTERNAL_HITS)
        with no_gc():
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        external = engines.counter_value(llm, EXTERNAL_HITS) - before
        return Sample(
            elapsed * 1e3,
            out[0].num_cached_tokens or 0,
            int(external),
            out[0].outputs[0].token_ids[0],
        )

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

    # -- cases ------------------------------------------------------------------------------

    def case_local(self) -> None:
        cold = Case("cold", 0)
        hit = Case("gpu_prefix_hit", self.full_hit(self.block_size))
        with self.engine() as llm:
            self.first_token(llm, self.warmup)
            self.first_token(llm, self.warmup)
            for _ in self.rounds(llm):
                cold.samples += [self.first_token(llm, p) for p in self.prompts]
                hit.samples += [self.first_token(llm, p) for p in self.prompts]
        self.cold_tokens = [s.token for s in cold.samples[: len(self.prompts)]]
        self.cases["cold"] = cold
        self.cases["gpu_prefix_hit"] = hit

    def case_example(self) -> None:
        storage = self.root / "example-connector"
        storage.mkdir()
        connector = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
        expected = self.full_hit(self.block_size)
        warm = Case("example_connector_warm", expected, connector=True)
        cold = Case("example_connector_cold", expected, connector=True)
        with self.engine(connector) as llm:
            self.compute(llm, [self.warmup, *self.prompts])
        files = sorted(storage.rglob("*.safetensors"))
        log.info("ExampleConnector wrote %d files, %.0f MiB", len(files), _size(files) / MiB)
        with self.engine(connector) as llm:
            self.first_token(llm, self.warmup)
            for _ in self.rounds(llm):
                for prompt in self.prompts:
                    self.from_files(llm, prompt, warm, files, drop=False)
        with self.engine(connector) as llm:
            drop_page_cache(files)
            self.first_token(llm, self.warmup)
            for _ in self.rounds(llm):
                for prompt in self.prompts:
                    self.from_files(llm, prompt, cold, files, drop=True)
        self.cases[warm.name] = warm
        self.cases[cold.name] = cold
        self.example_bytes = _size(files)

    def sidecar(self, daemon: Kvtierd, bpc: int) -> dict[str, Any]:
        return self.kvtier_connector(
            {"mode": "sidecar", "socket_path": str(daemon.socket_path), "blocks_per_chunk": bpc}
        )

    def case_kvtier(self, daemon: Kvtierd, bpc: int) -> None:
        connector = self.sidecar(daemon, bpc)
        chunk_tokens = self.block_size * bpc
        expected = self.full_hit(chunk_tokens)
        arena = Case(f"arena_hit_bpc{bpc}", expected, connector=True)
        lmdb = Case(f"lmdb_cold_hit_bpc{bpc}", expected, connector=True)
        chunks = (len(self.prompts) + 1) * expected // chunk_tokens
        before = daemon.counters()
        with self.engine(connector) as llm:
            self.compute(llm, [self.warmup, *self.prompts])
        stored = daemon.counters()
        with self.engine(connector) as llm:
            self.first_token(llm, self.warmup)
            for _ in self.rounds(llm):
                arena.samples += [self.first_token(llm, p) for p in self.prompts]
        loaded = daemon.counters()
        assert daemon.admin is not None
        drain = daemon.admin.drain()
        evicted = daemon.admin.evict(tier="cpu")
        drained = daemon.counters()
        data = daemon.lmdb_path / "data.mdb"
        lmdb_bytes = _file_size(data)
        # one pass only: chunks kvtierd has read stay mapped in it, and mapped pages are not
        # dropped from the page cache
        with self.engine(connector) as llm:
            drop_page_cache([data])
            self.first_token(llm, self.warmup)
            for prompt in self.prompts:
                self.from_files(llm, prompt, lmdb, [data], drop=True)
        after = daemon.counters()
        arena.counters = {name: delta(loaded, stored, name) for name in LOAD_COUNTERS}
        lmdb.counters = {name: delta(after, drained, name) for name in LOAD_COUNTERS}
        daemon.admin.evict(tier="cpu")  # the next namespace starts with an empty arena
        self.cases[arena.name] = arena
        self.cases[lmdb.name] = lmdb
        self.per_bpc[bpc] = {
            "blocks_per_chunk": bpc,
            "chunk_tokens": chunk_tokens,
            "chunk_bytes": self.chunk_bytes(bpc),
            "arena_hit_ms": arena.ms,
            "lmdb_cold_hit_ms": lmdb.ms,
            "arena_hits_ok": arena.hits_ok,
            "lmdb_hits_ok": lmdb.hits_ok,
            "chunks_expected": chunks,
            "chunks_stored": delta(stored, before, "cpu.stores"),
            "drain_complete": bool(drain.complete),
            "evicted_from_arena": evicted.get("cpu", 0),
            "lmdb_data_bytes": lmdb_bytes,
        }
        log.info(
            "blocks_per_chunk %d: arena hit %.1f ms, lmdb cold hit %.1f ms",
            bpc,
            arena.ms,
            lmdb.ms,
        )

    def case_miss(self, bpc: int) -> None:
        batches = [
            models.shared_prefix_prompts(
                MISS_PROMPTS,
                vocab_size=self.vocab,
                prefix_len=MISS_PROMPT_TOKENS,
                suffix_len=0,
                num_prefixes=MISS_PROMPTS,
                seed=1000 + rep,
            )
            for rep in range(self.mode.miss_reps + 1)
        ]
        params = engines.greedy(MISS_OUTPUT_TOKENS)
        tokens = MISS_PROMPTS * (MISS_PROMPT_TOKENS + MISS_OUTPUT_TOKENS)
        engine_times: list[tuple[bool, list[float]]] = []
        lmdb_written: list[int] = []
        outputs: dict[bool, list[list[list[int]]]] = {False: [], True: []}
        cached = 0
        arena_bytes = round_up(
            (self.mode.miss_reps + 1) * MISS_PROMPTS * MISS_PROMPT_TOKENS * self.kv_per_token * 2,
            64 * MiB,
        )
        for n, with_connector in enumerate(self.mode.miss_engines):
            connector = self.embedded(n, bpc, arena_bytes) if with_connector else None
            times: list[float] = []
            engine_times.append((with_connector, times))
            with self.engine(connector) as llm:
                llm.generate(_requests(batches[0]), params, use_tqdm=False)
                data = self.root / f"embedded-{n}-lmdb" / "data.mdb"
            with self.engine(connector) as llm:
                llm.generate(_requests(batches[0]), params, use_tqdm=False)
                written = _file_size(data)
                for batch in batches[1:]:
                    with no_gc():
                        start = time.perf_counter()
                        out = llm.generate(_requests(batch), params, use_tqdm=False)
                        times.append(time.perf_counter() - start)
                    cached += sum(o.num_cached_tokens or 0 for o in out)
                    outputs[with_connector].append([list(o.outputs[0].token_ids) for o in out])
                lmdb_written.append(_file_size(data) - written)
        reps = self.mode.miss_reps
        # every engine ran the same batches in the same order
        same = all(
            got == outputs[False][i % reps]
            for runs in outputs.values()
            for i, got in enumerate(runs)
        )
        # the mean of per-engine medians: the engine order is symmetric, so a steady drift of the
        # machine's speed over the run cancels
        per_engine = [(w, median(t)) for w, t in engine_times]
        without = statistics.fmean(m for w, m in per_engine if not w)
        with_ = statistics.fmean(m for w, m in per_engine if w)
        self.miss = {
            "blocks_per_chunk": bpc,
            "batch": f"{MISS_PROMPTS} x {MISS_PROMPT_TOKENS} prompt + {MISS_OUTPUT_TOKENS} output",
            "without_connector_s": without,
            "with_connector_s": with_,
            "without_connector_tokens_per_s": tokens / without,
            "with_connector_tokens_per_s": tokens / with_,
            "engines": [
                {"connector": w, "s_each": [round(x, 4) for x in t]} for w, t in engine_times
            ],
            "cached_tokens": cached,
            "outputs_match": same,
            "lmdb_bytes_grown_while_timed": [
                n for (w, _), n in zip(engine_times, lmdb_written, strict=True) if w
            ],
            "overhead": with_ / without,
        }

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
        self.case_local()
        mark = self.phase(started, "baseline_and_local_s")
        log.info("ExampleConnector")
        self.case_example()
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
                self.case_kvtier(daemon, bpc)
            finally:
                daemon.stop()
        mark = self.phase(mark, "kvtier_s")
        best = headline_blocks_per_chunk(list(self.per_bpc.values()))
        log.info("miss path, blocks_per_chunk %d", best)
        self.case_miss(best)
        mark = self.phase(mark, "miss_path_s")
        log.info("hybrid KV-cache groups, blocks_per_chunk %d", best)
        self.hybrid = hybrid_ttft.run(self, best)
        self.phase(mark, "hybrid_s")
        self.phases["total_s"] = time.perf_counter() - started
        self.other_cpu = share.others()
        return self.report(best, daemons)

    def phase(self, since: float, name: str) -> float:
        now = time.perf_counter()
        self.phases[name] = now - since
        return now

    def report(self, best: int, daemons: list[Kvtierd]) -> dict[str, Any]:
        c = self.cases
        arena, lmdb = c[f"arena_hit_bpc{best}"], c[f"lmdb_cold_hit_bpc{best}"]
        out: dict[str, Any] = {
            "mode": self.mode.name,
            "model": self.model.name,
            "prompt_tokens": PROMPT_TOKENS,
            "prompts": len(self.prompts),
            "block_size": self.block_size,
            "blocks_per_chunk_tried": self.bpcs,
            "connector_extra": self.connector_extra,
            "best_blocks_per_chunk": best,
            "kv_bytes_per_prompt": self.full_hit(self.block_size) * self.kv_per_token,
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
        out["miss_path_overhead"] = self.miss["overhead"]
        for key in hybrid_ttft.TARGETS:
            out[key] = self.hybrid[key]
        out["targets"] = stated(TARGETS)
        out["targets_met"] = judged(out, TARGETS)
        hits = {
            "cold": c["cold"].hits_ok,
            "gpu_prefix_hit": c["gpu_prefix_hit"].hits_ok,
            "arena_hit": arena.hits_ok,
            "lmdb_cold_hit": lmdb.hits_ok,
            "example_connector_warm": c["example_connector_warm"].hits_ok,
            "example_connector_cold": c["example_connector_cold"].hits_ok,
            "miss_path_all_missed": self.miss["cached_tokens"] == 0,
            **self.hybrid["hits_ok"],
        }
        out["hits_ok"] = hits
        out["all_ok"] = all(hits.values()) and all(out["targets_met"].values())
        out["cases"] = {
            "cold": c["cold"].summary(),
            "gpu_prefix_hit": c["gpu_prefix_hit"].summary(self.cold_tokens),
            "example_connector_warm": c["example_connector_warm"].summary(self.cold_tokens),
            "example_connector_cold": c["example_connector_cold"].summary(self.cold_tokens),
            **{
                name: case.summary(self.cold_tokens)
                for name, case in c.items()
                if name.startswith(("arena_hit_bpc", "lmdb_cold_hit_bpc"))
            },
        }
        out["blocks_per_chunk"] = list(self.per_bpc.values())
        out["miss_path"] = self.miss
        out["hybrid"] = self.hybrid
        kv = out["kv_bytes_per_prompt"]
        example_cold = c["example_connector_cold"]
        out["lmdb_read_in_vs_prompt_kv"] = median(lmdb.read_in) / kv
        out["example_connector_cold_read_in_vs_prompt_kv"] = median(example_cold.read_in) / kv
        out["lmdb_resident_before_load"] = median(lmdb.resident)
        out["example_connector_cold_resident_before_load"] = median(example_cold.resident)
        out["disk_cold_read_ms"] = self.disk_ms
        out["example_connector_bytes"] = self.example_bytes
        out["storage_dir"] = str(self.root)
        out["storage_fs"] = fs_type(self.root)
        out["kvtierd_start_s"] = max(d.start_s for d in daemons)
        out["kvtierd_exit_code"] = next((d.exit_code for d in daemons if d.exit_code), 0)
        out["engine_start_s"] = {
            "median": median(self.engine_starts),
            "max": max(self.engine_starts),
            "engines": len(self.engine_starts),
        }
        out["elapsed_s"] = self.phases
        out["other_processes_cpu_share"] = self.other_cpu
        return out

    def close(self) -> None:
        for path in self.shm_paths:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _requests(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def _size(paths: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


# -- the GPU variant --------------------------------------------------------------------------

GPU_BLOCKS = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
GPU_EXTENT = 32 * MiB


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


# -- output -----------------------------------------------------------------------------------


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


def parse_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and chunk sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "kvtier-bench",
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
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    logging.getLogger("kvtier_vllm").setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
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
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(gpu_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
