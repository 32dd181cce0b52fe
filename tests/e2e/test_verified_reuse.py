"""Verified reuse in a real engine (the CPU build, in-process, embedded tiers): with every hit
sampled, vLLM computes each prefix itself and the chunks kvtier would have loaded are compared
with it. Right chunks match; chunks whose bytes were swapped in the arena after their commit
(nothing but a recomputation can tell: the commit checksum is off here, as it would pass a
chunk moved with its checksum) are caught, their namespace is quarantined, and no later request
loads from it. Every output is vLLM's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvtier.keys import namespace_of
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter, counter_value, generate_tokens, running_llm
from tests.e2e.test_connector import EXTERNAL_HITS, embedded_yaml, kvtier_config

VERIFIED = "vllm:kvtier_verify_chunks"
EVERY_HIT = {"verify_sample_rate": 1.0}


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler


def unchecked_arena(tmp: Path, shm_path: Path) -> Path:
    path = embedded_yaml(tmp, shm_path)
    config = yaml.safe_load(path.read_text())
    config["arena"]["commit_checksum"] = False
    path.write_text(yaml.safe_dump(config))
    return path


def swap_two_chunks(scheduler: Any) -> bytes:
    """Swap the bytes of two committed target chunks in the arena; their namespace."""
    namespace = scheduler.namespaces["target"]
    cpu = scheduler.session.client.manager.cpu
    keys = sorted(k for k in cpu._index if namespace_of(k) == namespace)[:2]
    assert len(keys) == 2, "the first requests stored fewer than two chunks"
    refs = cpu.lease(keys)
    assert all(refs)
    try:
        first, second = (cpu.view(ref) for ref in refs)
        assert first.nbytes == second.nbytes
        assert bytes(first) != bytes(second)
        saved = bytes(first)
        first[:] = second
        second[:] = saved
    finally:
        cpu.release(refs)
    return bytes(namespace)


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
        matched = counter(llm, VERIFIED, pool="target", result="match")
        mismatched = counter(llm, VERIFIED, result="mismatch")
        assert counter_value(llm, EXTERNAL_HITS) == 0  # every hit was served as a miss
        verifier = scheduler_of(llm).verifier
        assert verifier.quarantined == {}
        errors = sorted(e for _, e in verifier.errors)
    assert tokens == expected
    # the shared prefix (640 tokens) of each prompt is 20 chunks kvtier held: all compared
    assert matched >= 20
    assert mismatched == 0
    # right chunks sit far below the threshold: recomputed in another batch, not bit-exact
    assert errors[-1] < 0.05 / 5
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
        namespace = swap_two_chunks(scheduler)
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
