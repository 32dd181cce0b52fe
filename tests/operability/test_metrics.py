"""The metric set: declared once, documented in the reference pages, exported as declared."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.keys import NAMESPACE_BYTES
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import LookupResult
from kvtier.observability.metric_specs import METRICS
from kvtier.observability.telemetry import MAX_REPLICAS, OTHER, Telemetry
from tests.operability.stack import Stack
from tests.support import draft_spec, keys_for, target_spec

ROOT = Path(__file__).resolve().parents[2]
LABELS = {
    "tier": {"cpu", "lmdb", "object"},
    "pool": {"target", "draft", "hidden", "encoder", "state"},
    "op": {"lookup", "reserve", "commit", "abort", "prefetch", "release", "promote"},
    "result": {"ok", "error", "credential", "rejected", "invalid"}
    | {"confirmed", "refused", "gone", "foreign", "unchecked"},
    "direction": {"store", "load", "demote", "promote", "upload", "download"},
    "reason": {"capacity", "quota", "admin", "reclaim", "expired"},
    "queue": {"writeback", "promote", "upload"},
    "state": {"closed", "open", "half_open"},
    "policy": {"lru", "fifo"},
    "outcome": {"deferred", "expired"},
    "stat": {"mean", "spread"},
    "part": {"step", "token", "load", "chunk"},
    "store": {"lmdb", "events"},
}
FREE_LABELS = {"replica", "event", "le", "version", "url", "principal", "model"}
FREE_LABELS |= {"draft_model", "draft_revision"}


def _reference_table() -> dict[str, tuple[str, str]]:
    """metric -> (type, labels) from the metrics reference page's kvtierd section."""
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    section = text.split("\n## kvtierd\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(kvtier_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    return {name: (kind, labels.strip()) for name, kind, labels in rows}


def _scrape(stack: Stack) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(stack.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def test_reference_table_lists_every_metric_and_nothing_else() -> None:
    table = _reference_table()
    declared = {spec.exposed: spec for spec in METRICS}
    assert set(table) == set(declared), (
        f"missing from docs/reference/metrics.md: {sorted(set(declared) - set(table))}; "
        f"not exported: {sorted(set(table) - set(declared))}"
    )
    for name, (kind, labels) in table.items():
        spec = declared[name]
        assert kind == spec.kind, name
        assert labels.replace("`", "").replace(",", " ").split() == list(spec.labels), name


def test_names_carry_units_and_the_prefix() -> None:
    for spec in METRICS:
        assert re.fullmatch(r"kvtier_[a-z0-9_]+", spec.name), spec.name
        assert not spec.name.endswith("_total"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds"), spec.name
        if "bytes" in spec.name or "seconds" in spec.name:  # the unit ends the name
            assert spec.name.endswith(("_bytes", "_seconds")), spec.name


def test_live_daemon_exports_exactly_the_declared_metrics(stack: Stack) -> None:
    from tests.operability.test_prometheus import _wait_for_load

    _wait_for_load(stack)
    names = set()
    for name, labels, _ in _scrape(stack):
        names.add(re.sub(r"_(bucket|sum|count)$", "", name) if "_seconds_" in name else name)
        for label, value in labels.items():
            assert label in LABELS or label in FREE_LABELS, (name, label)
            if label in LABELS:
                assert value in LABELS[label], (name, label, value)
            assert not re.fullmatch(r"[0-9a-f]{32,}", value), (name, label, value)
        if "replica" in labels:
            assert labels["replica"] in {"dp0", "dp1", "remote"}, labels
    assert names == {spec.exposed for spec in METRICS}


def test_hits_per_tier_add_up_to_all_hits(stack: Stack) -> None:
    from tests.operability.test_prometheus import _wait_for_load

    _wait_for_load(stack)
    with stack.load.paused():
        samples = _scrape(stack)
        asked, hits, verified = stack.load.asked, stack.load.hits, stack.load.verified
        stats = stack.daemon.stats()
    per_tier: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "kvtier_hit_chunks_total":
            per_tier[labels["tier"]] = per_tier.get(labels["tier"], 0) + value
    lookups = sum(v for n, _, v in samples if n == "kvtier_lookup_chunks_total")
    assert lookups == asked
    assert sum(per_tier.values()) == hits
    # a sampled request's lookups: counted as asked, and what they found as verified, not hit
    assert sum(v for n, _, v in samples if n == "kvtier_verified_chunks_total") == verified > 0
    assert stats.counters["verified_chunks"] == verified
    assert all(per_tier[t] > 0 for t in ("cpu", "lmdb", "object")), per_tier
    # the manager counts the same hits on its own
    for tier, value in per_tier.items():
        assert stats.counters[f"hit_chunks_{tier}"] == value, tier


def test_replica_label_values_are_bounded() -> None:
    registry = PoolRegistry()
    namespace = registry.register(target_spec(), 4096).namespace
    telemetry = Telemetry(registry)
    packed = b"".join(keys_for(namespace, 3))
    for i in range(MAX_REPLICAS + 10):
        telemetry.looked_up(f"r{i}", packed, len(packed) // 3, LookupResult(2, b"\x01\x02"))
    replicas = {key[2] for key in telemetry.counts() if key[0] == "lookup"}
    assert len(replicas) == MAX_REPLICAS + 1
    assert OTHER in replicas
    assert telemetry.counts()["lookup", "target", OTHER] == 30


def test_lookups_of_mixed_pools_count_per_pool() -> None:
    registry = PoolRegistry()
    target = registry.register(target_spec(), 4096).namespace
    draft = registry.register(draft_spec(), 1024).namespace
    keys = keys_for(target, 2) + keys_for(draft, 2, start=10) + keys_for(target, 1, start=5)
    telemetry = Telemetry(registry)
    # the first four were found: cpu, lmdb (target); object, cpu (draft)
    found = LookupResult(4, b"\x01\x02\x03\x01")
    telemetry.looked_up("dp0", b"".join(keys), len(keys[0]), found)
    counts = telemetry.counts()
    assert counts["lookup", "target", "dp0"] == 3
    assert counts["lookup", "draft", "dp0"] == 2
    assert counts["hit", "cpu", "target", "dp0"] == 1
    assert counts["hit", "lmdb", "target", "dp0"] == 1
    assert counts["hit", "object", "draft", "dp0"] == 1
    assert counts["hit", "cpu", "draft", "dp0"] == 1
    assert sum(v for k, v in counts.items() if k[0] == "hit") == 4
    assert len(keys[0]) > NAMESPACE_BYTES


def test_chunks_a_probe_brought_count_as_object_hits_once() -> None:
    registry = PoolRegistry()
    target = registry.register(target_spec(), 4096).namespace
    keys = keys_for(target, 4)
    packed = b"".join(keys)
    telemetry = Telemetry(registry)
    # one chunk in the arena, then two a probe just brought into lmdb; the fourth still probed
    telemetry.looked_up("dp0", packed, len(keys[0]), LookupResult(3, b"\x01\x02\x02", True, 2))
    # asked again: the fourth has come, and is all that counts
    again = LookupResult(4, b"\x01\x02\x02\x02", from_store=1)
    telemetry.looked_up("dp0", packed, len(keys[0]), again, again=True)
    counts = telemetry.counts()
    assert counts["lookup", "target", "dp0"] == 4, "a re-ask is not another lookup"
    assert counts["hit", "cpu", "target", "dp0"] == 1
    assert counts["hit", "lmdb", "target", "dp0"] == 0
    assert counts["hit", "object", "target", "dp0"] == 3


def test_draft_swaps_count_revision_changes_only() -> None:
    telemetry = Telemetry(PoolRegistry())
    telemetry.registered(target_spec())
    for revision in ("d1", "d1", "d2", "d2", "d3"):
        telemetry.registered(draft_spec(draft_revision=revision))
    telemetry.registered(draft_spec(draft_model="other-draft", draft_revision="x"))
    assert telemetry.counts()["draft_swaps",] == 2
    assert telemetry.drafts() == {
        ("tiny-llama", "tiny-draft"): "d3",
        ("tiny-llama", "other-draft"): "x",
    }


def test_top_does_not_import_the_daemon() -> None:
    # `kvtier top` runs next to a daemon, often on a small machine: keep it light
    code = "import kvtier.observability.top, sys; assert 'kvtier.server.daemon' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
