from __future__ import annotations

from pathlib import Path

from kvtier.core.pools import PoolRegistry
from kvtier.tiers.cpu import CpuTier
from tests.contract.tier_contract import TierContract
from tests.support import MiB, arena_config


class TestCpuTierContract(TierContract):
    capacity_chunks = 56  # 7 extents of 2 MiB, 8 slots of 256 KiB each

    def make_tier(self, registry: PoolRegistry, root: Path) -> CpuTier:
        return CpuTier(arena_config(self.shm_path, 16 * MiB), registry)
