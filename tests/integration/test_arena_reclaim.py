"""The arena gives memory back: extents return to the free list, a new chunk size takes room
from idle classes (their dirty chunks written back first), pools keep their floors, and idle
namespaces and slot classes expire. Real arena in /dev/shm, real LMDB, the embedded client."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.client import InProcessClient
from kvtier.core.config import from_mapping
from kvtier.core.errors import CapacityError
from kvtier.core.keys import ChunkKey, NamespaceSpec
from kvtier.core.pools import PoolRegistry
from kvtier.server.sessions import SessionRegistry
from kvtier.tiering.manager import TierManager
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.cpu import CpuTier
from tests.support import MiB, arena_config, draft_spec, keys_for, payload_for, target_spec

KiB = 1 << 10
DEADLINE_S = 60.0  # under a loaded machine, write-back before a reclaim can take a while


def _config(shm: Path, tmp: Path, arena_mib: int = 64, **arena: object) -> dict[str, object]:
    return {
        "arena": {
            "path": str(shm),
            "size_bytes": arena_mib * MiB,
            "extent_bytes": 4 * MiB,
            "prefault": False,
            **arena,
        },
        "lmdb": {"path": str(tmp / "lmdb"), "budget_bytes": 512 * MiB},
    }


def _client(config: dict[str, object]) -> InProcessClient:
    return InProcessClient(TierManager(from_mapping(config)), "r0")


@pytest.fixture
def close_after() -> Iterator[list[InProcessClient]]:
    clients: list[InProcessClient] = []
    yield clients
    for client in clients:
        client.close()


def _store(client: InProcessClient, keys: list[ChunkKey]) -> int:
    refs = [r for r in client.reserve(keys) if r is not None]
    for ref in refs:
        client.manager.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    return client.commit(refs)


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def _store_until(
    client: InProcessClient, keys: list[ChunkKey], want: int, what: str
) -> set[ChunkKey]:
    """Store ``keys`` again and again (refused stores are retried) until ``want`` are in."""
    committed: set[ChunkKey] = set()

    def stored() -> bool:
        todo = [k for k in keys if k not in committed]
        refs = [r for r in client.reserve(todo) if r is not None]
        for ref in refs:
            client.manager.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
        client.commit(refs)
        committed.update(r.key for r in refs)
        return len(committed) >= want

    _until(stored, what)
    return committed


def _hold_until(client: InProcessClient, keys: list[ChunkKey], want: int, what: str) -> None:
    """Store the ``keys`` the arena does not hold until it holds ``want`` of them at once:
    a class may evict its own chunks while another class's extents are still being freed."""
    cpu = client.manager.cpu

    def held() -> bool:
        missing = [k for k, has in zip(keys, cpu.contains(keys), strict=True) if not has]
        _store(client, missing)
        return sum(cpu.contains(keys)) >= want

    _until(held, what)


def _extents(cpu: CpuTier, chunk_bytes: int) -> int:
    return sum(c.extents for (_pool, size), c in cpu.slots.classes.items() if size == chunk_bytes)


def test_a_model_switch_after_the_arena_filled_stores_within_seconds(
    shm_path: Path, tmp_path: Path, close_after: list[InProcessClient]
) -> None:
    client = _client(_config(shm_path, tmp_path, reclaim_idle_s=0.5))
    close_after.append(client)
    a = client.register_pool(target_spec(model="a"), 512 * KiB)
    a_keys = keys_for(a, 160)  # 80 MiB of chunks into a 64 MiB arena: A holds every extent
    for start in range(0, len(a_keys), 16):
        _store(client, a_keys[start : start + 16])
    assert client.manager.cpu.live_counts()["free_extents"] == 0
    b = client.register_pool(target_spec(model="b"), 768 * KiB)  # A now goes idle
    b_keys = keys_for(b, 50)
    committed = _store_until(client, b_keys, 45, "model B's chunks committed")
    assert client.lookup(b_keys).hits >= 45
    assert client.flush()
    lmdb = client.manager.lmdb
    assert lmdb is not None
    assert sum(lmdb.contains(sorted(committed))) == len(committed)  # B reaches lmdb too


def test_dirty_chunks_taken_for_another_class_are_written_back_first(
    shm_path: Path, tmp_path: Path, close_after: list[InProcessClient]
) -> None:
    # write-back keeps no clean reserve: every chunk of A stays dirty until it is pressed
    config = _config(shm_path, tmp_path, arena_mib=16, reclaim_idle_s=0.2)
    config["manager"] = {"clean_reserve": 0.0}
    client = _client(config)
    close_after.append(client)
    cpu = client.manager.cpu
    a = client.register_pool(target_spec(model="a"), 512 * KiB)
    a_keys = keys_for(a, cpu.memory.num_extents * 8)  # every slot of every extent
    assert _store(client, a_keys) == len(a_keys)
    assert client.writeback_pending() == len(a_keys)  # all dirty: nothing pressed write-back
    b = client.register_pool(target_spec(model="b"), 1 * MiB)
    b_keys = keys_for(b, 4)
    _until(lambda: _store(client, b_keys[:1]) == 1, "model B's first chunk stored")
    gone = [k for k, held in zip(a_keys, cpu.contains(a_keys), strict=True) if not held]
    assert gone, "B's extent came from nowhere"
    lmdb = client.manager.lmdb
    assert lmdb is not None
    assert lmdb.contains(gone) == [True] * len(gone), "a dirty chunk was evicted unwritten"
    assert cpu.stats().counters["evictions_reclaim"] == len(gone)


def test_a_class_that_evicts_its_own_chunks_presses_write_back_for_its_lenders(
    shm_path: Path, tmp_path: Path, close_after: list[InProcessClient]
) -> None:
    # the default clean reserve: write-back keeps a fifth of each class clean, so most of A's
    # extents stay dirty while B's stores always find a clean chunk of B's own to evict
    client = _client(_config(shm_path, tmp_path, arena_mib=32, reclaim_idle_s=0.2))
    close_after.append(client)
    cpu = client.manager.cpu
    extents = cpu.memory.num_extents
    a = client.register_pool(target_spec(model="a"), 512 * KiB)
    a_keys = keys_for(a, extents * 8)
    assert _store(client, a_keys) == len(a_keys)  # A holds every extent
    b = client.register_pool(target_spec(model="b"), 1 * MiB)
    fresh = itertools.count()  # a key evicted once is in lmdb: B stores new ones

    def grown() -> bool:
        _store(client, keys_for(b, 1, start=next(fresh)))
        return _extents(cpu, 1 * MiB) >= extents - 1

    _until(grown, "B took A's extents once they were written")
    gone = [k for k, held in zip(a_keys, cpu.contains(a_keys), strict=True) if not held]
    lmdb = client.manager.lmdb
    assert lmdb is not None
    assert lmdb.contains(gone) == [True] * len(gone), "a dirty chunk was evicted unwritten"


def test_a_fully_free_extent_returns_and_a_new_class_takes_it(shm_path: Path) -> None:
    registry = PoolRegistry()
    cpu = CpuTier(arena_config(shm_path, 8 * MiB, prefault=False), registry)
    try:
        extents = cpu.memory.num_extents
        a = registry.register(target_spec(model="a"), 256 * KiB)
        a_keys = keys_for(a.namespace, extents * 8)  # 2 MiB extents: the whole arena
        assert all(cpu.put(k, payload_for(k, a.chunk_bytes)) for k in a_keys)
        assert cpu.live_counts()["free_extents"] == 0
        assert cpu.delete(a_keys[:8]) == 8  # the first extent's chunks: stores fill low first
        assert cpu.live_counts()["free_extents"] == 1
        assert _extents(cpu, a.chunk_bytes) == extents - 1
        b = registry.register(target_spec(model="b"), 512 * KiB)
        b_keys = keys_for(b.namespace, 4)
        assert all(cpu.put(k, payload_for(k, b.chunk_bytes)) for k in b_keys)
        assert _extents(cpu, b.chunk_bytes) == 1
        assert all(cpu.contains(a_keys[8:]))  # A kept what it held
        for key in b_keys:
            buf = bytearray(b.chunk_bytes)
            assert cpu.read_into(key, memoryview(buf))
            assert bytes(buf) == payload_for(key, b.chunk_bytes)
    finally:
        cpu.close()


def test_a_pool_in_use_keeps_its_floor_while_another_pool_grows(shm_path: Path) -> None:
    registry = PoolRegistry()
    pools = {
        "target": {"max_share": 1.0},
        "draft": {"max_share": 0.5, "floor_share": 0.25},
    }
    config = arena_config(shm_path, 16 * MiB, prefault=False, reclaim_idle_s=0.1, pools=pools)
    cpu = CpuTier(config, registry)
    try:
        extents = cpu.memory.num_extents
        cap, floor = int(extents * 0.5), int(extents * 0.25)
        draft = registry.register(draft_spec(), 256 * KiB)
        draft_keys = keys_for(draft.namespace, cap * 8)  # 2 MiB extents of 8 chunks
        assert all(cpu.put(k, payload_for(k, draft.chunk_bytes)) for k in draft_keys)
        assert _extents(cpu, draft.chunk_bytes) == cap  # its share
        target = registry.register(target_spec(), 512 * KiB)
        target_keys = keys_for(target.namespace, extents * 4)

        def grown() -> bool:
            for key in target_keys:
                cpu.put(key, payload_for(key, target.chunk_bytes))
            return _extents(cpu, target.chunk_bytes) >= extents - floor

        _until(grown, "the target pool grew into the idle draft pool's extents")
        assert _extents(cpu, draft.chunk_bytes) == floor  # a quarter of the arena, kept
        assert sum(cpu.contains(draft_keys)) == floor * 8
    finally:
        cpu.close()


def test_idle_namespaces_and_slot_classes_expire_and_bounds_count_live_ones(
    shm_path: Path, tmp_path: Path, close_after: list[InProcessClient]
) -> None:
    config = _config(shm_path, tmp_path, arena_mib=16, max_slot_classes=2)
    config["server"] = {"namespace_idle_s": 0.2}
    client = _client(config)
    close_after.append(client)
    client.manager.registry.limit_namespaces(2)
    cpu = client.manager.cpu
    for model in range(21):
        spec = target_spec(model=f"m{model}")
        chunk = (256 + 64 * model) * KiB  # each model its own chunk size: its own class

        def registered(spec: NamespaceSpec = spec, chunk: int = chunk) -> bool:
            try:
                client.register_pool(spec, chunk)
            except CapacityError:
                return False
            return True

        _until(registered, f"model {model} registered after the others went idle")
        ns = client.register_pool(spec, chunk)
        _store_until(client, keys_for(ns, 4), 4, f"model {model}'s chunks stored")
        live = cpu.live_counts()
        assert live["slot_classes"] <= 2
        assert live["namespaces"] <= 2
    counts = cpu.stats().counters
    assert counts["slot_classes_expired"] >= 19
    _until(
        lambda: cpu.live_counts()["namespaces"] == 0 and cpu.live_counts()["slot_classes"] == 0,
        "every idle namespace and slot class expired",
    )


def test_a_namespace_an_open_session_registered_never_expires(
    shm_path: Path, tmp_path: Path, close_after: list[InProcessClient]
) -> None:
    config = _config(shm_path, tmp_path, arena_mib=16)
    config["server"] = {"namespace_idle_s": 0.05}
    client = _client(config)
    close_after.append(client)
    registry = client.manager.registry
    sessions = SessionRegistry(client.manager, timeout_s=60.0)
    session = sessions.open("r0", "engine", 0, 0)
    held = client.register_pool(target_spec(model="held"), 256 * KiB)
    session.namespaces.add(held)
    idle = client.register_pool(target_spec(model="idle"), 256 * KiB)
    _until(lambda: registry.get(idle) is not None and registry.live_count() == 1, "idle expired")
    assert registry.registrations()[0].namespace == held
    registry.expire_idle()
    assert registry.live_count() == 1  # still held
    (key,) = keys_for(idle, 1)
    assert _store(client, [key]) == 1  # a store of the expired namespace brings it back
    assert registry.live_count() == 2
    sessions.close_all()
    _until(lambda: registry.live_count() == 0, "both expired once nothing held them")


def test_extents_passed_between_classes_reuse_their_eviction_nodes(shm_path: Path) -> None:
    registry = PoolRegistry()
    cpu = CpuTier(arena_config(shm_path, 8 * MiB, prefault=False), registry)
    try:
        regs = [
            registry.register(target_spec(model=m), c)
            for m, c in (("a", 256 * KiB), ("b", 512 * KiB))
        ]
        for _ in range(20):
            for reg in regs:
                keys = keys_for(reg.namespace, cpu.memory.num_extents * 2 * MiB // reg.chunk_bytes)
                assert all(cpu.put(k, payload_for(k, reg.chunk_bytes)) for k in keys)
                assert cpu.delete(keys) == len(keys)  # every extent goes back
        assert cpu.live_counts()["free_extents"] == cpu.memory.num_extents
        for cls in cpu.slots.classes.values():
            built = len(cls.policy._next) - cls.policy.queues
            assert built == cpu.memory.num_extents * cls.per_extent, "nodes were not reused"
    finally:
        cpu.close()


def test_a_busy_pool_below_its_floor_takes_up_to_it_and_no_further(shm_path: Path) -> None:
    registry = PoolRegistry()
    pools = {"target": {"max_share": 1.0}, "draft": {"max_share": 0.5, "floor_share": 0.25}}
    config = arena_config(shm_path, 32 * MiB, prefault=False, reclaim_idle_s=3600, pools=pools)
    cpu = CpuTier(config, registry)
    try:
        floor = int(cpu.memory.num_extents * 0.25)
        target = registry.register(target_spec(), 512 * KiB)
        target_keys = keys_for(target.namespace, cpu.memory.num_extents * 4)
        assert all(cpu.put(k, payload_for(k, target.chunk_bytes)) for k in target_keys)
        assert cpu.live_counts()["free_extents"] == 0  # the target took every extent
        draft = registry.register(draft_spec(), 256 * KiB)
        draft_keys = keys_for(draft.namespace, 4 * floor * 8)
        for key in draft_keys:  # both pools busy: nothing is idle for an hour
            assert cpu.put(key, payload_for(key, draft.chunk_bytes))
        assert _extents(cpu, draft.chunk_bytes) == floor  # its floor, and no level with target
        assert _extents(cpu, target.chunk_bytes) == cpu.memory.num_extents - floor
    finally:
        cpu.close()


def test_the_owner_ignores_extent_words_a_client_writes(shm_path: Path) -> None:
    registry = PoolRegistry()
    cpu = CpuTier(arena_config(shm_path, 8 * MiB, prefault=False), registry)
    client = ArenaMemory.attach(shm_path)
    try:
        reg = registry.register(target_spec(), 256 * KiB)
        first, second = keys_for(reg.namespace, 2)
        assert cpu.put(first, payload_for(first, reg.chunk_bytes))
        client.extent_slot_bytes[:] = 64 * KiB  # a client's words: every extent cut smaller
        (ref,) = cpu.reserve([second])
        assert ref is not None
        assert ref.offset == client.data_offset + ref.slot * reg.chunk_bytes  # extent 0's slots
        cpu.view(ref)[:] = payload_for(second, reg.chunk_bytes)
        assert cpu.commit([ref]) == 1
        for key in (first, second):
            buf = bytearray(reg.chunk_bytes)
            assert cpu.read_into(key, memoryview(buf))
            assert bytes(buf) == payload_for(key, reg.chunk_bytes)
    finally:
        client.close()
        cpu.close()


def test_a_class_no_open_session_holds_lends_its_extents_at_once(
    shm_path: Path, tmp_path: Path, close_after: list[InProcessClient]
) -> None:
    # nothing goes idle within the test: only the ended session can free A's extents
    config = _config(shm_path, tmp_path, arena_mib=32, reclaim_idle_s=3600)
    client = _client(config)
    close_after.append(client)
    cpu = client.manager.cpu
    sessions = SessionRegistry(client.manager, timeout_s=60.0)
    first = sessions.open("r0", "engine-a", 0, 0)
    a = client.register_pool(target_spec(model="a"), 512 * KiB)
    first.namespaces.add(a)
    a_keys = keys_for(a, cpu.memory.num_extents * 8)
    assert _store(client, a_keys) == len(a_keys)  # A holds every extent
    # written back, so that only the session can stand between B and A's extents (dirty ones
    # are lent once written: test_dirty_chunks_taken_for_another_class_are_written_back_first)
    assert client.flush()
    sessions.discard(first)  # model A's engine goes away; its namespace is not yet expired
    assert client.manager.registry.get(a) in client.manager.registry.registrations()
    second = sessions.open("r0", "engine-b", 0, 0)
    b = client.register_pool(target_spec(model="b"), 1 * MiB)
    second.namespaces.add(b)
    want = (cpu.memory.num_extents - 1) * 4  # more than levelling with a busy A would give
    _hold_until(client, keys_for(b, cpu.memory.num_extents * 4), want, "B took A's extents")
    assert _extents(cpu, 1 * MiB) >= cpu.memory.num_extents - 1
    sessions.close_all()
