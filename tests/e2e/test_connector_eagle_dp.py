"""KVTierConnector with an EAGLE drafter, and with data-parallel replicas sharing one kvtierd,
in the real vLLM engine (the CPU build) with locally built models."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtier.rpc import AdminClient
from kvtier.tiers.arena_room import BLANK_SHARE
from tests.e2e.conftest import MAX_TOKENS, set_engine_env
from tests.e2e.models import (
    EagleModels,
    ModelSet,
    counter_value,
    generate_tokens,
    make_llm,
    reset_env_caches,
    running_llm,
    shared_prefix_prompts,
    shutdown_llm,
    vocab_size_of,
)
from tests.e2e.test_connector import (
    ACCEPTED,
    EVERY_HIT,
    EXTERNAL_HITS,
    TRANSFER_BYTES,
    cached_by_source,
    counter,
    embedded_yaml,
    kvtier_config,
    verified,
)
from tests.integration.daemon_harness import Processes, RunningDaemon, write_config

pytestmark = pytest.mark.slow

DRAFTED = "vllm:spec_decode_num_draft_tokens"
CHUNK_HEADER = 128


# -- EAGLE ---------------------------------------------------------------------------------------


@contextmanager
def recorded_worker_plans(mp: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The pools each in-process worker planned from the caches vLLM registered."""
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker

    plans: dict[str, Any] = {}
    register = KVTierWorker.register_kv_caches

    def recording(self: KVTierWorker, kv_caches: dict[str, Any]) -> None:
        register(self, kv_caches)
        plans.update(self.plans)

    mp.setattr(KVTierWorker, "register_kv_caches", recording)
    yield plans


def eagle_prompts(target: Path) -> list[list[int]]:
    return shared_prefix_prompts(
        4, vocab_size=vocab_size_of(target), prefix_len=640, suffix_len=48, num_prefixes=4
    )


def eagle_spec(models: EagleModels) -> dict[str, Any]:
    return {"method": "eagle", "model": str(models.head), "num_speculative_tokens": 3}


def test_eagle_head_gets_its_own_pool_and_a_fresh_engine_accepts_as_on_local_hits(
    eagle_models: EagleModels,
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.core.config import load_config
    from kvtier.core.pools import PoolRegistry
    from kvtier.tiers.lmdb_tier import LmdbTier

    target = eagle_models.target
    prompts = eagle_prompts(target)
    spec = eagle_spec(eagle_models)
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})

    with running_llm(target, speculative_config=spec) as llm:
        reference, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        # the last two again hit vLLM's own prefix cache: the acceptance to match
        accepted, drafted = counter_value(llm, ACCEPTED), counter_value(llm, DRAFTED)
        again, cached = generate_tokens(llm, prompts[2:], max_tokens=MAX_TOKENS)
        accepted_on_prefix_hits = counter_value(llm, ACCEPTED) - accepted
        drafted_on_prefix_hits = counter_value(llm, DRAFTED) - drafted
    assert again == reference[2:]
    assert min(cached) >= 600, cached
    # a head that guesses well, so draft KV lost or misplaced would show in acceptance
    assert accepted_on_prefix_hits * 2 > drafted_on_prefix_hits > 0

    with (
        recorded_worker_plans(monkeypatch) as plans,
        running_llm(target, kv_transfer_config=connector, speculative_config=spec) as llm,
    ):
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        stored = {p: counter(llm, TRANSFER_BYTES, direction="store", pool=p) for p in plans}
    assert tokens == reference
    assert cached == [0] * len(prompts)
    # the head's layer continues the target's numbering: it, and only it, is the draft pool
    assert {pool: plan.layer_names for pool, plan in plans.items()} == {
        "target": ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
        "draft": ("model.layers.2.self_attn.attn",),
    }
    # one draft layer against two target layers, the same heads: half the bytes per chunk
    assert stored["draft"] > 0
    assert stored["draft"] * 2 == stored["target"]
    tier = LmdbTier(load_config(config).lmdb, PoolRegistry())
    try:
        pools = tier.stats().pools
        per_chunk = {name: u.used_bytes / u.chunks for name, u in pools.items()}
        assert pools["draft"].chunks == pools["target"].chunks > 0
        assert (per_chunk["draft"] - CHUNK_HEADER) * 2 == per_chunk["target"] - CHUNK_HEADER
    finally:
        tier.close()

    # a fresh engine loads both pools and its head accepts exactly as on vLLM's own hits
    with running_llm(target, kv_transfer_config=connector, speculative_config=spec) as llm:
        tokens, cached = generate_tokens(llm, prompts[2:], max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) > 0
        loaded = {p: counter(llm, TRANSFER_BYTES, direction="load", pool=p) for p in plans}
        accepted = counter_value(llm, ACCEPTED)
    assert tokens == reference[2:]
    assert min(cached) >= 600, cached
    assert loaded["draft"] > 0
    assert loaded["draft"] * 2 == loaded["target"]
    assert accepted == accepted_on_prefix_hits


def test_eagle_hits_recomputed_match_in_the_target_and_head_pools(
    eagle_models: EagleModels, tmp_path: Path, shm_path: Path
) -> None:
    target, prompts, spec = (
        eagle_models.target,
        eagle_prompts(eagle_models.target),
        eagle_spec(eagle_models),
    )
    config = str(embedded_yaml(tmp_path, shm_path))
    storing = kvtier_config({"kvtier_config": config})
    with running_llm(target, kv_transfer_config=storing, speculative_config=spec) as llm:
        reference, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    verifying = kvtier_config({"kvtier_config": config, **EVERY_HIT})
    with running_llm(target, kv_transfer_config=verifying, speculative_config=spec) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        matched = {pool: verified(llm, pool)[0] for pool in ("target", "draft")}
        mismatched = verified(llm)[1]
        assert counter_value(llm, EXTERNAL_HITS) == 0
    assert tokens == reference
    assert mismatched == 0
    # each 640-token prefix is 20 chunks per pool; the head's KV as its own engine computes it
    assert all(n >= 20 for n in matched.values()), matched


def test_an_eagle_engine_recomputes_the_last_block_of_a_hit_as_vllm_does(
    eagle_models: EagleModels, tmp_path: Path, shm_path: Path
) -> None:
    """The head's KV of a block's last position was written from the token after the block: a
    request that shares only the prefix must recompute that block, or its drafts degrade."""
    target = eagle_models.target
    # prompts 2 and 3 share only their 640-token prefix (20 blocks) with prompts 0 and 1
    prompts = shared_prefix_prompts(
        4, vocab_size=vocab_size_of(target), prefix_len=640, suffix_len=48, num_prefixes=2
    )
    stored, siblings = prompts[:2], prompts[2:]
    spec = {"method": "eagle", "model": str(eagle_models.head), "num_speculative_tokens": 3}
    with running_llm(target, speculative_config=spec) as llm:
        generate_tokens(llm, stored, max_tokens=MAX_TOKENS)
        accepted = counter_value(llm, ACCEPTED)
        reference, local = generate_tokens(llm, siblings, max_tokens=MAX_TOKENS)
        accepted_on_prefix_hits = counter_value(llm, ACCEPTED) - accepted
    assert local == [640 - 32] * 2  # vLLM's own hit drops the matched prefix's last block

    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    with running_llm(target, kv_transfer_config=connector, speculative_config=spec) as llm:
        generate_tokens(llm, stored, max_tokens=MAX_TOKENS)
    with running_llm(target, kv_transfer_config=connector, speculative_config=spec) as llm:
        tokens, cached = generate_tokens(llm, siblings, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) == sum(cached)
        accepted = counter_value(llm, ACCEPTED)
    assert tokens == reference
    assert cached == local  # the same block dropped, from kvtier's hit
    assert accepted == accepted_on_prefix_hits


# -- data-parallel replicas ----------------------------------------------------------------------

SLOT = 32 << 10  # one chunk of the 2-layer target: 32 tokens x 2 heads x 2 x 32 x fp32, 2 layers
ARENA_SLOTS = 64
QUOTA_SLOTS = 4
LONG_PROMPT = 640 + 48
SHORT_CHUNKS = 4  # full blocks of a short prompt, all stored in its prefill step
SHORT_PROMPT = SHORT_CHUNKS * 32 + 12  # its output never fills another block


@contextmanager
def dp_replica(mp: pytest.MonkeyPatch, index: int) -> Iterator[None]:
    """How a launcher starts replica ``index`` on its own: VLLM_DP_RANK without VLLM_DP_SIZE;
    the engine core reads it when it starts."""
    mp.setenv("VLLM_DP_RANK", str(index))
    mp.delenv("VLLM_DP_SIZE", raising=False)
    reset_env_caches()
    try:
        yield
    finally:
        mp.delenv("VLLM_DP_RANK")
        reset_env_caches()


def cpu_stats(admin: AdminClient) -> Any:
    return next(t for t in admin.stats().tiers if t.tier == "cpu")


def arena_and_held(admin: AdminClient, daemon: RunningDaemon) -> tuple[Any, int]:
    """The arena's stats, and the slots reserved beside its chunks (the engines' stores hold
    slots ahead), read together: the same reservations before and after the stats."""
    deadline = time.monotonic() + 30
    while True:
        (held,) = [v for n, _, v in daemon.metrics() if n == "kvtier_reservations"]
        cpu = cpu_stats(admin)
        if [v for n, _, v in daemon.metrics() if n == "kvtier_reservations"] == [held]:
            return cpu, int(held)
        assert time.monotonic() < deadline, "the reservations never settled"


def by_replica(cpu: Any) -> dict[str, Any]:
    return {r.replica: r.usage for r in cpu.replicas if r.pool == "target"}


def test_dp_replicas_share_one_daemon_under_their_own_names_and_quotas(
    tiny_models: ModelSet,
    procs: Processes,
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = tiny_models.target
    vocab = vocab_size_of(target)
    files = write_config(
        tmp_path,
        shm_path,
        {
            # 1 MiB extents of 32 target slots: two of them fit in 4 MiB
            "arena": {"size_bytes": 4 << 20, "extent_bytes": 1 << 20, "min_slot_bytes": 16 << 10},
        },
    )
    daemon = procs.start_daemon(files)
    admin = daemon.admin()
    # no replica_id: each connector names itself from vLLM's data_parallel_index
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(files.socket)})
    set_engine_env(monkeypatch, tmp_path, multiprocess=True)
    with ExitStack() as stack:
        stack.callback(admin.close)
        engines = []
        for index in range(2):
            with dp_replica(monkeypatch, index):
                llm = make_llm(target, kv_transfer_config=connector, multiprocess=True)
            stack.callback(shutdown_llm, llm)
            engines.append(llm)
        dp0, dp1 = engines
        indices = [e.llm_engine.vllm_config.parallel_config.data_parallel_index for e in engines]
        assert indices == [0, 1]
        cpu = cpu_stats(admin)
        assert {p.pool: p.usage.capacity_bytes for p in cpu.pools}["target"] == ARENA_SLOTS * SLOT

        # a prefix dp0 stored is a hit for dp1, and is stored once
        shared = shared_prefix_prompts(
            2, vocab_size=vocab, prefix_len=640, suffix_len=48, num_prefixes=2
        )
        first, cached = generate_tokens(dp0, shared, max_tokens=MAX_TOKENS)
        assert cached == [0, 0]
        stored = cpu_stats(admin).usage.chunks
        assert stored == 2 * (LONG_PROMPT // 32)
        tokens, cached = generate_tokens(dp1, shared, max_tokens=MAX_TOKENS)
        assert tokens == first
        assert min(cached) >= 600, cached
        assert cached_by_source(dp1, "host") > 0
        cpu = cpu_stats(admin)
        assert cpu.usage.chunks == stored
        assert set(by_replica(cpu)) == {"dp0"}
        assert by_replica(cpu)["dp0"].chunks == stored

        # dp1 gets a small quota; dp0 fills the arena
        quota = QUOTA_SLOTS * SLOT
        admin.set_quota("dp1", "target", quota)
        fill = shared_prefix_prompts(
            2, vocab_size=vocab, prefix_len=640, suffix_len=48, num_prefixes=2, seed=1
        )
        generate_tokens(dp0, fill, max_tokens=MAX_TOKENS)
        cpu, held = arena_and_held(admin, daemon)
        assert held <= ARENA_SLOTS // BLANK_SHARE, "slots held ahead crowd out the stores"
        assert cpu.usage.chunks == ARENA_SLOTS - held
        evicted_for_quota = cpu.counters["evictions_quota"]

        # dp1 stores far more than its quota, one request at a time. At its quota it makes room
        # from its own chunks (once written back to lmdb), or stores nothing; never from dp0's.
        refused = cpu.counters["store_over_quota"]
        short = shared_prefix_prompts(
            8, vocab_size=vocab, prefix_len=0, suffix_len=SHORT_PROMPT, seed=2
        )
        for prompt in short:
            generate_tokens(dp1, [prompt], max_tokens=MAX_TOKENS)
            usage = by_replica(cpu_stats(admin))
            assert usage["dp1"].used_bytes <= quota, usage
        cpu, held = arena_and_held(admin, daemon)
        usage = by_replica(cpu)
        assert set(usage) == {"dp0", "dp1"}
        assert usage["dp1"].capacity_bytes == quota
        evicted_for_quota = cpu.counters["evictions_quota"] - evicted_for_quota
        refused = cpu.counters["store_over_quota"] - refused
        assert evicted_for_quota + refused >= len(short) * SHORT_CHUNKS - QUOTA_SLOTS
        # dp0 keeps the rest of the arena, under its default quota (the whole pool)
        assert usage["dp0"].capacity_bytes == ARENA_SLOTS * SLOT
        assert usage["dp0"].chunks == ARENA_SLOTS - usage["dp1"].chunks - held
        assert usage["dp0"].chunks >= ARENA_SLOTS - QUOTA_SLOTS - held
