"""Hybrid models with vLLM's hybrid allocator on: sliding-window and full-attention layers in
separate KV-cache groups, through the arena, lmdb and the object store.

Outputs must be identical, top-3 fp32 logprobs included, with and without the connector and
in fresh engines that hit; sliding-window groups store only the window a hit reads.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.conftest import MAX_TOKENS, set_engine_env
from tests.e2e.models import (
    BLOCK_SIZE,
    ModelSet,
    build_eagle_pair,
    counter_value,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.e2e.test_connector import (
    EVERY_HIT,
    EXTERNAL_HITS,
    TRANSFER_BYTES,
    cached_by_source,
    counter,
    embedded_yaml,
    kvtier_config,
    verified,
)
from tests.integration.daemon_harness import Processes, write_config
from tests.objstore.fixtures import AwsIrsa

pytestmark = pytest.mark.slow

WINDOW = 200
LOGPROBS = 3
PROMPT_TOKENS = 940
WINDOW_SKIPPED = "vllm:kvtier_window_skipped_bytes"
# one chunk is one block here: two layers of 32 tokens x 2 KV heads x (k, v) x 32 x fp32
CHUNK_BYTES = 2 * BLOCK_SIZE * 2 * 2 * 32 * 4


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    """Per prompt and step, the top-3 tokens' logprobs (fp32, compared exactly)."""
    cached: list[int]

    def same_output(self, other: Run) -> bool:
        return self.tokens == other.tokens and self.logprobs == other.logprobs

    def same_tokens_and_top(self, other: Run, tolerance: float = 1e-5) -> bool:
        """The same tokens and top-k candidates, logprobs equal within ``tolerance``: engines
        in other processes may bind other cores, and requests batched differently round
        differently (seen as 5e-7 here)."""
        return self.tokens == other.tokens and all(
            a.keys() == b.keys() and all(abs(a[t] - b[t]) <= tolerance for t in a)
            for mine, theirs in zip(self.logprobs, other.logprobs, strict=True)
            for a, b in zip(mine, theirs, strict=True)
        )


def generate(llm: Any, prompts: Sequence[Sequence[int]]) -> Run:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS
    )
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return Run(
        [list(o.outputs[0].token_ids) for o in outputs],
        [
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or ()]
            for o in outputs
        ],
        [o.num_cached_tokens or 0 for o in outputs],
    )


def partial_prompts(stored: list[int]) -> tuple[list[int], list[int]]:
    """``stored`` and 200 tokens more; its first 600 tokens and 300 others."""
    other = shared_prefix_prompts(1, prefix_len=500, suffix_len=0, seed=99)[0]
    return stored + other[:200], stored[:600] + other[200:]


def hit_chunks(prompt_tokens: int) -> int:
    """The chunks a prompt can hit: at least one token is always computed."""
    return (prompt_tokens - 1) // BLOCK_SIZE


def window_start(chunks: int) -> int:
    """The first block vLLM keeps for a sliding window after ``chunks`` chunks: whole blocks
    before ``T - window + 1`` are skipped (its own formula)."""
    return max(0, chunks * BLOCK_SIZE - WINDOW + 1) // BLOCK_SIZE


@pytest.fixture(scope="module")
def hybrid_prompts(hybrid_model: Path) -> list[list[int]]:
    return shared_prefix_prompts(
        3,
        vocab_size=vocab_size_of(hybrid_model),
        prefix_len=PROMPT_TOKENS - 40,
        suffix_len=40,
        num_prefixes=3,
        seed=8,
    )


@dataclass(frozen=True)
class Baseline:
    """No connector (vLLM keeps its hybrid allocator on by itself): the prompts cold, then
    again on vLLM's own prefix-cache hits, which is what a kvtier hit must reproduce exactly
    (computing a suffix over cached KV may round differently from a whole prefill)."""

    cold: Run
    hit: Run


def baseline_of(model: Path, prompts: list[list[int]], **engine: Any) -> Baseline:
    with running_llm(model, **engine) as llm:
        cold = generate(llm, prompts)
        hit = generate(llm, prompts)
    assert hit.cached == [hit_chunks(PROMPT_TOKENS) * BLOCK_SIZE] * len(prompts)
    return Baseline(cold, hit)


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_model: Path, hybrid_prompts: list[list[int]]) -> Baseline:
    return baseline_of(hybrid_model, hybrid_prompts)


def test_hybrid_groups_store_only_the_window_and_fresh_engines_hit_from_every_tier(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    hybrid_baseline: Baseline,
    procs: Processes,
    tmp_path: Path,
    shm_path: Path,
    s3_store: str,
    aws_irsa: AwsIrsa,
) -> None:
    files = write_config(
        tmp_path,
        shm_path,
        {
            "arena": {"size_bytes": 64 << 20, "min_slot_bytes": 16 << 10},
            "object": {
                "url": s3_store,
                "index_path": str(tmp_path / "objindex"),
                "index_map_bytes": 64 << 20,
                "lookup_budget_ms": 3000,
            },
        },
    )
    # hits from lmdb and the store wait for promotion: room for a slow machine
    sidecar = kvtier_config(
        {"mode": "sidecar", "socket_path": str(files.socket), "promote_wait_ms": 20000}
    )
    prompts = hybrid_prompts
    chunks = hit_chunks(PROMPT_TOKENS)
    skipped_per_prompt = window_start(chunks)
    assert 0 < skipped_per_prompt < chunks  # the window is much shorter than the prompt

    daemon = procs.start_daemon(files)
    with running_llm(hybrid_model, kv_transfer_config=sidecar) as llm:
        first = generate(llm, prompts)
        stored = counter(llm, TRANSFER_BYTES, direction="store", pool="target")
        skipped = counter(llm, WINDOW_SKIPPED, pool="target")
    assert first.same_output(hybrid_baseline.cold)
    assert first.cached == [0] * len(prompts)
    # every full-attention chunk, and of the sliding-window group only the window before the
    # end of the prompt's hit: from the tier's own count and from vLLM's metrics
    expected = len(prompts) * (chunks + chunks - skipped_per_prompt)
    arena = next(t for t in daemon.stats().tiers if t.tier == "cpu")
    assert arena.usage.chunks == expected
    assert stored == expected * CHUNK_BYTES
    assert skipped == len(prompts) * skipped_per_prompt * CHUNK_BYTES

    def fresh_engine_hits(source: str) -> None:
        with running_llm(hybrid_model, kv_transfer_config=sidecar) as llm:
            run = generate(llm, prompts)
            assert cached_by_source(llm, source) == len(prompts) * chunks * BLOCK_SIZE
        if source == "host":
            assert run.same_output(hybrid_baseline.hit)
        else:
            # promotions finish when they finish: requests may be batched otherwise than in
            # the baseline, which rounds fp32 differently
            assert run.same_tokens_and_top(hybrid_baseline.hit)
        assert run.cached == [chunks * BLOCK_SIZE] * len(prompts)

    fresh_engine_hits("host")  # the daemon's arena outlived the first engine
    # a prompt extending a stored one hits the stored window; one sharing only a shorter
    # prefix finds no window there and computes it (what storing only windows gives up)
    extended, shorter = partial_prompts(prompts[0])
    with running_llm(hybrid_model) as llm:
        generate(llm, prompts[:1])
        reference = generate(llm, [extended, shorter])  # on vLLM's own prefix cache
    assert reference.cached[0] == chunks * BLOCK_SIZE
    with running_llm(hybrid_model, kv_transfer_config=sidecar) as llm:
        partial = generate(llm, [extended, shorter])
    assert partial.cached == [chunks * BLOCK_SIZE, 0]
    assert partial.same_tokens_and_top(reference)
    # SIGTERM drains the arena to lmdb and uploads to the store
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
    daemon = procs.start_daemon(files)
    fresh_engine_hits("disk")
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
    shutil.rmtree(files.lmdb)
    procs.start_daemon(files)
    fresh_engine_hits("external_unspecified")  # the object store, through the kept index


def test_hybrid_hits_recomputed_match_in_every_group(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    hybrid_baseline: Baseline,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    config = str(embedded_yaml(tmp_path, shm_path))
    with running_llm(
        hybrid_model, kv_transfer_config=kvtier_config({"kvtier_config": config})
    ) as llm:
        assert generate(llm, hybrid_prompts).same_output(hybrid_baseline.cold)
    verifying = kvtier_config({"kvtier_config": config, **EVERY_HIT})
    with running_llm(hybrid_model, kv_transfer_config=verifying) as llm:
        run = generate(llm, hybrid_prompts)
        matched, mismatched = verified(llm)
        assert counter_value(llm, EXTERNAL_HITS) == 0
    # the hits wait for promotion from lmdb, so the requests may be batched otherwise than in
    # the baseline, which rounds fp32 differently
    assert run.same_tokens_and_top(hybrid_baseline.cold)
    assert mismatched == 0
    # of the full-attention group's chunks and the sliding group's window (what was stored),
    # a prompt's at least; a request whose promotion outlasts its wait is not sampled
    chunks = hit_chunks(PROMPT_TOKENS)
    per_prompt = chunks + chunks - window_start(chunks)
    assert per_prompt <= matched <= len(hybrid_prompts) * per_prompt


def test_checkpoint_windows_give_a_prompt_sharing_a_shorter_prefix_a_hit(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    checkpoint = 8 * BLOCK_SIZE
    extra = {"kvtier_config": str(embedded_yaml(tmp_path, shm_path))}
    connector = kvtier_config({**extra, "window_checkpoint_tokens": checkpoint})
    _, shorter = partial_prompts(hybrid_prompts[0])
    with running_llm(hybrid_model) as llm:
        cold = generate(llm, [shorter])
    with running_llm(hybrid_model, kv_transfer_config=connector) as llm:
        generate(llm, hybrid_prompts[:1])
    with running_llm(hybrid_model, kv_transfer_config=connector) as llm:
        hit = generate(llm, [shorter])
    # 600 shared tokens: 18 whole chunks of full attention, and the window kept before the
    # last checkpoint below them (16 chunks)
    assert hit.cached == [16 * BLOCK_SIZE]
    assert hit.same_tokens_and_top(cold)


@dataclass
class _Snapshot:
    position: int
    block: int
    pages: torch.Tensor


@contextmanager
def sliding_block_reuse(mp: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts sliding-window blocks that vLLM handed to a later position of the same request
    while the first position's KV would still have been worth storing, and that then held other
    bytes: what a copy deferred past its step would have read.

    In-process engine: the scheduler side records each step's block table of the sliding
    group, and the worker snapshots the pages computed in that step right after the forward.
    """
    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker

    seen = {"snapshots": 0, "reused": 0, "overwritten": 0}
    steps: list[tuple[int, int, list[int]]] = []  # (computed before, after, block ids)
    snapshots: list[_Snapshot] = []
    build = KVTierScheduler.build_connector_meta
    save = KVTierWorker.wait_for_save

    def recording_build(self: KVTierScheduler, out: Any) -> Any:
        meta = build(self, out)
        for new in out.scheduled_new_reqs:
            steps.append((new.num_computed_tokens, 0, list(new.block_ids[0])))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is not None:
                steps.append((cached.num_computed_tokens[i], 0, list(state.block_ids[0])))
        if steps:
            before, _, ids = steps[-1]
            scheduled = sum(out.num_scheduled_tokens.values())
            steps[-1] = (before, before + scheduled, ids)
        return meta

    def snapshotting_save(self: KVTierWorker, meta: Any) -> None:
        save(self, meta)
        if not steps or "target.0" not in self.pages:
            return
        before, after, ids = steps[-1]
        pages = self.pages["target.0"][0]  # a layer of the sliding-window group
        for old in list(snapshots):
            later = [p for p in range(old.position + 1, after // BLOCK_SIZE) if ids[p] == old.block]
            if later:
                seen["reused"] += 1
                seen["overwritten"] += int(not torch.equal(pages[old.block], old.pages))
                snapshots.remove(old)
        for position in range(before // BLOCK_SIZE, after // BLOCK_SIZE):
            if position < len(ids) and ids[position]:
                snapshots.append(_Snapshot(position, ids[position], pages[ids[position]].clone()))
                seen["snapshots"] += 1

    mp.setattr(KVTierScheduler, "build_connector_meta", recording_build)
    mp.setattr(KVTierWorker, "wait_for_save", snapshotting_save)
    yield seen


def test_chunked_prefill_copies_each_block_in_the_step_that_computed_it(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 128}
    prompt = hybrid_prompts[:1]  # one request at a time: each step is that request's
    baseline = baseline_of(hybrid_model, prompt, **chunked)
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    with (
        sliding_block_reuse(monkeypatch) as seen,
        running_llm(hybrid_model, kv_transfer_config=connector, **chunked) as llm,
    ):
        stored = generate(llm, prompt)
    assert stored.same_output(baseline.cold)
    # vLLM gave sliding-window block ids to later positions of the same request, and their
    # bytes changed: a copy made after its step would have stored another position's KV
    assert seen["snapshots"] >= hit_chunks(PROMPT_TOKENS)
    assert seen["reused"] > 0
    assert seen["overwritten"] == seen["reused"]
    monkeypatch.undo()
    set_engine_env(monkeypatch, tmp_path)
    # what was stored, step by step, loads into a fresh engine (lmdb) with exact outputs
    with running_llm(hybrid_model, kv_transfer_config=connector, **chunked) as llm:
        loaded = generate(llm, prompt)
        assert cached_by_source(llm, "disk") > 0
    assert loaded.same_output(baseline.hit)
    assert loaded.cached == baseline.hit.cached


def test_six_groups_in_a_multiprocess_engine_store_and_load_across_processes(
    hybrid_five_to_one: Path,
    hybrid_prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = hybrid_prompts[:2]
    baseline = baseline_of(hybrid_five_to_one, prompts)
    set_engine_env(monkeypatch, tmp_path, multiprocess=True)
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    runs = []
    # the second engine in-process: what the first one's worker process stored, its own
    # worker loads (a multiprocess engine's loads are the TP tests')
    for multiprocess in (True, False):
        with running_llm(
            hybrid_five_to_one, kv_transfer_config=connector, multiprocess=multiprocess
        ) as llm:
            runs.append(generate(llm, prompts))
    assert runs[0].same_tokens_and_top(baseline.cold)
    assert runs[0].cached == [0, 0]
    assert runs[1].same_tokens_and_top(baseline.hit)
    assert runs[1].cached == baseline.hit.cached


def test_a_draft_model_the_hybrid_allocator_misplaces_is_never_cached(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    hybrid_baseline: Baseline,
    tiny_models: ModelSet,
    tmp_path: Path,
    shm_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})
    spec = {"method": "draft_model", "model": str(tiny_models.draft), "num_speculative_tokens": 2}
    prompts = hybrid_prompts[:2]
    with running_llm(hybrid_model, kv_transfer_config=connector, speculative_config=spec) as llm:
        generate(llm, prompts)  # vLLM's own output is wrong here; nothing of it may be kept
        stored = counter(llm, TRANSFER_BYTES, direction="store")
    assert stored == 0
    refusal = [r.getMessage() for r in caplog.records if "kvtier is off" in r.getMessage()]
    assert refusal
    assert "--disable-hybrid-kv-cache-manager" in refusal[0]
    assert lmdb_chunks(config) == 0

    # with the hybrid allocator off, the same drafter is right and both pools are cached
    off = {"disable_hybrid_kv_cache_manager": True, "speculative_config": spec}
    runs = []
    for _ in range(2):
        with running_llm(hybrid_model, kv_transfer_config=connector, **off) as llm:
            runs.append(generate(llm, prompts))
            drafted = counter(llm, TRANSFER_BYTES, pool="draft")
        assert drafted > 0
    assert runs[0].tokens == hybrid_baseline.cold.tokens[:2]
    assert runs[1].tokens == hybrid_baseline.cold.tokens[:2]
    assert min(runs[1].cached) >= hit_chunks(PROMPT_TOKENS) * BLOCK_SIZE - BLOCK_SIZE


def lmdb_chunks(config: Path) -> int:
    from kvtier.core.config import load_config
    from kvtier.core.pools import PoolRegistry
    from kvtier.tiers.lmdb_tier import LmdbTier

    tier = LmdbTier(load_config(config).lmdb, PoolRegistry())
    try:
        return sum(p.chunks for p in tier.stats().pools.values())
    finally:
        tier.close()


def test_eagle_on_a_hybrid_target_stores_and_loads_both_pools(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    hybrid_baseline: Baseline,
    models_dir: Path,
    tiny_models: ModelSet,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    # a llama EAGLE head of the target's width; vLLM numbers its layer after the target's
    head = build_eagle_pair(models_dir, tokenizer_dir=tiny_models.tokenizer, hidden=256).head
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    prompts = hybrid_prompts[:2]
    moved = []
    runs = []
    for direction in ("store", "load"):
        with running_llm(
            hybrid_model, kv_transfer_config=connector, speculative_config=spec
        ) as llm:
            runs.append(generate(llm, prompts))
            moved.append(
                {
                    pool: counter(llm, TRANSFER_BYTES, direction=direction, pool=pool)
                    for pool in ("target", "draft")
                }
            )
    assert runs[0].tokens == hybrid_baseline.cold.tokens[:2]
    assert runs[1].tokens == hybrid_baseline.cold.tokens[:2]
    assert runs[1].cached == [hit_chunks(PROMPT_TOKENS) * BLOCK_SIZE] * 2
    assert moved[0]["target"] > 0
    assert moved[0]["draft"] > 0
    assert moved[1]["draft"] > 0


def test_a_failed_load_is_reported_per_request_and_recomputed(
    hybrid_model: Path,
    hybrid_prompts: list[list[int]],
    hybrid_baseline: Baseline,
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.client import ArenaMemory, LmdbSnapshot

    # vLLM refuses block-level load errors when there are several KV-cache groups (it raises
    # and the engine dies); kvtier reports the request instead, and vLLM recomputes it
    connector = {
        **kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))}),
        "kv_load_failure_policy": "recompute",
    }
    prompts = hybrid_prompts[:2]
    with running_llm(hybrid_model, kv_transfer_config=connector) as llm:
        generate(llm, prompts)
    # every slot the worker copies from now reads as reused since it was leased, and every
    # chunk leased in lmdb as gone from it (the first engine's chunks are in lmdb by now)
    monkeypatch.setattr(ArenaMemory, "is_current", lambda self, slot, generation: False)
    monkeypatch.setattr(LmdbSnapshot, "read", lambda self, key, nbytes, buffer, in_place: False)
    with running_llm(hybrid_model, kv_transfer_config=connector) as llm:
        failed = generate(llm, prompts)
        errors = counter(llm, "vllm:kvtier_transfer_errors", direction="load")
        loaded = counter(llm, TRANSFER_BYTES, direction="load")
        again = generate(llm, prompts)  # vLLM's own cache now holds what it recomputed
    assert loaded > 0
    assert errors > 0
    cold = Run(hybrid_baseline.cold.tokens[:2], hybrid_baseline.cold.logprobs[:2], [])
    # recomputed in other batches than the baseline's: the same tokens, logprobs within fp32
    # rounding
    assert failed.same_tokens_and_top(cold)
    assert again.tokens == cold.tokens
