"""A lookup never waits on a slow object store longer than its budget."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.tiering.manager import TierManager
from tests.objstore.fixtures import StoreFactory
from tests.objstore.servers import FaultMode, FaultProxy, ServerProcess
from tests.support import keys_for, object_node_config, payload_for, target_spec

CHUNK = 256 << 10
BUDGET_MS = 50.0


def manager_on(url: str, root: Path) -> TierManager:
    config = object_node_config(root, url, lookup_budget_ms=BUDGET_MS, request_timeout_s=5.0)
    return TierManager(config)


@pytest.fixture
def managers(tmp_path: Path) -> Iterator[Callable[[str, str], TierManager]]:
    made: list[TierManager] = []

    def make(url: str, name: str) -> TierManager:
        manager = manager_on(url, tmp_path / name)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close(flush_timeout=5.0)
        manager.config.arena.path.unlink(missing_ok=True)


@pytest.mark.serial  # holds each lookup to its 50 ms budget plus 40 ms
def test_a_slow_store_costs_a_lookup_at_most_its_budget_and_asking_again_finds_the_chunks(
    managers: Callable[[str, str], TierManager],
    store_factory: StoreFactory,
    moto_server: ServerProcess,
    fault_proxy: Callable[[str], FaultProxy],
) -> None:
    proxy = fault_proxy(moto_server.url)
    url = store_factory("s3", endpoint=proxy.url)
    writer = managers(url, "writer")
    ns = writer.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 4)
    refs = [r for r in writer.reserve(keys, "r0") if r is not None]
    for ref in refs:
        writer.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    assert writer.commit(refs) == 4
    assert writer.flush()
    assert writer.flush_uploads(10.0)

    reader = managers(url, "reader")
    reader.register_pool(target_spec(), CHUNK)
    assert reader.object is not None
    assert reader.object.principal_resolved.wait(10)  # until then lookups do not probe
    # a first probe starts the download thread and botocore's first request, Python work that
    # can keep a lookup past its budget on a slow machine: done before the store slows down
    warm = keys_for(ns, 1, start=100)
    deadline = time.monotonic() + 10.0
    while reader.lookup(warm).pending:
        assert time.monotonic() < deadline, "the warm-up probe never ended"
        time.sleep(0.02)
    proxy.set_mode(FaultMode.DELAY, delay_ms=400)
    waits = []
    result = None
    for _ in range(40):
        started = time.monotonic()
        result = reader.lookup(keys)
        waits.append(time.monotonic() - started)
        if result.hits:
            break
        assert result.pending, "a probe in flight is reported, so the caller asks again"
        time.sleep(0.02)
    assert result is not None
    assert result.hits == 4
    assert result.tiers == ["lmdb"] * 4
    assert max(waits) < BUDGET_MS / 1000 + 0.04, waits
    assert len(waits) > 1, "the first lookup did not wait for the slow store"
