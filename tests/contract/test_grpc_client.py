"""The client contract on `GrpcTierClient`, against kvtierd in a process of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest

from kvtier.core.errors import PermissionDeniedError
from kvtier.rpc import GrpcTierClient
from tests.contract.client_contract import CHUNK, ClientContract, Connect, Foreign, unregistered
from tests.integration.daemon_harness import Processes, RunningDaemon, write_config
from tests.support import target_spec


class TestGrpcClient(ClientContract):
    @pytest.fixture
    def daemon(self, procs: Processes, tmp_path: Path, shm_path: Path) -> RunningDaemon:
        return procs.start_daemon(write_config(tmp_path, shm_path))

    @pytest.fixture
    def connect(self, daemon: RunningDaemon) -> Iterator[Connect]:
        clients: list[GrpcTierClient] = []

        def connect(replica: str) -> GrpcTierClient:
            clients.append(GrpcTierClient(daemon.files.socket, replica, timeout_s=10.0))
            return clients[-1]

        yield connect
        for client in clients:
            client.close()

    @pytest.fixture
    def evict_arena(self, daemon: RunningDaemon) -> Callable[[], None]:
        def evict() -> None:
            with closing(daemon.admin()) as admin:
                admin.evict(tier="cpu")

        return evict

    @pytest.fixture(params=["unregistered", "another-session"])
    def foreign(self, request: pytest.FixtureRequest, connect: Connect) -> Foreign:
        if request.param == "unregistered":
            return unregistered()
        theirs = connect("r1").register_pool(target_spec(model="theirs"), CHUNK)
        return theirs, PermissionDeniedError  # the client form of PERMISSION_DENIED
