"""TierManager end to end, in process: real arena in /dev/shm, real LMDB under tmp_path."""

from __future__ import annotations

import time
from pathlib import Path

import lmdb
import pytest

from kvtier.client import InProcessClient
from kvtier.core.errors import ConfigError, UnknownPoolError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef, TierClient
from kvtier.tiering.manager import TierManager
from kvtier.tiers.lmdb_reader import will_need
from tests.support import MiB, draft_spec, keys_for, manager_config, payload_for, target_spec

CHUNK = 256 << 10


def store(m: TierManager | TierClient, keys: list[ChunkKey], replica: str = "r0") -> int:
    reserved = m.reserve(keys, replica) if isinstance(m, TierManager) else m.reserve(keys)
    refs = [r for r in reserved if r is not None]
    view = m.cpu.view if isinstance(m, TierManager) else m.manager.cpu.view  # type: ignore[attr-defined]
    for ref in refs:
        view(ref)[:] = payload_for(ref.key, ref.nbytes)
    return m.commit(refs)


def read(m: TierManager, lease: SlotRef) -> bytes:
    return bytes(m.cpu.view(lease))


def test_lookup_reports_longest_prefix_and_tier_of_each_chunk(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 6)
    assert store(manager, keys[:4]) == 4
    assert manager.flush()
    manager.evict("cpu", namespace=ns)  # now only in lmdb
    assert store(manager, keys[:2]) == 0  # kept in lmdb already: not copied again
    manager.release([r for r in manager.lease(keys[:2], "r0") if r])  # promoted to the arena
    store(manager, keys[5:])  # present, but after a gap
    result = manager.lookup(keys)
    assert result.hits == 4
    assert result.tiers == ["cpu", "cpu", "lmdb", "lmdb"]
    counters = manager.stats().counters
    assert counters["hit_chunks_cpu"] + counters["hit_chunks_lmdb"] == 4


def test_uncommitted_and_aborted_chunks_are_invisible(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 2)
    refs = manager.reserve(keys)
    assert all(refs)
    assert manager.lookup(keys).hits == 0
    manager.abort([refs[0]])  # type: ignore[list-item]
    assert manager.commit([refs[1]]) == 1  # type: ignore[list-item]
    assert manager.lookup(keys).hits == 0
    assert manager.lookup(keys[1:]).hits == 1


def test_load_promotes_from_lmdb_under_a_lease(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 3)
    store(manager, keys)
    assert manager.flush()
    manager.evict("cpu")
    assert manager.lookup(keys).tiers == ["lmdb"] * 3
    leases = manager.lease(keys, "r1")
    assert all(leases)
    for key, lease in zip(keys, leases, strict=True):
        assert lease is not None
        assert read(manager, lease) == payload_for(key, CHUNK)
        assert manager.cpu.memory.refcount[lease.slot] == 1
    assert manager.lookup(keys).tiers == ["cpu"] * 3
    assert manager.stats().counters["promotions"] == 3
    manager.release([lease for lease in leases if lease])


def test_write_back_moves_evicted_chunks_to_lmdb(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 150)  # the arena holds 56
    stored = 0
    for i in range(0, len(keys), 10):
        stored += store(manager, keys[i : i + 10])
        manager.flush()  # stands in for time passing between steps
    assert stored == 150
    assert manager.lookup(keys).hits == 150
    stats = manager.stats()
    assert stats.tiers["lmdb"].chunks == 150
    assert stats.tiers["cpu"].chunks <= 56
    leases = manager.lease(keys[:5], "r0")
    assert [read(manager, lease) for lease in leases if lease] == [
        payload_for(k, CHUNK) for k in keys[:5]
    ]


def test_write_back_runs_in_the_background(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 300)
    for i in range(0, 300, 4):
        store(manager, keys[i : i + 4])
        time.sleep(0.005)
    assert manager.lmdb is not None
    deadline = time.monotonic() + 20
    while manager.lmdb.stats().chunks <= 56 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = manager.stats()
    assert stats.tiers["cpu"].counters["writeback_ok"] > 0
    assert stats.tiers["lmdb"].chunks > 56  # more than the arena could ever hold


def test_write_through_mode(shm_path: Path, tmp_path: Path) -> None:
    m = TierManager(manager_config(shm_path, tmp_path, demote_mode="write_through"))
    try:
        ns = m.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 4)
        store(m, keys)
        deadline = time.monotonic() + 10
        while m.lmdb is not None and m.lmdb.locate(keys) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.lmdb is not None
        assert m.lmdb.contains(keys) == [True] * 4
    finally:
        m.close()


def test_corrupt_lmdb_chunk_is_never_served(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 2)
    store(manager, keys)
    manager.flush()
    manager.evict("cpu")
    assert manager.lmdb is not None
    env = manager.lmdb.env
    with env.begin(write=True, db=manager.lmdb.store.chunks) as txn:
        value = bytearray(txn.get(keys[0]))
        value[-1] ^= 0x40
        txn.put(keys[0], bytes(value))
    leases = manager.lease(keys, "r0")
    assert leases[0] is None
    assert leases[1] is not None
    assert manager.stats().tiers["lmdb"].counters["corrupt"] == 1
    assert manager.lookup(keys).hits == 0  # quarantined
    assert manager.cpu.contains(keys[:1]) == [False]
    manager.release([leases[1]])


def test_warm_restart_serves_everything_from_lmdb(shm_path: Path, tmp_path: Path) -> None:
    m = TierManager(manager_config(shm_path, tmp_path))
    ns = m.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 20)
    store(m, keys)
    m.close()  # writes the arena back
    m = TierManager(manager_config(shm_path, tmp_path))
    try:
        assert m.register_pool(target_spec(), CHUNK) == ns
        assert m.lookup(keys).tiers == ["lmdb"] * 20
        leases = m.lease(keys, "r0")
        assert [read(m, lease) for lease in leases if lease] == [
            payload_for(k, CHUNK) for k in keys
        ]
    finally:
        m.close()


def test_target_and_draft_pools_stay_apart(manager: TierManager) -> None:
    t = manager.register_pool(target_spec(), CHUNK)
    d = manager.register_pool(draft_spec(), 64 << 10)
    store(manager, keys_for(t, 3))
    store(manager, keys_for(d, 5))
    manager.flush()
    stats = manager.stats()
    for tier in ("cpu", "lmdb"):
        assert stats.tiers[tier].pools["target"].chunks == 3
        assert stats.tiers[tier].pools["draft"].chunks == 5
    # same engine hashes, other pool: not a hit
    assert manager.lookup(keys_for(d, 3)).hits == 3
    assert manager.lookup([keys_for(t, 4)[3]]).hits == 0


def test_unknown_pool_is_a_clear_error(manager: TierManager) -> None:
    foreign = keys_for(target_spec(model="unregistered").digest(), 2)
    with pytest.raises(UnknownPoolError, match="not registered"):
        manager.lookup(foreign)
    with pytest.raises(UnknownPoolError):
        manager.reserve(foreign)


def test_client_protocol_in_process(manager: TierManager) -> None:
    client = InProcessClient(manager)
    assert isinstance(client, TierClient)
    ns = client.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 2)
    assert store(client, keys) == 2
    assert client.lookup(keys).hits == 2
    assert client.arena_path == manager.cpu.memory.path


def test_a_leasing_lookup_leases_only_a_hit_the_arena_holds_whole(manager: TierManager) -> None:
    client = InProcessClient(manager, "r0")
    ns = client.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 4)
    assert store(client, keys[:2]) == 2
    manager.evict("cpu")  # both reach lmdb first
    assert store(client, keys[2:]) == 2
    result, leases = client.lookup(keys[2:], lease=True)
    assert (result.hits, [lease.key if lease else None for lease in leases]) == (2, keys[2:])
    # the first chunk is only in lmdb: nothing is leased, so a lookup never waits on lmdb
    result, leases = client.lookup(
        keys, release=[lease for lease in leases if lease is not None], lease=True
    )
    assert (result.tiers, leases) == (["lmdb", "lmdb", "cpu", "cpu"], [])
    # nor when the arena holds only the first ones: they would only be given back
    result, leases = client.lookup(keys[2:] + keys[:2], lease=True)
    assert (result.tiers, leases) == (["cpu", "cpu", "lmdb", "lmdb"], [])
    assert manager.evict("cpu")["cpu"] == 2  # released: leased slots would stay


def test_unwritable_lmdb_path_is_a_config_error(shm_path: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = manager_config(shm_path, tmp_path)
    cfg = cfg.model_copy(update={"lmdb": cfg.lmdb.model_copy(update={"path": blocker / "x"})})
    with pytest.raises(ConfigError, match=r"lmdb\.path"):
        TierManager(cfg)
    assert not shm_path.exists()  # the arena made before the failure is gone again


def test_lmdb_budget_larger_than_the_disk_is_refused(shm_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lmdb\.budget_bytes"):
        TierManager(manager_config(shm_path, tmp_path, lmdb_mib=1 << 40))


def test_map_full_evicts_and_retries(shm_path: Path, tmp_path: Path) -> None:
    m = TierManager(manager_config(shm_path, tmp_path, lmdb_mib=8))
    try:
        assert m.lmdb is not None
        ns = m.register_pool(target_spec(), CHUNK)
        m.lmdb.env.set_mapsize(m.lmdb.budget // 2)  # the map is smaller than the budget says
        keys = keys_for(ns, 60)
        for i in range(0, 60, 6):
            store(m, keys[i : i + 6])
            assert m.flush()
        counters = m.lmdb.stats().counters
        assert counters["map_full"] > 0
        assert m.lmdb.stats().chunks > 0
        assert m.lookup(keys[-1:]).hits == 1
    finally:
        m.close()


def test_a_full_lmdb_turns_stores_into_misses_not_errors(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = TierManager(manager_config(shm_path, tmp_path, lmdb_mib=8))
    try:
        assert m.lmdb is not None
        ns = m.register_pool(target_spec(), CHUNK)
        tier = m.lmdb

        def disk_full(*args: object, **kwargs: object) -> list[bool]:
            raise lmdb.DiskError("No space left on device")

        monkeypatch.setattr(tier.store, "write", disk_full)
        keys = keys_for(ns, 4)
        assert tier.put_many([(k, payload_for(k, CHUNK)) for k in keys]) == [False] * 4
        assert tier.stats().counters["store_failed"] == 4
        assert tier.contains(keys) == [False] * 4
    finally:
        monkeypatch.undo()
        m.close()


def test_arena_is_sized_from_memory_when_unset(tmp_path: Path, shm_path: Path) -> None:
    cfg = manager_config(shm_path, tmp_path)
    cfg = cfg.model_copy(
        update={"arena": cfg.arena.model_copy(update={"size_bytes": None, "auto_fraction": 0.01})}
    )
    m = TierManager(cfg)
    try:
        assert m.cpu.memory.size > 16 * MiB
    finally:
        m.close()


def test_promote_moves_lmdb_chunks_into_the_arena_without_waiting(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 6)
    store(manager, keys)
    assert manager.flush()
    manager.evict("cpu")
    assert manager.promote(keys, "r0") == 6
    assert manager.promote(keys, "r0") <= 6  # already queued ones are not queued twice
    deadline = time.monotonic() + 10
    while manager.lookup(keys).tiers != ["cpu"] * 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.lookup(keys).tiers == ["cpu"] * 6
    assert manager.promote(keys, "r0") == 0  # nothing left to do
    # held for the load that asked, until its lease takes them
    assert int(sum(manager.cpu.memory.refcount)) == 6
    manager.release([r for r in manager.lease(keys, "r0") if r is not None])
    assert int(sum(manager.cpu.memory.refcount)) == 0


def test_read_ahead_finds_the_stored_chunks_and_reads_nothing_itself(
    manager: TierManager,
) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 6)
    store(manager, keys[:4])
    assert manager.flush()
    lmdb_tier = manager.lmdb
    assert lmdb_tier is not None
    hits = lmdb_tier.stats().counters["hits"]
    assert will_need(lmdb_tier.env, lmdb_tier.store.chunks, keys) == 4
    lmdb_tier.read_ahead(keys)  # absent keys are skipped, not errors
    assert lmdb_tier.stats().counters["hits"] == hits  # a hint, not a read
