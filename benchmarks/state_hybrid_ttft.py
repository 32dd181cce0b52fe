"""Time to first token on hybrid models whose state-space or linear-attention layers keep a
recurrent state beside their attention KV, with kvtier against vLLM's own prefix cache.

Usage: ``python -m benchmarks.state_hybrid_ttft [--quick] [--json] [--cache-dir DIR]``

Two models, built locally into ``--cache-dir`` (tests/fixtures/state_models.py), random weights:
a Qwen3-Next (gated delta nets and attention alternating, bf16) and a Nemotron-H (Mamba-2
mixers, attention and MLPs, ``M*-M*-``, fp32, its states fp32). Every engine is an in-process
eager vLLM engine with prefix caching on, so vLLM keeps the states in ``align`` mode: a state
at each block boundary, with the block size vLLM chose so that an attention page holds a state
(``block_size``). Prompts are random token ids, all distinct; the timing follows ``ttft.py``
(one warm-up prompt, then each prompt timed in passes with vLLM's prefix cache emptied
between them; medians). For each model:

- ``cold_ms`` and ``gpu_prefix_hit_ms``: no connector, a prompt cold and then on vLLM's own
  prefix cache (the floor), whose hit is the last block boundary before the prompt's last token;
- ``arena_hit_ms``: kvtierd (its own daemon) in sidecar mode, one block per chunk; engine 1
  stores the prompts, engine 2, fresh, loads them from the arena. While kvtier refuses such
  models at start, the row says so (``refused``: "refused at start: <reason>") and has no time;
- ``state_hybrid_bytes_per_token``: what kvtier stored per token of the stored chunks
  (``vllm:kvtier_transfer_bytes`` of direction ``store``), against ``kv_plus_state_per_token``:
  every attention layer's K and V plus every state layer's state once per block, one copy per
  TP rank (from the engine's KV-cache config, unpadded).

Targets: ``hybrid_state_hit_vs_gpu_prefix_hit`` (arena hit over vLLM's hit) <= 1.2 and
``state_hybrid_bytes_vs_kv_plus_state`` <= 1.0, for each model.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.cases import Case
from benchmarks.harness.cli import MODEL_CACHE, emit, log_progress
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import MiB, extent_for, round_up
from benchmarks.harness.targets import Target, judged, verdict
from benchmarks.ttft_cases import first_token
from tests.fixtures import engines, models, state_models

log = logging.getLogger("kvtier.bench")

TARGETS: dict[str, Target] = {
    "hybrid_state_hit_vs_gpu_prefix_hit": ("<=", 1.2),
    "state_hybrid_bytes_vs_kv_plus_state": ("<=", 1.0),
}
STORED = "vllm:kvtier_transfer_bytes"
KV_CACHE_BYTES = 512 * MiB
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Mode:
    prompts: int
    rounds: int
    prompt_tokens: int


QUICK = Mode(prompts=2, rounds=2, prompt_tokens=1800)
FULL = Mode(prompts=5, rounds=3, prompt_tokens=3600)


@dataclass(frozen=True)
class StateModel:
    build: Callable[[Path, Path], Path]
    dtype: str
    engine_patch: Callable[[], AbstractContextManager[None]] = nullcontext
    engine_args: dict[str, Any] = field(default_factory=dict)


MODELS = {
    "qwen3_next": StateModel(
        lambda root, tok: state_models.build_qwen3_next_hybrid(root, tokenizer_dir=tok),
        "bfloat16",
        engine_args=state_models.QWEN3_NEXT_ENGINE,
    ),
    "mamba2": StateModel(
        lambda root, tok: state_models.build_mamba2_hybrid(root, tokenizer_dir=tok),
        "float32",
        state_models.mamba2_align_on_cpu,
    ),
}


def kv_plus_state_per_token(kv_cache_config: Any) -> float:
    """Bytes a block of every group holds, unpadded (K and V of each attention layer, the state
    each state layer keeps at the block's end), over the block's tokens."""
    total, block = 0, 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        block = spec.block_size
        is_state = hasattr(spec, "shapes")  # a MambaSpec
        per_layer = state_models.state_bytes(spec) if is_state else spec.page_size_bytes
        total += per_layer * len(group.layer_names)
    return total / block


def refusal_of(llm: Any) -> str:
    """Why the connector in ``llm`` stores nothing ("" when it stores)."""
    return str(getattr(engines.scheduler_of(llm), "refusal", ""))


class StateBench:
    def __init__(self, mode: Mode, cache_dir: Path) -> None:
        self.mode = mode
        tokenizer = models.build_tokenizer(cache_dir)
        self.models = {name: case.build(cache_dir, tokenizer) for name, case in MODELS.items()}
        self.root = Path(tempfile.mkdtemp(prefix="state-ttft-", dir=cache_dir))
        self.shm_prefix = f"/dev/shm/kvtier-state-ttft-{os.getpid()}"
        self.shm_paths: list[Path] = []
        self.warmup, *self.prompts = models.shared_prefix_prompts(
            mode.prompts + 1,
            vocab_size=min(models.vocab_size_of(m) for m in self.models.values()),
            prefix_len=mode.prompt_tokens,
            suffix_len=0,
            num_prefixes=mode.prompts + 1,
            seed=13,
        )

    def full_hit(self, unit_tokens: int) -> int:
        """Tokens a whole-unit hit covers: the last prompt token is always computed."""
        return (self.mode.prompt_tokens - 1) // unit_tokens * unit_tokens

    @contextlib.contextmanager
    def engine(
        self, model: Path, case: StateModel, connector: dict[str, Any] | None = None
    ) -> Iterator[Any]:
        llm = engines.make_llm(
            model,
            kv_transfer_config=connector,
            dtype=case.dtype,
            block_size=None,  # vLLM raises it until an attention page holds a state
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=MAX_MODEL_LEN,
            enable_prefix_caching=True,
            **case.engine_args,
        )
        try:
            yield llm
        finally:
            engines.shutdown_llm(llm)
            del llm
            gc.collect()

    def rounds(self, llm: Any) -> Iterator[int]:
        """Passes over the prompts, vLLM's prefix cache emptied before each after the first."""
        for r in range(self.mode.rounds):
            if r and not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
            yield r

    def run(self, name: str, case: StateModel) -> dict[str, Any]:
        """Every figure of one model: vLLM alone, then kvtier (or its refusal)."""
        model = self.models[name]
        cold, local = Case("cold", 0), Case("gpu_prefix_hit", 0)
        with case.engine_patch():
            with self.engine(model, case) as llm:
                block = llm.llm_engine.vllm_config.cache_config.block_size
                per_token = kv_plus_state_per_token(state_models.kv_cache_config_of(llm))
                local.expected = self.full_hit(block)
                first_token(llm, self.warmup)
                first_token(llm, self.warmup)
                for _ in self.rounds(llm):
                    cold.samples += [first_token(llm, p) for p in self.prompts]
                    local.samples += [first_token(llm, p) for p in self.prompts]
            arena = Case("arena_hit", self.full_hit(block), connector=True)
            refused, stored = self.with_kvtier(name, model, case, block, per_token, arena)
        first_tokens = [s.token for s in cold.samples[: len(self.prompts)]]
        cases = {"cold": cold.summary(), "gpu_prefix_hit": local.summary(first_tokens)}
        if not refused:
            cases["arena_hit"] = arena.summary(first_tokens)
        stored_tokens = (len(self.prompts) + 1) * self.full_hit(block)
        bytes_per_token = stored / stored_tokens if stored else None
        out: dict[str, Any] = {
            "model": model.name,
            "dtype": case.dtype,
            "block_size": block,
            "refused": refused,
            "cold_ms": cold.ms,
            "gpu_prefix_hit_ms": local.ms,
            "arena_hit_ms": None if refused else arena.ms,
            "state_hybrid_bytes_per_token": bytes_per_token,
            "kv_plus_state_per_token": per_token,
            "hybrid_state_hit_vs_gpu_prefix_hit": None if refused else arena.ms / local.ms,
            "state_hybrid_bytes_vs_kv_plus_state": (
                bytes_per_token / per_token if bytes_per_token else None
            ),
            "cases": cases,
        }
        out["targets_met"] = judged(out, TARGETS)
        return out

    def with_kvtier(
        self, name: str, model: Path, case: StateModel, block: int, per_token: float, arena: Case
    ) -> tuple[str, float]:
        """Engine 1 stores the prompts through kvtierd, engine 2 times ``arena``'s hits: the
        refusal ("" if none) and the bytes engine 1 stored."""
        block_bytes = int(block * per_token)
        extent = extent_for(block_bytes)
        chunks = (len(self.prompts) + 1) * self.full_hit(block) // block
        # twice the unpadded bytes: room for padded state pages
        arena_bytes = round_up(2 * chunks * block_bytes, extent) + 2 * extent
        (self.root / name).mkdir()
        shm = Path(f"{self.shm_prefix}-{name}")
        self.shm_paths.append(shm)
        daemon = Kvtierd(self.root / name, shm, arena_bytes, extent)
        sidecar = {"mode": "sidecar", "socket_path": str(daemon.socket_path)}
        connector = kvtier_connector({**sidecar, "blocks_per_chunk": 1})
        try:
            daemon.start()
            with self.engine(model, case, connector) as llm:
                if refused := refusal_of(llm):
                    return f"refused at start: {refused}", 0.0
                for prompt in [self.warmup, *self.prompts]:
                    first_token(llm, prompt)
                stored = engines.counter(llm, STORED, direction="store")
            with self.engine(model, case, connector) as llm:
                first_token(llm, self.warmup)
                for _ in self.rounds(llm):
                    arena.samples += [first_token(llm, p) for p in self.prompts]
        finally:
            daemon.stop()
        return "", stored

    def close(self) -> None:
        for path in self.shm_paths:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _ms(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def table(result: dict[str, Any]) -> str:
    lines = []
    for name, figures in result["models"].items():
        lines.append(f"{name} ({figures['model']}, block_size {figures['block_size']}):")
        for case in ("cold", "gpu_prefix_hit", "arena_hit"):
            summary = figures["cases"].get(case)
            if summary is None:
                lines.append(f"  {case:24}{_ms(None)}  {figures['refused']}")
                continue
            ok = "ok" if summary["hits_ok"] else "WRONG"
            lines.append(
                f"  {case:24}{_ms(summary['ttft_ms'])}  "
                f"{min(summary['cached_tokens'], default=0)} / "
                f"{summary['expected_cached_tokens']} cached (min) {ok}"
            )
        stored = figures["state_hybrid_bytes_per_token"]
        lines.append(
            f"  bytes per token: stored {stored:.0f}" if stored else "  bytes per token: stored -"
        )
        lines[-1] += f", KV plus state {figures['kv_plus_state_per_token']:.0f}"
        for key, (op, bound) in TARGETS.items():
            value = figures[key]
            shown = f"{value:8.3f}" if value is not None else f"{'-':>8}"
            met = verdict(figures["targets_met"][key])
            lines.append(f"  {key:40}{shown}  {op} {bound:g}  {met}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter prompts")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE, help="models")
    args = parser.parse_args(argv)
    log_progress(log, "kvtier_vllm")
    # vLLM reads these when it is first imported and logs to stdout by default
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    bench = StateBench(QUICK if args.quick else FULL, args.cache_dir)
    result: dict[str, Any] = {"mode": "quick" if args.quick else "full", "models": {}}
    try:
        engines.apply_engine_env(engines.engine_env(bench.root / "engine"))
        for name, case in MODELS.items():
            log.info("%s", name)
            result["models"][name] = bench.run(name, case)
    finally:
        bench.close()
    emit(result, args.json, lambda: table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
