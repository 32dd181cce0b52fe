"""The connector's timing of its engine's steps: which count as prefill, what it reports to
kvtierd, and what a hit is worth waiting for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvtier_vllm.kv.scheduler_side import timings as timings_module
from kvtier_vllm.kv.scheduler_side.timings import StepTimings

from tests.support import HandClock


def step(timings: StepTimings, clock: HandClock, per_request: list[int], seconds: float) -> None:
    scheduled = {f"r{i}": n for i, n in enumerate(per_request)}
    timings.began(
        SimpleNamespace(total_num_scheduled_tokens=sum(per_request), num_scheduled_tokens=scheduled)
    )
    clock.now += seconds
    timings.ended(None)


def test_steps_are_priced_at_their_part_per_token_not_their_mean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = HandClock()
    monkeypatch.setattr(timings_module.time, "perf_counter", clock)
    timings = StepTimings(wait_share=0.5)
    for tokens in (800, 64, 800, 96):  # whole prompts and suffixes: 20 ms a step, 1 ms a token
        step(timings, clock, [tokens], 0.02 + 0.001 * tokens)
    step(timings, clock, [1, 1, 1], 0.019)  # a decode step: not prefill
    assert timings.recompute_wait(100) == pytest.approx(0.5 * 0.001 * 100)
    assert timings.prefill.mean > 0.001, "the mean per token carries the steps' fixed part"
    reported = timings.take()
    assert reported is not None
    assert reported.prefill_steps == 4
    assert reported.prefill_tokens == 800 + 64 + 800 + 96
    assert reported.prefill_tokens_squared == 2 * 800**2 + 64**2 + 96**2
    assert timings.take() is None


def test_steps_of_one_length_are_priced_at_their_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = HandClock()
    monkeypatch.setattr(timings_module.time, "perf_counter", clock)
    timings = StepTimings(wait_share=1.0)
    assert timings.recompute_wait(100) == 0.0, "nothing timed: no longer wait"
    step(timings, clock, [512], 0.532)
    assert timings.recompute_wait(100) == pytest.approx(100 * 0.532 / 512)
