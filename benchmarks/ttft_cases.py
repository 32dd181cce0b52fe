"""The TTFT benchmark's settings (prompts, engine sizes, modes, targets) and its cases, each run on
the bench: vLLM alone (cold, its prefix cache), ExampleConnector (warm, cold), kvtier (arena and
lmdb cold hits per chunk size) and the miss path (engines with and without the connector)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import hybrid_ttft
from benchmarks.harness.buffers import no_gc
from benchmarks.harness.cases import Case, Sample, delta
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import GiB, MiB, round_up
from benchmarks.harness.stats import median
from benchmarks.harness.system import (
    drop_page_cache,
)
from benchmarks.harness.targets import Target
from tests.fixtures import engines, models

if TYPE_CHECKING:
    from benchmarks.ttft import Bench

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


def first_token(llm: Any, prompt: Sequence[int]) -> Sample:
    """One prompt's TTFT: one ``generate`` with ``max_tokens=1``, with its hit and first token."""
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


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _requests(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def _size(paths: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def local(bench: Bench) -> None:
    cold = Case("cold", 0)
    hit = Case("gpu_prefix_hit", bench.full_hit(bench.block_size))
    with bench.engine() as llm:
        bench.first_token(llm, bench.warmup)
        bench.first_token(llm, bench.warmup)
        for _ in bench.rounds(llm):
            cold.samples += [bench.first_token(llm, p) for p in bench.prompts]
            hit.samples += [bench.first_token(llm, p) for p in bench.prompts]
    bench.cold_tokens = [s.token for s in cold.samples[: len(bench.prompts)]]
    bench.cases["cold"] = cold
    bench.cases["gpu_prefix_hit"] = hit


def example_connector(bench: Bench) -> None:
    storage = bench.root / "example-connector"
    storage.mkdir()
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    expected = bench.full_hit(bench.block_size)
    warm = Case("example_connector_warm", expected, connector=True)
    cold = Case("example_connector_cold", expected, connector=True)
    with bench.engine(connector) as llm:
        bench.compute(llm, [bench.warmup, *bench.prompts])
    files = sorted(storage.rglob("*.safetensors"))
    log.info("ExampleConnector wrote %d files, %.0f MiB", len(files), _size(files) / MiB)
    with bench.engine(connector) as llm:
        bench.first_token(llm, bench.warmup)
        for _ in bench.rounds(llm):
            for prompt in bench.prompts:
                bench.from_files(llm, prompt, warm, files, drop=False)
    with bench.engine(connector) as llm:
        drop_page_cache(files)
        bench.first_token(llm, bench.warmup)
        for _ in bench.rounds(llm):
            for prompt in bench.prompts:
                bench.from_files(llm, prompt, cold, files, drop=True)
    bench.cases[warm.name] = warm
    bench.cases[cold.name] = cold
    bench.example_bytes = _size(files)


def kvtier(bench: Bench, daemon: Kvtierd, bpc: int) -> None:
    connector = bench.sidecar(daemon, bpc)
    chunk_tokens = bench.block_size * bpc
    expected = bench.full_hit(chunk_tokens)
    arena = Case(f"arena_hit_bpc{bpc}", expected, connector=True)
    lmdb = Case(f"lmdb_cold_hit_bpc{bpc}", expected, connector=True)
    chunks = (len(bench.prompts) + 1) * expected // chunk_tokens
    before = daemon.counters()
    with bench.engine(connector) as llm:
        bench.compute(llm, [bench.warmup, *bench.prompts])
    stored = daemon.counters()
    with bench.engine(connector) as llm:
        bench.first_token(llm, bench.warmup)
        for _ in bench.rounds(llm):
            arena.samples += [bench.first_token(llm, p) for p in bench.prompts]
    loaded = daemon.counters()
    assert daemon.admin is not None
    drain = daemon.admin.drain()
    evicted = daemon.admin.evict(tier="cpu")
    drained = daemon.counters()
    data = daemon.lmdb_path / "data.mdb"
    lmdb_bytes = _file_size(data)
    # one pass only: chunks kvtierd has read stay mapped in it, and mapped pages are not
    # dropped from the page cache
    with bench.engine(connector) as llm:
        drop_page_cache([data])
        bench.first_token(llm, bench.warmup)
        for prompt in bench.prompts:
            bench.from_files(llm, prompt, lmdb, [data], drop=True)
    after = daemon.counters()
    arena.counters = {name: delta(loaded, stored, name) for name in LOAD_COUNTERS}
    lmdb.counters = {name: delta(after, drained, name) for name in LOAD_COUNTERS}
    daemon.admin.evict(tier="cpu")  # the next namespace starts with an empty arena
    bench.cases[arena.name] = arena
    bench.cases[lmdb.name] = lmdb
    bench.per_bpc[bpc] = {
        "blocks_per_chunk": bpc,
        "chunk_tokens": chunk_tokens,
        "chunk_bytes": bench.chunk_bytes(bpc),
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


def miss(bench: Bench, bpc: int) -> None:
    batches = [
        models.shared_prefix_prompts(
            MISS_PROMPTS,
            vocab_size=bench.vocab,
            prefix_len=MISS_PROMPT_TOKENS,
            suffix_len=0,
            num_prefixes=MISS_PROMPTS,
            seed=1000 + rep,
        )
        for rep in range(bench.mode.miss_reps + 1)
    ]
    params = engines.greedy(MISS_OUTPUT_TOKENS)
    tokens = MISS_PROMPTS * (MISS_PROMPT_TOKENS + MISS_OUTPUT_TOKENS)
    engine_times: list[tuple[bool, list[float]]] = []
    lmdb_written: list[int] = []
    outputs: dict[bool, list[list[list[int]]]] = {False: [], True: []}
    cached = 0
    arena_bytes = round_up(
        (bench.mode.miss_reps + 1) * MISS_PROMPTS * MISS_PROMPT_TOKENS * bench.kv_per_token * 2,
        64 * MiB,
    )
    for n, with_connector in enumerate(bench.mode.miss_engines):
        connector = bench.embedded(n, bpc, arena_bytes) if with_connector else None
        times: list[float] = []
        engine_times.append((with_connector, times))
        with bench.engine(connector) as llm:
            llm.generate(_requests(batches[0]), params, use_tqdm=False)
            data = bench.root / f"embedded-{n}-lmdb" / "data.mdb"
        with bench.engine(connector) as llm:
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
    reps = bench.mode.miss_reps
    # every engine ran the same batches in the same order
    same = all(
        got == outputs[False][i % reps] for runs in outputs.values() for i, got in enumerate(runs)
    )
    # the mean of per-engine medians: the engine order is symmetric, so a steady drift of the
    # machine's speed over the run cancels
    per_engine = [(w, median(t)) for w, t in engine_times]
    without = statistics.fmean(m for w, m in per_engine if not w)
    with_ = statistics.fmean(m for w, m in per_engine if w)
    bench.miss = {
        "blocks_per_chunk": bpc,
        "batch": f"{MISS_PROMPTS} x {MISS_PROMPT_TOKENS} prompt + {MISS_OUTPUT_TOKENS} output",
        "without_connector_s": without,
        "with_connector_s": with_,
        "without_connector_tokens_per_s": tokens / without,
        "with_connector_tokens_per_s": tokens / with_,
        "engines": [{"connector": w, "s_each": [round(x, 4) for x in t]} for w, t in engine_times],
        "cached_tokens": cached,
        "outputs_match": same,
        "lmdb_bytes_grown_while_timed": [
            n for (w, _), n in zip(engine_times, lmdb_written, strict=True) if w
        ],
        "overhead": with_ / without,
    }
