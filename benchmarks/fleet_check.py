"""The fleet model checked against a real fleet of two: two vLLM servers (the serving benchmark's
model), each with its own kvtierd, arena and lmdb, sharing one S3 bucket (moto, reached through
IRSA), driven by multi-turn sessions through a router; then the same fleet, sessions and router in
`benchmarks/fleet_sim.py`, with this machine's capacities.

Where a prompt's tokens came from in the real fleet: the engine's own prefix cache
(``vllm:prefix_cache_hits_total``), kvtierd's hits by tier (``kvtier_hit_chunks_total``, in
chunks of ``chunk_tokens``), and the rest recomputed, over ``vllm:prompt_tokens_total``.
``validation_error`` is the largest difference between the real and the modeled share of any of
them (target: at most 0.15).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import boto3.session  # noqa: E402
import httpx  # noqa: E402
import models  # noqa: E402
import yaml  # noqa: E402
from engine import KiB, Kvtierd, MiB, extent_for  # noqa: E402
from s3_local import SCRUBBED_ENV, MotoServer, irsa_env, patched_env  # noqa: E402
from servers import VllmServer, connector_arg  # noqa: E402

from benchmarks.fleet_costs import NodeCosts  # noqa: E402
from benchmarks.fleet_sim import Shape, Workload, simulate  # noqa: E402
from kvtier.bench import WorkloadSpec  # noqa: E402
from kvtier.bench.client import RequestResult, completion_body, stream_completion  # noqa: E402
from kvtier.bench.scrape import (  # noqa: E402
    CACHED_BY_SOURCE,
    DAEMON_HITS,
    PROMPT_TOKENS,
    by_label,
    parse_counters,
    total,
)

BLOCK_SIZE = 32
BLOCKS_PER_CHUNK = 4
CHUNK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
KV_CACHE_BYTES = 24 * MiB
ARENA_CHUNKS = 16
MAX_MODEL_LEN = 1280
BUCKET = "kvtier-fleet"
SESSIONS = 8
USERS = 4  # sessions in flight at once
DOC_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS, TURNS = 768, 32, 32, 4
THINK_S = 3.0
CHECK_ROUTERS = ("round_robin", "sticky")
"""A router that picks each request's server in turn, and one that keeps a session on one."""
TARGET = 0.15


def chunk_bytes(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * head * 2 * 2
    return int(per_token * CHUNK_TOKENS)


@contextmanager
def node(root: Path, model: Path, moto: MotoServer, name: str, chunk: int) -> Iterator[Any]:
    """One node: kvtierd uploading to the shared bucket, and a vLLM server beside it."""
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
        "pack_linger_ms": 20,
    }
    daemon.config_path.write_text(yaml.safe_dump(tree))
    daemon.env = irsa_env(root, moto.url)
    daemon.env_drop = SCRUBBED_ENV
    connector = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "mode": "sidecar",
            "socket_path": str(daemon.socket_path),
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
        },
        "kv_load_failure_policy": "recompute",
    }
    server = VllmServer(
        model,
        home,
        args=connector_arg(connector),
        kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        daemon.start()
        server.start()
        yield server, daemon
    finally:
        server.stop()
        daemon.stop()
        shm.unlink(missing_ok=True)


def counted(server: Any, daemon: Kvtierd) -> dict[str, float]:
    """Prompt tokens by where they came from, as the server and kvtierd count them."""
    with httpx.Client(timeout=30) as client:
        engine = parse_counters(client.get(f"{server.url}/metrics").text)
    hits = by_label(parse_counters(daemon.metrics()), DAEMON_HITS, "tier")
    out = {
        "prompt": total(engine, PROMPT_TOKENS),
        "gpu": total(engine, CACHED_BY_SOURCE, source="device"),
    }
    for tier in ("cpu", "lmdb", "object"):
        out[tier] = hits.get(tier, 0.0) * CHUNK_TOKENS
    return out


async def drive(urls: list[str], model: str, vocab: int, router: str) -> None:
    spec = WorkloadSpec(
        kind="multi-round",
        doc_tokens=DOC_TOKENS,
        question_tokens=QUESTION_TOKENS,
        answer_tokens=ANSWER_TOKENS,
        rounds=TURNS,
        vocab_size=vocab,
        min_token_id=len(models.SPECIAL_TOKENS),
        seed=7,
    )
    sessions = spec.sessions(SESSIONS * TURNS, router)
    turn = itertools.count()
    pick: Callable[[int], str] = (
        (lambda s: urls[next(turn) % len(urls)])
        if router == "round_robin"
        else (lambda s: urls[s % len(urls)])
    )
    queue = list(enumerate(sessions))
    rng = random.Random(3)
    async with httpx.AsyncClient(timeout=600) as client:

        async def user() -> None:
            while queue:
                index, session = queue.pop(0)
                for r in range(session.rounds):
                    prompt = session.prompt(r)
                    result = RequestResult(session.name, r, len(prompt), 0.0)
                    body = completion_body(model, prompt, ANSWER_TOKENS)
                    await stream_completion(client, pick(index), body, result)
                    if not result.ok:
                        raise RuntimeError(f"request failed: {result.error}")
                    session.record(r, result.token_ids)
                    await asyncio.sleep(rng.expovariate(1 / THINK_S))

        await asyncio.gather(*(user() for _ in range(USERS)))


def real_shares(root: Path, model: Path, router: str, chunk: int) -> dict[str, float]:
    moto = MotoServer(root / f"moto-{router}.log").start()
    try:
        with patched_env(irsa_env(root, moto.url), drop=SCRUBBED_ENV):
            s3 = boto3.session.Session().client("s3")
            s3.create_bucket(Bucket=BUCKET)
            s3.close()
        with ExitStack() as stack:
            nodes = [
                stack.enter_context(node(root / router, model, moto, name, chunk))
                for name in ("a", "b")
            ]
            urls = [server.url for server, _ in nodes]
            asyncio.run(drive(urls, str(model), models.vocab_size_of(model), router))
            counts = [counted(server, daemon) for server, daemon in nodes]
    finally:
        moto.stop()
    summed = {k: sum(c[k] for c in counts) for k in ("prompt", "gpu", "cpu", "lmdb", "object")}
    prompt = summed.pop("prompt") or 1.0
    shares = {k: v / prompt for k, v in summed.items()}
    shares["recompute"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def modeled_shares(router: str, chunk: int) -> dict[str, float]:
    costs = NodeCosts(
        chunk_tokens=CHUNK_TOKENS,
        chunk_bytes=chunk,
        prefill_s_per_token=2e-4,
        load_s_per_chunk={"cpu": 2e-3, "lmdb": 5e-3, "object": 2e-2},
        load_latency_s={"object": 0.01},
        decode_s_per_token=0.02,
        upload_delay_s=1.0,
    )
    shape = Shape(
        nodes=2,
        engines=1,
        gpu=KV_CACHE_BYTES // chunk,
        arena=ARENA_CHUNKS,
        lmdb=1 << 20,
    )
    workload = Workload(
        doc_tokens=DOC_TOKENS,
        question_tokens=QUESTION_TOKENS,
        answer_tokens=ANSWER_TOKENS,
        turns=TURNS,
        think_s=THINK_S,
        arrivals=tuple(0.0 for _ in range(USERS)) + tuple(60.0 for _ in range(SESSIONS - USERS)),
    )
    sim_router = "round_robin" if router == "round_robin" else "gpu_prefix"
    totals = simulate(shape, costs, sim_router, workload)
    prompt = sum(totals.tokens.values()) or 1
    return {k: v / prompt for k, v in totals.tokens.items()}


def check(cache_dir: Path) -> dict[str, Any]:
    tokenizer = models.build_tokenizer(cache_dir)
    model = models.build_benchmark_llama(cache_dir, tokenizer_dir=tokenizer)
    chunk = chunk_bytes(model)
    root = Path(tempfile.mkdtemp(prefix="fleet-", dir=cache_dir))
    out: dict[str, Any] = {"routers": {}}
    worst = 0.0
    for router in CHECK_ROUTERS:
        real = real_shares(root, model, router, chunk)
        modeled = modeled_shares(router, chunk)
        error = max(abs(real.get(k, 0.0) - modeled.get(k, 0.0)) for k in modeled)
        out["routers"][router] = {"real": real, "modeled": modeled, "error": error}
        worst = max(worst, error)
    out["validation_error"] = worst
    out["validation_target"] = TARGET
    return out
