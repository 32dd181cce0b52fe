"""The hybrid case of ``ttft.py``: a model whose sliding-window and full-attention layers vLLM
keeps in separate KV-cache groups (its hybrid allocator on, which kvtier keeps on).

The model is a locally built Gemma3-text (tests/fixtures/models.py, ``build_gemma3_hybrid``): 12
layers alternating sliding (window ``WINDOW`` tokens, much shorter than the prompts) and full,
hidden 768, head_dim 32, 2 KV heads, fp32, random weights. On the same prompts as the other
cases:

- ``hybrid_cold_ms`` and ``hybrid_gpu_prefix_hit_ms``: no connector, a prompt cold and then on
  vLLM's own prefix cache (the floor);
- ``hybrid_arena_hit_ms``: kvtierd (its own daemon) in sidecar mode; engine 1 stores the prompts,
  engine 2, fresh, loads them from the arena;
- ``hybrid_bytes_stored_vs_all_groups``: bytes engine 1 stored over what storing every block of
  every group would have taken (stored plus the sliding-window bytes it left out, both from
  vLLM's own /metrics).
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.harness.cases import Case, EngineBench
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import extent_for, round_up
from benchmarks.harness.targets import Target
from tests.fixtures import engines, models

WINDOW = 256
LAYERS = ("S", "F") * 6
HIDDEN = 768
TARGETS: dict[str, Target] = {
    "hybrid_arena_hit_vs_gpu_prefix_hit": ("<=", 1.2),
    "hybrid_bytes_stored_vs_all_groups": ("<=", 0.6),
}
STORED = "vllm:kvtier_transfer_bytes"
SKIPPED = "vllm:kvtier_window_skipped_bytes"


def build_model(bench: EngineBench) -> Any:
    return models.build_gemma3_hybrid(
        bench.cache_dir,
        layer_types=LAYERS,
        sliding_window=WINDOW,
        hidden_size=HIDDEN,
        tokenizer_dir=bench.tokenizer,
    )


def kv_bytes_per_token(model: Any) -> int:
    config = json.loads((model / "config.json").read_text())
    # K and V of every layer, fp32
    return int(config["num_hidden_layers"] * config["num_key_value_heads"] * 32 * 2 * 4)


def table(hybrid: dict[str, Any]) -> list[str]:
    cases = hybrid["cases"]
    lines = [
        f"hybrid ({hybrid['model']}, window {hybrid['sliding_window']}, blocks_per_chunk "
        f"{hybrid['blocks_per_chunk']}):"
    ]
    for name in ("hybrid_cold", "hybrid_gpu_prefix_hit", "hybrid_arena_hit"):
        case = cases[name]
        verdict = "ok" if case["hits_ok"] else "WRONG"
        lines.append(
            f"  {name:32}{case['ttft_ms']:9.1f}  {min(case['cached_tokens'], default=0)} / "
            f"{case['expected_cached_tokens']} (min) {verdict}"
        )
    stored, skipped = hybrid["hybrid_stored_bytes"], hybrid["hybrid_window_skipped_bytes"]
    lines.append(
        f"  stored {stored / 2**20:.1f} MiB; sliding-window chunks left out "
        f"{skipped / 2**20:.1f} MiB"
    )
    return lines


def run(bench: EngineBench, bpc: int) -> dict[str, Any]:
    """Every hybrid figure, with its own kvtierd; ``bpc``: blocks per chunk."""
    model = build_model(bench)
    engine = {"model": model, "dtype": "float32"}
    cold = Case("hybrid_cold", 0)
    local = Case("hybrid_gpu_prefix_hit", bench.full_hit(bench.block_size))
    with bench.engine(**engine) as llm:
        bench.first_token(llm, bench.warmup)
        bench.first_token(llm, bench.warmup)
        for _ in bench.rounds(llm):
            cold.samples += [bench.first_token(llm, p) for p in bench.prompts]
            local.samples += [bench.first_token(llm, p) for p in bench.prompts]
    chunk_tokens = bench.block_size * bpc
    arena = Case("hybrid_arena_hit", bench.full_hit(chunk_tokens), connector=True)
    kv = (len(bench.prompts) + 1) * bench.full_hit(chunk_tokens) * kv_bytes_per_token(model)
    # each plan (sliding or full) holds half the layers
    extent = extent_for(kv_bytes_per_token(model) * chunk_tokens // 2)
    (bench.root / "hybrid").mkdir()
    daemon = Kvtierd(bench.root / "hybrid", bench.shm("hybrid"), round_up(2 * kv, extent), extent)
    try:
        daemon.start()
        connector = bench.sidecar(daemon, bpc)
        with bench.engine(connector, **engine) as llm:
            bench.compute(llm, [bench.warmup, *bench.prompts])
            stored = engines.counter(llm, STORED, direction="store")
            skipped = engines.counter(llm, SKIPPED)
        with bench.engine(connector, **engine) as llm:
            bench.first_token(llm, bench.warmup)
            for _ in bench.rounds(llm):
                arena.samples += [bench.first_token(llm, p) for p in bench.prompts]
    finally:
        daemon.stop()
    first_tokens = [s.token for s in cold.samples[: len(bench.prompts)]]
    out: dict[str, Any] = {
        "model": model.name,
        "sliding_window": WINDOW,
        "blocks_per_chunk": bpc,
        "hybrid_cold_ms": cold.ms,
        "hybrid_gpu_prefix_hit_ms": local.ms,
        "hybrid_arena_hit_ms": arena.ms,
        "hybrid_stored_bytes": stored,
        "hybrid_window_skipped_bytes": skipped,
        "hybrid_arena_hit_vs_gpu_prefix_hit": arena.ms / local.ms,
        "hybrid_bytes_stored_vs_all_groups": stored / (stored + skipped) if stored else 1.0,
        "hits_ok": {
            "hybrid_cold": cold.hits_ok,
            "hybrid_gpu_prefix_hit": local.hits_ok,
            "hybrid_arena_hit": arena.hits_ok,
        },
        "cases": {
            "hybrid_cold": cold.summary(),
            "hybrid_gpu_prefix_hit": local.summary(first_tokens),
            "hybrid_arena_hit": arena.summary(first_tokens),
        },
    }
    return out
