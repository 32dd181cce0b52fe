"""Asynchronous loads of a dense model (one KV-cache group) in a real vLLM engine: a request with a
hit waits for its load while the running ones decode, the worker copies it on its loading thread,
and the outputs are vLLM's own; a chunk found corrupt between lookup and load is recomputed from
there, and only from there."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
from kvtier_vllm.kv.worker_side.background_loads import BackgroundLoads, LoadBatch
from kvtier_vllm.kv.worker_side.worker import KVTierWorker

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import (
    ModelSet,
    counter,
    generate_tokens,
    greedy,
    running_llm,
    untimed_transfers,
)
from tests.e2e.test_connector import cached_by_source, embedded_yaml, kvtier_config
from tests.e2e.test_lmdb_loads import LOAD_ERRORS, corrupt_chunks
from tests.fixtures.models import BLOCK_SIZE

HOLD_S = 60  # a held load waits at most this long for the test to let it go
CORRUPT_CHUNK = 10  # of each request's hit: loaded from lmdb, found corrupt, recomputed from


def _connector(tmp_path: Path, shm_path: Path, **extra: Any) -> dict[str, Any]:
    # asynchronous whatever the steps and costs measured (auto may load a hit inside its step)
    settings = {"load_mode": "async", **extra}
    config = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), **settings})
    return {**config, "kv_load_failure_policy": "recompute"}


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The requests of each batch of loads handed to a worker's loading thread."""
    batches: list[set[str]] = []
    submit = BackgroundLoads.submit

    def recording(self: BackgroundLoads, batch: LoadBatch, issue: Any, fence: Any) -> None:
        batches.append(set(batch.requests))
        submit(self, batch, issue, fence)

    monkeypatch.setattr(BackgroundLoads, "submit", recording)
    return batches


def computed_tokens(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The tokens vLLM schedules per request, summed over steps (in-process engines)."""
    computed: dict[str, int] = {}
    build = KVTierScheduler.build_connector_meta

    def counting(self: KVTierScheduler, scheduler_output: Any) -> Any:
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            computed[req_id] = computed.get(req_id, 0) + n
        return build(self, scheduler_output)

    monkeypatch.setattr(KVTierScheduler, "build_connector_meta", counting)
    return computed


def test_arena_hits_load_on_the_loading_thread_and_give_vllms_outputs(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    submitted: list[set[str]],
) -> None:
    with running_llm(tiny_models.target, kv_transfer_config=_connector(tmp_path, shm_path)) as llm:
        first, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert not submitted  # nothing was stored before
        assert llm.reset_prefix_cache()  # vLLM's own cache forgets them: kvtier's arena holds them
        again, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        from_arena = cached_by_source(llm, "host")
        untimed = untimed_transfers(llm)
    assert first == again == baseline[: len(prompts)]
    assert all(c >= 600 for c in cached), cached
    assert from_arena >= 600 * len(prompts)
    # every hit's load went through the loading thread, each request's once
    loaded = [r for batch in submitted for r in batch]
    assert len(loaded) == len(set(loaded)) == len(prompts)
    assert not untimed  # timed on the loading thread, counted on the engine's


def test_a_chunk_corrupt_between_lookup_and_load_is_recomputed_from_there(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    submitted: list[set[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connector = _connector(tmp_path, shm_path)
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    # the arena died with that engine: lmdb holds the chunks, and the next engine's workers
    # read them from lmdb's map; one chunk of each hit goes bad after its lookup leased it
    corrupted: list[bytes] = []
    issue = KVTierWorker._issue_loads

    def corrupting(self: KVTierWorker, jobs: list[Any], *args: Any) -> Any:
        by_request: dict[str, list[Any]] = {}
        for job in jobs:
            by_request.setdefault(job.request, []).append(job)
        bad = [loads[CORRUPT_CHUNK].key for r, loads in by_request.items() if r]
        if bad:
            assert all(bad)  # leased in lmdb
            assert corrupt_chunks(tmp_path / "lmdb", bad) == len(bad)
            corrupted.extend(bad)
        return issue(self, jobs, *args)

    monkeypatch.setattr(KVTierWorker, "_issue_loads", corrupting)
    computed = computed_tokens(monkeypatch)
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        errors = counter(llm, LOAD_ERRORS, direction="load")
    assert len(corrupted) == len(prompts)
    assert errors == len(corrupted)  # each found corrupt, never served
    assert tokens == baseline[: len(prompts)]
    # vLLM kept what loaded before the bad chunk and computed the rest of each prompt (and
    # each output token but the last)
    expected = [len(p) - CORRUPT_CHUNK * BLOCK_SIZE + MAX_TOKENS - 1 for p in prompts]
    assert sorted(computed.values()) == sorted(expected), computed


def test_a_running_request_decodes_while_a_hits_load_is_held(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    issue = KVTierWorker._issue_loads

    def held(self: KVTierWorker, jobs: list[Any], *args: Any) -> Any:
        if any(job.request for job in jobs):
            entered.set()
            release.wait(HOLD_S)
            returned.set()
        return issue(self, jobs, *args)

    with running_llm(tiny_models.target, kv_transfer_config=_connector(tmp_path, shm_path)) as llm:
        generate_tokens(llm, prompts[:1], max_tokens=MAX_TOKENS)
        assert llm.reset_prefix_cache()
        monkeypatch.setattr(KVTierWorker, "_issue_loads", held)
        engine = llm.llm_engine
        produced: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():
                produced[out.request_id] = list(out.outputs[0].token_ids)

        engine.add_request("running", {"prompt_token_ids": fresh_prompts[0]}, greedy(MAX_TOKENS))
        deadline = time.monotonic() + HOLD_S
        while not produced.get("running"):
            assert time.monotonic() < deadline
            step()
        engine.add_request("hit", {"prompt_token_ids": prompts[0]}, greedy(MAX_TOKENS))
        while not entered.is_set():
            assert time.monotonic() < deadline
            step()
        # the hit's load is held on the loading thread: the running request goes on decoding
        before = len(produced["running"])
        for _ in range(3):
            step()
        assert not returned.is_set()  # still held through those steps
        assert len(produced["running"]) == before + 3
        assert not produced.get("hit")
        release.set()
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            step()
        from_arena = cached_by_source(llm, "host")
    assert produced["hit"] == baseline[0]
    assert produced["running"] == baseline[len(prompts)]
    assert from_arena >= 600
