"""A chunk whose arena bytes change after its commit is never written back to lmdb: the lmdb tier's
check, the TierManager in process (write-back, write-through, a leased chunk) and a real kvtierd
(admin drain, SIGTERM drain)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest

from kvtier.core import blockfmt
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import SlotRef
from kvtier.rpc import GrpcTierClient
from kvtier.tiering.manager import TierManager
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.integration.daemon_harness import (
    CHUNK,
    DaemonFiles,
    Processes,
    RunningDaemon,
    expected,
    key_of,
)
from tests.support import keys_for, lmdb_config, manager_config, payload_for, target_spec

EXIT_TIMEOUT_S = 10.0
CHANGED = b"\xa5"  # what a late or hostile writer leaves in a committed slot


def _without_commit_checksum(config: KVTierConfig) -> KVTierConfig:
    arena = config.arena.model_copy(update={"commit_checksum": False})
    return config.model_copy(update={"arena": arena})


def _wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def _overwrite(arena: ArenaMemory, ref: SlotRef) -> None:
    arena.view(ref.offset, ref.nbytes)[:] = CHANGED * ref.nbytes


# -- LmdbTier: the encoder's checksum against the one given ----------------------------------


def test_lmdb_stores_only_payloads_that_still_match_their_checksum(tmp_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    keys = keys_for(ns, 3)
    tier = LmdbTier(lmdb_config(tmp_path / "lmdb"), registry)
    try:
        payloads = [payload_for(k, CHUNK) for k in keys]
        taken = [blockfmt.payload_checksum(p) for p in payloads]
        payloads[1] = CHANGED * CHUNK
        stored, changed = tier.put_many_checked(
            [
                (keys[0], payloads[0], taken[0]),
                (keys[1], payloads[1], taken[1]),
                (keys[2], payloads[2], None),
            ]
        )
        assert (stored, changed) == ([True, False, True], [keys[1]])
        assert tier.contains(keys) == [True, False, True]
        counters = tier.stats().counters
        assert (counters["stores"], counters["store_rejected"]) == (2, 0)
    finally:
        tier.close()


# -- TierManager, in process -------------------------------------------------------------------


@pytest.fixture
def hostile(shm_path: Path) -> Iterator[Callable[[], ArenaMemory]]:
    """Another mapping of the arena file, as a client process has."""
    opened: list[ArenaMemory] = []

    def attach() -> ArenaMemory:
        opened.append(ArenaMemory.attach(shm_path))
        return opened[-1]

    yield attach
    for arena in opened:
        arena.close()


def _store_and_change(
    m: TierManager, arena: ArenaMemory, keys: list[ChunkKey], victim: int
) -> list[SlotRef]:
    refs = [r for r in m.reserve(keys, "r0") if r is not None]
    assert len(refs) == len(keys)
    for ref in refs:
        m.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    hashed = m.cpu.stats().counters["commit_checksums"]
    assert m.commit(refs) == len(refs)
    if m.cpu.config.commit_checksum:
        _hashed(lambda: m.cpu.stats().counters["commit_checksums"], hashed + len(refs))
    _overwrite(arena, refs[victim])
    return refs


def _hashed(taken: Callable[[], int], count: int) -> None:
    """Commits are hashed by a thread of the tier's owner: wait until it took ``count``, so the
    change below comes after the hash, as a late or hostile write does."""
    _wait_for(lambda: taken() >= count, 10.0, "commit checksums taken")


def _written_back(m: TierManager, mode: str) -> None:
    if mode == "write_back":
        assert m.flush()
    else:  # the write-back thread writes every commit at once
        _wait_for(lambda: m.cpu.writeback_pending() == 0, 10.0, "write-through done")


def _served_intact(m: TierManager, keys: list[ChunkKey]) -> list[bool]:
    """Per key: whether a load gives exactly its stored bytes (False also for a miss)."""
    leases = m.lease(keys, "r1")
    try:
        return [
            lease is not None and bytes(m.cpu.view(lease)) == payload_for(key, CHUNK)
            for key, lease in zip(keys, leases, strict=True)
        ]
    finally:
        m.release([lease for lease in leases if lease is not None])


@pytest.mark.parametrize("mode", ["write_back", "write_through"])
def test_a_chunk_changed_after_commit_is_dropped_not_written_to_lmdb(
    shm_path: Path,
    tmp_path: Path,
    hostile: Callable[[], ArenaMemory],
    mode: str,
) -> None:
    config = manager_config(shm_path, tmp_path, demote_mode=mode)
    m = TierManager(config)
    try:
        ns = m.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 4)
        assert m.lmdb is not None
        # write-through starts writing at the commit: hold lmdb writes off until the change
        with m.lmdb.store.lock:
            _store_and_change(m, hostile(), keys, victim=1)
        _written_back(m, mode)

        assert m.cpu.stats().counters["corrupt"] == 1
        assert m.cpu.stats().counters["writeback_ok"] == 3
        assert m.lmdb.contains(keys) == [True, False, True, True]
        assert m.cpu.contains(keys) == [True, False, True, True]
        assert m.lookup(keys).hits == 1
        assert m.lease(keys[1:2], "r1") == [None]
        assert m.lmdb.stats().counters["store_rejected"] == 0  # not counted as want of room
    finally:
        m.close()

    m = TierManager(config)  # a restart: only lmdb holds anything
    try:
        m.register_pool(target_spec(), CHUNK)
        assert m.lookup(keys).hits == 1
        assert m.lookup(keys[2:]).tiers == ["lmdb", "lmdb"]
        assert _served_intact(m, keys) == [True, False, True, True]
    finally:
        m.close()


def test_a_leased_changed_chunk_leaves_lookups_at_once_and_its_slot_when_released(
    shm_path: Path, tmp_path: Path, hostile: Callable[[], ArenaMemory]
) -> None:
    m = TierManager(manager_config(shm_path, tmp_path))
    try:
        ns = m.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 3)
        _store_and_change(m, hostile(), keys, victim=0)
        (lease,) = m.lease(keys[:1], "r1")
        assert lease is not None
        assert m.flush()

        assert m.cpu.stats().counters["corrupt"] == 1
        assert m.lookup(keys).hits == 0
        assert m.lease(keys[:1], "r2") == [None]
        # the holder's slot stays put until it lets go: what it reads is what is there
        assert m.cpu.memory.is_current(lease.slot, lease.generation)
        assert bytes(m.cpu.view(lease)) == CHANGED * CHUNK
        m.release([lease])
        assert not m.cpu.memory.is_current(lease.slot, lease.generation)
        assert m.cpu.stats().pools["target"].chunks == 2
        # stored again, it is a new chunk: committed, checked and written back like any other
        again = m.reserve(keys[:1], "r0")[0]
        assert again is not None
        m.cpu.view(again)[:] = payload_for(again.key, again.nbytes)
        assert m.commit([again]) == 1
        assert m.flush()
        assert m.lmdb is not None
        assert m.lmdb.contains(keys) == [True, True, True]
    finally:
        m.close()


def test_with_commit_checksum_off_changed_bytes_are_written_back(
    shm_path: Path, tmp_path: Path, hostile: Callable[[], ArenaMemory]
) -> None:
    """What the switch gives up: lmdb checksums whatever the arena holds at write-back."""
    m = TierManager(_without_commit_checksum(manager_config(shm_path, tmp_path)))
    try:
        ns = m.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 2)
        _store_and_change(m, hostile(), keys, victim=1)
        assert m.flush()
        m.evict("cpu")
        assert m.cpu.stats().counters["corrupt"] == 0
        (lease,) = m.lease(keys[1:], "r1")
        assert lease is not None
        assert bytes(m.cpu.view(lease)) == CHANGED * CHUNK
        m.release([lease])
    finally:
        m.close()


# -- kvtierd, a process of its own -------------------------------------------------------------


def _integrity_failures(daemon: RunningDaemon, tier: str) -> float:
    """The tier's chunks that failed verification, in the target pool (all these tests use)."""
    found = [
        value
        for name, labels, value in daemon.metrics()
        if name == "kvtier_integrity_failures_total" and labels == {"tier": tier, "pool": "target"}
    ]
    assert len(found) == 1, found
    return found[0]


def _store_and_change_over_rpc(
    daemon: RunningDaemon,
    client: GrpcTierClient,
    arena: ArenaMemory,
    indices: range,
    victim: int,
) -> None:
    """Store chunks as an engine worker does, then write other bytes into one committed slot
    through this client's own mapping."""

    def taken() -> int:
        return next(t for t in daemon.stats().tiers if t.tier == "cpu").counters["commit_checksums"]

    hashed = taken()
    refs = client.reserve([key_of(i) for i in indices])
    held = [ref for ref in refs if ref is not None]
    assert len(held) == len(indices)
    for ref in held:
        arena.view(ref.offset, ref.nbytes)[:] = expected(ref.key)
    assert client.commit(held) == len(held)
    _hashed(taken, hashed + len(held))
    (changed,) = [ref for ref in held if ref.key == key_of(victim)]
    _overwrite(arena, changed)


def test_daemon_drops_a_chunk_a_client_changed_after_commit_and_serves_the_rest(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    assert _integrity_failures(daemon, "cpu") == 0
    client = GrpcTierClient(files.socket, "dp0")
    client.register_pool(target_spec(), CHUNK)
    arena = ArenaMemory.attach(client.arena_path)
    try:
        _store_and_change_over_rpc(daemon, client, arena, range(0, 6), victim=2)
        with closing(daemon.admin()) as admin:
            drained = admin.drain(20.0)
        assert drained.complete
        assert _integrity_failures(daemon, "cpu") == 1
        cpu = next(t for t in daemon.stats().tiers if t.tier == "cpu")
        assert cpu.counters["corrupt"] == 1
        assert client.lookup([key_of(i) for i in range(6)]).hits == 2
        assert client.lookup([key_of(2)]).hits == 0

        # the same, found by the write-back of the SIGTERM drain
        _store_and_change_over_rpc(daemon, client, arena, range(6, 9), victim=7)
    finally:
        arena.close()
        client.close()
    assert daemon.signal_and_wait(signal.SIGTERM, EXIT_TIMEOUT_S) == 0, daemon.log_text()
    logged = [line for line in daemon.log_text().splitlines() if "changed after it was" in line]
    assert len(logged) == 2, logged  # once each
    for line, victim in zip(logged, (2, 7), strict=True):
        assert key_of(victim).hex() in line

    daemon = procs.start_daemon(files)
    lmdb = next(t for t in daemon.stats().tiers if t.tier == "lmdb")
    assert lmdb.usage.chunks == 7
    found = procs.check(files.socket, end=9)
    assert found == {"present": [0, 1, 3, 4, 5, 6, 8], "mismatched": [], "not_leased": []}
    assert _integrity_failures(daemon, "lmdb") == 0
