"""The fleet model checked against a real fleet of two: two vLLM servers (the serving benchmark's
model, each on a core of its own), each with its own kvtierd, arena and lmdb, sharing one S3
bucket (moto, reached through IRSA), driven by multi-turn sessions through a router; then the
same fleet, sessions, users and router in `benchmarks/fleet_sim.py`, with this machine's
capacities and the costs the real fleet measured: what kvtierd timed over the workload (loads by
tier, the engine's prefill per token, uploads, probes of the store that found nothing), the
decode step the client saw, and a request's fixed latency, calibrated before the workload from
prompts each server computes whole and prompts it holds.

Two figures are compared, for each router:

- **hit rate**: prompt tokens served from any cache over all prompt tokens (the real fleet's from
  each response's ``usage.prompt_tokens_details.cached_tokens``);
- **TTFT ratio**: the TTFT p50 of the sessions' later turns over the TTFT p50 of their first
  turns (nothing cached yet), which is what the caches saved a typical turn. The model's are
  the mean of ``SEEDS`` runs with different think times.

``validation_error`` is the largest relative error of either (target: at most 0.15). Where the
hits came from by tier is reported too: the engine's own prefix cache (its ``device`` source),
kvtierd's hits by tier (``kvtier_hit_chunks_total``, in chunks of ``chunk_tokens``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import boto3.session
import httpx
import yaml

from benchmarks.fleet_calibration import (
    EngineCalibration,
    Window,
    warm,
    warm_the_store,
)
from benchmarks.fleet_costs import NodeCosts
from benchmarks.fleet_sim import Shape, Workload, simulate
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import KiB, MiB, extent_for
from kvtier.bench import WorkloadSpec
from kvtier.bench.client import RequestResult, completion_body, stream_completion
from kvtier.bench.scrape import (
    CACHED_BY_SOURCE,
    DAEMON_HITS,
    Samples,
    by_label,
    parse_counters,
    total,
)
from tests.fixtures import models
from tests.fixtures.s3 import SCRUBBED_ENV, MotoServer, irsa_env, patched_env
from tests.fixtures.servers import VllmServer, connector_arg

BLOCK_SIZE = 32
BLOCKS_PER_CHUNK = 4
CHUNK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
KV_CACHE_BYTES = 24 * MiB
ARENA_CHUNKS = 16
MAX_MODEL_LEN = 1280
BUCKET = "kvtier-fleet"
SESSIONS = 16
USERS = 4  # sessions in flight at once
DOC_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS, TURNS = 768, 32, 32, 4
THINK_S = 3.0
CHECK_ROUTERS = ("round_robin", "sticky")
"""A router that picks each request's server in turn, and one that keeps a session on one."""
TARGET = 0.15
SEEDS = 20
"""Runs of the model, with as many draws of think times, averaged: its expectation, where
the real fleet's one run is one draw."""
DRAWS = 5
"""Runs of the real workload, one after another on the same fleet, each with sessions and
think times of its own: a TTFT p50 of one run moves by a fifth from run to run."""
PACK_LINGER_S = 0.02
SLOW_CPU_DEADLINES = {
    "lookup_deadline_ms": 2000,
    "store_deadline_ms": 2000,
    "probe_deadline_ms": 2000,
}


def chunk_bytes(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * head * 2 * 2
    return int(per_token * CHUNK_TOKENS)


@contextmanager
def node(
    root: Path, model: Path, moto: MotoServer, name: str, chunk: int, core: int
) -> Iterator[Any]:
    """One node: kvtierd uploading to the shared bucket, and a vLLM server beside it, its
    compute thread on ``core`` (a node's engine does not share its GPU with another node's)."""
    home = root / name
    (home / "kvtierd").mkdir(parents=True)
    shm = Path(f"/dev/shm/kvtier-fleet-{os.getpid()}-{name}")
    daemon = Kvtierd(home / "kvtierd", shm, ARENA_CHUNKS * chunk, extent_for(chunk))
    tree = yaml.safe_load(daemon.config_path.read_text())
    tree["arena"].update(size_bytes=ARENA_CHUNKS * chunk, extent_bytes=4 * chunk)
    tree["arena"]["min_slot_bytes"] = 64 * KiB
    # the model stores every chunk in lmdb and the bucket as it is computed: write-through
    tree["manager"] = {"demote_mode": "write_through"}
    tree["object"] = {
        "url": f"s3://{BUCKET}/fleet",
        "index_path": str(home / "kvtierd" / "objindex"),
        "admission": "all",
        "pack_linger_ms": PACK_LINGER_S * 1000,
    }
    daemon.config_path.write_text(yaml.safe_dump(tree))
    daemon.env = irsa_env(root, moto.url)
    daemon.env_drop = SCRUBBED_ENV
    connector = kvtier_connector(
        {
            "mode": "sidecar",
            "socket_path": str(daemon.socket_path),
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
            # two engines computing on this machine's two cores leave kvtierd's answers late:
            # past the default deadlines (50 and 100 ms) a lookup is a miss, and the check is
            # of the model's hits, not of deadlines on a starved CPU
            **SLOW_CPU_DEADLINES,
        }
    )
    server = VllmServer(
        model,
        home,
        args=connector_arg(connector),
        kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)},
    )
    try:
        daemon.start()
        server.start()
        yield server, daemon
    finally:
        server.stop()
        daemon.stop()
        shm.unlink(missing_ok=True)


def counted(server: Any, daemon: Samples) -> dict[str, float]:
    """Prompt tokens by where they came from, as the server and kvtierd (its ``daemon``
    counters) count them so far."""
    with httpx.Client(timeout=30) as client:
        engine = parse_counters(client.get(f"{server.url}/metrics").text)
    hits = by_label(daemon, DAEMON_HITS, "tier")
    out = {"gpu": total(engine, CACHED_BY_SOURCE, source="device")}
    for tier in ("cpu", "lmdb", "object"):
        out[tier] = hits.get(tier, 0.0) * CHUNK_TOKENS
    return out


@dataclass
class Served:
    """One request of the real fleet: which server took it, and what the client saw."""

    server: int
    result: RequestResult


async def drive(urls: list[str], model: str, vocab: int, router: str, draw: int) -> list[Served]:
    """The workload once, its sessions and think times the ``draw``-th of their kind."""
    spec = WorkloadSpec(
        kind="multi-round",
        doc_tokens=DOC_TOKENS,
        question_tokens=QUESTION_TOKENS,
        answer_tokens=ANSWER_TOKENS,
        rounds=TURNS,
        vocab_size=vocab,
        min_token_id=len(models.SPECIAL_TOKENS),
        seed=7 + draw,
    )
    sessions = spec.sessions(SESSIONS * TURNS, f"{router}-{draw}")
    turn = itertools.count()
    pick: Callable[[int], int] = (
        (lambda s: next(turn) % len(urls)) if router == "round_robin" else (lambda s: s % len(urls))
    )
    queue = list(enumerate(sessions))
    rng = random.Random(3 + draw)
    served: list[Served] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def user() -> None:
            await asyncio.sleep(rng.expovariate(1 / THINK_S))  # users do not start in step
            while queue:
                index, session = queue.pop(0)
                for r in range(session.rounds):
                    prompt = session.prompt(r)
                    result = RequestResult(session.name, r, len(prompt), time.perf_counter())
                    body = completion_body(model, prompt, ANSWER_TOKENS)
                    server = pick(index)
                    await stream_completion(client, urls[server], body, result)
                    if not result.ok:
                        raise RuntimeError(f"request failed: {result.error}")
                    served.append(Served(server, result))
                    session.record(r, result.token_ids)
                    await asyncio.sleep(rng.expovariate(1 / THINK_S))

        await asyncio.gather(*(user() for _ in range(USERS)))
    return served


@dataclass
class RealRun:
    draws: list[list[Served]]
    """The workload's ``DRAWS`` runs, one after another."""
    shares: dict[str, float]
    """Prompt tokens by where they came from, over both servers."""
    workload: Window
    """Each node's kvtierd's counters over the workload."""
    calibrations: list[EngineCalibration]
    """Each server's, before the workload."""

    @property
    def served(self) -> list[Served]:
        return [s for draw in self.draws for s in draw]


def real_run(root: Path, model: Path, router: str, chunk: int) -> RealRun:
    moto = MotoServer(root / f"moto-{router}.log").start()
    vocab = models.vocab_size_of(model)
    try:
        with patched_env(irsa_env(root, moto.url), drop=SCRUBBED_ENV):
            s3 = boto3.session.Session().client("s3")
            s3.create_bucket(Bucket=BUCKET)
            s3.close()
        with ExitStack() as stack:
            nodes = [
                stack.enter_context(node(root / router, model, moto, name, chunk, core))
                for core, name in enumerate(("a", "b"))
            ]
            urls = [server.url for server, _ in nodes]
            calibrations = [
                warm(server, daemon, str(model), vocab, i, DOC_TOKENS, ANSWER_TOKENS)
                for i, (server, daemon) in enumerate(nodes)
            ]
            warm_the_store(nodes, str(model), vocab, DOC_TOKENS)
            started = [parse_counters(daemon.metrics()) for _, daemon in nodes]
            before = [counted(s, d) for (s, _), d in zip(nodes, started, strict=True)]
            draws = [asyncio.run(drive(urls, str(model), vocab, router, d)) for d in range(DRAWS)]
            ended = [parse_counters(daemon.metrics()) for _, daemon in nodes]
            after = [counted(s, d) for (s, _), d in zip(nodes, ended, strict=True)]
            workload = Window(started, ended)
    finally:
        moto.stop()
    prompt = sum(s.result.prompt_tokens for draw in draws for s in draw) or 1
    shares = {
        k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) / prompt for k in after[0]
    }
    shares["recompute"] = max(0.0, 1.0 - sum(shares.values()))
    return RealRun(draws, shares, workload, calibrations)


def ttft_figures(first: list[float], later: list[float]) -> dict[str, float]:
    """TTFT p50 of the sessions' first turns, of their later ones, and the ratio."""
    first_p50, later_p50 = statistics.median(first), statistics.median(later)
    ratio = later_p50 / first_p50
    return {"ttft_ratio": ratio, "ttft_first_s": first_p50, "ttft_later_s": later_p50}


def figures(real: RealRun) -> dict[str, float]:
    """The real fleet's hit rate and TTFT ratio (see the module's docstring): their means over
    the draws, and the TTFT ratio's range."""
    each = [_figures(draw) for draw in real.draws]
    out = {k: statistics.mean(e[k] for e in each) for k in each[0]}
    ratios = [e["ttft_ratio"] for e in each]
    return {**out, "ttft_ratio_min": min(ratios), "ttft_ratio_max": max(ratios)}


def _figures(served: list[Served]) -> dict[str, float]:
    results = [s.result for s in served]
    cached = sum(r.cached_tokens or 0 for r in results)
    return {
        "hit_rate": cached / (sum(r.prompt_tokens for r in results) or 1),
        **ttft_figures(
            [r.ttft for r in results if r.round_index == 0],
            [r.ttft for r in results if r.round_index > 0],
        ),
    }


def measured_costs(real: RealRun, chunk: int) -> NodeCosts:
    """The costs the real fleet measured: what kvtierd timed over the workload (loads by tier,
    the engine's prefill per token as its steps ran beside everything else on the machine,
    uploads, probes that found nothing), the client's decode rate, and from the calibrations
    before the workload, the latency every request pays past its prefill."""
    w = real.workload
    lmdb = w.load_s_per_chunk("lmdb")
    loads = {
        "cpu": w.load_s_per_chunk("cpu"),
        "lmdb": lmdb,
        # a download lands in lmdb, and is loaded from there; timed from the probe that found
        # it (its first byte included). None in the workload: none was loaded, any figure serves
        "object": w.load_s_per_chunk("object") + lmdb,
    }
    # a decode step's time: the median gap between tokens (a gap behind another request's
    # prefill is the model's own to add)
    gaps = [b - a for s in real.served for a, b in itertools.pairwise(s.result.chunk_times)]
    return NodeCosts(
        chunk_tokens=CHUNK_TOKENS,
        chunk_bytes=chunk,
        prefill_s_per_token=w.prefill_s_per_token,
        load_s_per_chunk=loads,
        load_latency_s={},
        decode_s_per_token=statistics.median(gaps),
        upload_delay_s=PACK_LINGER_S + w.upload_s,
        request_latency_s=statistics.mean(c.latency_s for c in real.calibrations),
        probe_miss_s=w.probe_miss_s,
    )


def modeled(router: str, costs: NodeCosts) -> dict[str, Any]:
    """The same fleet, sessions and router in the model: shares by tier, hit rate, TTFT ratio."""
    shape = Shape(
        nodes=2,
        engines=1,
        gpu=KV_CACHE_BYTES // costs.chunk_bytes,
        arena=ARENA_CHUNKS,
        lmdb=1 << 20,
        block_tokens=BLOCK_SIZE,
    )
    workload = Workload(
        doc_tokens=DOC_TOKENS,
        question_tokens=QUESTION_TOKENS,
        answer_tokens=ANSWER_TOKENS,
        turns=TURNS,
        think_s=THINK_S,
        users=USERS,
        sessions=SESSIONS,
    )
    runs = [simulate(shape, costs, router, replace(workload, seed=seed)) for seed in range(SEEDS)]
    shares = {
        level: statistics.mean(t.tokens[level] / sum(t.tokens.values()) for t in runs)
        for level in runs[0].tokens
    }
    each = [ttft_figures(t.first_ttft, t.later_ttft) for t in runs]
    return {
        "shares": shares,
        "hit_rate": 1 - shares["recompute"],
        **{k: statistics.mean(e[k] for e in each) for k in each[0]},
    }


def check(cache_dir: Path) -> dict[str, Any]:
    tokenizer = models.build_tokenizer(cache_dir)
    model = models.build_benchmark_llama(cache_dir, tokenizer_dir=tokenizer)
    chunk = chunk_bytes(model)
    root = Path(tempfile.mkdtemp(prefix="fleet-", dir=cache_dir))
    out: dict[str, Any] = {"routers": {}}
    worst = 0.0
    for router in CHECK_ROUTERS:
        real = real_run(root, model, router, chunk)
        costs = measured_costs(real, chunk)
        model_view = modeled(router, costs)
        real_view = {"shares": real.shares, **figures(real)}
        errors = {
            k: abs(model_view[k] - real_view[k]) / real_view[k] for k in ("hit_rate", "ttft_ratio")
        }
        out["routers"][router] = {
            "real": real_view,
            "modeled": model_view,
            "costs": costs.to_dict(),
            # for comparison: the engines' prefill per token alone, before the workload; and
            # kvtierd's fit of their steps at the workload's end (a part per step and per token)
            "idle_prefill_s_per_token": statistics.mean(
                c.prefill_s_per_token for c in real.calibrations
            ),
            "fit_prefill_s_per_step": real.workload.prefill_fit("step"),
            "fit_prefill_s_per_token": real.workload.prefill_fit("token"),
            "errors": errors,
        }
        worst = max(worst, *errors.values())
    out["validation_error"] = worst
    out["validation_target"] = TARGET
    return out
