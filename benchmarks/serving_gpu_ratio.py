"""The serving benchmark on the GPU-ratio model (``--model gpu-ratio``): its documents' length
fitted to this machine first (benchmarks/gpu_ratio_fit.py), its recompute:load ratios measured
in the run beside a GPU node's, the connector's load decisions, and the targets that hold on a
GPU node.

Targets, each a ratio measured in the same run at concurrency 4 (kvtier: the sidecar with the
``measured`` load policy where the connector has load policies, else its default). vLLM alone
stays up through the run, and each other server's levels run in pairs beside one of its levels
of the same prompts (benchmarks/serving_pairs.py: 3 pairs a server with ``--quick``, 6 in the
full run, ``--pairs``; 0 runs one level a server, the servers one after another): a ratio over
vLLM alone is the mean over a server's pairs (``gpu_ratio_pairs`` gives each pair's, the mean's
standard error, and the server's hit TTFT ratio), and one server over another the ratio of
their means.

- ``gpu_ratio_throughput_vs_vllm_alone`` (>= 1.3): multi-round output tokens/s, the arena
  holding the working set, over vLLM alone's.
- ``gpu_ratio_vs_lmcache`` (>= 1.1): the same over LMCache's (multiprocess mode, the arena's
  budget).
- ``hit_ttft_vs_recompute_p90`` (<= 1.0), ``..._lmdb``, ``..._object``: TTFT p90 of the rounds
  after each user's first (those a cache can serve) over vLLM alone's for the same rounds
  (which it recomputes: its KV cache holds a quarter of the working set), with the arena, then
  lmdb, then the object store holding the history.
- ``gpu_ratio_no_reuse`` (>= 0.98): the no-reuse phase's sidecar over vLLM alone.

``gpu_ratio_throughput_bound`` says how far the first target can be reached in the run: vLLM
alone's level with the prefill of every prompt token the sidecar found cached (and vLLM alone
did not) taken out and its arena load put in, each at its cost measured in the run; decode,
scheduling and the API server stay as vLLM alone spent them. With this workload's 64-token
answers decode is most of a level: on this machine (2026-12-06, otherwise idle) vLLM
alone's level took 9.55 s, of which the 40,000 hit tokens' prefill at 57 us/token is 2.3 s, so
the bound is about 1.3 (the marginal prefill cost, measured up to 992 tokens, understates it at
2,000: the embedded connector reached 1.35 in that run). The target sits at the bound, and
everything the sidecar spends (its hooks, kvtierd's CPU on the engine's two cores) counts
against it. The GPU node of benchmarks/fleet_costs.py prefills a token in 32 us and spends
25 ms a decode step at the batch it runs, a ratio that depends on that batch, which no figure
gives; the workload is therefore not reshaped to it.

Documents fitted shorter than the model's own make short levels, which this machine's drift
(identical servers started a minute apart differ by up to a quarter) would swamp: a level then
runs as many times the users, and a no-reuse level the requests, as its longest request is
shorter than at the model's own length, rounded up (``ServingModel.level_scale``). Each user's
history is live only while its rounds run, so the live working set stays what the KV cache and
arena were sized to.
"""

from __future__ import annotations

import logging
import math
import re
import urllib.request
from typing import TYPE_CHECKING, Any

from benchmarks.gpu_ratio import measure_loads, measure_prefill, ratios
from benchmarks.gpu_ratio_fit import DocFit, fit_on_engine, sized_to
from benchmarks.harness.targets import met as target_met
from benchmarks.models import ServingModel
from benchmarks.serving_cases import (
    BLOCK_SIZE,
    GPU_RATIO_TARGETS,
    LMCACHE,
    LMDB_BACKED,
    OBJECT_BACKED,
    SIDECAR,
    VLLM,
    headline_name,
)
from benchmarks.serving_figures import Outcome, Pair, kvtier_time, no_reuse_ratios
from benchmarks.serving_pairs import hit_ttft_ratio, later_rounds_p90, pair_ratios
from benchmarks.serving_servers import Servers
from kvtier.bench.scrape import Samples, delta, parse_counters
from tests.fixtures import models
from tests.fixtures.servers import VllmServer

if TYPE_CHECKING:
    from benchmarks.serving import Bench

log = logging.getLogger("kvtier.bench.serving")

PREFILL_PROMPTS = 11
"""Prompts of each length the prefill time is measured with (the first one unmeasured): at the
fitted documents' lengths a prompt's prefill differs from the short one's by a few ms, about
what one prefill varies by, so the medians need ten."""
SHORT_PROMPT = 64


def prefill_prompts(vocab: int, long_tokens: int) -> dict[int, list[list[int]]]:
    """Prompts no cache holds (each its own, and the short ones their own for each
    ``long_tokens``: one engine measures several lengths), of ``SHORT_PROMPT`` and
    ``long_tokens`` tokens."""
    return {
        length: models.shared_prefix_prompts(
            PREFILL_PROMPTS,
            vocab_size=vocab,
            prefix_len=length - 1,
            suffix_len=1,
            num_prefixes=PREFILL_PROMPTS,
            seed=7000 + length + 10_000 * long_tokens,
        )
        for length in (SHORT_PROMPT, long_tokens)
    }


def engine_prefill(bench: Bench, server: VllmServer) -> dict[str, float]:
    """The engine's prefill time per token over what a hit of ``bench``'s workload's first
    prompt would save (benchmarks/gpu_ratio.py)."""
    long = bench.sizes.doc_tokens + bench.sizes.question_tokens
    prompts = prefill_prompts(bench.vocab, long)
    prefill = measure_prefill(server.url, str(bench.model), prompts)
    log.info("prefill: %.1f us/token", prefill["prefill_s_per_token"] * 1e6)
    return prefill


def fitted_sizes(bench: Bench, doc_tokens: int | None) -> tuple[ServingModel, DocFit]:
    """``bench``'s model sized to documents of ``doc_tokens``, or of the length fitted to this
    machine (benchmarks/gpu_ratio_fit.py) where that is None, and the fit."""
    if doc_tokens is None:
        found = fit_on_engine(
            bench.sizes,
            bench.model,
            lambda long: prefill_prompts(bench.vocab, long),
            bench.kv_per_token,
            bench.bpc * BLOCK_SIZE,
        )
    else:
        found = DocFit(doc_tokens)
    longest = lambda doc: bench.workload(doc_tokens=doc).longest_request()  # noqa: E731
    return sized_to(bench.sizes, found.doc_tokens, longest), found


_DECIDED = re.compile(r"kvtier_load_(decision|modes)")


def decision_counters(url: str) -> Samples:
    """The connector's load-decision and load-mode series on the engine's /metrics (none
    before the connector counts them)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        samples = parse_counters(r.read().decode())
    return {key: v for key, v in samples.items() if _DECIDED.search(key[0])}


def decisions_between(before: Samples, after: Samples) -> dict[str, float]:
    """Each series' count over the levels, named with its labels."""
    out: dict[str, float] = {}
    for (name, labels), value in delta(before, after).items():
        label = ",".join(f"{k}={v}" for k, v in labels if k not in ("engine", "model_name"))
        out[f"{name}{{{label}}}" if label else name] = value
    return out


def headline(
    outcomes: dict[str, Outcome],
    cycles: list[dict[str, float]],
    concurrency: int,
    policies: bool,
    measured_ratios: dict[str, Any],
) -> dict[str, Any]:
    """The GPU-ratio targets' values, the ratios measured, and each server's load decisions,
    share of its levels spent in kvtier's hooks (and ms a request), and kvtierd's CPU (a share
    of one core: on this machine it competes with the engine for its two cores, which a GPU
    node's engine does not)."""

    def level(name: str) -> Any:
        outcome = outcomes.get(name)
        found = outcome.at(concurrency) if outcome else None
        return found if found is not None and found.ok else None

    def tps(name: str) -> float | None:
        found = level(name)
        return found.output_tps if found is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def pairs(name: str) -> list[Pair]:
        return outcomes[name].pairs if name in outcomes else []

    def over_alone(name: str) -> float | None:
        """Output tokens/s over vLLM alone's: the mean over the server's pairs, where paired."""
        return pair_ratios(pairs(name)).mean if pairs(name) else ratio(tps(name), tps(VLLM.name))

    def hit_ttft(name: str) -> float | None:
        if pairs(name):
            return hit_ttft_ratio(pairs(name))
        found, alone = level(name), level(VLLM.name)
        return ratio(*(later_rounds_p90([lv]) if lv else None for lv in (found, alone)))

    side = headline_name(SIDECAR.name, policies)
    alone, served = level(VLLM.name), level(side)
    if pairs(side):  # the sidecar's first pair: its two levels ran on the same prompts
        alone, served = pairs(side)[0].alone, pairs(side)[0].server
    most = (
        throughput_bound(alone, served, measured_ratios)
        if alone is not None and served is not None
        else None
    )
    values = {
        "gpu_ratio_throughput_vs_vllm_alone": over_alone(side),
        "gpu_ratio_vs_lmcache": ratio(over_alone(side), over_alone(LMCACHE.name)),
        "hit_ttft_vs_recompute_p90": hit_ttft(side),
        "hit_ttft_vs_recompute_p90_lmdb": hit_ttft(headline_name(LMDB_BACKED.name, policies)),
        "hit_ttft_vs_recompute_p90_object": hit_ttft(headline_name(OBJECT_BACKED.name, policies)),
        "gpu_ratio_no_reuse": no_reuse_ratios(cycles, SIDECAR.name).mean,
    }
    targets = {}
    for key, (op, bound) in GPU_RATIO_TARGETS.items():
        value = values[key]
        met = None if value is None else target_met(value, op, bound)
        targets[key] = {"value": value, "target": f"{op} {bound:g}", "met": met}
    hooks = {  # kvtierd's CPU share is read per outcome, below
        n: kvtier_time(found, math.nan)
        for n in outcomes
        if (found := level(n)) is not None and found.server.connector_hook_seconds
    }
    return {
        **values,
        "gpu_ratio_throughput_bound": most,
        "gpu_ratio_targets": targets,
        "gpu_ratio_pairs": {
            n: {
                "over_vllm_alone": (found := pair_ratios(o.pairs)).values,
                "mean": found.mean,
                "se": found.se,
                "hit_ttft_p90_over_vllm_alone": hit_ttft_ratio(o.pairs),
            }
            for n, o in outcomes.items()
            if o.pairs
        },
        "gpu_ratios": measured_ratios,
        "load_decisions": {n: o.load_decisions for n, o in outcomes.items() if o.load_decisions},
        "kvtier_hook_share": {n: c["hooks"] for n, c in hooks.items()},
        "kvtier_hook_ms_per_request": {n: c["hooks_ms_per_request"] for n, c in hooks.items()},
        "kvtierd_cpu_share": {
            n: share
            for n, o in outcomes.items()
            if (share := o.daemon_cpu_share(concurrency)) is not None
        },
    }


def throughput_bound(alone: Any, served: Any, measured_ratios: dict[str, Any]) -> float | None:
    """The most ``served``'s cache hits can raise output tokens/s over vLLM ``alone``'s level:
    the prefill of each token ``served`` found cached, and ``alone`` did not, taken out of
    ``alone``'s level and its arena load put in (both per token, as measured in the run)."""
    prefill = (measured_ratios.get("prefill") or {}).get("prefill_s_per_token")
    load = (measured_ratios.get("loads") or {}).get("arena_s_per_token")
    served_cached = served.server.cached_tokens_by_source  # vLLM's own and the connector's
    if prefill is None or load is None or not served_cached:
        return None
    hit_tokens = sum(served_cached.values()) - sum(alone.server.cached_tokens_by_source.values())
    left = alone.duration_s - hit_tokens * (prefill - load)
    return float(alone.duration_s / left) if left > 0 else None


def measure(
    outcomes: dict[str, Outcome], servers: Servers, chunk_tokens: int, doc_fit: DocFit | None
) -> dict[str, Any]:
    """The loads' costs measured now, lmdb's on the disk ``servers`` read it at below an arena
    (scaled to the engine's prefill time, vLLM alone's ``Plan.measure_prefill``), the ratios of
    that time to them, how each server past the arena had its lmdb reads throttled, and how the
    documents' length was chosen."""
    fitted = {"doc_fit": doc_fit.describe()} if doc_fit is not None else {}
    prefill = next((o.prefill for o in outcomes.values() if o.prefill), None)
    if prefill is None:
        return {"error": "vLLM alone did not run: no prefill time", **fitted}
    loads = measure_loads(servers.kv_per_token, chunk_tokens, disk=servers.lmdb_disk)
    return {
        **ratios(prefill["prefill_s_per_token"], loads, chunk_tokens),
        "prefill": prefill,
        "lmdb_servers": dict(servers.lmdb_throttles),
        **fitted,
    }


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def tables(result: dict[str, Any]) -> list[str]:
    """The ratios beside the GPU's, the targets, and each server's load decisions, kvtier hook
    share and kvtierd CPU share."""
    measured = result.get("gpu_ratios") or {}
    lines = ["", "## Recompute over load, per token (this machine, in this run; GPU node)", ""]
    if measured.get("doc_fit"):
        lines += [measured["doc_fit"], ""]
    if measured.get("error"):
        lines.append(f"Not measured: {measured['error']}")
    elif measured:
        here, gpu = measured["recompute_vs_load_here"], measured["recompute_vs_load_gpu"]
        loads, prefill = measured["loads"], measured["prefill"]
        lines += [
            f"Prefill {prefill['prefill_s_per_token'] * 1e6:.1f} us/token (engine, "
            f"{prefill['short_tokens']} vs {prefill['long_tokens']} tokens); arena load "
            f"{loads['arena_s_per_token'] * 1e6:.2f} us/token; lmdb, pages dropped "
            f"({loads['dropped_by']}), {loads['lmdb_cold_s_per_token'] * 1e6:.2f} us/token.",
            "",
            f"lmdb's disk {loads.get('lmdb_disk') or 'not throttled: not asked'}.",
            *(f"- {name}: {said}" for name, said in measured.get("lmdb_servers", {}).items()),
            "",
            "| tier | here | GPU node | within 2x |",
            "|---|---:|---:|---|",
        ]
        for tier, gpu_value in gpu.items():
            within = measured["within_gpu_window"].get(tier)
            lines.append(
                f"| {tier} | {_f(here.get(tier), '.2f')} | {gpu_value:.2f} | "
                f"{'-' if within is None else ('yes' if within else 'no')} |"
            )
    lines += ["", "## GPU-ratio targets", ""]
    bound = result.get("gpu_ratio_throughput_bound")
    if bound is not None:
        lines += [
            f"Throughput over vLLM alone's bound {bound:.3f} (the hits' prefill at the "
            "marginal cost measured, which understates a long prompt's).",
            "",
        ]
    lines += ["| ratio | value | target | met |"]
    lines.append("|---|---:|---:|---|")
    for key, t in result.get("gpu_ratio_targets", {}).items():
        met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {key} | {_f(t['value'], '.3f')} | {t['target']} | {met} |")
    lines += [
        "",
        "| server | kvtier hooks, share of the level | ms a request | kvtierd CPU, share of a "
        "core | load decisions |",
        "|---|---:|---:|---:|---|",
    ]
    shares, decisions = result.get("kvtier_hook_share", {}), result.get("load_decisions", {})
    per_request = result.get("kvtier_hook_ms_per_request", {})
    daemon = result.get("kvtierd_cpu_share", {})
    for name in sorted(set(shares) | set(decisions) | set(daemon)):
        counted = ", ".join(f"{k} {v:g}" for k, v in sorted(decisions.get(name, {}).items()))
        lines.append(
            f"| {name} | {_f(shares.get(name), '.2%')} | {_f(per_request.get(name), '.1f')} | "
            f"{_f(daemon.get(name), '.1%')} | {counted or '-'} |"
        )
    return lines
