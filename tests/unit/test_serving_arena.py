"""The serving benchmark's servers past the arena: an arena that holds a quarter of the working
set in whole extents, however small the working set (the GPU-ratio model's fitted documents
make it a few dozen chunks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.core.config import ArenaConfig
from kvtier.tiers.cpu import open_arena
from tests.bench.serving_harness import small_servers


@pytest.mark.parametrize("working_set_chunks", [9, 24, 128, 1000])
def test_the_arena_holds_a_quarter_of_the_working_set_in_whole_extents(
    tmp_path: Path, shm_path: Path, working_set_chunks: int
) -> None:
    servers = small_servers(tmp_path)
    servers.working_set_bytes = working_set_chunks * servers.chunk_bytes
    tree: dict[str, Any] = {"arena": {"path": str(shm_path)}, "lmdb": {}}
    servers.past_the_arena(tree, "lmdb", daemon=None)  # type: ignore[arg-type]  # lmdb: unused
    arena = tree["arena"]
    memory = open_arena(ArenaConfig(**arena))
    try:
        extent_chunks = memory.extent_bytes // servers.chunk_bytes
        held_chunks = memory.num_extents * extent_chunks
        quarter = max(1, round(working_set_chunks / 4))
        assert held_chunks == max(extent_chunks, round(quarter / extent_chunks) * extent_chunks)
        assert abs(held_chunks - quarter) < extent_chunks
        assert extent_chunks <= 8
        assert memory.num_extents >= min(4, held_chunks)
    finally:
        memory.close()
