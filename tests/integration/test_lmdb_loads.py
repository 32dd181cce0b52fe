"""Loads leased in lmdb: a real TierManager leases chunks lmdb holds without promoting them, keeps
them from eviction until released, and another process reads them byte-exact from lmdb's map
beside the manager's writer; a corrupt one is refused, never handed out. A process whose engines
shut down gives lmdb's environment back, and opens it again."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client import InProcessClient, reader_at, release_reader
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import in_lmdb
from kvtier.tiering.manager import TierManager
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.integration.test_manager import store
from tests.support import MiB, keys_for, lmdb_config, manager_config, payload_for, target_spec

CHUNK = 256 << 10


@pytest.fixture
def manager(shm_path: Path, tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(manager_config(shm_path, tmp_path, lmdb_mib=8))
    yield m
    m.close()


def _only_in_lmdb(m: TierManager, n: int) -> list[bytes]:
    ns = m.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, n)
    assert store(m, keys) == n
    assert m.flush()
    m.evict("cpu")
    assert m.cpu.contains(keys) == [False] * n
    return keys


_READ_ELSEWHERE = """
import sys
from kvtier.client import reader_at
from kvtier.core.keys import ChunkKey
reader = reader_at(sys.argv[1])
for key in sys.argv[2:]:
    buf = bytearray(int(262144))
    assert reader.read_into(ChunkKey(bytes.fromhex(key)), memoryview(buf)) is True
    sys.stdout.buffer.write(buf)
"""


def test_a_chunk_lmdb_holds_is_leased_there_and_read_byte_exact_by_another_process(
    manager: TierManager,
) -> None:
    keys = _only_in_lmdb(manager, 3)
    client = InProcessClient(manager, "r0")
    assert manager.lmdb is not None
    assert client.lmdb_path == manager.lmdb.config.path
    leases = client.lease(keys, in_lmdb=True)
    assert all(ref is not None and in_lmdb(ref) for ref in leases)
    assert [ref.nbytes for ref in leases if ref] == [CHUNK] * 3
    assert len({ref.generation for ref in leases if ref}) == 3  # each told apart
    counters = manager.stats().counters
    assert counters["promotions"] == 0
    assert manager.cpu.contains(keys) == [False] * 3  # no arena slot taken
    # this process reads through the manager's own environment, another opens it read-only
    buf = bytearray(CHUNK)
    assert reader_at(client.lmdb_path).read_into(keys[0], memoryview(buf)) is True
    assert bytes(buf) == payload_for(keys[0], CHUNK)
    out = subprocess.run(
        [sys.executable, "-c", _READ_ELSEWHERE, str(client.lmdb_path), *(k.hex() for k in keys)],
        capture_output=True,
        check=True,
    ).stdout
    assert out == b"".join(payload_for(k, CHUNK) for k in keys)
    client.release([ref for ref in leases if ref])
    assert len(manager.lmdb.loads) == 0


def test_without_in_lmdb_the_same_lease_promotes_into_the_arena(manager: TierManager) -> None:
    keys = _only_in_lmdb(manager, 2)
    leases = manager.lease(keys, "r0")
    assert all(ref is not None and not in_lmdb(ref) for ref in leases)
    assert manager.stats().counters["promotions"] == 2
    manager.release([ref for ref in leases if ref])


def test_chunks_leased_in_lmdb_are_kept_from_eviction_until_released(
    manager: TierManager,
) -> None:
    keys = _only_in_lmdb(manager, 4)
    assert manager.lmdb is not None
    leases = manager.lease(keys[:2], "r0", in_lmdb=True)
    ns = namespace_of(keys[0])

    def fill_past_the_budget(start: int) -> None:
        more = keys_for(ns, 36, start)  # 9 MiB more, past lmdb's 8 MiB
        for i in range(0, len(more), 6):
            assert store(manager, more[i : i + 6]) == 6
            assert manager.flush()

    fill_past_the_budget(100)
    in_lmdb_now = manager.lmdb.contains(keys)
    assert in_lmdb_now[:2] == [True, True]  # leased: passed over
    assert in_lmdb_now[2:] == [False, False]  # the oldest others went
    manager.release([ref for ref in leases if ref])
    fill_past_the_budget(200)
    assert manager.lmdb.contains(keys[:2]) == [False, False]  # released: evicted in turn


def test_a_corrupt_chunk_in_lmdb_is_refused_by_the_reader(manager: TierManager) -> None:
    keys = _only_in_lmdb(manager, 1)
    assert manager.lmdb is not None
    with manager.lmdb.env.begin(write=True, db=manager.lmdb.store.chunks) as txn:
        value = bytearray(txn.get(keys[0]))
        value[-1] ^= 0x40
        txn.put(keys[0], bytes(value))
    (lease,) = manager.lease(keys, "r0", in_lmdb=True)
    assert lease is not None
    outcome = reader_at(manager.lmdb.config.path).read_into(keys[0], memoryview(bytearray(CHUNK)))
    assert isinstance(outcome, ChunkFormatError)
    manager.release([lease])


def test_a_key_lmdb_does_not_hold_is_not_leased_there(manager: TierManager) -> None:
    keys = _only_in_lmdb(manager, 1)
    absent = keys_for(namespace_of(keys[0]), 1, 50)
    assert manager.lease(absent, "r0", in_lmdb=True) == [None]
    assert manager.lmdb is not None
    assert len(manager.lmdb.loads) == 0


def test_a_process_that_gives_its_reader_back_opens_lmdb_again_past_max_readers(
    tmp_path: Path,
) -> None:
    registry = PoolRegistry()
    namespace = registry.register(target_spec(), CHUNK).namespace
    config = lmdb_config(tmp_path / "lmdb", 8 * MiB, max_readers=2)
    dst = memoryview(bytearray(CHUNK))
    for key in keys_for(namespace, 3 * config.max_readers):
        tier = LmdbTier(config, registry)  # the tiers in this process (an embedded engine)
        assert tier.put(key, payload_for(key, CHUNK))
        tier.close()
        for _ in range(2):  # two engines of the process share one environment
            assert reader_at(config.path).read_into(key, dst) is True
        assert bytes(dst) == payload_for(key, CHUNK)
        release_reader(config.path)
        release_reader(config.path)  # the last engine shut down: closed


def test_an_engine_shut_down_closes_lmdb_so_the_process_opens_it_again(tmp_path: Path) -> None:
    from kvtier_vllm.kv.metadata import ChunkCopy
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker
    from kvtier_vllm.shared.settings import ConnectorConfig

    registry = PoolRegistry()
    namespace = registry.register(target_spec(), CHUNK).namespace
    config = lmdb_config(tmp_path / "lmdb", 8 * MiB, max_readers=2)
    for key in keys_for(namespace, 3 * config.max_readers):
        tier = LmdbTier(config, registry)  # raises where an engine left it open here
        assert tier.put(key, payload_for(key, CHUNK))
        tier.close()
        worker = KVTierWorker(None, ConnectorConfig())
        job = ChunkCopy("target", 0, 0, 0, (0,), key=key)
        chunk = worker.staging.stage(str(config.path), job, CHUNK)
        assert chunk is not None
        assert bytes(chunk.numpy()) == payload_for(key, CHUNK)
        worker.shutdown()
