"""One engine's connectors share the tier manager of their arena (an arena has one owner)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.client import shared_embedded
from kvtier.core.errors import KVTierError
from kvtier.tiering.manager import TierManager
from tests.support import manager_config


def test_clients_of_one_arena_share_a_manager_closed_with_the_last(
    shm_path: Path, tmp_path: Path
) -> None:
    config = manager_config(shm_path, tmp_path)
    kv = shared_embedded(config, "dp0")
    encoder = shared_embedded(config, "dp0")
    assert kv.manager is encoder.manager
    with pytest.raises(KVTierError, match="in use"):
        TierManager(config)  # another owner of the same arena is refused, as before
    kv.close()
    kv.close()  # twice: still one user gone
    assert encoder.stats().tiers["cpu"].capacity_bytes > 0  # the other still serves
    encoder.close()
    again = shared_embedded(config, "dp0")  # closed with the last: the arena can be owned anew
    assert again.manager is not kv.manager
    again.close()
