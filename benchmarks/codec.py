"""Coded tiers below the arena (``lmdb.codec``: int8, fp8): what each costs in accuracy, bytes
and time.

On the benchmarks' 12-layer bf16 llama, with embedded tiers whose arena starts empty in each
engine (so every hit is read from lmdb):

- the error: an engine stores ``PROMPTS`` prompts into lmdb in each codec; a fresh engine with every
  hit sampled computes them again, one at a time, and compares each decoded chunk with what it
  computed (the relative error verified reuse measures: the norm of the difference over the
  norm of vLLM's own KV, per layer, the worst layer per chunk). The same is measured with an
  exact lmdb, whose chunks differ only by being computed in another batch;
- greedy outputs: a fresh engine serves the prompts from each coded lmdb, another from the exact
  one, ``MAX_TOKENS`` tokens each; prompts whose outputs differ, and the first token where
  they do. For scale, the same between the exact hits and an engine with no connector, which
  computes every prompt in its own batch (bf16 KV computed in another batch differs too);
- bytes: what lmdb holds per chunk in each codec;
- speed: coding and decoding a chunk against a memcpy of its bytes, timed in the same run.

    python -m benchmarks.codec [--json]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.cli import model_bench_args
from benchmarks.verify_errors import connector, embedded_config, summary, verifying_every_hit
from kvtier.core import kvcodec
from kvtier.core.kvcodec import Codec, error_bound
from tests.fixtures.engines import (
    apply_engine_env,
    engine_env,
    generate_tokens,
    running_llm,
    scheduler_of,
)
from tests.fixtures.models import (
    build_benchmark_llama,
    build_tokenizer,
    shared_prefix_prompts,
    vocab_size_of,
)

PROMPTS = 16
MAX_TOKENS = 32
PREFIX_TOKENS = 1024
CHUNK_BYTES = 12 * 2 * 4 * 64 * 2 * 32  # the benchmark model's chunk: 32 tokens, 393,216 bytes
HEAD = 64


def lmdb_bytes_per_chunk(tmp: Path) -> float:
    """What the closed lmdb holds per chunk, headers included."""
    import lmdb

    env = lmdb.open(str(tmp / "lmdb"), readonly=True, lock=False, max_dbs=8)
    try:
        chunks = env.open_db(b"chunks", create=False)
        with env.begin(db=chunks) as txn:
            sizes = [len(value) for _, value in txn.cursor()]
    finally:
        env.close()
    return statistics.mean(sizes) if sizes else float("nan")


def measure(model: Path, codec: str, tmp: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Store the prompts, verify every hit, then serve them: errors, outputs and bytes."""
    config = embedded_config(tmp, codec=codec)
    engine = {"dtype": "bfloat16", "kv_cache_memory_bytes": 256 << 20}
    with verifying_every_hit(model, config, engine, prompts, 1) as llm:
        verifier = scheduler_of(llm).verifier
        errors = [e for _, e in verifier.errors]
        quarantined = len(verifier.quarantined)
        coded = sorted(verifier.coded)
    with running_llm(model, kv_transfer_config=connector(config), **engine) as llm:
        outputs, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    return {
        "codec": codec,
        "coded_pools": coded,
        "errors": summary(errors),
        "quarantined": quarantined,
        "outputs": outputs,
        "cached_tokens": sum(cached),
        "lmdb_bytes_per_chunk": lmdb_bytes_per_chunk(tmp),
    }


def divergence(coded: list[list[int]], exact: list[list[int]]) -> dict[str, Any]:
    firsts = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(coded, exact, strict=True)
    ]
    differ = [i for i in firsts if i is not None]
    return {
        "prompts": len(firsts),
        "outputs_differ": len(differ),
        "share_differ": len(differ) / len(firsts),
        "first_differing_token_median": statistics.median(differ) if differ else None,
        "tokens_equal_share": sum(
            x == y for a, b in zip(coded, exact, strict=True) for x, y in zip(a, b, strict=True)
        )
        / sum(len(a) for a in exact),
    }


def speed(codec: Codec, rounds: int = 20) -> dict[str, float]:
    """Median GB/s (of the raw chunk's bytes) of coding, decoding and a memcpy, interleaved."""
    dtype = kvcodec.element_dtype("bfloat16")
    assert dtype is not None
    rng = np.random.default_rng(0)
    raw = rng.standard_normal(CHUNK_BYTES // 2).astype(np.float32).astype(dtype).tobytes()
    coded = bytearray(CHUNK_BYTES)
    back = bytearray(CHUNK_BYTES)
    copy = np.empty(CHUNK_BYTES, np.uint8)
    src = np.frombuffer(raw, np.uint8)
    times: dict[str, list[float]] = {"encode": [], "decode": [], "memcpy": []}
    for _ in range(rounds):
        start = time.perf_counter()
        length = kvcodec.encode_into(codec, raw, dtype, HEAD, memoryview(coded))
        times["encode"].append(time.perf_counter() - start)
        assert length is not None
        start = time.perf_counter()
        kvcodec.decode_into(codec, memoryview(coded)[:length], dtype, HEAD, memoryview(back))
        times["decode"].append(time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(copy, src)
        times["memcpy"].append(time.perf_counter() - start)
    gbps = {name: CHUNK_BYTES / statistics.median(t) / 1e9 for name, t in times.items()}
    return {
        **{f"{name}_gbps": value for name, value in gbps.items()},
        "encode_vs_memcpy": gbps["encode"] / gbps["memcpy"],
        "decode_vs_memcpy": gbps["decode"] / gbps["memcpy"],
    }


def main(argv: list[str] | None = None) -> int:
    args = model_bench_args(__doc__.splitlines()[0], argv)
    model = build_benchmark_llama(args.cache_dir, tokenizer_dir=build_tokenizer(args.cache_dir))
    prompts = shared_prefix_prompts(
        PROMPTS,
        vocab_size=vocab_size_of(model),
        prefix_len=PREFIX_TOKENS,
        suffix_len=48,
        num_prefixes=PROMPTS,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-codec-") as root:
        apply_engine_env(engine_env(Path(root)))
        for codec in Codec:
            tmp = Path(root) / codec
            tmp.mkdir()
            results[codec] = measure(model, codec.value, tmp, prompts)
        engine = {"dtype": "bfloat16", "kv_cache_memory_bytes": 256 << 20}
        with running_llm(model, **engine) as llm:
            recomputed, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    outputs = {codec: results[codec].pop("outputs") for codec in Codec}
    exact = outputs[Codec.NONE]
    for codec in (Codec.INT8, Codec.FP8):
        r = results[codec]
        r["error_bound"] = error_bound(codec, HEAD)
        r["greedy_vs_exact_hits"] = divergence(outputs[codec], exact)
        r["bytes_ratio"] = r["lmdb_bytes_per_chunk"] / results[Codec.NONE]["lmdb_bytes_per_chunk"]
        r["speed"] = speed(codec)
    results[Codec.NONE]["greedy_vs_recomputed"] = divergence(exact, recomputed)
    out = {"model": "llama 12 layers, 4 KV heads of 64, bf16", "cases": results}
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        "| lmdb codec | bytes/chunk | chunks verified | median | p99 | max | bound | quarantined "
        "| greedy: prompts that differ | tokens equal | encode GB/s | decode GB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for codec, r in results.items():
        e = r["errors"]
        greedy = r.get("greedy_vs_exact_hits") or r["greedy_vs_recomputed"]
        s = r.get("speed", {})
        print(
            f"| {codec} | {r['lmdb_bytes_per_chunk']:,.0f} | {e['chunks']} | "
            f"{e.get('median', 0):.3g} | {e.get('p99', 0):.3g} | {e.get('max', 0):.3g} | "
            f"{r.get('error_bound', 0):.3g} | {r['quarantined']} | "
            f"{greedy['outputs_differ']} of {greedy['prompts']} | "
            f"{greedy['tokens_equal_share']:.1%} | {s.get('encode_gbps', math.nan):.2f} | "
            f"{s.get('decode_gbps', math.nan):.2f} |"
        )
    print(
        f"greedy: {MAX_TOKENS} tokens; the coded rows against exact hits, the exact row against "
        "an engine without the connector (each prompt computed in its own batch)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
