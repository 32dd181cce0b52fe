"""Verified reuse in a real engine (the CPU build): with every hit sampled, vLLM computes each
prefix itself and the chunks kvtier would have loaded are compared with it. Right chunks match;
wrong ones are caught and their namespace is quarantined, so that no later request loads from
it: chunks whose bytes were swapped in the arena after their commit (nothing but a recomputation
can tell: the commit checksum is off there, as it would pass a chunk moved with its checksum),
and chunks of other weights filed under the same model revision. A quarantine told to kvtierd
holds for every engine on it and across its restart, until an admin lifts it. Every output is
vLLM's own."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.e2e.conftest import MAX_TOKENS, deploy
from tests.e2e.models import ModelSet, counter, counter_value, generate_tokens, running_llm
from tests.e2e.test_connector import (
    EVERY_HIT,
    EXTERNAL_HITS,
    VERIFIED,
    _self_draft,
    embedded_yaml,
    kvtier_config,
    verified,
)
from tests.e2e.test_connector_tp import engine, sidecar
from tests.fixtures.engines import scheduler_of, swap_chunks
from tests.integration.daemon_harness import DaemonFiles, Processes

POOLS = ("target", "draft")
RIGHT_CHUNK_BOUND = 0.05 / 5  # right chunks sit far below the default verify_max_error


def unchecked_arena(tmp: Path, shm_path: Path) -> Path:
    return embedded_yaml(tmp, shm_path, arena={"commit_checksum": False})


def test_every_hit_recomputed_matches_and_costs_only_a_miss(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    expected = baseline[: len(prompts)]
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
    verifying = kvtier_config(
        {"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), **EVERY_HIT}
    )
    with running_llm(tiny_models.target, kv_transfer_config=verifying) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        matched, mismatched = verified(llm)
        assert counter_value(llm, EXTERNAL_HITS) == 0  # every hit was served as a miss
        verifier = scheduler_of(llm).verifier
        assert verifier.quarantined == {}
        errors = sorted(e for _, e in verifier.errors)
    assert tokens == expected
    # the shared prefix (640 tokens) of each prompt is 20 chunks kvtier held: all compared
    assert matched >= 20
    assert mismatched == 0
    # right chunks sit far below the threshold: recomputed in another batch, not bit-exact
    assert errors[-1] < RIGHT_CHUNK_BOUND
    median, worst = errors[len(errors) // 2], errors[-1]
    print(f"relative errors of right chunks: median {median:.3g}, max {worst:.3g}")


def test_chunks_swapped_in_the_arena_are_caught_and_their_namespace_quarantined(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    expected = baseline[: len(prompts)]
    connector = kvtier_config(
        {"kvtier_config": str(unchecked_arena(tmp_path, shm_path)), **EVERY_HIT}
    )
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        scheduler = scheduler_of(llm)
        assert swap_chunks(scheduler, 1) == 2
        namespace = bytes(scheduler.namespaces["target"])
        llm.reset_prefix_cache()  # the next lookups go to kvtier
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        assert counter(llm, VERIFIED, pool="target", result="mismatch") >= 1
        assert counter(llm, VERIFIED, pool="target", result="match") >= 1
        assert list(scheduler.verifier.quarantined) == [namespace]
        wrong = sorted(e for _, e in scheduler.verifier.errors if e > 0.05)
        print(f"relative errors of swapped chunks: {[round(e, 3) for e in wrong]}")
        # quarantined: no request loads from it, nor is sampled from it
        scheduler.verifier.rate = 0.0
        llm.reset_prefix_cache()
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) == 0
    assert tokens == expected


def test_a_draft_with_its_own_kv_dtype_is_verified_in_both_pools(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    from tests.e2e.cpu_patches import per_layer_kv_dtype_on_cpu, skip_without_fp8_kv

    skip_without_fp8_kv()
    config = str(embedded_yaml(tmp_path, shm_path))
    spec = {**_self_draft(tiny_models), "kv_cache_dtype": "fp8"}
    expected = baseline[:2]
    with per_layer_kv_dtype_on_cpu():
        storing = kvtier_config({"kvtier_config": config})
        with running_llm(
            tiny_models.target, kv_transfer_config=storing, speculative_config=spec
        ) as llm:
            assert generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)[0] == expected
        verifying = kvtier_config({"kvtier_config": config, **EVERY_HIT})
        with running_llm(
            tiny_models.target, kv_transfer_config=verifying, speculative_config=spec
        ) as llm:
            tokens, _ = generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
            matched = {p: verified(llm, p)[0] for p in POOLS}
            mismatched = verified(llm)[1]
            errors = list(scheduler_of(llm).verifier.errors)
    assert tokens == expected
    assert mismatched == 0
    assert all(n >= 20 for n in matched.values()), matched
    for pool in POOLS:
        worst = max(e for p, e in errors if p == pool)
        assert worst < RIGHT_CHUNK_BOUND
        print(f"relative errors of right {pool} chunks: max {worst:.3g}")


def test_chunks_one_tp_degree_stored_match_what_each_rank_of_another_computes(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    procs.start_daemon(daemon_files)
    expected = baseline[: len(prompts)]
    with engine(tiny_models.target, 1, sidecar(daemon_files)) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
    verifying = sidecar(daemon_files)
    verifying["kv_connector_extra_config"] |= EVERY_HIT
    # each rank compares its own heads with its part of the chunk the TP=1 engine wrote
    with engine(tiny_models.target, 2, verifying) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        matched, mismatched = verified(llm)
    assert tokens == expected
    assert matched >= 20
    assert mismatched == 0


def test_other_weights_under_one_revision_are_quarantined_for_every_engine_on_the_daemon(
    two_builds: tuple[Path, Path],
    prompts: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    tmp_path: Path,
) -> None:
    old, new = two_builds
    served = tmp_path / "served-model"
    daemon = procs.start_daemon(daemon_files)
    # an operator's explicit revision that was not changed with the weights: both builds' chunks
    # carry one name, which no fingerprint or checksum can tell apart
    connector = sidecar(daemon_files)
    connector["kv_connector_extra_config"]["model_revision"] = "release-7"
    verifying = sidecar(daemon_files)
    verifying["kv_connector_extra_config"] |= {"model_revision": "release-7", **EVERY_HIT}

    def serve(build: Path) -> tuple[list[list[int]], int, bytes]:
        deploy(build, served)
        with running_llm(served, kv_transfer_config=connector) as llm:
            tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            namespace = bytes(scheduler_of(llm).namespaces["target"])
            return tokens, counter_value(llm, EXTERNAL_HITS), namespace

    old_tokens, hits, namespace = serve(old)
    assert hits == 0  # a fresh daemon: the old weights' own outputs, now stored
    admin = daemon.admin()
    assert admin.drain().complete  # in lmdb before any engine found them wrong

    deploy(new, served)
    with running_llm(served, kv_transfer_config=verifying) as llm:
        new_tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) == 0  # sampled: computed, not loaded
        assert counter(llm, VERIFIED, pool="target", result="mismatch") >= 1
        scheduler = scheduler_of(llm)
        assert bytes(scheduler.namespaces["target"]) == namespace
        wrong = sorted(e for _, e in scheduler.verifier.errors)
    print(f"relative errors of other weights' chunks: {[round(e, 3) for e in wrong]}")
    assert new_tokens != old_tokens  # the weights differ where it shows
    [held] = admin.quarantines()
    assert held.namespace == namespace
    assert "differs from the recomputed KV" in held.reason
    assert held.source.startswith("replica dp0, engine ")  # the engine that found it

    # another engine, which verifies nothing itself, gets no hit from the daemon
    assert serve(old)[:2] == (old_tokens, 0)
    # nor after kvtierd restarts, its chunks still in lmdb
    admin.close()
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
    daemon = procs.start_daemon(daemon_files)
    admin = daemon.admin()
    assert [(q.namespace, q.source) for q in admin.quarantines()] == [(namespace, held.source)]
    assert serve(old)[:2] == (old_tokens, 0)
    # lifted: the old weights' chunks are served again
    assert admin.lift_quarantine(namespace)
    tokens, hits, _ = serve(old)
    admin.close()
    assert hits > 0
    assert tokens == old_tokens
