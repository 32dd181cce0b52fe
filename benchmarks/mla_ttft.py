"""Time to first token of an MLA model on a kvtier arena hit, against a prompt of the uncached
suffix alone; and the bytes kvtier stores per token against one latent copy per TP rank.

Usage: ``python -m benchmarks.mla_ttft [--quick] [--json] [--tp N] [--load-mode MODE]
[--suffix-tokens N] [--cache-dir DIR]``

The model is built locally into ``--cache-dir`` (tests/fixtures/models.py, ``build_deepseek_mla``:
a 3-layer DeepSeek-V2, hidden 128, 4 heads, kv_lora_rank 512 + rope 64, fp32, random weights);
nothing is downloaded. Engines are in-process vLLM engines at ``--tp`` (2), eager, 16-token
blocks, on vLLM's reference CPU MLA backend (``CPU_MLA``, named so that a CPU with AMX does not
pick the bf16-only AMX backend). With that backend vLLM turns its own prefix caching (and chunked
prefill) off, so there is no vLLM prefix-cache hit to compare with: the floor is computing only
the tokens a hit leaves, as a prompt of its own.

kvtierd runs as a subprocess and the engines use the connector in sidecar mode. Each prompt
starts with a document of ``DOC_TOKENS`` (whole blocks). Engine 1 computes and stores each
document followed by a tail of 2 or 3 tokens (``DOC_TOKENS + 2`` or ``+ 3``; the tail is shorter
than a block, so only the document is stored). Engine 2, fresh, times two kinds of hit, each
right before its suffix as a prompt of its own (never stored, so never a hit):

- the question (``--suffix-tokens``, default 64: a new turn of tens of tokens): the document
  followed by a question engine 1 never saw, new in every pass, so the hit is the document alone
  and the question is computed against it; the suffix alone is the question with no document.
  This is what a request that hits a cached document brings in serving.
- the tail: the very prompt engine 1 computed, whose hit leaves its 2-3 tail tokens; the suffix
  alone is those tokens. ``--suffix-tokens 0`` times only this case.

A TTFT is the wall time of one ``llm.generate()`` of one prompt with ``max_tokens=1``, the median
over every prompt of every pass (5 prompts, 3 passes; 3 and 2 with ``--quick``), after an untimed
warm-up of each path. ``--load-mode`` sets the connector's ``load_mode`` in both engines (its
default otherwise). Each hit's time is split by vLLM's own request metrics: ``queue`` (arrival to
first scheduled, which holds an asynchronous load's wait) and ``prefill`` (first scheduled to
first token: the step, which holds a synchronous load); the rest of the TTFT is ``generate``'s
own work around the engine. Engine 2's loaded bytes and chunks (summed over the TP ranks, each
loading the same latent) and its load decisions (``load_policy``: a hit may be recomputed where
kvtier measures that cheaper) come with them.

- ``mla_cold_ms``: engine 1's prefill of a whole document and tail (nothing to hit yet).
- ``mla_arena_hit_ms``, ``mla_suffix_only_ms``: engine 2's hit with the ``--suffix-tokens``
  question, and that question alone (the tail's with ``--suffix-tokens 0``).
- ``mla_hit_vs_suffix_only`` (target <= 1.2): their ratio.
- ``mla_tail_hit_vs_tail_only``: the same ratio for the 2-3 token tail, for comparison.
- ``mla_bytes_vs_per_rank_copies`` (target <= 1 / TP): bytes engine 1 stored (vLLM's
  ``vllm:kvtier_transfer_bytes``) per stored token, over one 576-wide latent per layer and token
  for each rank: the latent is the same on every rank, so one copy serves them all.
- ``first_token_same_as_cold``: the tail hit's first token against engine 1's.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_vllm.shared.settings import LoadMode

from benchmarks.harness.cases import Case
from benchmarks.harness.cli import MODEL_CACHE, emit, log_progress
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import MiB, extent_for, round_up
from benchmarks.harness.stats import median
from benchmarks.harness.targets import Target, judged, judged_cell
from benchmarks.ttft_cases import first_token
from tests.fixtures import engines, models

log = logging.getLogger("kvtier.bench")

BLOCK = 16  # the only block size CPU_MLA takes
DOC_TOKENS = 64 * BLOCK
SUFFIX_TOKENS = 64
LATENT = 576  # kv_lora_rank 512 + rope 64
STORED = "vllm:kvtier_transfer_bytes"
STORED_CHUNKS = "vllm:kvtier_transfer_chunks"
DECISIONS = "vllm:kvtier_load_decisions"
DECIDED = ("load", "recompute")
QUEUE_SECONDS = "vllm:request_queue_time_seconds"
PREFILL_SECONDS = "vllm:request_prefill_time_seconds"
SPLIT = {"queue": QUEUE_SECONDS, "prefill": PREFILL_SECONDS}


def targets(tp: int) -> dict[str, Target]:
    return {"mla_hit_vs_suffix_only": ("<=", 1.2), "mla_bytes_vs_per_rank_copies": ("<=", 1 / tp)}


def histogram_sum(llm: Any, name: str) -> float:
    """A vLLM histogram's sum of observations over this engine's label sets."""
    from vllm.v1.metrics.reader import Histogram

    return sum(m.sum for m in llm.get_metrics() if isinstance(m, Histogram) and m.name == name)


@dataclass
class HitPair:
    """A hit and its suffix as a prompt of its own, with the hit's time split."""

    name: str
    hit: Case
    suffix: Case
    split_ms: dict[str, list[float]] = field(default_factory=lambda: {key: [] for key in SPLIT})

    @classmethod
    def named(cls, name: str, hit_tokens: int) -> HitPair:
        return cls(
            name,
            Case(f"mla_{name}_arena_hit", hit_tokens, connector=True),
            Case(f"mla_{name}_only", 0),
        )

    def time(self, llm: Any, prompt: Sequence[int], suffix: Sequence[int]) -> None:
        before = self._split_totals(llm)
        self.hit.samples.append(first_token(llm, prompt))
        after = self._split_totals(llm)
        for key, total in after.items():
            self.split_ms[key].append((total - before[key]) * 1e3)
        self.suffix.samples.append(first_token(llm, suffix))

    @staticmethod
    def _split_totals(llm: Any) -> dict[str, float]:
        return {key: histogram_sum(llm, name) for key, name in SPLIT.items()}

    @property
    def ratio(self) -> float:
        return self.hit.ms / self.suffix.ms

    def summary(self, suffix_tokens: str, cold_tokens: Sequence[int] | None) -> dict[str, Any]:
        return {
            "suffix_tokens": suffix_tokens,
            "arena_hit_ms": self.hit.ms,
            "suffix_only_ms": self.suffix.ms,
            "hit_vs_suffix_only": self.ratio,
            "hit_split_ms": {key: median(v) for key, v in self.split_ms.items()},
            "hits_ok": self.hit.hits_ok and self.suffix.hits_ok,
            "cases": {
                self.hit.name: self.hit.summary(cold_tokens),
                self.suffix.name: self.suffix.summary(),
            },
        }


class MlaBench:
    def __init__(
        self, cache_dir: Path, tp: int, quick: bool, load_mode: str | None, suffix_tokens: int
    ) -> None:
        self.tp = tp
        self.load_mode = load_mode
        self.suffix_tokens = suffix_tokens
        self.passes = 2 if quick else 3
        self.root = Path(tempfile.mkdtemp(prefix="mla-ttft-", dir=cache_dir))
        engines.apply_engine_env(engines.engine_env(self.root, caches=cache_dir))
        tokenizer = models.build_tokenizer(cache_dir)
        self.model = models.build_deepseek_mla(cache_dir, tokenizer_dir=tokenizer)
        self.layers = int(json.loads((self.model / "config.json").read_text())["num_hidden_layers"])
        self.vocab = models.vocab_size_of(self.model)
        self.rng = random.Random(13)
        count = 4 if quick else 6
        self.warmup, *self.docs = [self.tokens(DOC_TOKENS) for _ in range(count)]
        self.tails = [self.tokens(2 + i % 2) for i in range(count)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def question(self) -> list[int]:
        """A question no engine has seen: fresh for every prompt of every pass, since engine 2
        stores what it computes and a repeat would hit it."""
        return self.tokens(self.suffix_tokens)

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
        # engine 1's documents, and engine 2's stored questions of every pass
        questions = self.passes * len(self.docs) + 1
        tokens = (len(self.docs) + 1) * DOC_TOKENS + questions * (DOC_TOKENS + self.suffix_tokens)
        kv = tokens * self.latent_bytes_per_token()
        shm = Path(f"/dev/shm/kvtier-mla-ttft-{uuid.uuid4().hex[:8]}")
        daemon = Kvtierd(self.root / "kvtierd", shm, round_up(kv + 2 * extent, 256 * MiB), extent)
        cold = Case("mla_cold", 0)
        tail = HitPair.named("tail", DOC_TOKENS)
        asked = HitPair.named("question", DOC_TOKENS) if self.suffix_tokens else None
        try:
            daemon.start()
            extra = {"mode": "sidecar", "socket_path": str(daemon.socket_path)}
            if self.load_mode:
                extra["load_mode"] = self.load_mode
            connector = kvtier_connector(extra, recompute_failed_loads=False)
            log.info("engine 1 (TP=%d): computes and stores the documents", self.tp)
            with self.engine(connector) as llm:
                first_token(llm, self.warmup + self.tails[0])
                cold.samples = [
                    first_token(llm, doc + t)
                    for doc, t in zip(self.docs, self.tails[1:], strict=True)
                ]
                stored = engines.counter(llm, STORED, direction="store")
                chunks = engines.counter(llm, STORED_CHUNKS, direction="store")
            log.info("engine 2 (TP=%d, fresh): arena hits and suffixes alone", self.tp)
            with self.engine(connector) as llm:
                self.warm_up(llm)
                for _ in range(self.passes):
                    for doc, t in zip(self.docs, self.tails[1:], strict=True):
                        if asked is not None:
                            question = self.question()
                            asked.time(llm, doc + question, question)
                        tail.time(llm, doc + t, t)
                loaded = {
                    what: engines.counter(llm, f"vllm:kvtier_transfer_{what}", direction="load")
                    for what in ("bytes", "chunks", "seconds")
                }
                decided = {d: engines.counter(llm, DECISIONS, decision=d) for d in DECIDED}
        finally:
            daemon.stop()
        per_rank = chunks * BLOCK * self.latent_bytes_per_token() * self.tp
        cold_tokens = [s.token for s in cold.samples]
        headline = asked or tail
        tail_summary = tail.summary("2-3", cold_tokens)
        pairs = {"tail": tail_summary}
        if asked is not None:
            pairs["question"] = asked.summary(str(self.suffix_tokens), None)
        return {
            "model": self.model.name,
            "tp": self.tp,
            "load_mode": self.load_mode or "default",
            "doc_tokens": DOC_TOKENS,
            "suffix_tokens": self.suffix_tokens,
            "mla_cold_ms": cold.ms,
            "mla_arena_hit_ms": headline.hit.ms,
            "mla_suffix_only_ms": headline.suffix.ms,
            "mla_hit_vs_suffix_only": headline.ratio,
            "mla_tail_hit_vs_tail_only": tail.ratio,
            "stored_bytes": stored,
            "stored_chunks": chunks,
            "loaded_by_engine_2": loaded,
            "load_decisions_by_engine_2": decided,
            "mla_bytes_vs_per_rank_copies": stored / per_rank if per_rank else float("nan"),
            "first_token_same_as_cold": tail_summary["cases"][tail.hit.name][
                "first_token_same_as_cold"
            ],
            "hits_ok": all(p["hits_ok"] for p in pairs.values()),
            "pairs": pairs,
            "cases": {"mla_cold": cold.summary()},
        }

    def warm_up(self, llm: Any) -> None:
        """One untimed pass of each path: a tail hit, a question hit, and each suffix alone."""
        doc = self.warmup
        first_token(llm, doc + self.tails[0])
        first_token(llm, self.tails[0])
        if self.suffix_tokens:
            question = self.question()
            first_token(llm, doc + question)
            first_token(llm, question)


def table(result: dict[str, Any]) -> str:
    goals = targets(result["tp"])
    met = result["targets_met"]
    lines = [
        f"MLA ({result['model']}, TP={result['tp']}, a {result['doc_tokens']}-token document, "
        f"load_mode {result['load_mode']}):",
        f"  {'mla_cold':28}{result['mla_cold_ms']:9.1f} ms",
    ]
    for pair in result["pairs"].values():
        split = ", ".join(f"{k} {v:.1f}" for k, v in pair["hit_split_ms"].items())
        lines += [
            f"  suffix of {pair['suffix_tokens']} tokens:",
            f"    {'arena hit':26}{pair['arena_hit_ms']:9.1f} ms  (median ms: {split})",
            f"    {'suffix alone':26}{pair['suffix_only_ms']:9.1f} ms",
            f"    {'hit / suffix alone':26}{pair['hit_vs_suffix_only']:9.3f}",
        ]
    for key in goals:
        lines.append(f"  {key:32}{result[key]:8.3f}  {judged_cell(goals, met, key)}")
    loaded = result["loaded_by_engine_2"]
    lines.append(
        f"  engine 2 loaded {loaded['chunks']:.0f} chunks, {loaded['bytes'] / MiB:.0f} MiB"
        f" in {loaded.get('seconds', 0.0) * 1e3:.1f} ms of copies (all ranks);"
        f" load decisions {result['load_decisions_by_engine_2']}"
    )
    lines.append(f"  first_token_same_as_cold (tail hit): {result['first_token_same_as_cold']}")
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
    parser.add_argument(
        "--suffix-tokens",
        type=int,
        default=SUFFIX_TOKENS,
        help="tokens of the new question after the cached document (0: only the 2-3 token tail)",
    )
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE, help="models")
    args = parser.parse_args(argv)
    if args.suffix_tokens < 0:
        parser.error("--suffix-tokens is 0 or more")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    log_progress(log)
    bench = MlaBench(args.cache_dir, args.tp, args.quick, args.load_mode, args.suffix_tokens)
    try:
        result = bench.run()
    finally:
        shutil.rmtree(bench.root, ignore_errors=True)
    result["targets_met"] = judged(result, targets(args.tp))
    emit(result, args.json, lambda: table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
