from __future__ import annotations

from pathlib import Path

from kvtier.config import ObjectStoreConfig
from kvtier.pools import PoolRegistry
from kvtier.tiers.objstore.tier import ObjectTier
from tests.contract.tier_contract import TierContract
from tests.support import MiB


def object_config(url: str, index: Path, **overrides: object) -> ObjectStoreConfig:
    fields: dict[str, object] = {
        "url": url,
        "index_path": index,
        "index_map_bytes": 64 * MiB,
        "retries": 1,
        "backoff_s": 0.01,
        "request_timeout_s": 5.0,
    }
    fields.update(overrides)
    return ObjectStoreConfig.model_validate(fields)


class TestObjectTierContractFile(TierContract):
    capacity_chunks = 15  # 4 MiB budget of 256 KiB chunks plus headers

    def make_tier(self, registry: PoolRegistry, root: Path) -> ObjectTier:
        config = object_config(f"file://{root}/bucket", root / "objindex", budget_bytes=4 * MiB)
        return ObjectTier(config, registry)
