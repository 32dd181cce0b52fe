"""A real engine beside a real kvtierd stores what its stock of slots held ahead cannot cover (a
fresh engine holds none) without its step waiting: requests that finish before their
reservations are answered keep their blocks until the copies are made, then let them go, so the
engine goes idle holding none of them; what they stored is a fresh engine's hit, and the outputs
are vLLM's own."""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import cached_by_source
from tests.e2e.test_connector_tp import sidecar
from tests.integration.daemon_harness import DaemonFiles, Processes

IDLE_STEPS = 20
"""Steps with nothing to run an engine is given to let kept blocks go: each waits for the
reservations out (up to ``store_deadline_ms``), and one is enough."""


def _idle_steps(llm: Any) -> int:
    """Step the engine until it holds no request (at most `IDLE_STEPS`); the steps taken."""
    core = llm.llm_engine.engine_core.engine_core
    for taken in range(IDLE_STEPS):
        if not core.scheduler.has_requests():
            return taken
        core.step_fn()
    return IDLE_STEPS


def test_requests_finished_before_their_reservations_were_answered_let_their_blocks_go(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files)
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        # one token each: every request finishes in the step that fills its chunks
        firsts, _ = generate_tokens(llm, prompts, max_tokens=1)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        kept = [r for r in scheduler.requests.values() if r.is_finished()]
        assert kept, "finished while their reservations were out: their blocks kept"
        assert _idle_steps(llm) < IDLE_STEPS, "every kept request let its blocks go"
        assert not scheduler.requests
    assert firsts == [b[:1] for b in baseline[: len(prompts)]]
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert tokens == baseline[: len(prompts)]
        assert all(c >= 600 for c in cached), cached
        assert cached_by_source(llm, "host") > 0
