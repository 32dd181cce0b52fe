"""A request's first lookup, made inside the engine's step, never waits for a probe of the
object store: the tiers answer with what the arena and lmdb hold, the probe runs on, and the
request is asked again until it finds the chunks the probe brought."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.hit_decision import HitDecision
from kvtier_vllm.kv.scheduler_side.hit_setup import HitSetup
from kvtier_vllm.kv.scheduler_side.prompt_keys import keys_in
from kvtier_vllm.layout.plans import PoolPlan

from kvtier.client import InProcessClient
from kvtier.core.keys import Pool
from kvtier.rpc import GrpcTierClient
from kvtier.tiering.manager import TierManager
from kvtier.tiers.arena import ArenaMemory
from tests.integration.daemon_harness import Processes, RunningDaemon, object_node
from tests.objstore.fixtures import ObjectNodes, ProxiedStore
from tests.objstore.servers import FaultMode
from tests.objstore.test_daemon_objstore import wait_serving
from tests.support import payload_for, target_spec

BPC = 4  # blocks per chunk, as in tests.support's layout
CHUNK_TOKENS = 16 * BPC
CHUNKS = 4
HASHES = [i.to_bytes(32, "big") for i in range(CHUNKS * BPC)]  # one per block
TARGET = PoolPlan(Pool.TARGET, ("t0", "t1"), 32 << 10, target_spec(), BPC, "target")
BUDGET_MS = 50.0
STORE_DELAY_MS = 500.0  # every answer of the store: ten budgets


def until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30.0
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def uploaded(node: TierManager, chunks: range = range(CHUNKS)) -> bytes:
    """The request's ``chunks``, stored by ``node`` and uploaded to its store in one object;
    returns their namespace."""
    ns = node.register_pool(TARGET.spec, TARGET.chunk_bytes)
    refs = [r for r in node.reserve(keys_in(ns, HASHES, chunks, BPC), "r0") if r]
    for ref in refs:
        node.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    assert node.commit(refs) == len(chunks)
    assert node.flush()
    assert node.flush_uploads(10.0)
    return ns


def test_a_first_lookup_leaves_a_slow_probe_running_and_a_later_ask_loads_what_it_found(
    object_nodes: ObjectNodes, proxied_store: ProxiedStore
) -> None:
    url, proxy = proxied_store("s3")
    uploaded(object_nodes(url, "writer"))
    reader = object_nodes(url, "reader", lookup_budget_ms=BUDGET_MS, request_timeout_s=5.0)
    assert reader.object is not None
    assert reader.lmdb is not None
    assert reader.object.principal_resolved.wait(10)  # until then lookups do not probe
    client = InProcessClient(reader, "r0")  # the node's fixture closes its manager
    ns = {TARGET.key: client.register_pool(TARGET.spec, TARGET.chunk_bytes)}
    keys = keys_in(ns[TARGET.key], HASHES, range(CHUNKS), BPC)
    # a first probe starts the download thread and botocore's first request: done before the
    # store slows down, so the probe below waits only on the store
    warm = keys_in(ns[TARGET.key], [b"\xff" * 32] * BPC, range(1), BPC)
    until(lambda: not reader.lookup(warm).pending, "the warm-up probe never ended")
    proxy.set_mode(FaultMode.DELAY, delay_ms=STORE_DELAY_MS)

    setup = HitSetup(
        client, [TARGET], ns, chunk_tokens=CHUNK_TOKENS, blocks_per_chunk=BPC, wait_s=30
    )
    request = SimpleNamespace(
        block_hashes=HASHES, prompt_token_ids=[0] * (CHUNKS * CHUNK_TOKENS + 1)
    )
    decision = HitDecision(setup, request)
    stats = KVTierStats()
    before = reader.stats().counters
    assert decision.ask(0, 1, stats) is None  # the store may hold the prompt: ask again
    assert decision.probing, "the answer said a probe of the store runs"
    counted = reader.stats().counters
    assert counted["probes_over_budget"] == before["probes_over_budget"], (
        "the engine's step waited for the probe"
    )
    assert not any(reader.lmdb.contains(keys)), "the probe answered within the first lookup"

    until(lambda: all(reader.lmdb.contains(keys)), "the probe never brought the chunks")
    assert decision.ask(0, 2, stats) is None  # found in lmdb: promoted, asked again
    until(lambda: all(reader.cpu.contains(keys)), "the promotion never landed")
    assert decision.ask(0, 3, stats) == CHUNKS * CHUNK_TOKENS
    plan = decision.take_plan()
    assert plan is not None
    assert (plan.first_chunk, plan.chunks) == (0, CHUNKS)
    now = reader.stats().counters
    assert now["hit_chunks_object"] - before["hit_chunks_object"] == CHUNKS
    assert now["lookups"] - before["lookups"] == 1, "asked again: counted once"
    client.release(plan.refs())


def probe_timeouts(daemon: RunningDaemon) -> float:
    """Lookups kvtierd held for a probe up to its budget."""
    name = "kvtier_object_store_probe_timeouts_total"
    return sum(v for n, _, v in daemon.metrics() if n == name)


def test_kvtierd_answers_a_lookup_from_the_step_without_waiting_for_its_probe(
    object_nodes: ObjectNodes, proxied_store: ProxiedStore, procs: Processes, tmp_path: Path
) -> None:
    """In sidecar mode a first lookup is asked in the step where the arena's index holds the
    request's first chunk: kvtierd answers the rest at once, its probe left running."""
    url, proxy = proxied_store("s3")
    ns = uploaded(object_nodes(url, "writer"), range(2, CHUNKS))  # one object, from chunk 2
    files = object_node(tmp_path / "node", url, lookup_budget_ms=BUDGET_MS, request_timeout_s=5.0)
    daemon = procs.start_daemon(files)
    wait_serving(daemon)  # the identity is resolved in the background
    client = GrpcTierClient(files.socket, "r0", timeout_s=10.0)
    try:
        assert client.register_pool(TARGET.spec, TARGET.chunk_bytes) == ns
        assert client.object_tier  # the session said this daemon has an object store
        keys = keys_in(ns, HASHES, range(CHUNKS), BPC)
        arena = ArenaMemory.attach(client.arena_path)
        try:
            refs = [r for r in client.reserve(keys[:2]) if r is not None]
            for ref in refs:
                arena.view(ref.offset, ref.nbytes)[:] = payload_for(ref.key, ref.nbytes)
            assert client.commit(refs) == 2  # chunks 0-1 in this node's arena
        finally:
            arena.close()
        warm = keys_in(ns, [b"\xff" * 32] * BPC, range(1), BPC)
        until(lambda: not client.lookup(warm).pending, "the warm-up probe never ended")
        proxy.set_mode(FaultMode.DELAY, delay_ms=STORE_DELAY_MS)

        setup = HitSetup(
            client,
            [TARGET],
            {TARGET.key: ns},
            chunk_tokens=CHUNK_TOKENS,
            blocks_per_chunk=BPC,
            wait_s=30,
        )
        request = SimpleNamespace(
            block_hashes=HASHES, prompt_token_ids=[0] * (CHUNKS * CHUNK_TOKENS + 1)
        )
        decision = HitDecision(setup, request)
        stats = KVTierStats()
        timeouts = probe_timeouts(daemon)
        assert decision.ask(0, 1, stats) is None  # chunks 2-3 may be in the store: ask again
        assert decision.probing, "kvtierd said its probe of the store runs"
        assert probe_timeouts(daemon) == timeouts, "kvtierd held the step's lookup for its probe"

        step = 2
        tokens = None
        deadline = time.monotonic() + 30.0
        while tokens is None:  # asked again off the step until the probe's chunks are in
            assert time.monotonic() < deadline, "the store's chunks never came"
            setup.next_step(0.05)
            tokens = decision.ask(0, step, stats)
            step += 1
        assert tokens == CHUNKS * CHUNK_TOKENS
        plan = decision.take_plan()
        assert plan is not None
        client.release(plan.refs())
    finally:
        client.close()
