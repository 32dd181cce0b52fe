"""Measured costs from a real engine: its prefill and its loads from the arena reach kvtierd with
its heartbeats, and `kvtier locate`, given a prompt's block hashes as the engine publishes them,
answers the leading tokens the arena holds and what loading them costs against recomputing."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon
from tests.integration.test_locate import locate_cli

pytestmark = pytest.mark.slow


def stored_hashes(events: list[Any]) -> list[bytes]:
    """The block hashes the connector announced in the arena, in order."""
    return [
        h
        for e in events
        if type(e).__name__ == "BlockStored" and e.medium == "CPU"
        for h in e.block_hashes
    ]


def wait_for_costs(daemon: RunningDaemon) -> Any:
    deadline = time.monotonic() + 10.0
    while True:
        costs = daemon.stats().costs
        tiers = {t.tier: t.samples for t in costs.tiers}
        if costs.prefill_samples and tiers.get("cpu"):
            return costs
        assert time.monotonic() < deadline, f"no timings reached kvtierd: {costs}"
        time.sleep(0.1)


def test_locate_answers_from_an_engines_own_hashes_and_measured_costs(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    kv_events: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # the full hashes
    daemon = procs.start_daemon(daemon_files)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    with running_llm(tiny_models.target, kv_transfer_config=connector, kv_events=True) as llm:
        generate_tokens(llm, prompts[:1], max_tokens=MAX_TOKENS)
    hashes = stored_hashes(kv_events)
    assert hashes
    assert all(isinstance(h, bytes) for h in hashes)
    # a second engine has none of it on its GPU: its hits load from the arena
    with running_llm(tiny_models.target, kv_transfer_config=connector, kv_events=True) as llm:
        generate_tokens(llm, prompts[:1], max_tokens=MAX_TOKENS)
        costs = wait_for_costs(daemon)
    assert costs.prefill_seconds_per_token > 0
    cpu = next(t for t in costs.tiers if t.tier == "cpu")
    assert cpu.seconds_per_chunk > 0
    assert cpu.seconds_per_byte > 0

    found = locate_cli(daemon, str(tiny_models.target), hashes)
    arena = next(t for t in found["tiers"] if t["tier"] == "cpu")
    assert int(arena["tokens"]) == int(found["tokens"]) > 0  # every announced block
    assert arena["measured"]
    assert found["recomputeMeasured"]
    assert arena["loadSeconds"] > 0
    assert found["recomputeSeconds"] > 0
