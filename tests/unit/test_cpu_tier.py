"""The arena's own guarantees beyond the shared contract: slot states, generations, leases,
per-replica quotas, per-pool size classes, mapping by path, and refusal of bad set-ups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from kvtier.core.errors import CapacityError, ConfigError, PoolLayoutError, TierUnavailableError
from kvtier.core.pools import PoolRegistry
from kvtier.tiers import arena
from kvtier.tiers.arena import ArenaAtPath, ArenaMemory, SlotState
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.slots import default_arena_size
from tests.support import MiB, arena_config, draft_spec, keys_for, payload_for, target_spec

CHUNK = 256 << 10


@pytest.fixture
def registry() -> PoolRegistry:
    return PoolRegistry()


@pytest.fixture
def tier(shm_path: Path, registry: PoolRegistry) -> CpuTier:
    tier = CpuTier(arena_config(shm_path, 16 * MiB), registry)
    yield tier  # type: ignore[misc]
    tier.close()


@pytest.fixture
def ns(registry: PoolRegistry) -> bytes:
    return registry.register(target_spec(), CHUNK).namespace


def test_slot_moves_free_writing_ready_and_uncommitted_is_invisible(
    tier: CpuTier, ns: bytes
) -> None:
    (key,) = keys_for(ns, 1)
    (ref,) = tier.reserve([key], "r0")
    assert ref is not None
    assert tier.memory.state[ref.slot] == SlotState.WRITING
    assert tier.contains([key]) == [False]  # reserved, not yet visible
    assert tier.lease([key]) == [None]
    assert tier.reserve([key], "r1") == [None]  # already in flight: not copied twice
    tier.view(ref)[:] = payload_for(key, CHUNK)
    assert tier.commit([ref]) == 1
    assert tier.memory.state[ref.slot] == SlotState.READY
    assert tier.contains([key]) == [True]
    assert tier.reserve([key], "r1") == [None]  # present: not copied twice


def test_abort_frees_the_slot_and_bumps_the_generation(tier: CpuTier, ns: bytes) -> None:
    (key,) = keys_for(ns, 1)
    (ref,) = tier.reserve([key])
    assert ref is not None
    tier.abort([ref])
    assert tier.memory.state[ref.slot] == SlotState.FREE
    assert not tier.memory.is_current(ref.slot, ref.generation)
    assert tier.commit([ref]) == 0  # a stale reservation cannot publish anything
    assert tier.contains([key]) == [False]
    assert tier.stats().counters["commit_stale"] == 1


def test_leased_chunks_are_never_evicted(tier: CpuTier, ns: bytes) -> None:
    keys = keys_for(ns, 200)
    assert tier.put(keys[0], payload_for(keys[0], CHUNK))
    (lease,) = tier.lease([keys[0]])
    assert lease is not None
    for key in keys[1:]:
        tier.put(key, payload_for(key, CHUNK))
    assert tier.contains([keys[0]]) == [True]
    assert bytes(tier.view(lease)) == payload_for(keys[0], CHUNK)
    assert tier.delete([keys[0]]) == 0  # in use
    tier.release([lease])
    assert tier.delete([keys[0]]) == 1
    assert not tier.memory.is_current(lease.slot, lease.generation)
    tier.release([lease])  # a stale release is ignored, not an underflow
    assert tier.stats().counters["release_stale"] == 1


def test_when_everything_is_leased_stores_are_rejected_not_blocked(
    tier: CpuTier, ns: bytes
) -> None:
    keys = keys_for(ns, 57)
    for key in keys[:56]:
        assert tier.put(key, payload_for(key, CHUNK))
    leases = tier.lease(keys[:56])
    assert tier.reserve([keys[56]]) == [None]
    assert tier.stats().counters["store_rejected"] == 1
    tier.release([lease for lease in leases if lease is not None])
    assert tier.reserve([keys[56]])[0] is not None


def test_replica_over_quota_is_evicted_first(tier: CpuTier, ns: bytes) -> None:
    tier.set_quota("hot", "target", 8 * CHUNK)
    calm = keys_for(ns, 20)
    for key in calm:  # the older chunks: plain LRU would evict these first
        tier.put(key, payload_for(key, CHUNK), "calm")
    for key in keys_for(ns, 200, start=1000):
        tier.put(key, payload_for(key, CHUNK), "hot")
    assert tier.contains(calm) == [True] * 20
    stats = tier.stats()
    assert stats.replicas[("hot", "target")].chunks == 56 - 20
    assert stats.counters["evictions_quota"] > 0


def test_a_replica_at_its_quota_never_evicts_another_replicas_chunks(
    tier: CpuTier, ns: bytes
) -> None:
    """With write-back, a replica's own recent chunks are dirty (not evictable): it must store
    nothing rather than push out another replica's chunks; reservations count as held."""
    tier.track_dirty(True)
    calm = keys_for(ns, 56)
    for key in calm:
        tier.put(key, payload_for(key, CHUNK), "calm")
    tier.writeback_done(tier.take_dirty(100, everything=True), ok=True)  # calm's are clean
    tier.set_quota("hot", "target", 4 * CHUNK)
    batch = tier.reserve(keys_for(ns, 8, start=1000), "hot")
    assert sum(ref is not None for ref in batch) == 4, "in-flight reservations count"
    tier.commit([ref for ref in batch if ref is not None])
    assert tier.reserve(keys_for(ns, 4, start=2000), "hot") == [None] * 4  # own chunks dirty
    stats = tier.stats()
    assert stats.replicas[("hot", "target")].chunks == 4
    assert stats.replicas[("calm", "target")].chunks == 52
    assert stats.counters["store_over_quota"] >= 4


def test_the_clean_reserve_counts_the_extents_a_class_can_still_take(
    tier: CpuTier, ns: bytes
) -> None:
    """Write-back before eviction is needed only once the arena runs short of clean slots: a
    class whose own extents are all dirty, with free extents behind it, is within its reserve."""
    tier.track_dirty(True)
    tier.set_clean_reserve(0.2)
    per_extent = (2 * MiB) // CHUNK
    reach = tier.pool_capacity_bytes("target") // CHUNK
    keys = keys_for(ns, reach)
    for key in keys[: 2 * per_extent]:  # two whole extents, every chunk dirty
        tier.put(key, payload_for(key, CHUNK), "r")
    assert tier.take_dirty(100, everything=False) == []
    for key in keys[2 * per_extent :]:  # now every slot the pool can reach
        tier.put(key, payload_for(key, CHUNK), "r")
    taken = tier.take_dirty(4, everything=False)
    assert [ref.key for ref in taken] == keys[:4], "past the reserve: the oldest go first"
    tier.writeback_done(taken, ok=True)
    assert len(tier.take_dirty(100, everything=True)) == reach - 4


def test_chunk_stored_by_one_replica_is_a_hit_for_another_and_stored_once(
    tier: CpuTier, ns: bytes
) -> None:
    (key,) = keys_for(ns, 1)
    assert tier.put(key, payload_for(key, CHUNK), "r0")
    assert tier.put(key, payload_for(key, CHUNK), "r1")
    assert tier.lease([key])[0] is not None
    stats = tier.stats()
    assert stats.chunks == 1
    assert ("r1", "target") not in stats.replicas


def test_draft_pool_uses_its_own_slot_size(
    tier: CpuTier, ns: bytes, registry: PoolRegistry
) -> None:
    draft = registry.register(draft_spec(), 64 << 10).namespace
    for key in keys_for(draft, 40):
        assert tier.put(key, payload_for(key, 64 << 10))
    pools = tier.stats().pools
    assert pools["draft"].used_bytes == 40 * (64 << 10)  # no slot padded to the target's size
    # 40 small chunks fit in two extents; the other five remain for the target pool
    for key in keys_for(ns, 40):
        assert tier.put(key, payload_for(key, CHUNK))
    assert tier.stats().pools["target"].chunks == 40


def test_pool_share_caps_a_pool(shm_path: Path, registry: PoolRegistry) -> None:
    tier = CpuTier(arena_config(shm_path, 16 * MiB), registry)  # draft max_share 0.5
    try:
        draft = registry.register(draft_spec(), CHUNK).namespace
        for key in keys_for(draft, 100):
            tier.put(key, payload_for(key, CHUNK))
        assert tier.stats().pools["draft"].chunks == 3 * 8  # floor(7 * 0.5) extents
    finally:
        tier.close()


def test_chunks_larger_than_an_extent_are_refused(tier: CpuTier, registry: PoolRegistry) -> None:
    spec = target_spec(model="big")
    with pytest.raises(PoolLayoutError, match="extent_bytes"):
        registry.register(spec, 4 * MiB)
    assert registry.get(spec.digest()) is None  # refused: nothing recorded
    assert registry.register(spec, CHUNK).chunk_bytes == CHUNK


def test_chunks_below_the_smallest_slot_are_refused_saying_what_to_set(
    tier: CpuTier, registry: PoolRegistry
) -> None:
    spec = target_spec(model="small")
    with pytest.raises(PoolLayoutError) as refused:
        registry.register(spec, 24_960)  # an fp8 hidden-state chunk of a small model
    assert "set arena.min_slot_bytes to 24960 or less" in str(refused.value)
    assert registry.get(spec.digest()) is None


def test_another_process_maps_the_arena_by_path(tier: CpuTier, ns: bytes) -> None:
    key, other = keys_for(ns, 2)
    tier.put(key, payload_for(key, CHUNK))
    (lease,) = tier.lease([key])
    (res,) = tier.reserve([other])
    assert lease is not None
    assert res is not None
    script = (
        "import sys; from pathlib import Path; from kvtier.tiers.arena import ArenaMemory;"
        "m = ArenaMemory.attach(Path(sys.argv[1]));"
        "r = m.view(int(sys.argv[2]), int(sys.argv[3]));"
        "w = m.view(int(sys.argv[4]), int(sys.argv[3]));"
        "w[:] = bytes(r)[::-1];"  # write the reverse into the reserved slot
        "s = int(sys.argv[5]);"
        "print(m.is_current(s, int(sys.argv[6])), int(m.generation[s]))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(tier.memory.path),
            str(lease.offset),
            str(CHUNK),
            str(res.offset),
            str(lease.slot),
            str(lease.generation),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == ["True", str(lease.generation)]
    tier.commit([res])
    assert bytes(tier.view(res)) == payload_for(key, CHUNK)[::-1]


def stats_of(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Each look at ``path`` (os.stat) from now on."""
    looked: list[Path] = []
    real = os.stat

    def counting(what: Path, *args: object, **kwargs: object) -> os.stat_result:
        if what == path:
            looked.append(what)
        return real(what, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(arena.os, "stat", counting)
    return looked


def test_a_mapping_by_path_costs_no_system_call_and_follows_a_successor_at_once(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = CpuTier(arena_config(shm_path, 16 * MiB), PoolRegistry())
    at = ArenaAtPath(shm_path, populate=False, recheck_s=3600)
    looked = stats_of(shm_path, monkeypatch)
    try:
        mapped = at.current()
        old_epoch = mapped.epoch
        assert old_epoch == first.memory.epoch
        assert all(at.current() is mapped for _ in range(100))
        assert len(looked) == 1  # a busy engine loop never gives up the GIL for it
        first.close()  # marks the file retired, then unlinks it
        assert mapped.retired
        second = CpuTier(arena_config(shm_path, 16 * MiB), PoolRegistry())
        try:
            assert at.current().epoch == second.memory.epoch != old_epoch
        finally:
            second.close()
    finally:
        at.close()
        first.close()


def test_a_successor_marks_a_killed_owners_file_for_every_process_mapping_it(
    shm_path: Path,
) -> None:
    script = (
        "import sys, time; from pathlib import Path; from kvtier.tiers.arena import ArenaMemory;"
        "ArenaMemory.create(Path(sys.argv[1]), 16 << 20, 2 << 20, 64 << 10, prefault=False);"
        "print('up', flush=True); time.sleep(600)"
    )
    at = ArenaAtPath(shm_path, populate=False, recheck_s=3600)
    with subprocess.Popen(
        [sys.executable, "-c", script, str(shm_path)], stdout=subprocess.PIPE, text=True
    ) as owner:
        try:
            assert owner.stdout is not None
            assert owner.stdout.readline() == "up\n"
            dead = at.current()
            dead_epoch = dead.epoch
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=30)
            assert at.current() is dead  # no successor yet: nowhere to move
            assert not dead.retired
            successor = CpuTier(arena_config(shm_path, 16 * MiB), PoolRegistry())
            try:
                assert dead.retired
                assert at.current().epoch == successor.memory.epoch != dead_epoch
            finally:
                successor.close()
        finally:
            owner.kill()
            at.close()


def test_an_arena_file_removed_by_hand_is_noticed_after_recheck_s(shm_path: Path) -> None:
    tier = CpuTier(arena_config(shm_path, 16 * MiB), PoolRegistry())
    at = ArenaAtPath(shm_path, populate=False, recheck_s=0.05)
    try:
        at.current()
        shm_path.unlink()  # no mark: only a look at the path tells
        time.sleep(0.1)
        with pytest.raises(TierUnavailableError, match="no arena at"):
            at.current()
    finally:
        at.close()
        tier.close()


def test_second_owner_of_the_same_arena_is_refused(tier: CpuTier, shm_path: Path) -> None:
    with pytest.raises(ConfigError, match="in use by another kvtier process"):
        CpuTier(arena_config(shm_path, 16 * MiB), PoolRegistry())


def test_stale_arena_of_a_dead_owner_is_replaced(shm_path: Path) -> None:
    shm_path.write_bytes(b"left over by a killed daemon")
    tier = CpuTier(arena_config(shm_path, 16 * MiB), PoolRegistry())
    try:
        assert ArenaMemory.attach(shm_path).num_extents == tier.memory.num_extents
    finally:
        tier.close()
    assert not shm_path.exists()


def test_unwritable_arena_path_is_a_config_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    path = Path("/proc/kvtier-arena") if _is_root() else ro / "arena"
    with pytest.raises(ConfigError, match=r"arena\.path"):
        CpuTier(arena_config(path, 16 * MiB), PoolRegistry())


def test_arena_larger_than_memory_is_refused(shm_path: Path) -> None:
    with pytest.raises(CapacityError, match=r"arena\.size_bytes"):
        CpuTier(arena_config(shm_path, 1 << 50), PoolRegistry())
    assert not shm_path.exists()


def test_default_size_comes_from_free_memory_with_a_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING"):
        size = default_arena_size(0.25, Path("/dev/shm"))
    assert size > 0
    assert "arena.size_bytes is not set" in caplog.text


def test_hot_path_allocates_nothing_chunk_sized(tier: CpuTier, ns: bytes) -> None:
    keys = keys_for(ns, 300)
    payload = payload_for(keys[0], CHUNK)
    for key in keys[:60]:  # warm up: every slot and list already exists
        tier.put(key, payload)
    tracemalloc.start()
    try:
        for key in keys[60:]:
            (ref,) = tier.reserve([key])
            assert ref is not None
            tier.view(ref)[:] = payload
            tier.commit([ref])
            (lease,) = tier.lease([key])
            assert lease is not None
            tier.release([lease])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < CHUNK // 4, f"peak {peak} bytes traced on the store/load path"


def _is_root() -> bool:
    import os

    return os.geteuid() == 0
