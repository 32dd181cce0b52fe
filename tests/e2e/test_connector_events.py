"""KV events from a real vLLM engine: routers hear which blocks the arena (CPU) and lmdb
(STORAGE) hold, and which the arena let go of when it ran out of room."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config

WRITE_THROUGH_WAIT_S = 1.0


def _small_arena_yaml(tmp: Path, shm_path: Path) -> Path:
    # one 2 MiB extent: 64 chunks of the tiny model, fewer than the prompts need
    path = tmp / "kvtier.yaml"
    config = {
        "arena": {
            "path": str(shm_path),
            "size_bytes": "4MiB",
            "extent_bytes": "2MiB",
            "min_slot_bytes": "4KiB",
        },
        "lmdb": {"path": str(tmp / "lmdb"), "budget_bytes": "256MiB"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _hashes(events: list[Any], kind: str, medium: str) -> list[Any]:
    chosen = [e for e in events if type(e).__name__ == kind and e.medium == medium]
    return [h for e in chosen for h in e.block_hashes]


def test_routers_hear_of_blocks_entering_the_arena_and_lmdb_and_leaving_the_arena(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    kv_events: list[Any],
) -> None:
    extra = {"kvtier_config": str(_small_arena_yaml(tmp_path, shm_path)), "write_through": True}
    outputs = []
    connector = kvtier_config(extra)
    with running_llm(tiny_models.target, kv_transfer_config=connector, kv_events=True) as llm:
        for prompt in prompts:
            outputs += generate_tokens(llm, [prompt], max_tokens=MAX_TOKENS)[0]
            time.sleep(WRITE_THROUGH_WAIT_S)  # written to lmdb: clean, so the arena may evict
        generate_tokens(llm, [prompts[0][:40]], max_tokens=4)  # steps that take the last events
    assert outputs == baseline[: len(prompts)]
    events = kv_events
    in_arena = _hashes(events, "BlockStored", "CPU")
    in_lmdb = _hashes(events, "BlockStored", "STORAGE")
    out_of_arena = _hashes(events, "BlockRemoved", "CPU")
    # every full block of every prompt reached the arena once (the prompts share no prefix)
    assert len(in_arena) == len(set(in_arena)) >= len(prompts) * (640 // 32)
    # write-through: all but the last prompt's blocks are in lmdb by now
    assert set(in_lmdb) <= set(in_arena)
    assert len(in_lmdb) >= (len(prompts) - 1) * (640 // 32)
    # the arena holds 64 chunks: the oldest blocks left it, and routers were told
    assert len(in_arena) - len(out_of_arena) <= 64
    assert out_of_arena
    assert set(out_of_arena) <= set(in_arena)
    assert _hashes(events, "BlockRemoved", "STORAGE") == []  # lmdb had room for all
    # told in order: a block leaves a medium only after it was said to be there
    told: set[tuple[str, Any]] = set()
    for event in events:
        for h in event.block_hashes:
            if type(event).__name__ == "BlockStored":
                told.add((event.medium, h))
            else:
                assert (event.medium, h) in told
                told.discard((event.medium, h))
