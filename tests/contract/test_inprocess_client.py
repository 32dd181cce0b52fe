"""The client contract on `InProcessClient`: the tiers in this process (embedded mode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.client import InProcessClient
from kvtier.tiering.manager import TierManager
from tests.contract.client_contract import ClientContract, Connect, Foreign, unregistered
from tests.support import manager_config


class TestInProcessClient(ClientContract):
    @pytest.fixture
    def manager(self, shm_path: Path, tmp_path: Path) -> Iterator[TierManager]:
        manager = TierManager(manager_config(shm_path, tmp_path))
        yield manager
        manager.close()  # the clients' close would close it once per client

    @pytest.fixture
    def connect(self, manager: TierManager) -> Connect:
        return lambda replica: InProcessClient(manager, replica)

    @pytest.fixture
    def evict_arena(self, manager: TierManager) -> Callable[[], None]:
        return lambda: manager.evict(tier="cpu") and None

    @pytest.fixture
    def foreign(self) -> Foreign:
        return unregistered()  # one process, one trust domain: only registration counts
