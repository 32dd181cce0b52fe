"""The contract every tier passes. A tier's test module subclasses `TierContract` and supplies
`make_tier`; capacity-dependent tests size themselves from `capacity_chunks`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import PayloadSizeError, UnknownPoolError
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.base import Tier
from tests.support import draft_spec, keys_for, payload_for, target_spec

CHUNK = 256 << 10
DRAFT_CHUNK = 64 << 10


class TierContract:
    capacity_chunks: int
    """About how many CHUNK-sized chunks the tier made by `make_tier` holds."""

    def make_tier(self, registry: PoolRegistry, root: Path) -> Tier:
        raise NotImplementedError  # supplied by each tier's test class

    @pytest.fixture
    def root(self, tmp_path: Path, shm_path: Path) -> Path:
        self.shm_path = shm_path
        return tmp_path

    @pytest.fixture
    def registry(self) -> PoolRegistry:
        return PoolRegistry()

    @pytest.fixture
    def tier(self, registry: PoolRegistry, root: Path) -> Iterator[Tier]:
        tier = self.make_tier(registry, root)
        yield tier
        tier.close()

    @pytest.fixture
    def ns(self, registry: PoolRegistry) -> bytes:
        return registry.register(target_spec(), CHUNK).namespace

    def _put(self, tier: Tier, key: ChunkKey, nbytes: int = CHUNK, replica: str = "r0") -> bool:
        return tier.put(key, payload_for(key, nbytes), replica)

    def _read(self, tier: Tier, key: ChunkKey, nbytes: int = CHUNK) -> bytes | None:
        dst = bytearray(nbytes)
        return bytes(dst) if tier.read_into(key, memoryview(dst)) else None

    # -- basic behaviour ------------------------------------------------------------------

    def test_put_then_read_returns_the_same_bytes(self, tier: Tier, ns: bytes) -> None:
        keys = keys_for(ns, 4)
        for key in keys:
            assert self._put(tier, key)
        assert tier.contains(keys) == [True] * 4
        for key in keys:
            assert self._read(tier, key) == payload_for(key, CHUNK)

    def test_miss_leaves_destination_untouched(self, tier: Tier, ns: bytes) -> None:
        dst = bytearray(b"\xab" * CHUNK)
        assert not tier.read_into(keys_for(ns, 1)[0], memoryview(dst))
        assert dst == bytearray(b"\xab" * CHUNK)
        assert tier.stats().counters["misses"] >= 1

    def test_put_is_idempotent(self, tier: Tier, ns: bytes) -> None:
        (key,) = keys_for(ns, 1)
        assert self._put(tier, key)
        assert self._put(tier, key)
        stats = tier.stats()
        assert stats.chunks == 1
        assert stats.counters["stores"] == 1

    def test_unknown_pool_is_refused_and_changes_nothing(self, tier: Tier) -> None:
        foreign = keys_for(target_spec(model="never-registered").digest(), 1)[0]
        with pytest.raises(UnknownPoolError, match="not registered"):
            self._put(tier, foreign)
        assert tier.stats().chunks == 0

    def test_wrong_payload_size_is_refused_and_changes_nothing(self, tier: Tier, ns: bytes) -> None:
        (key,) = keys_for(ns, 1)
        with pytest.raises(PayloadSizeError, match=f"{CHUNK - 1} bytes"):
            tier.put(key, b"x" * (CHUNK - 1))
        assert tier.contains([key]) == [False]
        assert tier.stats().chunks == 0

    def test_delete(self, tier: Tier, ns: bytes) -> None:
        keys = keys_for(ns, 3)
        for key in keys:
            self._put(tier, key)
        assert tier.delete(keys[:2]) == 2
        assert tier.contains(keys) == [False, False, True]
        assert self._read(tier, keys[0]) is None

    def test_pools_of_different_chunk_sizes_coexist(
        self, tier: Tier, ns: bytes, registry: PoolRegistry
    ) -> None:
        draft_ns = registry.register(draft_spec(), DRAFT_CHUNK).namespace
        (t,) = keys_for(ns, 1)
        (d,) = keys_for(draft_ns, 1)
        assert self._put(tier, t)
        assert self._put(tier, d, DRAFT_CHUNK)
        assert self._read(tier, d, DRAFT_CHUNK) == payload_for(d, DRAFT_CHUNK)
        pools = tier.stats().pools
        assert pools["target"].chunks == 1
        assert pools["draft"].chunks == 1
        assert pools["draft"].used_bytes < pools["target"].used_bytes

    # -- capacity -------------------------------------------------------------------------

    def test_eviction_keeps_recently_used_chunks(self, tier: Tier, ns: bytes) -> None:
        keys = keys_for(ns, self.capacity_chunks * 2)
        hot = keys[0]
        for key in keys:
            self._put(tier, key)
            assert self._read(tier, hot) is not None, "a recently read chunk was evicted"
        assert tier.contains([keys[1]]) == [False], "the least recently used chunk survived"
        assert tier.stats().used_bytes <= tier.stats().capacity_bytes

    def test_pinned_chunks_are_never_evicted(self, tier: Tier, ns: bytes) -> None:
        keys = keys_for(ns, self.capacity_chunks * 2)
        pinned = keys[:3]
        tier.pin(pinned)
        for key in keys:
            self._put(tier, key)
        assert tier.contains(pinned) == [True] * 3
        assert tier.evict() > 0
        assert tier.contains(pinned) == [True] * 3
        tier.unpin(pinned)
        tier.evict()
        assert tier.contains(pinned) == [False] * 3

    def test_admin_evict_filters(self, tier: Tier, ns: bytes, registry: PoolRegistry) -> None:
        draft_ns = registry.register(draft_spec(), DRAFT_CHUNK).namespace
        t_keys = keys_for(ns, 2)
        d_keys = keys_for(draft_ns, 2)
        for key in t_keys:
            self._put(tier, key, replica="r0")
        for key in d_keys:
            self._put(tier, key, DRAFT_CHUNK, replica="r1")
        assert tier.evict(pool="draft", replica="r0") == 0
        assert tier.evict(namespace=draft_ns) == 2
        assert tier.contains(d_keys + t_keys) == [False, False, True, True]
        assert tier.evict(replica="r0") == 2
        assert tier.stats().chunks == 0

    def test_stats_account_per_pool_and_replica(self, tier: Tier, ns: bytes) -> None:
        for i, key in enumerate(keys_for(ns, 4)):
            self._put(tier, key, replica=f"r{i % 2}")
        stats = tier.stats()
        assert stats.chunks == 4
        assert stats.replicas[("r0", "target")].chunks == 2
        assert stats.replicas[("r1", "target")].chunks == 2
        assert stats.pools["target"].used_bytes == stats.used_bytes >= 4 * CHUNK

    # -- persistence ----------------------------------------------------------------------

    def test_persistent_tiers_survive_reopen(
        self, tier: Tier, ns: bytes, registry: PoolRegistry, root: Path
    ) -> None:
        keys = keys_for(ns, 3)
        for key in keys:
            self._put(tier, key)
        tier.close()
        reopened = self.make_tier(registry, root)
        try:
            expected = [tier.persistent] * 3
            assert reopened.contains(keys) == expected
            if tier.persistent:
                assert self._read(reopened, keys[2]) == payload_for(keys[2], CHUNK)
        finally:
            reopened.close()
