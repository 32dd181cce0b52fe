"""The connector end to end on whatever device vLLM runs on: the check a GPU node runs
(scripts/gpu-check.sh), and the same run on vLLM's CPU build here.

Usage: ``python -m benchmarks.gpu_e2e [--cache-dir DIR] [--require-cuda] [--out FILE]``

Small models are built locally (tests/fixtures/models.py: a 2-layer llama target and a 1-layer
draft, one tokenizer); nothing is downloaded. Each case runs fresh engines, one at a time:

- ``baseline``: vLLM alone, greedy outputs of prompts that share an 800-token prefix.
- ``embedded``: the connector with its tiers in the engine's process. Engine 1 stores; engine 2,
  fresh, must give the baseline's tokens with external hits (vLLM's
  ``external_prefix_cache_hits``) covering every prompt's stored prefix.
- ``sidecar``: the same through a kvtierd subprocess (``kvtier serve``) over its socket.
- ``draft``: a speculating engine (the target as its own draft, with the draft's KV in fp8 while
  the target's is in the model dtype) through kvtierd; a fresh engine loads both pools and keeps
  the baseline's tokens; kvtierd's arena holds a draft pool whose chunks are smaller than the
  target's by the dtypes' ratio.

Prints each check; ``--out`` writes the result as one JSON object (``ok`` says whether every
check held) to a file, since vLLM logs to stdout. Exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import KvtierdProcess
from tests.fixtures import engines, models

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("kvtier.bench")

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
PROMPTS = 4
PREFIX = 800
MAX_TOKENS = 16
# the engine and the tiers share the machine: deadlines for correctness, not for speed
CONNECTOR_SETTINGS = {"lookup_deadline_ms": 2000, "store_deadline_ms": 4000}
NO_SAMPLING = {"verify_sample_rate": 0.0}  # a sampled hit is served as a miss


def connector(extra: dict[str, Any]) -> dict[str, Any]:
    return kvtier_connector({**CONNECTOR_SETTINGS, **NO_SAMPLING, **extra})


def tiers(shm: Path, lmdb: Path) -> dict[str, Any]:
    return {
        "arena": {
            "path": str(shm),
            "size_bytes": "128MiB",
            "extent_bytes": "2MiB",
            "min_slot_bytes": "4KiB",
        },
        "lmdb": {"path": str(lmdb), "budget_bytes": "512MiB"},
    }


class Run:
    def __init__(self, root: Path, require_cuda: bool) -> None:
        self.root = root
        self.models = models.build_models(root / "models")
        self.prompts = models.shared_prefix_prompts(PROMPTS, prefix_len=PREFIX, suffix_len=64)
        self.checks: dict[str, bool] = {}
        self.figures: dict[str, Any] = {}
        self.arenas: list[Path] = []
        import torch
        from vllm.platforms import current_platform

        self.device = str(current_platform.device_type)
        self.figures["device"] = self.device
        self.figures["device_name"] = (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        )
        if require_cuda and self.device != "cuda":
            raise SystemExit(f"gpu_e2e.py --require-cuda: vLLM runs on {self.device!r}, not CUDA")

    def arena(self, name: str) -> Path:
        path = Path("/dev/shm") / f"kvtier-e2e-{name}-{uuid.uuid4().hex[:8]}"
        self.arenas.append(path)
        return path

    def check(self, name: str, held: bool) -> None:
        self.checks[name] = bool(held)
        log.info("%-40s %s", name, "ok" if held else "FAILED")

    def generate(self, **engine: Any) -> tuple[list[list[int]], list[int], int]:
        started = time.perf_counter()
        with engines.running_llm(self.models.target, **engine) as llm:
            tokens, cached = engines.generate_tokens(llm, self.prompts, max_tokens=MAX_TOKENS)
            hits = engines.counter_value(llm, EXTERNAL_HITS)
        log.info("engine ran in %.1f s: cached %s, external hits %d", _since(started), cached, hits)
        return tokens, cached, hits

    def store_then_load(self, name: str, transfer: dict[str, Any], **engine: Any) -> None:
        """Engine 1 stores; engine 2, fresh, must load every prompt's stored prefix."""
        baseline = self.figures["baseline_tokens"]
        first, _, first_hits = self.generate(kv_transfer_config=transfer, **engine)
        second, cached, hits = self.generate(kv_transfer_config=transfer, **engine)
        # engine 1 stored every prompt whole, so engine 2 finds each but its last block: the
        # first from kvtier, the rest partly from its own prefix cache (their shared prefix)
        least = PREFIX - PREFIX % models.BLOCK_SIZE
        self.check(f"{name}: outputs match vLLM alone (storing)", first == baseline)
        self.check(f"{name}: outputs match vLLM alone (loading)", second == baseline)
        self.check(f"{name}: no external hit before anything was stored", first_hits == 0)
        self.check(f"{name}: a fresh engine gets external hits", hits >= least)
        self.check(f"{name}: every prompt's prefix is cached", min(cached) >= least)
        self.figures[f"{name}_external_hit_tokens"] = hits
        self.figures[f"{name}_cached_tokens"] = cached

    def baseline(self) -> None:
        tokens, _, _ = self.generate()
        self.figures["baseline_tokens"] = tokens

    def embedded(self) -> None:
        config = self.root / "embedded.yaml"
        config.write_text(json.dumps(tiers(self.arena("emb"), self.root / "emb-lmdb")))
        self.store_then_load("embedded", connector({"kvtier_config": str(config)}))

    @contextmanager
    def daemon(self, name: str) -> Iterator[KvtierdProcess]:
        socket = Path(tempfile.mkdtemp(prefix="kvt-")) / "d.sock"
        config = tiers(self.arena(name), self.root / f"{name}-lmdb")
        config["server"] = {
            "socket_path": str(socket),
            "admin_address": "127.0.0.1:0",
            "metrics_address": "127.0.0.1:0",
        }
        daemon = KvtierdProcess(self.root / name, config)
        daemon.start()
        try:
            yield daemon
        finally:
            daemon.stop()

    def sidecar(self) -> None:
        with self.daemon("side") as daemon:
            extra = {"mode": "sidecar", "socket_path": _socket_of(daemon)}
            self.store_then_load("sidecar", connector(extra))

    def draft(self) -> None:
        spec = {
            "method": "draft_model",
            "model": str(self.models.target),
            "num_speculative_tokens": 3,
            "kv_cache_dtype": "fp8",
        }
        with self.daemon("draft") as daemon, _draft_dtype_patch(self.device):
            extra = {"mode": "sidecar", "socket_path": _socket_of(daemon)}
            self.store_then_load("draft", connector(extra), speculative_config=spec)
            admin = daemon.admin_client(timeout_s=20.0)
            try:
                (cpu,) = [t for t in admin.stats().tiers if t.tier == "cpu"]
            finally:
                admin.close()
        pools = {p.pool: p.usage for p in cpu.pools}
        target, draft = pools.get("target"), pools.get("draft")
        self.check("draft: the arena holds a draft pool", draft is not None and draft.chunks > 0)
        if target is None or draft is None or not draft.chunks:
            return
        per_chunk = (draft.used_bytes / draft.chunks) / (target.used_bytes / target.chunks)
        self.figures["draft_vs_target_bytes_per_chunk"] = round(per_chunk, 3)
        # fp8 against the target's float32: a quarter, plus each chunk's header
        self.check("draft: its own dtype, its own bytes per chunk", 0.2 < per_chunk < 0.35)

    def run(self) -> dict[str, Any]:
        for case in (self.baseline, self.embedded, self.sidecar, self.draft):
            started = time.perf_counter()
            case()
            self.figures[f"{case.__name__}_s"] = round(_since(started), 1)
        self.figures.pop("baseline_tokens")
        return {"ok": all(self.checks.values()), "checks": self.checks, **self.figures}

    def close(self) -> None:
        for path in self.arenas:
            path.unlink(missing_ok=True)


def _socket_of(daemon: KvtierdProcess) -> str:
    import yaml

    return str(yaml.safe_load(daemon.config_path.read_text())["server"]["socket_path"])


def _draft_dtype_patch(device: str) -> Any:
    """vLLM's CPU build needs the tests' fix to run a draft KV dtype of its own; CUDA does not."""
    if device == "cuda":
        return nullcontext()
    from tests.e2e.cpu_patches import per_layer_kv_dtype_on_cpu

    return per_layer_kv_dtype_on_cpu()


def _since(started: float) -> float:
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvt-e2e")
    parser.add_argument("--require-cuda", action="store_true", help="fail unless vLLM uses CUDA")
    parser.add_argument("--out", type=Path, help="write the result here as one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    root = args.cache_dir / f"run-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    engines.apply_engine_env(engines.engine_env(root, caches=args.cache_dir))
    run = Run(root, args.require_cuda)
    try:
        result = run.run()
    finally:
        run.close()
    if args.out is not None:
        args.out.write_text(json.dumps(result, sort_keys=True) + "\n")
    for name, held in result["checks"].items():
        print(f"{'ok' if held else 'FAILED':7} {name}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
