"""The connector's draft-swap logic without an engine: fingerprints, the scheduler's view of the
draft pool, the worker's check, acceptance accounting and the metrics vLLM exports."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from kvtier_vllm.drafts.swaps import (
    AcceptanceMeter,
    DraftTracker,
    DraftWatch,
    Fill,
    fingerprint,
    lease_draft,
)
from kvtier_vllm.kv.connector_stats import KVTierPromMetrics, KVTierStats
from kvtier_vllm.shared.settings import FillPolicy
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.client import InProcessClient
from kvtier.core.errors import TierUnavailableError
from kvtier.core.keys import NamespaceSpec, make_key, namespace_of
from kvtier.core.protocol import DraftState
from kvtier.tiering.manager import TierManager
from tests.support import draft_spec, manager_config


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def test_fingerprint_follows_the_weights() -> None:
    m = model()
    before = fingerprint(m)
    assert fingerprint(m) == before
    assert fingerprint(model()) == before  # same weights, another instance
    with torch.no_grad():
        m[0].weight.add_(torch.randn_like(m[0].weight) * 1e-3)
    assert fingerprint(m) != before
    assert fingerprint(model(1)) != before


class Registry:
    """Stands in for kvtier: a namespace per spec, and the specs registered."""

    def __init__(self, fail: bool = False) -> None:
        self.specs: list[NamespaceSpec] = []
        self.fail = fail

    def __call__(self, spec: NamespaceSpec) -> bytes:
        if self.fail:
            raise TierUnavailableError("kvtierd is gone")
        self.specs.append(spec)
        return spec.digest()


def tracker(policy: FillPolicy = FillPolicy.PREVIOUS) -> tuple[DraftTracker, Registry]:
    registry = Registry()
    t = DraftTracker(draft_spec(), registry, policy, check_steps=4)
    t.namespace = registry(draft_spec())
    return t, registry


def test_a_changed_fingerprint_is_a_swap_and_the_old_weights_come_back_by_name() -> None:
    t, registry = tracker()
    original = t.namespace
    assert t.check_due()  # the first step fingerprints
    assert [t.check_due() for _ in range(4)] == [False, False, False, True]
    t.reported({0: "a", 1: "b"})
    assert t.bound == {0: "a", 1: "b"}
    assert t.active
    assert t.fill_sources() == []  # no previous revision yet
    t.reported({0: "a", 1: "b"})
    assert t.swaps == []

    t.reported({0: "c", 1: "b"})  # one shard's weights changed
    assert t.swaps == ["fingerprint"]
    assert t.revision.startswith("d1+fp-")
    assert registry.specs[-1] == draft_spec(draft_revision=t.revision)
    assert t.namespace == registry.specs[-1].digest() != original
    assert t.previous == original
    assert t.fill_sources() == [original]
    assert t.local_cache_stale

    t.reported({0: "a", 1: "b"})  # swapped back: the original revision, not a new name
    assert (t.revision, t.namespace) == ("d1", original)
    assert t.swaps == ["fingerprint", "fingerprint"]
    swapped = t.previous
    t.reset()
    assert not t.local_cache_stale
    assert not t.active  # reset_cache: draft chunks wait for a fresh fingerprint
    # the weights may be either revision now: both are fills, never current
    assert t.fill_sources() == [original, swapped]
    assert t.check_due()
    t.reported({0: "a", 1: "b"})
    assert t.active


def test_an_admin_swap_pauses_draft_chunks_then_names_the_revision() -> None:
    t, registry = tracker()
    lineage = draft_spec().draft_lineage()
    t.reported({0: "a"})
    t.follow({lineage: DraftState("d1", False, 0)})
    t.follow({b"another": DraftState("x", True, 9)})  # another draft pool's swap
    assert t.active
    t.follow({lineage: DraftState("d1", True, 1)})
    assert not t.active
    # during the swap, the revision in use so far is only a fill, never loaded as current
    assert t.fill_sources() == [t.namespace]
    t.reported({0: "new"})  # vLLM updated the weights: kvtier's commit names them
    assert t.swaps == []
    t.follow({lineage: DraftState("d2", False, 2)})
    assert t.active
    assert (t.revision, t.swaps) == ("d2", ["admin"])
    assert t.namespace == draft_spec(draft_revision="d2").digest()
    assert t.bound == {}
    assert t.check_due()
    t.reported({0: "new"})  # binds d2 to these weights
    assert t.bound == {0: "new"}
    t.follow({lineage: DraftState("d2", False, 2)})
    assert t.swaps == ["admin"]
    assert len(registry.specs) == 2


def test_zeros_policy_never_reads_another_revision_and_a_failed_register_disables() -> None:
    t, _ = tracker(FillPolicy.ZEROS)
    t.reported({0: "a"})
    t.reported({0: "b"})
    assert t.previous is not None
    assert t.fill_sources() == []
    broken = DraftTracker(draft_spec(), Registry(fail=True), FillPolicy.PREVIOUS)
    broken.namespace = b"n" * 16
    broken.reported({0: "a"})
    broken.reported({0: "b"})
    assert broken.namespace is None
    assert not broken.active


def test_the_worker_checks_before_moving_draft_chunks_and_counts_what_it_could_not() -> None:
    m = model()
    watch = DraftWatch(lambda: m, rank=0, on_transfers=True)
    ok, taken = watch.check(asked=True, moves=False, expected={})
    assert ok
    assert taken == fingerprint(m)
    assert watch.check(asked=False, moves=False, expected={0: taken}) == (True, "")
    with torch.no_grad():
        m[1].bias.add_(1.0)
    ok, now = watch.check(asked=False, moves=True, expected={0: taken})
    assert not ok
    assert now != taken
    assert watch.stale_after(ok) == 0

    # checks on transfers off: loads between checks are counted as possibly stale
    lax = DraftWatch(lambda: m, rank=0, on_transfers=False)
    assert lax.check(asked=False, moves=True, expected={0: now}) == (True, "")
    lax.unverified += 3
    with torch.no_grad():
        m[1].bias.add_(1.0)
    ok, _ = lax.check(asked=True, moves=False, expected={0: now})
    assert not ok
    assert lax.stale_after(ok) == 3
    assert lax.stale_after(True) == 0
    assert DraftWatch(None, 0, True).check(True, True, {0: now}) == (True, "unknown")
    assert DraftWatch(None, 0, True).check(False, True, {0: now}) == (True, "")


def test_acceptance_is_computed_from_the_advance_of_computed_tokens() -> None:
    meter = AcceptanceMeter()
    meter.scheduled("r", computed=100, drafted=3, revision="d1", fill="previous")
    assert meter.progressed("r", 103) == ("d1", "previous", 3, 2)
    assert meter.progressed("r", 110) is None
    meter.scheduled("r", computed=103, drafted=3, revision="d1", fill="none")
    assert meter.progressed("r", 107) == ("d1", "none", 3, 3)
    meter.scheduled("r", computed=107, drafted=3, revision="d2", fill="none")
    assert meter.progressed("r", 50) == ("d2", "none", 3, 0)  # preempted: rolled back
    meter.scheduled("r", computed=1, drafted=0, revision="d2", fill="none")
    assert meter.progressed("r", 2) is None
    meter.scheduled("q", computed=1, drafted=2, revision="d2", fill="none")
    meter.forget("q")
    assert meter.progressed("q", 4) is None


def test_draft_stats_reach_vllms_metrics() -> None:
    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    prom = KVTierPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name"], {0: ["m"]}
    )
    stats = KVTierStats()
    stats.record("load", "target", 1024, 0.001, True)
    stats.spec("d1", "none", 6, 6)
    stats.spec("d1", "previous", 6, 3)
    stats.fill("previous", 2)
    stats.swap("admin")
    stats.revision("d1")
    assert stats.reduce()["kvtier_acceptance"] == 0.75
    prom.observe(stats.data)
    later = KVTierStats()
    later.revision("d2")
    later.stale(0)
    prom.observe(later.data)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    spec = "vllm:kvtier_spec_accepted_tokens_total"
    assert value(spec, draft_revision="d1", fill="previous") == 3
    assert value("vllm:kvtier_spec_drafted_tokens_total", draft_revision="d1", fill="none") == 6
    assert value("vllm:kvtier_draft_fill_chunks_total", policy="previous") == 2
    assert value("vllm:kvtier_draft_swaps_total", source="admin") == 1
    assert value("vllm:kvtier_draft_revision_info", draft_revision="d1") == 0
    assert value("vllm:kvtier_draft_revision_info", draft_revision="d2") == 1
    assert value("vllm:kvtier_stale_draft_chunks_served_total") == 0
    assert value("vllm:kvtier_transfer_bytes_total", direction="load", pool="target") == 1024


def test_revision_labels_are_bounded() -> None:
    revisions = 20
    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, [], {0: []})
    for i in range(revisions):
        stats = KVTierStats()
        stats.spec(f"r{i}", "none", 1, 1)
        prom.observe(stats.data)
    assert registry.get_sample_value(
        "vllm:kvtier_spec_drafted_tokens_total", {"draft_revision": "other", "fill": "none"}
    ) == (revisions - 16)


def test_draft_leases_come_from_the_current_revision_else_the_fill_source(
    shm_path: Path, tmp_path: Path
) -> None:
    manager = TierManager(manager_config(shm_path, tmp_path))
    client = InProcessClient(manager, "dp0")
    try:
        chunk = 64 << 10
        hashes = [bytes([i]) * 32 for i in range(3)]

        def store(namespace: bytes, which: list[bytes]) -> None:
            keys = [make_key(namespace, h) for h in which]
            refs = [r for r in client.reserve(keys) if r is not None]
            assert client.commit(refs) == len(which)

        def register(spec: NamespaceSpec) -> bytes:
            return client.register_pool(spec, chunk)

        t = DraftTracker(draft_spec(), register, FillPolicy.PREVIOUS)
        t.namespace = register(draft_spec())
        old = t.namespace
        store(old, hashes)
        t.reported({0: "a"})
        refs, fill, back = lease_draft(client, t, hashes)
        assert (fill, back) == (Fill.NONE, [])
        assert refs is not None
        assert {namespace_of(r.key) for r in refs} == {old}
        client.release(refs)

        t.reported({0: "b"})  # swapped: the new revision has nothing yet
        refs, fill, back = lease_draft(client, t, hashes)
        assert fill is Fill.PREVIOUS
        assert refs is not None
        assert {namespace_of(r.key) for r in refs} == {old}
        client.release(refs)
        assert t.namespace is not None
        store(t.namespace, hashes[:2])  # only part of the prefix: all or nothing
        refs, fill, back = lease_draft(client, t, hashes)
        assert fill is Fill.PREVIOUS
        assert len(back) == 2
        assert refs is not None
        client.release(refs + back)
        store(t.namespace, hashes[2:])
        refs, fill, _ = lease_draft(client, t, hashes)
        assert fill is Fill.NONE
        assert refs is not None
        assert {namespace_of(r.key) for r in refs} == {t.namespace}
        client.release(refs)

        t.reset()  # weights maybe in flux: the current revision only as a fill
        refs, fill, _ = lease_draft(client, t, hashes)
        assert fill is Fill.PREVIOUS
        assert refs is not None
        client.release(refs)
        t.policy = FillPolicy.ZEROS
        assert lease_draft(client, t, hashes)[:2] == (None, Fill.ZEROS)
    finally:
        client.close()
