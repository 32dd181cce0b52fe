"""One live stack (kvtierd under load, Prometheus, a vLLM stand-in) shared by this directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.daemon_harness import Processes
from tests.operability.stack import Stack, start
from tests.support import new_arena_path


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("operability")
    arena = new_arena_path()
    (directory / "logs").mkdir()
    procs = Processes(directory / "logs")
    live = vllm = None
    try:
        live, vllm = start(directory, arena, procs)
        yield live
    finally:
        try:
            if live is not None:
                live.load.stop()
                live.prometheus.close()
            if vllm is not None:
                vllm.shutdown()
                vllm.server_close()
        finally:
            procs.close()
            arena.unlink(missing_ok=True)
