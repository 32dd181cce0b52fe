"""What tier-aware routing is worth across a fleet: `benchmarks/fleet_sim.py`'s model of nodes
serving multi-turn sessions through kvtier, at 1, 8, 64 and 512 nodes, under four routers.

    .venv/bin/python -m benchmarks.fleet                # table; --json for one JSON object
    .venv/bin/python -m benchmarks.fleet --quick        # 1 and 8 nodes only
    .venv/bin/python -m benchmarks.fleet --no-validate  # the model only

Unless told not to, it then checks the model against a real fleet of two
(`benchmarks/fleet_check.py`) and reports ``validation_error``.

The tier costs are a GPU node's (`benchmarks/fleet_costs.py` names each figure and its source),
with this machine's measured efficiencies applied (`--measured` takes the JSON of
`benchmarks/tiers.py`, `benchmarks/ttft.py` or `benchmarks/objstore.py` runs to replace the
recorded ones). For each router and fleet size it reports where prompt tokens came from (hit
share by tier, and recomputed), modeled TTFT p50 and p99, and GPU-seconds of prefill saved.

The workload is `kvtier bench`'s multi-round shape: each session a private 8,192-token document,
then 8 turns of a 128-token question and a 256-token answer, a think time of 30 s on average
(exponential) between a turn's last token and the next question, and sessions arriving at 0.25 a
second per engine for 240 s (every node serves the same load per engine, so the sizes compare).
Each fleet has 8 engines a node.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.fleet_costs import (
    GPU_FIGURES,
    MEASURED_HERE,
    NodeCosts,
    capacities,
    gpu_node,
    measured,
)
from benchmarks.fleet_sim import LEVELS, ROUTERS, Shape, Totals, Workload, simulate
from benchmarks.harness.stats import median, percentile

SIZES = (1, 8, 64, 512)
QUICK_SIZES = (1, 8)


def summary(totals: Totals) -> dict[str, Any]:
    prompt = sum(totals.tokens.values()) or 1
    return {
        "requests": totals.requests,
        "share": {level: totals.tokens[level] / prompt for level in LEVELS},
        "ttft_p50_s": median(totals.ttft) if totals.ttft else 0.0,
        "ttft_p99_s": percentile(totals.ttft, 99) if totals.ttft else 0.0,
        "gpu_s_saved": totals.prefill_saved_s,
        "gpu_s_saved_per_request": totals.prefill_saved_s / max(1, totals.requests),
    }


def one(shape: Shape, costs: NodeCosts, router: str, workload: Workload) -> dict[str, Any]:
    started = time.perf_counter()
    found = summary(simulate(shape, costs, router, workload))
    found["wall_s"] = time.perf_counter() - started
    return found


def run(sizes: tuple[int, ...], workload: Workload, here: dict[str, float]) -> dict[str, Any]:
    costs = gpu_node(here=here)
    caps = capacities(costs)
    block = int(GPU_FIGURES["block_tokens"][0])
    jobs = {
        (nodes, router): Shape(nodes=nodes, block_tokens=block, **caps)
        for nodes in sizes
        for router in ROUTERS
    }
    # one simulation per core: each is one Python thread's work
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        futures = {
            job: pool.submit(one, shape, costs, job[1], workload) for job, shape in jobs.items()
        }
        results: dict[str, Any] = {}
        for (nodes, router), future in futures.items():
            results.setdefault(str(nodes), {})[router] = future.result()
    return {
        "costs": costs.to_dict(),
        "capacities": caps,
        "workload": asdict(workload),
        "gpu_figures": {k: {"value": v, "source": s} for k, (v, s) in GPU_FIGURES.items()},
        "measured_here": {
            k: {"value": here[k], "source": MEASURED_HERE[k][1]} for k in MEASURED_HERE
        },
        "fleet": results,
    }


def table(report: dict[str, Any]) -> None:
    c = report["costs"]
    print(
        f"chunk {c['chunk_tokens']} tokens ({c['chunk_bytes'] / 2**20:.0f} MiB); prefill "
        f"{c['prefill_s_per_token'] * 1e6:.1f} us/token; load per chunk "
        + ", ".join(f"{t} {s * 1e3:.2f} ms" for t, s in c["load_s_per_chunk"].items())
    )
    head = ("nodes", "router", *(f"{lv} %" for lv in LEVELS), "TTFT p50", "TTFT p99", "GPU-s saved")
    print("  ".join(f"{h:>11}" for h in head))
    for nodes, routers in report["fleet"].items():
        for router, r in routers.items():
            cells = [nodes, router, *(f"{100 * r['share'][lv]:.1f}" for lv in LEVELS)]
            cells += [f"{r['ttft_p50_s']:.3f} s", f"{r['ttft_p99_s']:.3f} s"]
            cells.append(f"{r['gpu_s_saved']:.0f}")
            print("  ".join(f"{x:>11}" for x in cells))
    check = report.get("validation")
    if check:
        print("the real fleet of two against the model:")
        print("  ".join(f"{h:>11}" for h in ("router", "", "hit rate", "TTFT ratio", *LEVELS)))
        for router, found in check["routers"].items():
            for label in ("real", "modeled"):
                r = found[label]
                cells = [router, label, f"{r['hit_rate']:.3f}", f"{r['ttft_ratio']:.3f}"]
                cells += [f"{100 * r['shares'].get(lv, 0.0):.1f} %" for lv in LEVELS]
                print("  ".join(f"{x:>11}" for x in cells))
            errors = found["errors"]
            cells = ["", "error", f"{errors['hit_rate']:.3f}", f"{errors['ttft_ratio']:.3f}"]
            print("  ".join(f"{x:>11}" for x in cells))
        error, target = check["validation_error"], check["validation_target"]
        print(f"validation_error {error:.3f} (target {target})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 8 nodes only")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measured", type=Path, nargs="*", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="leave out the check of the model against two real vLLM servers sharing S3 on "
        "moto (`benchmarks/fleet_check.py`, about 10 minutes)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtier-fleet"
    )
    args = parser.parse_args(argv)
    workload = Workload(seed=args.seed)
    report = run(QUICK_SIZES if args.quick else SIZES, workload, measured(args.measured))
    if args.validate:
        from benchmarks import fleet_check

        report["validation"] = fleet_check.check(args.cache_dir)
        report["validation_error"] = report["validation"]["validation_error"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
