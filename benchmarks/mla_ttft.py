"""Time to first token of an MLA model on a kvtier arena hit, against a prompt of the uncached
suffix alone; and the bytes kvtier stores per token against one latent copy per TP rank.

Usage: ``python -m benchmarks.mla_ttft [--quick] [--json] [--tp N] [--load-mode MODE]
[--cache-dir DIR]``

The model is built locally into ``--cache-dir`` (tests/fixtures/models.py, ``build_deepseek_mla``:
a 3-layer DeepSeek-V2, hidden 128, 4 heads, kv_lora_rank 512 + rope 64, fp32, random weights);
nothing is downloaded. Engines are in-process vLLM engines at ``--tp`` (2), eager, 16-token
blocks, on vLLM's reference CPU MLA backend (``CPU_MLA``, named so that a CPU with AMX does not
pick the bf16-only AMX backend). With that backend vLLM turns its own prefix caching (and chunked
prefill) off, so there is no vLLM prefix-cache hit to compare with: the floor is computing only
the tokens a hit leaves, as a prompt of its own.

kvtierd runs as a subprocess and the engines use the connector in sidecar mode. Engine 1
computes and stores the prompts (``PROMPT_TOKENS`` each, 1 or 2 past a block boundary, as a
conversation's next turn); engine 2, fresh, serves each prompt from the arena (every full block
but the one holding the last token) and, right after it, the suffix the hit left as a prompt of
its own (shorter than a block, so never stored). A TTFT is the wall time of one
``llm.generate()`` of one prompt with ``max_tokens=1``, the median over every prompt of every
pass (5 prompts, 3 passes; 3 and 2 with ``--quick``), after an untimed warm-up of each path.
``--load-mode`` sets the connector's ``load_mode`` in both engines (its default otherwise).

- ``mla_cold_ms``: engine 1's prefill of a whole prompt (nothing to hit yet), for scale.
- ``mla_arena_hit_ms``, ``mla_suffix_only_ms``: engine 2's hit, and its suffix alone.
- ``mla_hit_vs_suffix_only`` (target <= 1.2): their ratio.
- ``mla_bytes_vs_per_rank_copies`` (target <= 1 / TP): bytes engine 1 stored (vLLM's
  ``vllm:kvtier_transfer_bytes``) per stored token, over one 576-wide latent per layer and token
  for each rank: the latent is the same on every rank, so one copy serves them all.
- ``first_token_same_as_cold``: the hit's first token against engine 1's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier_vllm.shared.settings import LoadMode

from benchmarks.harness.cases import Case
from benchmarks.harness.cli import MODEL_CACHE, emit, log_progress
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import MiB, extent_for, round_up
from benchmarks.harness.targets import Target, judged, judged_cell
from benchmarks.ttft_cases import first_token
from tests.fixtures import engines, models

log = logging.getLogger("kvtier.bench")

BLOCK = 16  # the only block size CPU_MLA takes
PROMPT_TOKENS = 64 * BLOCK + 2
LATENT = 576  # kv_lora_rank 512 + rope 64
STORED = "vllm:kvtier_transfer_bytes"
STORED_CHUNKS = "vllm:kvtier_transfer_chunks"


def targets(tp: int) -> dict[str, Target]:
    return {"mla_hit_vs_suffix_only": ("<=", 1.2), "mla_bytes_vs_per_rank_copies": ("<=", 1 / tp)}


class MlaBench:
    def __init__(self, cache_dir: Path, tp: int, quick: bool, load_mode: str | None) -> None:
        self.tp = tp
        self.load_mode = load_mode
        self.passes = 2 if quick else 3
        self.root = Path(tempfile.mkdtemp(prefix="mla-ttft-", dir=cache_dir))
        engines.apply_engine_env(engines.engine_env(self.root, caches=cache_dir))
        tokenizer = models.build_tokenizer(cache_dir)
        self.model = models.build_deepseek_mla(cache_dir, tokenizer_dir=tokenizer)
        self.layers = json.loads((self.model / "config.json").read_text())["num_hidden_layers"]
        vocab = models.vocab_size_of(self.model)
        rng = random.Random(13)
        lengths = [PROMPT_TOKENS + i % 2 for i in range(4 if quick else 6)]
        self.warmup, *self.prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
        self.hit = [self.full_hit(p) for p in self.prompts]

    @staticmethod
    def full_hit(prompt: Sequence[int]) -> int:
        """Every full block but one holding the prompt's last token, which is always computed."""
        return (len(prompt) - 1) // BLOCK * BLOCK

    def latent_bytes_per_token(self) -> int:
        return self.layers * LATENT * 4  # fp32

    @contextmanager
    def engine(self, connector: dict[str, Any]) -> Iterator[Any]:
        kwargs: dict[str, Any] = {"block_size": BLOCK, "attention_config": {"backend": "CPU_MLA"}}
        if self.tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(self.tp)))
            kwargs |= {"tensor_parallel_size": self.tp, "distributed_executor_backend": "mp"}
        with engines.running_llm(self.model, kv_transfer_config=connector, **kwargs) as llm:
            yield llm

    def run(self) -> dict[str, Any]:
        chunk = BLOCK * self.latent_bytes_per_token()
        extent = extent_for(chunk)
        kv = (len(self.prompts) + 1) * PROMPT_TOKENS * self.latent_bytes_per_token()
        shm = Path(f"/dev/shm/kvtier-mla-ttft-{uuid.uuid4().hex[:8]}")
        daemon = Kvtierd(self.root / "kvtierd", shm, round_up(kv + 2 * extent, 256 * MiB), extent)
        cold = Case("mla_cold", 0)
        arena = Case("mla_arena_hit", min(self.hit), connector=True)
        suffix = Case("mla_suffix_only", 0)
        try:
            daemon.start()
            extra = {"mode": "sidecar", "socket_path": str(daemon.socket_path)}
            if self.load_mode:
                extra["load_mode"] = self.load_mode
            connector = kvtier_connector(extra, recompute_failed_loads=False)
            log.info("engine 1 (TP=%d): computes and stores the prompts", self.tp)
            with self.engine(connector) as llm:
                first_token(llm, self.warmup)
                cold.samples = [first_token(llm, p) for p in self.prompts]
                stored = engines.counter(llm, STORED, direction="store")
                chunks = engines.counter(llm, STORED_CHUNKS, direction="store")
            log.info("engine 2 (TP=%d, fresh): arena hits and suffixes alone", self.tp)
            with self.engine(connector) as llm:
                first_token(llm, self.warmup)
                first_token(llm, self.warmup[self.full_hit(self.warmup) :])
                for _ in range(self.passes):
                    for prompt, hit in zip(self.prompts, self.hit, strict=True):
                        arena.samples.append(first_token(llm, prompt))
                        suffix.samples.append(first_token(llm, prompt[hit:]))
        finally:
            daemon.stop()
        per_rank = chunks * BLOCK * self.latent_bytes_per_token() * self.tp
        cold_tokens = [s.token for s in cold.samples]
        return {
            "model": self.model.name,
            "tp": self.tp,
            "load_mode": self.load_mode or "default",
            "prompt_tokens": PROMPT_TOKENS,
            "hit_tokens": self.hit,
            "mla_cold_ms": cold.ms,
            "mla_arena_hit_ms": arena.ms,
            "mla_suffix_only_ms": suffix.ms,
            "mla_hit_vs_suffix_only": arena.ms / suffix.ms,
            "stored_bytes": stored,
            "stored_chunks": chunks,
            "mla_bytes_vs_per_rank_copies": stored / per_rank if per_rank else float("nan"),
            "hits_ok": arena.hits_ok and suffix.hits_ok,
            "cases": {
                "mla_cold": cold.summary(),
                "mla_arena_hit": arena.summary(cold_tokens),
                "mla_suffix_only": suffix.summary(),
            },
        }


def table(result: dict[str, Any]) -> str:
    goals = targets(result["tp"])
    met = result["targets_met"]
    cases = result["cases"]
    lines = [
        f"MLA ({result['model']}, TP={result['tp']}, {result['prompt_tokens']} tokens, "
        f"load_mode {result['load_mode']}):"
    ]
    for name in ("mla_cold", "mla_arena_hit", "mla_suffix_only"):
        case = cases[name]
        same = case.get("first_token_same_as_cold", "")
        lines.append(f"  {name:20}{case['ttft_ms']:9.1f} ms  cached {case['cached_tokens']} {same}")
    for key in goals:
        lines.append(f"  {key:32}{result[key]:8.3f}  {judged_cell(goals, met, key)}")
    lines.append(f"  hits_ok: {result['hits_ok']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and passes")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    parser.add_argument(
        "--load-mode",
        choices=[mode.value for mode in LoadMode],
        help="the connector's load_mode (default: the connector's own default)",
    )
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE, help="models")
    args = parser.parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    log_progress(log)
    bench = MlaBench(args.cache_dir, args.tp, args.quick, args.load_mode)
    try:
        result = bench.run()
    finally:
        shutil.rmtree(bench.root, ignore_errors=True)
    result["targets_met"] = judged(result, targets(args.tp))
    emit(result, args.json, lambda: table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
