"""The draft loop: hidden states captured by kvtier while serving train an EAGLE-3 drafter with
Speculators, through Speculators' file backend (the states exported first) and through kvtier's
own backend (read from kvtier's tiers), then the trained drafter is swapped into a serving
engine.

A tiny 3-layer fp32 llama captures layers 0 to 3 for requests sharing a system prompt;
an engine stores them exact (``hidden_dtype: auto``), another as fp8. From the same fresh
drafter, each backend trains a copy of its own (its own optimizer) the same steps over the same
samples, one a step, each read through the backend every step as a dataloader does. The backends
train in lockstep, step ``i`` of each in turn, so whatever else loads the machine falls on all of
them alike; each one's steps are timed on their own. Figures per backend: training samples per
second, the seconds a step's read took (the read alone), the bytes written to disk for training
data (the file backend's export; kvtier's backend writes nothing beyond its tiers), the bytes
held per sample (kvtier's hidden pool, deduplicated by prefix, against the exported files), and
the mean loss over the samples after the steps. Then an engine serving with the fresh drafter
has the trained weights written where its draft model points and swapped in: acceptance per
draft revision, before and after, from kvtier's counters.

    python -m benchmarks.draft_loop [--quick] [--json FILE] [--backend file|kvtier ...]

``kvtier_vs_file_samples_per_s`` is kvtier's backend's rate over the file backend's, both from
the one lockstep run (kvtier's fp8 states train in it too, as a third copy);
``loss_difference_exact`` is the relative difference of the two final losses with exact storage
(the same states: 0), ``loss_difference_fp8`` the same for kvtier's fp8 states. The kvtier row
is skipped, with the reason, where ``kvtier_speculators`` does not import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.cli import MODEL_CACHE
from benchmarks.harness.connector import kvtier_connector
from tests.fixtures.draft_training import (
    CAPTURED_LAYERS,
    SPECULATIVE_TOKENS,
    Trainer,
    build_drafter,
    build_target,
    link_as_samples,
    read_transfer,
    train_in_lockstep,
)
from tests.fixtures.draft_weights import checkpoint_weights, swap_draft_weights
from tests.fixtures.engines import (
    apply_engine_env,
    capture_config,
    counter,
    engine_env,
    running_llm,
)
from tests.fixtures.models import build_tokenizer, shared_prefix_prompts, vocab_size_of

FULL = {"requests": 12, "shared": 256, "suffix": 64, "steps": 24}
QUICK = {"requests": 4, "shared": 64, "suffix": 40, "steps": 8}
OUTPUT_TOKENS = 8
STORED = "vllm:kvtier_transfer_bytes"


def tiers_config(root: Path, dtype: str) -> Path:
    """Embedded tiers of their own per storage dtype; a tiny model's chunks need small slots."""
    path = root / f"kvtier-{dtype}.yaml"
    arena = Path("/dev/shm") / f"kvtier-draft-loop-{os.getpid()}-{dtype}"
    settings = {
        "arena": {"path": str(arena), "size_bytes": "128MiB", "min_slot_bytes": "4KiB"},
        "lmdb": {"path": str(root / f"lmdb-{dtype}"), "budget_bytes": "1GiB"},
    }
    path.write_text(yaml.safe_dump(settings))
    return path


def connector(config: Path, **extra: Any) -> dict[str, Any]:
    return kvtier_connector(
        {"kvtier_config": str(config), "verify_sample_rate": 0.0, **extra},
        recompute_failed_loads=False,
    )


def capture(target: Path, config: Path, prompts: list[list[int]], dtype: str) -> dict[str, Any]:
    """One engine capturing every prompt's states: their references and the bytes stored."""
    from vllm import SamplingParams

    from kvtier.hidden.reader import REF_FIELD

    spec = capture_config(CAPTURED_LAYERS)
    sampling = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    kv = connector(config, hidden_dtype=dtype)
    with running_llm(target, kv_transfer_config=kv, speculative_config=spec) as llm:
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, sampling, use_tqdm=False)
        stored = counter(llm, STORED, direction="store", pool="hidden")
    return {
        "refs": [o.kv_transfer_params[REF_FIELD] for o in outputs],
        "stored_bytes": stored,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    }


def export(config: Path, refs: list[dict[str, Any]], root: Path) -> tuple[Path, int]:
    """`kvtier hidden export` of ``refs`` as the file backend's samples, and the bytes written."""
    from kvtier.cli.main import main as kvtier_cli
    from kvtier.hidden.export import file_name
    from kvtier.hidden.reader import HiddenStatesRef

    refs_file = root / "refs.jsonl"
    refs_file.write_text("".join(json.dumps(r) + "\n" for r in refs))
    exported = root / "exported"
    argv = ["hidden", "export", "--config", str(config), "--refs", str(refs_file)]
    if kvtier_cli([*argv, "--to", str(exported)]) != 0:
        raise RuntimeError("kvtier hidden export failed")
    names = [file_name(HiddenStatesRef.from_json(r)) for r in refs]
    written = sum(f.stat().st_size for f in exported.iterdir())
    return link_as_samples(exported, names, root / "samples"), written


def kvtier_backend() -> Any:
    """kvtier's ``HiddenStatesTransfer`` class, or a string saying why it is not available."""
    try:
        from kvtier_speculators.transfer import KVTierHiddenStates
    except ImportError as exc:
        return f"kvtier_speculators does not import: {exc}"
    return KVTierHiddenStates


def kvtier_transfer(
    backend: Any, config: Path, refs: list[dict[str, Any]], prompts: list[list[int]]
) -> Any:
    """kvtier's backend over the tiers at ``config`` (opened by the trainer), finding sample
    ``i`` by its tokens."""
    return backend(
        str(config),
        refs[0]["namespace"],
        token_ids=lambda index: prompts[index],
        through_daemon=False,
    )


def swap_acceptance(
    target: Path, config: Path, drafter: Path, trained: Trainer, prompts: list[list[int]]
) -> dict[str, Any]:
    """Serve with the fresh drafter, write the trained weights where it points, swap them in,
    serve again: acceptance per draft revision from the connector's counters."""
    from vllm.v1.metrics.reader import Gauge

    def current(llm: Any) -> str:
        (revision,) = [
            m.labels["draft_revision"]
            for m in llm.get_metrics()
            if isinstance(m, Gauge) and m.name == "vllm:kvtier_draft_revision_info" and m.value
        ]
        return revision

    def acceptance(llm: Any, revision: str) -> float:
        labels = {"draft_revision": revision}
        drafted = counter(llm, "vllm:kvtier_spec_drafted_tokens", **labels)
        return counter(llm, "vllm:kvtier_spec_accepted_tokens", **labels) / max(drafted, 1.0)

    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": SPECULATIVE_TOKENS}
    with running_llm(target, kv_transfer_config=connector(config), speculative_config=spec) as llm:
        before = generate(llm, prompts)
        fresh = current(llm)
        trained.save(drafter)
        if not llm.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM did not reset its prefix cache for the swap")
        swap_draft_weights(llm, checkpoint_weights(drafter))
        after = generate(llm, prompts)
        swapped = current(llm)
        return {
            "revision_before": fresh,
            "revision_after": swapped,
            "swap_seen": swapped != fresh,
            "acceptance_before": acceptance(llm, fresh),
            "acceptance_after": acceptance(llm, swapped),
            "outputs": (before, after),
        }


def generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="4 requests, 8 steps")
    parser.add_argument(
        "--backend",
        action="append",
        choices=["file", "kvtier"],
        help="the backends to train through (default: both)",
    )
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE)
    args = parser.parse_args(argv)
    backends = args.backend or ["file", "kvtier"]
    shape = QUICK if args.quick else FULL

    root = Path(tempfile.mkdtemp(prefix="draft-loop-"))
    apply_engine_env(engine_env(root))
    target = build_target(args.cache_dir, build_tokenizer(args.cache_dir))
    prompts = shared_prefix_prompts(
        shape["requests"],
        vocab_size=vocab_size_of(target),
        prefix_len=shape["shared"],
        suffix_len=shape["suffix"],
        seed=7,
    )
    configs = {dtype: tiers_config(root, dtype) for dtype in ("auto", "fp8")}
    try:
        result = run(root, target, prompts, configs, backends, shape["steps"])
    finally:
        for config in configs.values():
            arena = Path(yaml.safe_load(config.read_text())["arena"]["path"])
            arena.unlink(missing_ok=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


def run(
    root: Path,
    target: Path,
    prompts: list[list[int]],
    configs: dict[str, Path],
    backends: list[str],
    steps: int,
) -> dict[str, Any]:
    samples = len(prompts)
    backend = kvtier_backend() if "kvtier" in backends else "not asked for"
    dtypes = ["auto"] if isinstance(backend, str) else ["auto", "fp8"]
    captured = {dtype: capture(target, configs[dtype], prompts, dtype) for dtype in dtypes}
    drafter = build_drafter(target, root / "drafter")
    result: dict[str, Any] = {"requests": samples, "tokens": len(prompts[0]), "steps": steps}
    transfers: dict[str, Any] = {}

    if "file" in backends:
        from hs_connectors import FileTransfer

        started = time.perf_counter()
        files, written = export(configs["auto"], captured["auto"]["refs"], root)
        export_s = time.perf_counter() - started
        transfers["file"] = FileTransfer(files)
        result["file"] = {
            "export_s": export_s,
            "disk_bytes_written": written,
            "bytes_per_sample": written / samples,
        }
    if isinstance(backend, str):
        result["kvtier"] = {"skipped": backend}
    else:
        for dtype, name in (("auto", "kvtier"), ("fp8", "kvtier_fp8")):
            refs = captured[dtype]["refs"]
            transfers[name] = kvtier_transfer(backend, configs[dtype], refs, prompts)
            stored = captured[dtype]["stored_bytes"]
            result[name] = {
                "disk_bytes_written": 0,
                "tier_bytes": stored,
                "bytes_per_sample": stored / samples,
            }
    trainers = {name: Trainer(drafter) for name in transfers}
    try:
        runs = {name: (trainers[name], read_transfer(t)) for name, t in transfers.items()}
        trained = train_in_lockstep(runs, samples, steps) if runs else {}
    finally:
        for transfer in transfers.values():
            if hasattr(transfer, "close"):
                transfer.close()  # the tiers go back whole to the engine that swaps
    for name, training in trained.items():
        result[name] = {**asdict(training), **result[name]}
    file, kvtier, fp8 = (result.get(n, {}) for n in ("file", "kvtier", "kvtier_fp8"))
    if "loss_after" in file and "loss_after" in kvtier:
        result["kvtier_vs_file_samples_per_s"] = kvtier["samples_per_s"] / file["samples_per_s"]
        result["kvtier_vs_file_bytes_per_sample"] = (
            kvtier["bytes_per_sample"] / file["bytes_per_sample"]
        )
        result["loss_difference_exact"] = relative(kvtier["loss_after"], file["loss_after"])
        if "loss_after" in fp8:
            result["loss_difference_fp8"] = relative(fp8["loss_after"], file["loss_after"])
    if trainers:
        trained_by = next(iter(trainers.values()))
        swap = swap_acceptance(target, configs["auto"], drafter, trained_by, prompts)
        before, after = swap.pop("outputs")
        expected = captured["auto"]["tokens"]
        result["swap"] = {**swap, "outputs_equal_target": before == expected == after}
    return result


if __name__ == "__main__":
    sys.exit(main())
