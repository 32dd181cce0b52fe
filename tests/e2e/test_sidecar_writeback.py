"""kvtierd beside a real engine: while the engine serves requests whose chunks fit in the arena,
nothing is written to lmdb (the CPU time would be taken from its forwards); within a heartbeat
or two of the engine going idle, every chunk is."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config
from tests.e2e.test_counters_under_queueing import unique_prompts
from tests.integration.daemon_harness import DaemonFiles, Processes


def test_chunks_reach_lmdb_once_the_engine_is_idle_and_not_before(
    tiny_models: ModelSet,
    procs: Processes,
    daemon_files: DaemonFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

    daemon = procs.start_daemon(daemon_files)
    during: list[float] = []
    build = KVTierScheduler.build_connector_meta

    def watching(self: KVTierScheduler, scheduler_output: Any) -> Any:
        during.append(daemon.chunks_moved("demote"))  # at each of the engine's steps
        return build(self, scheduler_output)

    monkeypatch.setattr(KVTierScheduler, "build_connector_meta", watching)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        generate_tokens(llm, unique_prompts(tiny_models, 8, seed=31), max_tokens=8)
        stored = daemon.chunks_moved("store")
        assert stored > 0
        assert len(during) > 4  # prefill and decode steps
        assert max(during) == 0, f"written to lmdb while the engine served: {during}"
        deadline = time.monotonic() + 5.0
        while daemon.chunks_moved("demote") < daemon.chunks_moved("store"):
            assert time.monotonic() < deadline, "the idle engine's chunks never reached lmdb"
            time.sleep(0.1)
    assert daemon.chunks_moved("demote") == daemon.chunks_moved("store") >= stored
