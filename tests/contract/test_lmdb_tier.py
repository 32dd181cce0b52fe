from __future__ import annotations

from pathlib import Path

from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.contract.tier_contract import TierContract
from tests.support import MiB, lmdb_config


class TestLmdbTierContract(TierContract):
    capacity_chunks = 15  # 4 MiB budget, 95% high-water, 256 KiB chunks plus headers

    def make_tier(self, registry: PoolRegistry, root: Path) -> LmdbTier:
        return LmdbTier(lmdb_config(root / "lmdb", 4 * MiB), registry)
