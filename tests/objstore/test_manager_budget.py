"""A lookup never waits on a slow object store longer than its budget."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvtier.tiering.manager import TierManager
from tests.objstore.fixtures import ObjectNodes, ProxiedStore
from tests.objstore.servers import FaultMode
from tests.support import keys_for, payload_for, target_spec

CHUNK = 256 << 10
BUDGET_MS = 50.0


@pytest.fixture
def managers(object_nodes: ObjectNodes) -> Callable[[str, str], TierManager]:
    def make(url: str, name: str) -> TierManager:
        return object_nodes(url, name, lookup_budget_ms=BUDGET_MS, request_timeout_s=5.0)

    return make


@pytest.mark.serial  # holds each lookup to its 50 ms budget plus 40 ms
def test_a_slow_store_costs_a_lookup_at_most_its_budget_and_asking_again_finds_the_chunks(
    managers: Callable[[str, str], TierManager], proxied_store: ProxiedStore
) -> None:
    url, proxy = proxied_store("s3")
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
