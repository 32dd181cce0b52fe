"""Relative errors of verified reuse, per KV dtype: right chunks and wrong ones, to set
``verify_max_error`` between them.

For each model (the tests' fp32 llama; the benchmarks' 12-layer bf16 llama) an in-process engine
with embedded tiers stores 8 prompts, computed in one batch. A second engine, with every hit
sampled (``verify_sample_rate: 1.0``), computes them again one at a time, so each chunk is
recomputed in another batch than the one that stored it: the right chunks' errors. Then the bytes
of pairs of chunks held in the arena are swapped (what a slot holding another prompt's KV looks
like), vLLM's own prefix cache is reset, and the same requests are compared again: the wrong
chunks' errors.

The cost of a sampled request is timed on its own: one request at a time on an idle engine, each
a miss (a prefix never stored), a sampled hit (computed and compared) or a hit (loaded), in turn
so that the machine's drift touches all three alike. Nothing is downloaded; models are built
under ``--cache-dir``.

    python -m benchmarks.verify_errors [--json]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.cli import model_bench_args
from benchmarks.harness.connector import kvtier_connector
from tests.fixtures.engines import (
    apply_engine_env,
    engine_env,
    generate_tokens,
    running_llm,
    scheduler_of,
    swap_chunks,
)
from tests.fixtures.models import (
    build_benchmark_llama,
    build_llama,
    build_tokenizer,
    shared_prefix_prompts,
    vocab_size_of,
)

PROMPTS = 8
SWAPS = 4
TIMED_ROUNDS = 8


def connector(config: Path, **extra: Any) -> dict[str, Any]:
    return kvtier_connector({"kvtier_config": str(config), **extra}, recompute_failed_loads=False)


def embedded_config(tmp: Path, **lmdb: Any) -> Path:
    """Embedded tiers under ``tmp``, with ``lmdb`` keys set over the defaults."""
    path = tmp / "kvtier.yaml"
    tree = {
        "arena": {
            "path": f"/dev/shm/kvtier-verify-{tmp.name}",
            "size_bytes": "256MiB",
            "extent_bytes": "2MiB",
            "min_slot_bytes": "4KiB",
            # the swapped chunks must reach the comparison, not be caught on the way to lmdb
            "commit_checksum": False,
        },
        "lmdb": {"path": str(tmp / "lmdb"), "budget_bytes": "1GiB", **lmdb},
    }
    path.write_text(yaml.safe_dump(tree))
    return path


def summary(errors: list[float]) -> dict[str, float | int]:
    errors = sorted(errors)
    if not errors:
        return {"chunks": 0}
    return {
        "chunks": len(errors),
        "min": errors[0],
        "median": errors[len(errors) // 2],
        "p99": errors[min(len(errors) - 1, int(len(errors) * 0.99))],
        "max": errors[-1],
    }


@contextmanager
def verifying_every_hit(
    model: Path, config: Path, engine: dict[str, Any], prompts: list[list[int]], max_tokens: int
) -> Iterator[Any]:
    """An engine that verifies every hit, after one that stored ``prompts`` in the tiers of
    ``config``, and that has asked each of them already."""
    with running_llm(model, kv_transfer_config=connector(config), **engine) as llm:
        generate_tokens(llm, prompts, max_tokens=max_tokens)
    with running_llm(
        model, kv_transfer_config=connector(config, verify_sample_rate=1.0), **engine
    ) as llm:
        for prompt in prompts:  # one at a time: another batch than the one that stored them
            generate_tokens(llm, [prompt], max_tokens=max_tokens)
        yield llm


def measure(model: Path, dtype: str, tmp: Path) -> dict[str, Any]:
    prompts = shared_prefix_prompts(
        PROMPTS, vocab_size=vocab_size_of(model), prefix_len=640, suffix_len=48, num_prefixes=4
    )
    engine = {"dtype": dtype, "kv_cache_memory_bytes": 256 << 20}
    with verifying_every_hit(model, embedded_config(tmp), engine, prompts, 4) as llm:
        verifier = scheduler_of(llm).verifier
        right = [e for _, e in verifier.errors]
        verifier.errors.clear()
        changed = swap_chunks(scheduler_of(llm), SWAPS)
        verifier.max_error = float("inf")  # measured, not quarantined: every pair is compared
        llm.reset_prefix_cache()
        generate_tokens(llm, prompts, max_tokens=4)
        # the swapped chunks are the ones off by far more than any right one
        floor = max(right, default=0.0)
        wrong = [e for _, e in verifier.errors if e > floor]
    return {
        "dtype": dtype,
        "right": summary(right),
        "wrong": summary(wrong),
        "swapped_chunks": changed,
    }


def first_token_s(llm: Any, prompt: list[int]) -> float:
    """Seconds to the first token of ``prompt`` alone, vLLM's own cache emptied first."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    generate_tokens(llm, [prompt], max_tokens=1)
    return time.perf_counter() - start


def sampled_cost(model: Path, dtype: str, tmp: Path) -> dict[str, Any]:
    """Median time to the first token of a miss, a sampled hit and a served hit."""
    prompts = shared_prefix_prompts(
        2 * TIMED_ROUNDS,
        vocab_size=vocab_size_of(model),
        prefix_len=640,
        suffix_len=48,
        num_prefixes=2 * TIMED_ROUNDS,
        seed=3,
    )
    stored, fresh = prompts[:TIMED_ROUNDS], prompts[TIMED_ROUNDS:]
    engine = {"dtype": dtype, "kv_cache_memory_bytes": 256 << 20}
    config = embedded_config(tmp)
    times: dict[str, list[float]] = {"miss": [], "sampled": [], "hit": []}
    with running_llm(
        model, kv_transfer_config=connector(config, verify_sample_rate=0.0), **engine
    ) as llm:
        generate_tokens(llm, stored, max_tokens=1)
        verifier = scheduler_of(llm).verifier
        for prompt, new in zip(stored, fresh, strict=True):
            times["miss"].append(first_token_s(llm, new))
            verifier.rate = 1.0
            times["sampled"].append(first_token_s(llm, prompt))
            verifier.rate = 0.0
            times["hit"].append(first_token_s(llm, prompt))
        compared = len(verifier.errors)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "dtype": dtype,
        "ttft_s": median,
        "compared_chunks": compared,
        "sampled_vs_miss": median["sampled"] / median["miss"],
        "hit_vs_miss": median["hit"] / median["miss"],
    }


def main(argv: list[str] | None = None) -> int:
    args = model_bench_args(__doc__.splitlines()[0], argv)
    tokenizer = build_tokenizer(args.cache_dir)
    models = {
        "float32": build_llama(args.cache_dir, tokenizer_dir=tokenizer),
        "bfloat16": build_benchmark_llama(args.cache_dir, tokenizer_dir=tokenizer),
    }
    results, costs = [], []
    with tempfile.TemporaryDirectory(prefix="kvtier-verify-") as root:
        apply_engine_env(engine_env(Path(root)))
        for dtype, model in models.items():
            tmp = Path(root) / dtype
            (tmp / "errors").mkdir(parents=True)
            (tmp / "cost").mkdir()
            results.append(measure(model, dtype, tmp / "errors"))
            costs.append(sampled_cost(model, dtype, tmp / "cost"))
    if args.json:
        print(json.dumps({"cases": results, "sampled_cost": costs}))
        return 0
    print("| KV dtype | right chunks | median | p99 | max | wrong chunks | min | median |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        right, wrong = r["right"], r["wrong"]
        print(
            f"| {r['dtype']} | {right['chunks']} | {right.get('median', 0):.3g} | "
            f"{right.get('p99', 0):.3g} | {right.get('max', 0):.3g} | {wrong['chunks']} | "
            f"{wrong.get('min', 0):.3g} | {wrong.get('median', 0):.3g} |"
        )
    print()
    print("| KV dtype | TTFT miss | TTFT sampled | TTFT hit | sampled / miss | hit / miss |")
    print("|---|---|---|---|---|---|")
    for c in costs:
        t = c["ttft_s"]
        print(
            f"| {c['dtype']} | {t['miss'] * 1e3:.0f} ms | {t['sampled'] * 1e3:.0f} ms | "
            f"{t['hit'] * 1e3:.0f} ms | {c['sampled_vs_miss']:.3f} | {c['hit_vs_miss']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
