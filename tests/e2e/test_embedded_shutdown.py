"""Embedded mode stopped under load the way a pod is: SIGTERM to vLLM's API server while its
requests decode. vLLM kills its engine process at once (its default ``--shutdown-timeout``),
so the connector's close never runs; the arena file stays in /dev/shm, and a fresh server on
the same tiers keeps what it held and serves every prompt from it. Real API servers (the CPU
build), the 2-layer model, a real arena and lmdb (benchmarks/shutdown.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.shutdown import EXIT_TIMEOUT_S, Run
from tests.fixtures.models import ModelSet


def test_a_sigterm_under_load_loses_nothing_the_arena_held(
    tiny_models: ModelSet, tmp_path: Path
) -> None:
    run = Run(
        tiny_models.target,
        tmp_path,
        prompts=4,
        prompt_tokens=1024,
        arena_mib=64,
        lmdb_mib=128,
        # no write-back while it runs, however soon its requests finish before the signal: the
        # arena alone holds what the engine stored, and only the next start can keep it
        connector_settings={"writeback_idle_ms": 3_600_000},
    )
    result = run.run()
    stored = result["stored_chunks"]
    assert stored >= 4 * 1024 // 128
    assert result["exit_s"] is not None, f"the engine outlived {EXIT_TIMEOUT_S} s"
    # the engine was never idle long enough to write: its chunks were in the arena only
    assert result["arena_left"], result
    assert result["lmdb_chunks_before_restart"] < stored, result
    assert result["lost_chunks"] == 0, result
    assert result["restart_hit_tokens"] == result["restart_hit_possible"] > 0, result
