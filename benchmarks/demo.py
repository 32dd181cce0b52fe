"""kvtier in one run: a long prompt's time to first token cold, then from a fresh engine that
loads its KV from kvtier instead of computing it, and the tier that served it.

Usage: ``python -m benchmarks.demo [--cache-dir DIR] [--tokens N]`` (``scripts/demo.sh`` installs
what it needs and runs it).

The model is built locally (tests/fixtures/models.py, ``build_benchmark_llama``: 12 layers, hidden
768, random weights; nothing is downloaded). Each engine is a fresh in-process vLLM engine with
``KVTierConnector`` in embedded mode on its default configuration: the tiers live in the
engine's process, the arena in /dev/shm and lmdb under the state directory. Only the state
directory (``XDG_STATE_HOME``, under ``--cache-dir``) and the arena's name and size are set,
so the demonstration leaves a machine's own kvtier state alone.

The first engine computes the prompt and kvtier stores its KV; it is shut down, and a second
engine, which has never seen the prompt, asks for it again: vLLM's own prefix cache is empty,
so what it does not compute comes from kvtier (``vllm:prompt_tokens_cached_by_source``: "host"
is the arena, "disk" is lmdb). Both greedy first tokens must agree.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.harness.connector import kvtier_connector
from tests.fixtures import engines, models

CONNECTOR = kvtier_connector({"mode": "embedded"})
SOURCES = {"host": "the arena (host memory)", "disk": "lmdb (local disk)"}


def first_token(model: Path, prompt: list[int]) -> tuple[float, int, dict[str, float], int]:
    """(TTFT ms, tokens vLLM did not compute, cached tokens per source, first token) of one
    fresh engine."""
    with engines.running_llm(
        model, kv_transfer_config=CONNECTOR, dtype="bfloat16", max_num_batched_tokens=8192
    ) as llm:
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], engines.greedy(1), use_tqdm=False)
        ttft_ms = (time.perf_counter() - started) * 1e3
        sources = {
            s: engines.counter(llm, "vllm:prompt_tokens_cached_by_source", source=s)
            for s in SOURCES
        }
    return ttft_ms, out[0].num_cached_tokens or 0, sources, out[0].outputs[0].token_ids[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvt-demo")
    parser.add_argument("--tokens", type=int, default=3600, help="prompt length")
    args = parser.parse_args(argv)
    root: Path = args.cache_dir
    root.mkdir(parents=True, exist_ok=True)
    arena = Path("/dev/shm") / f"kvtier-demo-{uuid.uuid4().hex[:8]}"
    os.environ.update(
        {
            "XDG_STATE_HOME": str(root / f"state-{os.getpid()}"),
            "KVTIER_ARENA__PATH": str(arena),
            "KVTIER_ARENA__SIZE_BYTES": "1GiB",
        }
    )
    engines.apply_engine_env(engines.engine_env(root / f"run-{os.getpid()}", caches=root))
    print("building the model (once per --cache-dir) ...", flush=True)
    model = models.build_benchmark_llama(
        root / "models", tokenizer_dir=models.build_tokenizer(root)
    )
    rng = random.Random(time.time_ns())  # a prompt no earlier run stored
    prompt = [
        rng.randrange(len(models.SPECIAL_TOKENS), models.VOCAB_SIZE) for _ in range(args.tokens)
    ]
    try:
        print("engine 1: computes the prompt; kvtier stores its KV ...", flush=True)
        cold_ms, cold_cached, _, cold_token = first_token(model, prompt)
        print("engine 2, fresh: asks for the same prompt ...", flush=True)
        hit_ms, hit_cached, sources, hit_token = first_token(model, prompt)
    finally:
        arena.unlink(missing_ok=True)
    served = [f"{SOURCES[s]}: {n:.0f} tokens" for s, n in sources.items() if n]
    print()
    print(f"prompt                {len(prompt)} tokens")
    print(f"cold TTFT             {cold_ms:8.1f} ms   ({cold_cached} tokens not computed)")
    print(f"hit TTFT              {hit_ms:8.1f} ms   ({hit_cached} tokens loaded from kvtier)")
    print(f"speed-up              {cold_ms / hit_ms:8.1f} x")
    print(f"served from           {'; '.join(served) or 'nowhere: a miss'}")
    print(f"same first token      {cold_token == hit_token}")
    ok = cold_cached == 0 and hit_cached > 0 and bool(served) and cold_token == hit_token
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
