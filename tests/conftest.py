"""Shared fixtures: small real arenas in /dev/shm, and processes a test starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiering.manager import TierManager
from kvtier.tiers.commit_checksums import ledger_path
from tests.integration.daemon_harness import Processes
from tests.support import arenas_of_this_process, manager_config, new_arena_path

# real object-store servers and identities (moto, the GCS emulator, fault proxy), for any test
pytest_plugins = ["tests.objstore.fixtures"]


ENGINE_DIRS = ("tests/e2e/", "tests/bench/")
"""Where tests start vLLM engines: minutes a file, against seconds elsewhere."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files that start engines first, those with a test marked slow before the rest. The suite
    runs by file over one worker per core (scripts/test.sh, xdist's own reordering off): a long
    file handed out last would run alone while the other workers sit idle."""

    def weight(item: pytest.Item) -> int:
        if item.get_closest_marker("slow") is not None:
            return 0
        return 1 if item.nodeid.startswith(ENGINE_DIRS) else 2

    per_file: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        per_file[path] = min(per_file.get(path, 2), weight(item))
    # a stable sort: each file's tests stay together, in their order
    items.sort(key=lambda item: per_file[item.nodeid.split("::", 1)[0]])


@pytest.fixture(scope="session", autouse=True)
def engine_caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM's and torch's compiled kernels, shared by every engine of the run."""
    from tests.e2e.conftest import use_engine_caches

    path = tmp_path_factory.mktemp("engine-caches")
    use_engine_caches(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """kvtier's default state directory (the admin token kvtierd writes, say) for this run and the
    processes it starts, never the user's own."""
    path = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def no_arena_left() -> Iterator[None]:
    """At the end of this process's run, the arenas its tests named (`new_arena_path`) and
    their ledgers go: some tests name one without this module's fixture, and a kvtierd that
    exits cleanly keeps its arena for the next start."""
    yield
    for path in arenas_of_this_process():
        path.unlink(missing_ok=True)


@pytest.fixture
def shm_path() -> Iterator[Path]:
    path = new_arena_path()
    yield path
    path.unlink(missing_ok=True)
    ledger_path(path).unlink(missing_ok=True)  # an owner killed in the test leaves it


@pytest.fixture
def manager(shm_path: Path, tmp_path: Path) -> Iterator[TierManager]:
    """A TierManager over a small arena and lmdb (`manager_config`), closed after the test."""
    m = TierManager(manager_config(shm_path, tmp_path))
    yield m
    m.close()


@pytest.fixture
def procs(tmp_path: Path, shm_path: Path) -> Iterator[Processes]:
    # depends on shm_path so that the arena is unlinked only after every process is gone
    logs = tmp_path / "logs"
    logs.mkdir()
    group = Processes(logs)
    yield group
    group.close()
