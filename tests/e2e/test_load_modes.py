"""``load_mode: auto`` in a real vLLM engine: a hit loads in the background until its cost is
measured, then inside the step that schedules it where that holds the step up far less than a
step, beside a running request whose outputs stay vLLM's own, as the hits' do."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvtier_vllm.connector import KVTierConnector

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter, generate_tokens, greedy, running_llm
from tests.e2e.test_connector import cached_by_source, embedded_yaml, kvtier_config

STEP_S = 0.3
"""What each step takes at least here: a step that prefills on a large model (a tiny model's
copies of a hit take well under a millisecond, a few on a machine busy with other work)."""
DEADLINE_S = 120


def test_auto_loads_in_the_background_until_measured_then_inside_long_steps(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wait_for_save = KVTierConnector.wait_for_save

    def long_step(self: KVTierConnector) -> None:
        time.sleep(STEP_S)  # after the forward, inside the step the scheduler times
        wait_for_save(self)

    tiers = str(embedded_yaml(tmp_path, shm_path))
    # every hit loaded, whatever its measured cost against the tiny model's recompute: the
    # mode of a load is what is tested, not whether it is made
    settings = {"kvtier_config": tiers, "load_mode": "auto", "load_policy": "always"}
    connector = kvtier_config(settings)
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)  # stored
        assert llm.reset_prefix_cache()  # vLLM's own cache forgets them: the arena holds them
        monkeypatch.setattr(KVTierConnector, "wait_for_save", long_step)
        # no load's cost is measured yet: the first hit loads in the background
        first, _ = generate_tokens(llm, prompts[:1], max_tokens=MAX_TOKENS)
        assert counter(llm, "vllm:kvtier_load_modes", mode="async") == 1
        assert counter(llm, "vllm:kvtier_load_modes", mode="sync") == 0

        engine = llm.llm_engine
        produced: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():
                produced[out.request_id] = list(out.outputs[0].token_ids)

        deadline = time.monotonic() + DEADLINE_S
        engine.add_request("running", {"prompt_token_ids": fresh_prompts[0]}, greedy(MAX_TOKENS))
        while not produced.get("running"):
            assert time.monotonic() < deadline
            step()
        # beside a running request, in steps of STEP_S: each hit's load is measured to hold
        # the step up far less than a step, so it loads inside the step that schedules it
        for i in range(1, len(prompts)):
            engine.add_request(f"hit{i}", {"prompt_token_ids": prompts[i]}, greedy(MAX_TOKENS))
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            step()
        hits = len(prompts) - 1
        assert counter(llm, "vllm:kvtier_load_modes", mode="sync") == hits
        assert counter(llm, "vllm:kvtier_load_modes", mode="async") == 1
        from_arena = cached_by_source(llm, "host")
    assert first == baseline[:1]
    assert [produced[f"hit{i}"] for i in range(1, len(prompts))] == baseline[1 : len(prompts)]
    assert produced["running"] == baseline[len(prompts)]
    assert from_arena >= 600 * len(prompts)
