"""Whole-server throughput and TTFT of a vision-language model with kvtier's encoder cache,
against vLLM alone and vLLM's ``ECExampleConnector``: `kvtier bench serve`'s multimodal
workload (users asking, in conversations of their own, about a shared set of images) at 4
users.

Usage: ``python -m benchmarks.encoder_serving [--quick] [--json] [--cache-dir DIR]``

Each configuration serves twice. The first server answers a warm-up of the workload (every
image of the set is asked about, so a cache stores it) and stops; the second one, fresh, is
measured: the case of a restarted engine, or another replica on the node. Its own encoder
cache starts empty, so vLLM alone encodes each image once more, where the connectors load it
(kvtier from lmdb, embedded mode; ``ECExampleConnector`` from its files). The model is the
random-weight Idefics3 of ``benchmarks/encoder.py`` (`vision_models.BENCHMARK_VISION`), built
locally.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.system import remove_arena
from kvtier.bench import BenchConfig, WorkloadSpec
from kvtier.bench.runner import LevelResult, run_level
from kvtier.bench.scrape import parse_counters, total
from tests.fixtures import vision_models as vision
from tests.fixtures.servers import vllm_server

USERS = 4
MAX_MODEL_LEN = 4096
STARTUP_S = 600.0
"""A server's start may take minutes on a busy machine (builds, the first image's warm-up)."""
CONFIGS = ("vllm_alone", "kvtier", "example_connector")
ARENA = Path(f"/dev/shm/kvtier-encoder-serving-{os.getpid()}")


def workload(quick: bool) -> WorkloadSpec:
    return WorkloadSpec(
        kind="multimodal",
        doc_tokens=64,
        question_tokens=12,
        answer_tokens=8,
        rounds=2 if quick else 3,
        images=8,
        image_side=vision.BENCHMARK_VISION.image_size,
        image_tokens=vision.BENCHMARK_VISION.embeds,
        seed=11,
    )


def connector_args(name: str, root: Path) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    if name == "vllm_alone":
        return []
    if name == "kvtier":
        config = root / "kvtier.yaml"
        arena = {"path": str(ARENA), "size_bytes": "512MiB"}
        tree = {"arena": arena, "lmdb": {"path": str(root / "lmdb"), "budget_bytes": "1GiB"}}
        config.write_text(yaml.safe_dump(tree))
        extra: dict[str, Any] = {"kvtier_config": str(config), "verify_sample_rate": 0}
        ec = {
            "ec_connector": "KVTierECConnector",
            "ec_connector_module_path": "kvtier_vllm.ec_connector",
        }
    else:
        extra = {"shared_storage_path": str(root / "files")}
        ec = {"ec_connector": "ECExampleConnector"}
    ec |= {"ec_role": "ec_both", "ec_connector_extra_config": extra}
    return ["--ec-transfer-config", json.dumps(ec)]


def encoder_hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        samples = parse_counters(r.read().decode())
    return total(samples, "vllm:kvtier_encoder_items_total", result="hit")


def serve(model: Path, name: str, root: Path, spec: WorkloadSpec, requests: int) -> dict[str, Any]:
    args = [*connector_args(name, root), "--limit-mm-per-prompt", '{"image": 1}']
    # every image of the set, asked about once: what a cache keeps for the next server
    warm = dataclasses.replace(spec, rounds=1)
    # short paths: vLLM's sockets live under them
    started = {"max_model_len": MAX_MODEL_LEN, "args": args, "startup_s": STARTUP_S}
    with vllm_server(model, root / "1", **started) as url:
        run_level(BenchConfig(url=url, workload=warm, requests=spec.images * 2), USERS, index=99)
    with vllm_server(model, root / "2", **started) as url:
        level = run_level(BenchConfig(url=url, workload=spec, requests=requests), USERS)
        hits = encoder_hits(url) if name == "kvtier" else None
    return summary(level, hits)


def summary(level: LevelResult, hits: float | None) -> dict[str, Any]:
    return {
        "requests": level.requests,
        "ok": level.ok,
        "errors": level.error_messages,
        "requests_per_s": level.requests_per_s,
        "output_tps": level.output_tps,
        "ttft_p50_ms": level.ttft_s.p50 * 1e3,
        "ttft_p90_ms": level.ttft_s.p90 * 1e3,
        "kvtier_encoder_hits": hits,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"multimodal serving at {USERS} users, {result['requests']} requests a server, "
        f"{result['images']} shared images ({result['model']})",
        f"{'config':20}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p90':>10}  errors",
    ]
    for name in CONFIGS:
        r = result["configs"][name]
        lines.append(
            f"{name:20}{r['requests_per_s']:8.2f}{r['output_tps']:11.1f}{r['ttft_p50_ms']:10.1f}"
            f"{r['ttft_p90_ms']:10.1f}  {len(r['errors'])}"
        )
    for other in ("vllm_alone", "example_connector"):
        lines.append(
            f"kvtier vs {other}: TTFT p50 x{result['ttft_p50_vs_' + other]:.3f}, "
            f"throughput x{result['throughput_vs_' + other]:.3f}"
        )
    lines.append(f"kvtier encoder hits in the measured server: {result['kvtier_hits']:.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtier-bench"
    )
    args = parser.parse_args(argv)
    spec = workload(args.quick)
    requests = USERS * spec.rounds * (2 if args.quick else 4)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    model = vision.build_idefics3(args.cache_dir, vision=vision.BENCHMARK_VISION)
    root = Path(tempfile.mkdtemp(prefix="ecs-", dir=args.cache_dir))
    try:
        configs = {
            name: serve(model, name, root / str(i), spec, requests)
            for i, name in enumerate(CONFIGS)
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        remove_arena(ARENA)
    ours = configs["kvtier"]
    result: dict[str, Any] = {
        "model": model.name,
        "users": USERS,
        "requests": requests,
        "images": spec.images,
        "configs": configs,
        "kvtier_hits": ours["kvtier_encoder_hits"] or 0,
    }
    for other in ("vllm_alone", "example_connector"):
        result[f"ttft_p50_vs_{other}"] = ours["ttft_p50_ms"] / configs[other]["ttft_p50_ms"]
        result[f"throughput_vs_{other}"] = ours["output_tps"] / configs[other]["output_tps"]
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
