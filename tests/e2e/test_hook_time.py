"""The time vLLM spends inside kvtier's hooks reaches its metrics, per hook, from the scheduler
and the worker: what kvtier takes from serving can be read off any engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import embedded_yaml, hook_seconds, kvtier_config

DELAY_S = 0.005


def test_hook_seconds_hold_what_the_hooks_took_and_no_more(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
    from kvtier_vllm.shared import guard

    monkeypatch.setattr(guard, "REPORT_INTERVAL_S", 0.0)  # every step's time, reported at once
    built = KVTierScheduler.build_connector_meta
    calls: list[float] = []

    def slowed(self: KVTierScheduler, scheduler_output: Any) -> Any:
        time.sleep(DELAY_S)
        calls.append(DELAY_S)
        return built(self, scheduler_output)

    monkeypatch.setattr(KVTierScheduler, "build_connector_meta", slowed)
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    hooks = (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "start_load_kv",
        "wait_for_save",
        "get_transfer_results",
        "get_kv_connector_stats",
    )
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        # start-up's hooks (register_kv_caches) are reported with the first step's stats
        generate_tokens(llm, prompts[:1], max_tokens=1)
        before = {hook: hook_seconds(hook) for hook in hooks}
        everything = hook_seconds()
        calls.clear()
        started = time.perf_counter()
        generate_tokens(llm, prompts[1:], max_tokens=MAX_TOKENS)
        elapsed = time.perf_counter() - started
        spent = {hook: hook_seconds(hook) - before[hook] for hook in hooks}
        everything = hook_seconds() - everything
    assert len(calls) >= MAX_TOKENS  # a step per token at least
    assert spent["build_connector_meta"] >= sum(calls)
    # both sides report: the scheduler's lookups and the worker's stores
    assert all(value > 0 for value in spent.values()), spent
    # the engine loop ran the hooks one after another, inside the generation
    assert sum(spent.values()) <= everything < elapsed
