"""KVTierConnector in a real vLLM engine (the CPU build), with locally built models.

Greedy outputs must be identical with and without the connector; a fresh engine must get
external hits for prefixes an earlier engine stored; and a dead kvtierd must never cost a
correct output.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.harness.connector import kvtier_connector
from tests.e2e.conftest import MAX_TOKENS, set_engine_env
from tests.e2e.models import (
    ModelSet,
    counter,
    counter_series,
    counter_value,
    generate_tokens,
    running_llm,
    untimed_transfers,
)
from tests.integration.daemon_harness import DaemonFiles, Processes, wait_for

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
TRANSFER_BYTES = "vllm:kvtier_transfer_bytes"  # the reader drops "_total"


def cached_by_source(llm: Any, source: str) -> float:
    """Prompt tokens vLLM counted as cached, from one source ("host", "disk", ...)."""
    return counter(llm, "vllm:prompt_tokens_cached_by_source", source=source)


# Engines, kvtierd, the object store's server and a second test share this machine's two cores,
# where a call (an object fetched through kvtierd above all) can miss a deadline of a second and
# open the breaker: tests of other things than deadlines wait as long as a call takes.
SHARED_CORE_DEADLINES = {"lookup_deadline_ms": 30_000, "store_deadline_ms": 30_000}
# a hit sampled for verification is served as a miss: tests count on their hits, and those of
# verification ask for it
NO_VERIFICATION = {"verify_sample_rate": 0.0}
EVERY_HIT = {"verify_sample_rate": 1.0}
# the measured policy may recompute a tiny model's hit when the step it would wait in costs
# more, which turns on the machine's timing: tests count on their hits, the decision has its own
EVERY_LOAD = {"load_policy": "always"}
VERIFIED = "vllm:kvtier_verify_chunks"


def verified(llm: Any, pool: str = "target") -> tuple[float, float]:
    """(chunks of ``pool`` that matched when verified, chunks of any pool that did not)."""
    return (
        counter(llm, VERIFIED, pool=pool, result="match"),
        counter(llm, VERIFIED, result="mismatch"),
    )


def hook_seconds(hook: str | None = None) -> float:
    """``vllm:kvtier_hook_seconds_total`` summed over engines and, without ``hook``, hooks."""
    which = {"hook": hook} if hook is not None else {}
    return sum(value for _, value in counter_series("vllm:kvtier_hook_seconds", **which))


def load_waits(llm: Any) -> tuple[float, float]:
    """(requests observed, seconds) of ``vllm:kvtier_load_wait_seconds``, over engines."""
    from vllm.v1.metrics.reader import Histogram

    found = [
        m
        for m in llm.get_metrics()
        if isinstance(m, Histogram) and m.name == "vllm:kvtier_load_wait_seconds"
    ]
    return sum(m.count for m in found), sum(m.sum for m in found)


def kvtier_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The connector with ``extra``, under the tests' deadlines, loading every hit and without
    verification; a failed load is vLLM's default (an error), so that tests see one."""
    settings = {**SHARED_CORE_DEADLINES, **NO_VERIFICATION, **EVERY_LOAD, **extra}
    return kvtier_connector(settings, recompute_failed_loads=False)


def embedded_yaml(
    tmp: Path,
    shm_path: Path,
    *,
    arena: dict[str, Any] | None = None,
    lmdb: dict[str, Any] | None = None,
) -> Path:
    """The embedded tiers' config, with ``arena`` and ``lmdb`` keys set over the defaults."""
    path = tmp / "kvtier.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "arena": {
                    "path": str(shm_path),
                    "size_bytes": "64MiB",
                    "extent_bytes": "2MiB",
                    "min_slot_bytes": "4KiB",
                    **(arena or {}),
                },
                "lmdb": {"path": str(tmp / "lmdb"), "budget_bytes": "256MiB", **(lmdb or {})},
            }
        )
    )
    return path


def test_embedded_outputs_match_and_a_fresh_engine_hits_what_another_stored(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    kv_events: list[Any],
) -> None:
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    with running_llm(tiny_models.target, kv_transfer_config=connector, kv_events=True) as llm:
        first, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) == 0  # nothing stored before this engine
        assert load_waits(llm)[0] == 0  # no hit, no load to wait for
        stored = counter(llm, TRANSFER_BYTES, direction="store", pool="target")
    assert first == baseline[: len(prompts)]
    assert cached == [0] * len(prompts)
    # routers hear of every chunk offloaded to host memory, with the engine's own hashes
    assert kv_events
    assert {e.medium for e in kv_events} == {"CPU"}
    assert sum(len(e.block_hashes) for e in kv_events) >= len(prompts) * 640 // 32
    # the first engine closed its tiers: the arena is gone, lmdb holds the chunks
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        second, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) > 0
        # the arena died with the first engine: these hits came up from lmdb
        assert cached_by_source(llm, "disk") > 0
        assert cached_by_source(llm, "host") == 0
        loaded = counter(llm, TRANSFER_BYTES, direction="load", pool="target")
        assert not untimed_transfers(llm)  # each copy's seconds counted with its bytes
        # each request waited for its one load from lmdb, and that wait took time
        waited, waited_s = load_waits(llm)
    assert waited == len(prompts)
    assert waited_s > 0
    # kvtier's own transfer counters in vLLM's /metrics: what one stored, the other loaded
    assert stored > 0
    assert 0 < loaded <= stored
    assert second == baseline[: len(prompts)]
    assert all(c >= 600 for c in cached), cached  # the whole shared part of each prompt


def test_multiprocess_engine_stores_and_loads_across_processes(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_engine_env(monkeypatch, tmp_path, multiprocess=True)
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    for run in range(2):
        with running_llm(
            tiny_models.target, kv_transfer_config=connector, multiprocess=True
        ) as llm:
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            # hook time from the worker's process and the engine core's: a finished request
            # reports it with the step that finished it, however fast the run
            worker_s = hook_seconds("wait_for_save")
            scheduler_s = hook_seconds("build_connector_meta")
        assert worker_s > 0
        assert scheduler_s > 0
        assert tokens == baseline[: len(prompts)]
        if run == 1:
            assert all(c >= 600 for c in cached), cached


def test_sidecar_hits_from_the_daemons_arena_and_survives_its_death(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    fresh_prompts: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    admin = daemon.admin()
    try:
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            assert (
                generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == baseline[: len(prompts)]
            )
        stored = admin.stats().counters["hit_chunks_cpu"]
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert tokens == baseline[: len(prompts)]
            assert all(c >= 600 for c in cached), cached
            # served from the daemon's arena, which outlived the first engine; hits read from
            # its index reach kvtierd in a report sent in the background, maybe after generate
            wait_for(
                lambda: admin.stats().counters["hit_chunks_cpu"] > stored, 10.0, "hits reported"
            )
            assert cached_by_source(llm, "host") > 0
            # kvtierd dies mid-run: the engine keeps serving, with correct outputs
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait()
            external = counter_value(llm, EXTERNAL_HITS)
            tokens, _ = generate_tokens(llm, fresh_prompts, max_tokens=MAX_TOKENS)
            assert tokens == baseline[len(prompts) :]
            assert counter_value(llm, EXTERNAL_HITS) == external
            again, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert again == baseline[: len(prompts)]
    finally:
        admin.close()


ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def _self_draft(models: ModelSet) -> dict[str, Any]:
    # the target as its own draft accepts every proposal, so any lost draft KV would show
    return {"method": "draft_model", "model": str(models.target), "num_speculative_tokens": 3}


def test_speculative_decoding_keeps_two_pools_and_mixed_fleets_share_one_store(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    from kvtier.core.config import load_config
    from kvtier.core.pools import PoolRegistry
    from kvtier.tiers.lmdb_tier import LmdbTier

    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})
    spec = _self_draft(tiny_models)
    with running_llm(tiny_models.target, speculative_config=spec) as llm:
        reference, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        # the last two again hit vLLM's own prefix cache: the acceptance to match
        before = counter_value(llm, ACCEPTED)
        assert generate_tokens(llm, prompts[2:], max_tokens=MAX_TOKENS)[0] == reference[2:]
        accepted_on_prefix_hits = counter_value(llm, ACCEPTED) - before
    assert reference == baseline[: len(prompts)]
    assert accepted_on_prefix_hits > 0

    # a fleet member without speculation stores only target chunks for the first two prompts
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
    # a speculating engine: target hits for the first two (draft pages zero-filled), and it
    # stores both pools for all four
    with running_llm(
        tiny_models.target, kv_transfer_config=connector, speculative_config=spec
    ) as llm:
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert tokens == reference
        assert min(cached[:2]) >= 600, cached  # only these were stored, and without a draft
    tier = LmdbTier(load_config(config).lmdb, PoolRegistry())
    try:
        pools = tier.stats().pools
        assert pools["draft"].chunks > 0
        # one draft layer against two target layers: each pool has its own bytes per chunk
        assert pools["draft"].used_bytes < pools["target"].used_bytes
    finally:
        tier.close()

    # a fresh speculating engine loads both pools of the last two (stored with their draft)
    # and accepts exactly as on vLLM's own prefix hits
    with running_llm(
        tiny_models.target, kv_transfer_config=connector, speculative_config=spec
    ) as llm:
        tokens, cached = generate_tokens(llm, prompts[2:], max_tokens=MAX_TOKENS)
        accepted = counter_value(llm, ACCEPTED)
    assert tokens == reference[2:]
    assert all(c >= 600 for c in cached), cached
    assert accepted == accepted_on_prefix_hits


def test_two_replicas_share_one_daemon_and_each_chunk_is_stored_once(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    admin = daemon.admin()
    sidecar = {"mode": "sidecar", "socket_path": str(daemon_files.socket)}
    try:
        # replica dp0 is named from vLLM's data_parallel_index; dp1 is set explicitly
        with running_llm(tiny_models.target, kv_transfer_config=kvtier_config(sidecar)) as llm:
            assert generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)[0] == baseline[:2]
        cpu = next(t for t in admin.stats().tiers if t.tier == "cpu")
        stored = cpu.usage.chunks
        assert stored > 0
        other = kvtier_config({**sidecar, "replica_id": "dp1"})
        with running_llm(tiny_models.target, kv_transfer_config=other) as llm:
            tokens, cached = generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
            assert cached_by_source(llm, "host") > 0
        assert tokens == baseline[:2]
        assert all(c >= 600 for c in cached), cached
        cpu = next(t for t in admin.stats().tiers if t.tier == "cpu")
        by_replica = {(r.replica, r.pool): r.usage.chunks for r in cpu.replicas}
        # dp1's hits were dp0's chunks: nothing stored twice, nothing charged to dp1
        assert by_replica.get(("dp1", "target"), 0) == 0
        assert by_replica[("dp0", "target")] == stored
        assert cpu.usage.chunks == stored
    finally:
        admin.close()


def test_a_draft_with_its_own_kv_dtype_gets_its_own_pool_bytes(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    from kvtier.core.config import load_config
    from kvtier.core.pools import PoolRegistry
    from kvtier.tiers.lmdb_tier import LmdbTier
    from tests.e2e.cpu_patches import per_layer_kv_dtype_on_cpu, skip_without_fp8_kv

    skip_without_fp8_kv()
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})
    spec = {**_self_draft(tiny_models), "kv_cache_dtype": "fp8"}
    with per_layer_kv_dtype_on_cpu():
        for run in range(2):
            with running_llm(
                tiny_models.target, kv_transfer_config=connector, speculative_config=spec
            ) as llm:
                tokens, cached = generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
            assert tokens == baseline[:2]  # verification keeps outputs exact whatever the draft
            if run == 1:
                assert all(c >= 600 for c in cached), cached
    tier = LmdbTier(load_config(config).lmdb, PoolRegistry())
    try:
        pools = tier.stats().pools
        # the same two layers as the target, at 1 byte per element against 4: a quarter per
        # chunk, in every tier, with nothing padded to the target's slot size
        per_chunk = {name: u.used_bytes / u.chunks for name, u in pools.items()}
        header = 128
        assert pools["draft"].chunks == pools["target"].chunks
        assert (per_chunk["draft"] - header) * 4 == per_chunk["target"] - header
    finally:
        tier.close()
