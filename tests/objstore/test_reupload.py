"""After a restart, chunks lmdb holds and the object index lacks are offered for upload again:
bounded per start, at a bounded rate, newest first, on a file:// store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.tiering.manager import TierManager
from tests.support import keys_for, object_node_config, payload_for, target_spec

CHUNK = 256 << 10


def config(root: Path, **obj: Any) -> KVTierConfig:
    return object_node_config(root, f"file://{root}/bucket", **{"pack_linger_ms": 10, **obj})


def test_a_restart_offers_what_was_never_uploaded_up_to_its_cap(tmp_path: Path) -> None:
    # hits admission with an unreachable threshold: chunks reach lmdb, never the store
    first = TierManager(config(tmp_path, admission="hits", admission_min_hits=99))
    try:
        ns = first.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 8)
        for key in keys:  # one at a time, so that lmdb orders them by age
            refs = [r for r in first.reserve([key], "r0") if r is not None]
            first.cpu.view(refs[0])[:] = payload_for(key, CHUNK)
            assert first.commit(refs) == 1
            assert first.flush()
        assert first.object is not None
        assert first.object.contains(keys) == [False] * 8
    finally:
        first.close()
        first.config.arena.path.unlink(missing_ok=True)

    again = TierManager(config(tmp_path, reupload_max_chunks=3, reupload_chunks_per_s=5.0))
    try:
        started = time.monotonic()
        again.register_pool(target_spec(), CHUNK)  # nothing is offered before this
        assert again.object is not None
        deadline = started + 20.0
        while sum(again.object.contains(keys)) < 3:
            assert time.monotonic() < deadline, again.object.contains(keys)
            time.sleep(0.05)
        assert again.flush_uploads(10.0)
        assert time.monotonic() - started >= 0.4, "3 chunks at 5 per second"
        time.sleep(1.5)  # past the scan's next pass: the cap holds
        assert again.object.contains(keys) == [False] * 5 + [True] * 3, "the newest first"
        counters = again.object.counters.snapshot()
        assert counters["uploads_resumed"] == 3
        assert counters["objects_uploaded"] == 3
    finally:
        again.close()
        again.config.arena.path.unlink(missing_ok=True)

    third = TierManager(config(tmp_path, reupload_max_chunks=100))
    try:
        third.register_pool(target_spec(), CHUNK)
        assert third.object is not None
        deadline = time.monotonic() + 20.0
        while not all(third.object.contains(keys)):
            assert time.monotonic() < deadline, third.object.contains(keys)
            time.sleep(0.05)
        assert third.flush_uploads(10.0)
        # what the index had is never uploaded again
        assert third.object.counters.snapshot()["objects_uploaded"] == 5
    finally:
        third.close()
        third.config.arena.path.unlink(missing_ok=True)
