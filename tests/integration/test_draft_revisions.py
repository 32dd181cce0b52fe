"""Versioned draft pools in the TierManager: swaps, eviction order, garbage collection, stats."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.config import from_mapping
from kvtier.core.errors import InvalidRequestError, UnknownPoolError
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.observability.metrics import build_registry
from kvtier.tiering.manager import TierManager
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import MiB, draft_spec, keys_for, lmdb_config, manager_config, payload_for
from tests.support import target_spec as target

CHUNK = 256 << 10


def store(m: TierManager, keys: list[ChunkKey]) -> int:
    refs = [r for r in m.reserve(keys, "dp0") if r is not None]
    for ref in refs:
        m.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    return m.commit(refs)


@pytest.fixture
def manager(shm_path: Path, tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(manager_config(shm_path, tmp_path, demote_mode="write_through"))
    yield m
    m.close()


def test_a_swap_changes_only_the_draft_namespace(manager: TierManager) -> None:
    tns = manager.register_pool(target(), CHUNK)
    d1 = manager.register_pool(draft_spec(), CHUNK)
    assert store(manager, keys_for(tns, 4)) == 4
    assert store(manager, keys_for(d1, 4)) == 4
    (lineage,) = manager.draft_states()
    assert lineage == draft_spec().draft_lineage() == draft_spec(draft_revision="x").draft_lineage()

    swap_id, previous = manager.begin_draft_swap("d2")
    assert previous == "d1"
    state = manager.draft_states()[lineage]
    assert state.swapping
    assert state.revision == "d1"
    assert manager.commit_draft_swap(swap_id) == "d2"
    after = manager.draft_states()[lineage]
    assert (after.revision, after.swapping) == ("d2", False)
    assert after.epoch > state.epoch
    # an engine computes the same namespace for the new revision; it holds nothing yet
    d2 = manager.register_pool(draft_spec(draft_revision="d2"), CHUNK)
    assert d2 != d1
    assert manager.lookup(keys_for(d2, 4)).hits == 0
    # target chunks and the old revision's chunks are untouched (the old ones under their own
    # namespace only)
    assert manager.lookup(keys_for(tns, 4)).hits == 4
    assert manager.lookup(keys_for(d1, 4)).hits == 4
    assert manager.stats().counters["draft_swaps"] == 1
    revisions = {(r.revision, r.current): r.chunks["cpu"] for r in manager.draft_revisions()}
    assert revisions == {("d1", False): 4, ("d2", True): 0}
    with pytest.raises(InvalidRequestError, match="no draft swap"):
        manager.commit_draft_swap(swap_id)


def test_swap_errors_and_a_swap_back(manager: TierManager) -> None:
    with pytest.raises(UnknownPoolError, match="no engine has registered a draft pool"):
        manager.begin_draft_swap("d2")
    manager.register_pool(draft_spec(), CHUNK)
    with pytest.raises(InvalidRequestError, match="needs a revision"):
        manager.begin_draft_swap("")
    with pytest.raises(UnknownPoolError):
        manager.begin_draft_swap("d2", draft_model="another-draft")
    # an engine that swapped by itself registers its new revision, then the original again
    manager.register_pool(draft_spec(draft_revision="d2"), CHUNK)
    manager.register_pool(draft_spec(), CHUNK)
    (state,) = manager.draft_states().values()
    assert state.revision == "d1"
    assert manager.stats().counters["draft_swaps"] == 2
    assert {(r.revision, r.current) for r in manager.draft_revisions()} == {
        ("d1", True),
        ("d2", False),
    }


def test_old_revision_chunks_leave_the_arena_first(shm_path: Path, tmp_path: Path) -> None:
    cfg = from_mapping(
        {
            "arena": {"path": str(shm_path), "size_bytes": 16 * MiB, "extent_bytes": 2 * MiB},
            "lmdb": {"enabled": False},
        }
    )
    m = TierManager(cfg)
    try:
        d1 = m.register_pool(draft_spec(), CHUNK)
        old = keys_for(d1, 4)
        assert store(m, old) == 4
        m.commit_draft_swap(m.begin_draft_swap("d2")[0])
        d2 = m.register_pool(draft_spec(draft_revision="d2"), CHUNK)
        # the old chunks are the most recently used: plain LRU would keep them longest
        stored: list[ChunkKey] = []
        for i in range(200):
            (key,) = keys_for(d2, 1, start=i)
            if i == 2:
                m.release([r for r in m.lease(old, "dp0") if r is not None])
            assert store(m, [key]) == 1
            stored.append(key)
            if not all(m.cpu.contains(stored)):  # the first chunk of d2 evicted
                break
        else:
            pytest.fail("the draft pool never filled up")
        assert not any(m.cpu.contains(old))
        assert m.cpu.stats().counters["retired_evicted"] == 4
        # not one chunk of the current revision went before every old one had
        assert sum(m.cpu.contains(stored)) == len(stored) - 1
    finally:
        m.close()


def test_old_revision_chunks_leave_lmdb_first(tmp_path: Path) -> None:
    registry = PoolRegistry()
    d1 = registry.register(draft_spec(), CHUNK).namespace
    d2 = registry.register(draft_spec(draft_revision="d2"), CHUNK).namespace
    tier = LmdbTier(lmdb_config(tmp_path / "lmdb", budget=4 * MiB, sync_interval_s=0), registry)
    try:
        old = keys_for(d1, 4)
        for key in old:
            assert tier.put(key, payload_for(key, CHUNK))
        tier.retire(d1)
        new = keys_for(d2, 14)
        for key in new:
            assert tier.put(key, payload_for(key, CHUNK))
        assert tier.stats().counters["retired_evicted"] > 0
        # under plain LRU the old ones, written first, would also go first: make them the
        # newest, then fill again
        held = tier.contains(old)
        tier.reinstate(d1)
        tier.retire(d2)
        for key in keys_for(d1, 8, start=100):
            assert tier.put(key, payload_for(key, CHUNK))
        assert sum(tier.contains(new)) < len(new)
        assert tier.contains(old) == held
        assert tier.stats().counters["retired_evicted"] == 4 - sum(held) + len(new) - sum(
            tier.contains(new)
        )
    finally:
        tier.close()


def test_old_revisions_are_deleted_everywhere_after_the_grace(manager: TierManager) -> None:
    tns = manager.register_pool(target(), CHUNK)
    d1 = manager.register_pool(draft_spec(), CHUNK)
    assert store(manager, keys_for(tns, 3)) == 3
    assert store(manager, keys_for(d1, 3)) == 3
    manager.commit_draft_swap(manager.begin_draft_swap("d2")[0])
    d2 = manager.register_pool(draft_spec(draft_revision="d2"), CHUNK)
    assert store(manager, keys_for(d2, 2)) == 2
    assert manager.flush()
    assert manager.lmdb is not None
    assert sum(manager.lmdb.contains(keys_for(d1, 3))) == 3
    assert manager.gc_draft_revisions() == 0  # within the hour's grace
    assert manager.gc_draft_revisions(grace_s=0) == 6  # three in the arena, three in lmdb
    assert not any(manager.lmdb.contains(keys_for(d1, 3)))
    assert manager.lookup(keys_for(d1, 3)).hits == 0
    assert manager.lookup(keys_for(d2, 2)).hits == 2
    assert manager.lookup(keys_for(tns, 3)).hits == 3
    assert [r.revision for r in manager.draft_revisions()] == ["d2"]


def test_the_background_mover_collects_with_no_grace(shm_path: Path, tmp_path: Path) -> None:
    m = TierManager(manager_config(shm_path, tmp_path, draft_grace_s=0))
    try:
        d1 = m.register_pool(draft_spec(), CHUNK)
        assert store(m, keys_for(d1, 2)) == 2
        m.register_pool(draft_spec(draft_revision="d2"), CHUNK)

        # the mover counts what it collected after it left every tier: wait for both
        def collected() -> bool:
            gone = not any(m.cpu.contains(keys_for(d1, 2)))
            return gone and m.stats().counters["draft_gc_chunks"] >= 2

        deadline = time.monotonic() + 10
        while not collected() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(m.cpu.contains(keys_for(d1, 2)))
        assert m.stats().counters["draft_gc_chunks"] >= 2
    finally:
        m.close()


def test_metrics_show_chunks_per_revision_the_current_one_and_swaps(
    manager: TierManager,
) -> None:
    d1 = manager.register_pool(draft_spec(), CHUNK)
    assert store(manager, keys_for(d1, 3)) == 3
    manager.commit_draft_swap(manager.begin_draft_swap("d2")[0])
    registry = build_registry(manager, lambda: (0, 0, 0))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    chunks = "kvtier_draft_revision_chunks"
    assert value(chunks, tier="cpu", draft_model="tiny-draft", draft_revision="d1") == 3
    assert value(chunks, tier="cpu", draft_model="tiny-draft", draft_revision="d2") == 0
    assert value("kvtier_draft_swaps_total") == 1
    info = {k for k in samples if k[0] == "kvtier_draft_revision_info"}
    assert info == {
        (
            "kvtier_draft_revision_info",
            (("draft_model", "tiny-draft"), ("draft_revision", "d2"), ("model", "tiny-llama")),
        )
    }


def test_old_revisions_leave_the_object_store_after_the_grace(
    shm_path: Path, tmp_path: Path
) -> None:
    cfg = from_mapping(
        {
            "arena": {"path": str(shm_path), "size_bytes": 16 * MiB, "extent_bytes": 2 * MiB},
            "lmdb": {"path": str(tmp_path / "lmdb"), "budget_bytes": 64 * MiB},
            "object": {
                "url": f"file://{tmp_path}/bucket",
                "index_path": str(tmp_path / "objindex"),
                "index_map_bytes": 64 * MiB,
                "pack_linger_ms": 20,
            },
        }
    )
    m = TierManager(cfg)
    try:
        tns = m.register_pool(target(), CHUNK)
        d1 = m.register_pool(draft_spec(), CHUNK)
        assert store(m, keys_for(tns, 2)) == 2
        assert store(m, keys_for(d1, 2)) == 2
        assert m.flush()
        assert m.flush_uploads()
        assert m.object is not None
        objects = m.object.index.chunks
        assert sum(k in objects for k in keys_for(d1, 2)) == 2
        m.register_pool(draft_spec(draft_revision="d2"), CHUNK)  # an engine swapped by itself
        (old,) = [r for r in m.draft_revisions() if not r.current]
        assert old.chunks == {"cpu": 2, "lmdb": 2, "object": 2}
        assert m.gc_draft_revisions(grace_s=0) == 6
        assert not any(k in objects for k in keys_for(d1, 2))
        assert all(k in objects for k in keys_for(tns, 2))  # the target's objects stay
    finally:
        m.close()
