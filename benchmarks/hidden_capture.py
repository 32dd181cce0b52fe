"""Captured hidden states: bytes stored against vLLM's reference connector on a shared-prefix
workload, fp8's error, and the time to read them back.

The 12-layer bf16 benchmark llama (hidden size 768) captures EAGLE-3's layers 2, 6 and 9 for 32
requests that share a 1,024-token system prompt, each with a private 80-token suffix. Three
multiprocess engines run the same requests:

- the reference: vLLM's ``ExampleHiddenStatesConnector`` (its device copy made synchronous for
  the CPU, `tests.fixtures.hidden_reference`), one safetensors file per request;
- kvtier embedded, ``hidden_dtype: auto`` (bf16, as captured), then ``fp8``.

Figures: the hidden pool's bytes stored (vLLM's ``kvtier_transfer_bytes{pool="hidden"}``) over
the reference's states bytes; fp8's relative error per request (the norm of the difference over
the norm of the reference's states); and reading every request's states back, from lmdb after
the engine is gone (``HiddenStatesReader``, the states in memory) against ``safetensors``
loading the reference's files and copying their tensors out, both from a warm page cache, each
the best of three.

    python -m benchmarks.hidden_capture [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.cli import MODEL_CACHE
from benchmarks.harness.connector import kvtier_connector
from tests.fixtures.engines import (
    apply_engine_env,
    capture_config,
    counter,
    engine_env,
    running_llm,
)
from tests.fixtures.models import (
    build_benchmark_llama,
    build_tokenizer,
    shared_prefix_prompts,
    vocab_size_of,
)

REQUESTS = 32
SHARED = 1024
SUFFIX = 80
LAYERS = [2, 6, 9]
CAPTURE = capture_config(LAYERS)


def generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


def engine(model: Path, connector: dict[str, Any]) -> Any:
    return running_llm(
        model,
        kv_transfer_config=connector,
        speculative_config=CAPTURE,
        multiprocess=True,
        dtype="bfloat16",
    )


def best_of(runs: int, work: Any) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def kvtier_run(model: Path, root: Path, prompts: list[list[int]], dtype: str) -> dict[str, Any]:
    from kvtier_vllm.hidden_capture.tensors import as_tensor

    from kvtier.client import InProcessClient
    from kvtier.core.config import load_config
    from kvtier.hidden.reader import REF_FIELD, HiddenStatesReader
    from kvtier.tiering.manager import TierManager

    config = root / f"kvtier-{dtype}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "arena": {"path": f"/dev/shm/kvtier-hidden-bench-{dtype}", "size_bytes": "512MiB"},
                "lmdb": {"path": str(root / f"lmdb-{dtype}"), "budget_bytes": "2GiB"},
            }
        )
    )
    connector = kvtier_connector(
        {
            "kvtier_config": str(config),
            "hidden_dtype": dtype,
            "verify_sample_rate": 0.0,
            # in lmdb at once: vLLM gives a multiprocess engine a few seconds to stop, and what
            # is still only in the arena then is not written down
            "write_through": True,
        },
        recompute_failed_loads=False,
    )
    with engine(model, connector) as llm:
        outputs = generate(llm, prompts)
        stored = counter(llm, "vllm:kvtier_transfer_bytes", direction="store", pool="hidden")
    refs = [o.kv_transfer_params[REF_FIELD] for o in outputs]
    manager = TierManager(load_config(config))
    reader = HiddenStatesReader(InProcessClient(manager))
    try:
        states = [as_tensor(reader.load(ref)) for ref in refs]
        read_s = best_of(3, lambda: [reader.load(ref) for ref in refs])
    finally:
        reader.close()
        manager.close()
    return {
        "stored_bytes": stored,
        "read_s": read_s,
        "states": states,
        "states_bytes": sum(s.numel() * s.element_size() for s in states),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE)
    args = parser.parse_args(argv)
    import torch
    from safetensors.torch import load_file

    root = Path(tempfile.mkdtemp(prefix="hidden-"))
    apply_engine_env(engine_env(root))
    tokenizer = build_tokenizer(args.cache_dir)
    model = build_benchmark_llama(args.cache_dir, tokenizer_dir=tokenizer)
    vocab = vocab_size_of(model)
    prompts = shared_prefix_prompts(
        REQUESTS, vocab_size=vocab, prefix_len=SHARED, suffix_len=SUFFIX, seed=7
    )
    reference = {
        "kv_connector": "CpuHiddenStatesConnector",
        "kv_connector_module_path": "tests.fixtures.hidden_reference",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(root / "files")},
    }
    with engine(model, reference) as llm:
        outputs = generate(llm, prompts)
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
    time.sleep(1.0)  # the writer's lock is released once the last file is on disk
    files = [load_file(p)["hidden_states"] for p in paths]
    file_bytes = sum(Path(p).stat().st_size for p in paths)
    states_bytes = sum(f.numel() * f.element_size() for f in files)
    # safetensors maps a file: reading it is copying its tensors out
    file_read_s = best_of(3, lambda: [load_file(p)["hidden_states"].clone() for p in paths])

    result: dict[str, Any] = {
        "requests": REQUESTS,
        "shared_tokens": SHARED,
        "suffix_tokens": SUFFIX,
        "layers": LAYERS,
        "reference_file_bytes": file_bytes,
        "reference_states_bytes": states_bytes,
        "reference_read_s": file_read_s,
    }
    for dtype in ("auto", "fp8"):
        run = kvtier_run(model, root, prompts, dtype)
        errors = [
            float((ours.float() - theirs.float()).norm() / theirs.float().norm())
            for ours, theirs in zip(run["states"], files, strict=True)
        ]
        exact = all(torch.equal(o, t) for o, t in zip(run["states"], files, strict=True))
        result[dtype] = {
            "stored_bytes": run["stored_bytes"],
            "stored_vs_reference_files": run["stored_bytes"] / file_bytes,
            "bit_exact": exact,
            "relative_error_median": statistics.median(errors),
            "relative_error_max": max(errors),
            "read_s": run["read_s"],
            "read_vs_reference_files": run["read_s"] / file_read_s,
            "read_mb_s": run["states_bytes"] / run["read_s"] / 1e6,
        }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"reference files: {file_bytes / 2**20:.1f} MiB, read in {file_read_s:.3f} s")
    for dtype in ("auto", "fp8"):
        r = result[dtype]
        print(
            f"kvtier {dtype}: {r['stored_bytes'] / 2**20:.2f} MiB stored "
            f"({r['stored_vs_reference_files']:.3f} of the files), bit-exact {r['bit_exact']}, "
            f"error median {r['relative_error_median']:.4f} max {r['relative_error_max']:.4f}, "
            f"read in {r['read_s']:.3f} s ({r['read_vs_reference_files']:.2f}x the files')"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
