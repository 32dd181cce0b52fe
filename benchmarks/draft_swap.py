"""A draft-weight swap in a running engine: what happens to the prefix cache and to acceptance.

Usage: ``python -m benchmarks.draft_swap [--quick] [--json] [--cache-dir DIR]``

The models are built locally (tests/e2e/models.py: a 2-layer Llama, hidden 128, fp32, random
weights; nothing is downloaded). The draft is the target itself (``method: draft_model``, 3
speculative tokens), so the original draft accepts every proposal. The "new" draft is the same
weights with Gaussian noise of ``--noise`` (0.05) times each tensor's standard deviation: a
revision that mostly agrees with the old one, as a fine-tuned draft would. Weights are swapped in
place with the CPU recipe of tests/fixtures/draft_weights.py, between
``reset_prefix_cache(reset_connector=True)`` (what ``pause_generation(clear_cache=True)`` does)
and the next request.

Each case is a fresh in-process engine (embedded kvtier where it has one, arena in /dev/shm,
lmdb under the run directory). It serves the prompts once (their KV is computed and stored),
then pauses as for a weight update (swapping the draft's weights, or not), then times the same
prefixes again:

- ``no_swap``: kvtier, no swap: the reference for hit rate and acceptance.
- ``swap_previous``: kvtier, a swap, ``draft_fill: previous`` (the old revision's draft KV).
- ``swap_zeros``: kvtier, a swap, ``draft_fill: zeros``.
- ``swap_without_kvtier``: no connector; vLLM resets its prefix cache, so every prefix is
  recomputed.

Per case: ``target_hit_rate`` (prompt tokens served from a cache over the tokens a cache could
serve: all but the last block of each prompt) and ``acceptance`` (vLLM's accepted over drafted
tokens, ``max_tokens`` each) of the first requests after the pause, then ``ttft_ms`` (median wall
time of one ``generate`` of one prompt with ``max_tokens=1``, vLLM's own prefix cache emptied
before each so hits come from kvtier; ``--passes`` passes over the prompts). The kvtier swap
cases then swap the original weights back (a second pause) and serve the prompts again:
``acceptance_after_swap_back``.

Headline keys (``--json``): ``target_hit_rate_after_swap_vs_before`` (the lower of the two swap
cases over ``no_swap``; target >= 0.95), ``stale_draft_chunks_served`` (vLLM's
``vllm:kvtier_stale_draft_chunks_served_total`` summed over the cases; target 0),
``acceptance_after_swap_back_vs_original`` (the lower over the swap cases, against ``no_swap``;
target >= 0.95), ``outputs_match`` (greedy outputs of every case against a plain engine).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.harness.connector import kvtier_connector
from tests.fixtures.draft_weights import checkpoint_weights, noisy, swap_draft_weights
from tests.fixtures.engines import (
    apply_engine_env,
    counter_value,
    engine_env,
    generate_tokens,
    greedy,
    make_llm,
    shutdown_llm,
)
from tests.fixtures.models import BLOCK_SIZE, build_models, vocab_size_of

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"
STALE = "vllm:kvtier_stale_draft_chunks_served"
CASES = ("no_swap", "swap_previous", "swap_zeros", "swap_without_kvtier")


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.cache_dir) / f"draft-swap-{uuid.uuid4().hex[:8]}"
        self.run_dir.mkdir(parents=True)
        apply_engine_env(engine_env(self.run_dir))
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.models = build_models(Path(args.cache_dir) / "models")
        vocab = vocab_size_of(self.models.target)
        n, length = (2, 1536) if args.quick else (4, 3072)
        self.prompts = random_prompts(n, length, vocab)
        self.cacheable = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in self.prompts)
        self.original = checkpoint_weights(self.models.target)
        self.revised = noisy(self.original, scale=args.noise)
        self.spec = {
            "method": "draft_model",
            "model": str(self.models.target),
            "num_speculative_tokens": 3,
        }
        self.reference: list[list[int]] = []

    @contextmanager
    def engine(self, fill: str | None, speculative: bool = True) -> Iterator[Any]:
        kwargs: dict[str, Any] = {}
        if speculative:
            kwargs["speculative_config"] = self.spec
        shm = Path("/dev/shm") / f"kvtier-bench-{uuid.uuid4().hex[:8]}"
        if fill is not None:
            case_dir = self.run_dir / f"kvtier-{uuid.uuid4().hex[:8]}"
            case_dir.mkdir()
            config = case_dir / "kvtier.yaml"
            config.write_text(
                json.dumps(
                    {
                        "arena": {
                            "path": str(shm),
                            "size_bytes": "256MiB",
                            "extent_bytes": "2MiB",
                            "min_slot_bytes": "16KiB",  # the tiny draft's chunks
                        },
                        "lmdb": {"path": str(case_dir / "lmdb"), "budget_bytes": "1GiB"},
                    }
                )
            )
            kwargs["kv_transfer_config"] = kvtier_connector(
                {"kvtier_config": str(config), "draft_fill": fill}, recompute_failed_loads=False
            )
        llm = make_llm(self.models.target, **kwargs)
        try:
            yield llm
        finally:
            shutdown_llm(llm)
            shm.unlink(missing_ok=True)

    def serve(self, llm: Any) -> dict[str, Any]:
        """The prompts once more, from kvtier or recomputed: hit rate, acceptance, outputs."""
        assert llm.reset_prefix_cache()  # vLLM's own cache only: hits must come from kvtier
        accepted, drafted = counter_value(llm, ACCEPTED), counter_value(llm, DRAFTED)
        tokens, cached = generate_tokens(llm, self.prompts, max_tokens=self.args.max_tokens)
        drafted = counter_value(llm, DRAFTED) - drafted
        accepted = counter_value(llm, ACCEPTED) - accepted
        return {
            "target_hit_rate": round(sum(cached) / self.cacheable, 4),
            "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens": tokens,
        }

    def ttft_ms(self, llm: Any) -> float:
        times = []
        for _ in range(self.args.passes):
            for prompt in self.prompts:
                assert llm.reset_prefix_cache()
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], greedy(1), use_tqdm=False)
                times.append((time.perf_counter() - started) * 1000)
        return round(statistics.median(times), 2)

    def case(self, name: str) -> dict[str, Any]:
        fill = {"no_swap": "previous", "swap_previous": "previous", "swap_zeros": "zeros"}.get(name)
        swap = name != "no_swap"
        with self.engine(fill) as llm:
            generate_tokens(llm, self.prompts, max_tokens=self.args.max_tokens)  # computed, stored
            time.sleep(0.5)  # the idle engine's arena reaches lmdb now, not while timed
            assert llm.reset_prefix_cache(reset_connector=True)  # the pause of an update
            swap_s = swap_draft_weights(llm, self.revised) if swap else 0.0
            row = self.serve(llm)  # the first requests after the pause: acceptance, hits
            ttft = self.ttft_ms(llm)
            row.update(case=name, ttft_ms=ttft, swap_s=round(swap_s, 3))
            if swap and fill is not None:
                assert llm.reset_prefix_cache(reset_connector=True)
                swap_draft_weights(llm, self.original)
                back = self.serve(llm)
                row["acceptance_after_swap_back"] = back["acceptance"]
                row["outputs_match_after_swap_back"] = back["tokens"] == self.reference
            row["stale_draft_chunks_served"] = counter_value(llm, STALE)
        row["outputs_match"] = row.pop("tokens") == self.reference
        return row

    def run(self) -> dict[str, Any]:
        with self.engine(None, speculative=False) as llm:
            self.reference, _ = generate_tokens(llm, self.prompts, max_tokens=self.args.max_tokens)
        rows = [self.case(name) for name in CASES]
        by = {r["case"]: r for r in rows}
        before = by["no_swap"]
        kvtier_swaps = [by["swap_previous"], by["swap_zeros"]]
        return {
            "rows": rows,
            "target_hit_rate_after_swap_vs_before": round(
                min(r["target_hit_rate"] for r in kvtier_swaps) / before["target_hit_rate"], 4
            ),
            "stale_draft_chunks_served": sum(r["stale_draft_chunks_served"] for r in rows),
            "acceptance_after_swap_back_vs_original": round(
                min(r["acceptance_after_swap_back"] for r in kvtier_swaps) / before["acceptance"],
                4,
            ),
            "outputs_match": all(
                r["outputs_match"] and r.get("outputs_match_after_swap_back", True) for r in rows
            ),
            "ttft_swap_previous_vs_without_kvtier": round(
                by["swap_previous"]["ttft_ms"] / by["swap_without_kvtier"]["ttft_ms"], 4
            ),
            "prompts": len(self.prompts),
            "prompt_tokens": len(self.prompts[0]),
            "max_tokens": self.args.max_tokens,
            "noise": self.args.noise,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter prompts")
    parser.add_argument("--json", action="store_true", help="also print one JSON object")
    parser.add_argument("--noise", type=float, default=0.05, help="the new draft's noise scale")
    parser.add_argument("--max-tokens", type=int, default=0, help="tokens per prompt")
    parser.add_argument("--passes", type=int, default=0, help="timed passes over the prompts")
    parser.add_argument(
        "--cache-dir", default=str(Path(tempfile.gettempdir()) / "kvtier-bench"), type=Path
    )
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    args.passes = args.passes or (3 if args.quick else 5)
    logging.disable(logging.WARNING)  # vLLM's per-engine chatter would bury the table
    bench = Bench(args)
    try:
        result = bench.run()
    finally:
        shutil.rmtree(bench.run_dir, ignore_errors=True)
    print(f"{'case':<22}{'target hit rate':>16}{'acceptance':>12}{'ttft ms':>10}")
    for row in result["rows"]:
        print(
            f"{row['case']:<22}{row['target_hit_rate']:>16.3f}{row['acceptance']:>12.3f}"
            f"{row['ttft_ms']:>10.2f}"
        )
    for key in (
        "target_hit_rate_after_swap_vs_before",
        "stale_draft_chunks_served",
        "acceptance_after_swap_back_vs_original",
        "outputs_match",
    ):
        print(f"{key}: {result[key]}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
