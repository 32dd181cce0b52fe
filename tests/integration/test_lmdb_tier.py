"""lmdb-specific behaviour beyond the shared tier contract."""

from __future__ import annotations

from pathlib import Path

from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import MiB, keys_for, lmdb_config, payload_for, target_spec

CHUNK = 256 << 10


def _tier(root: Path, registry: PoolRegistry) -> LmdbTier:
    return LmdbTier(lmdb_config(root / "lmdb", 4 * MiB), registry)


def test_put_many_never_reports_a_chunk_it_evicted_as_stored(tmp_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    tier = _tier(tmp_path, registry)
    try:
        keys = keys_for(ns, 30)
        for key in keys[:14]:  # up to the high-water mark
            assert tier.put(key, payload_for(key, CHUNK))
        batch = [keys[0], *keys[14:18]]  # the oldest key, and new ones that evict it
        results = tier.put_many([(k, payload_for(k, CHUNK)) for k in batch])
        assert results == tier.contains(batch)
        dst = memoryview(bytearray(CHUNK))
        for key, stored in zip(batch, results, strict=True):
            assert tier.read_into(key, dst) == stored
    finally:
        tier.close()


def test_a_pin_taken_before_the_chunk_exists_survives_reopen(tmp_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    keys = keys_for(ns, 60)
    tier = _tier(tmp_path, registry)
    tier.pin(keys[:1])
    tier.close()
    tier = _tier(tmp_path, registry)
    try:
        for key in keys:
            tier.put(key, payload_for(key, CHUNK))
        assert tier.contains(keys[:2]) == [True, False]
    finally:
        tier.close()


def test_recency_survives_reopen(tmp_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    keys = keys_for(ns, 40)
    tier = _tier(tmp_path, registry)
    for key in keys[:10]:
        tier.put(key, payload_for(key, CHUNK))
    assert tier.read_into(keys[0], memoryview(bytearray(CHUNK)))  # keys[0] is now the youngest
    tier.close()
    tier = _tier(tmp_path, registry)
    try:
        for key in keys[10:16]:
            tier.put(key, payload_for(key, CHUNK))
        assert tier.contains(keys[:2]) == [True, False]
    finally:
        tier.close()
