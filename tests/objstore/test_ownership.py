"""A node owns the objects it uploaded, and only those, on real stores: its budget counts and
evicts its own objects only, concurrent uploads reserve their room, uploads are exclusive (a lost
race is served from the winner's object), the index never leaves an own object unnamed, and gc
deletes what uploads and dead nodes leave behind."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.observability.metrics import build_registry
from kvtier.tiering.manager import TierManager
from kvtier.tiers.objstore import pins as fleet_pins
from kvtier.tiers.objstore.catalog import Catalog
from kvtier.tiers.objstore.pins import PINS_DIR, PINS_FORMAT
from kvtier.tiers.objstore.tier import COMPANION_SUFFIX, META_NODE, ObjectTier
from tests.contract.tier_contract import CHUNK
from tests.integration.test_object_manager import CHUNK as NODE_CHUNK
from tests.integration.test_object_manager import store, uploaded
from tests.objstore import test_object_tier
from tests.objstore.fixtures import GCS_ENDPOINT_ENV, ObjectNodes, ProxiedStore, StoreFactory
from tests.objstore.servers import FaultMode, _Handler, _LoopbackHttp
from tests.objstore.test_object_tier import Tier, keys, put_when_ready, read
from tests.support import keys_for, object_config, payload_for, target_spec

make_tier = test_object_tier.make_tier  # the same fixture, found by name here

OBJECT = CHUNK + 128
"""Bytes of a one-chunk object: the chunk and its header, at most."""


def pack(tier: ObjectTier, batch: Sequence[ChunkKey]) -> int:
    return tier.put_pack([(key, payload_for(key, CHUNK)) for key in batch])


def chunk_objects(tier: ObjectTier) -> dict[str, int]:
    """The store's chunk objects (no companions, no pins), with their sizes."""
    return {
        info.name: info.size
        for info in tier.backend.list()
        if ObjectTier.key_of(info.name) is not None
    }


def probe_prompt(reader: ObjectTier, prompt: Sequence[ChunkKey]) -> None:
    """Find a prompt's chunks as a lookup does: probe the first chunk no object found yet."""
    for key in prompt:
        if key not in reader:
            assert reader.probe(key) is not None, f"no object starts at {key.hex()}"
        assert read(reader, key) == payload_for(key, CHUNK)


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_two_nodes_packing_one_first_chunk_with_other_tails_both_stay_readable(
    make_tier: Tier, store_factory: StoreFactory, scheme: str
) -> None:
    url = store_factory(scheme)
    a, b, reader = make_tier(url), make_tier(url), make_tier(url)
    (first,) = keys(1)
    tail_a, tail_b = keys(2, start=10), keys(2, start=20)
    start = threading.Barrier(2)

    def upload(tier: ObjectTier, tail: list[ChunkKey]) -> int:
        start.wait(10)
        return pack(tier, [first, *tail])

    with ThreadPoolExecutor(2) as pool:
        stored = list(pool.map(upload, (a, b), (tail_a, tail_b)))
    assert stored == [3, 3]
    for tier, tail in ((a, tail_a), (b, tail_b)):
        for key in (first, *tail):
            assert read(tier, key) == payload_for(key, CHUNK), "each writer reads its own"
    probe_prompt(reader, [first, *tail_a])
    probe_prompt(reader, [first, *tail_b])
    for tier in (a, b, reader):
        counters = tier.stats().counters
        assert (counters["corrupt"], counters["store_errors"]) == (0, 0)
    assert a.stats().counters["upload_races_lost"] + b.stats().counters["upload_races_lost"] == 1


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_an_upload_losing_the_race_is_counted_as_lost_not_failed(
    make_tier: Tier, store_factory: StoreFactory, scheme: str
) -> None:
    url = store_factory(scheme)
    winner, loser = make_tier(url), make_tier(url)
    (key,) = keys(1)
    assert winner.put(key, payload_for(key, CHUNK))
    name = winner.object_name(key)
    assert loser.put(key, payload_for(key, CHUNK)), "the chunk is in the store: stored"
    counters = loser.stats().counters
    assert counters["upload_races_lost"] == 1
    assert counters["store_errors"] == counters["corrupt"] == counters["objects_uploaded"] == 0
    head = loser.backend.head(name)
    assert head is not None
    assert head.metadata[META_NODE] == winner.node_id, "the winner's object, never replaced"
    assert read(loser, key) == payload_for(key, CHUNK)
    assert not loser.index.objects[name].owned, "served from the winner's object, not owned"
    assert loser.budget.used() == 0


class _TakenEverywhere(_Handler):
    """A store where every name is taken by an object no one can read: a write answers 412
    Precondition Failed (as S3 and GCS answer a conditional put that lost), a read 404."""

    seen: ClassVar[list[tuple[str, str, str]]] = []  # method, target, If-None-Match

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.command, self.path, self.headers.get("If-None-Match", "")))
        gcs = self.path.startswith(("/storage/", "/upload/storage/"))
        if self.command in ("PUT", "POST"):
            if gcs:
                error = {"code": 412, "message": "conditionNotMet", "errors": []}
                self.reply_json(412, {"error": error})
            else:
                self.reply(412, _s3_error("PreconditionFailed"), "application/xml")
        elif gcs:
            self.reply_json(404, {"error": {"code": 404, "message": "No such object"}})
        else:
            self.reply(404, _s3_error("NoSuchKey"), "application/xml")

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer


def _s3_error(code: str) -> str:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        "<Message>m</Message><RequestId>1</RequestId></Error>"
    )


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_the_sdks_send_the_condition_and_a_412_is_a_lost_race(
    make_tier: Tier, store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    url = store_factory(scheme)
    store = _LoopbackHttp(_TakenEverywhere)
    _TakenEverywhere.seen = []
    try:
        # the identity (STS, the metadata server) still answers; the store has every name
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3" if scheme == "s3" else GCS_ENDPOINT_ENV, store.url)
        tier = make_tier(url, breaker_failures=2, retries=3)
        (key,) = keys(1)
        assert not tier.put(key, payload_for(key, CHUNK)), "nothing readable holds it"
        counters = tier.stats().counters
        assert counters["upload_races_lost"] == 1
        assert counters["request_errors"] == counters["retries"] == counters["corrupt"] == 0
        assert tier.healthy
        writes = [
            (target, cond)
            for method, target, cond in _TakenEverywhere.seen
            if method in ("PUT", "POST")
        ]
        assert len(writes) == 1, "a lost race is not retried"
        if scheme == "s3":
            assert writes[0][1] == "*"
        else:
            assert "ifGenerationMatch=0" in writes[0][0]
    finally:
        store.close()


def test_a_node_warmed_from_the_bucket_deletes_nothing_it_did_not_upload(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("s3")
    other = make_tier(url, pack_target_bytes=0)
    theirs = keys(6)
    for key in theirs:
        assert other.put(key, payload_for(key, CHUNK))
    warmed = make_tier(url, pack_target_bytes=0, budget_bytes=2 * OBJECT)
    counts = list(Catalog(warmed).rebuild_index())[-1]
    assert counts.indexed == len(theirs)
    mine = keys(4, start=100)
    for key in mine:
        assert warmed.put(key, payload_for(key, CHUNK))
    names = chunk_objects(warmed)
    assert all(other.object_name(key) in names for key in theirs), "another node's objects"
    own = [key for key in mine if warmed.object_name(key) in names]
    assert own == mine[-2:], "its own budget: its two newest objects"
    assert warmed.stats().counters["evictions_capacity"] == 2
    assert all(read(warmed, key) == payload_for(key, CHUNK) for key in theirs)


def test_the_budget_keeps_an_object_another_node_pinned(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("file")
    owner = make_tier(url, pack_target_bytes=0, budget_bytes=2 * OBJECT)
    pinned, other = keys(2)
    for key in (pinned, other):
        assert owner.put(key, payload_for(key, CHUNK))
    pinner = make_tier(url)
    assert pinner.probe(pinned) is not None
    pinner.pin([pinned])  # published in the store, where the owner's budget reads it
    later = keys(2, start=10)
    for key in later:
        assert owner.put(key, payload_for(key, CHUNK))
    names = chunk_objects(owner)
    kept = [owner.object_name(key) in names for key in (pinned, other, *later)]
    assert kept == [True, False, False, True], "the oldest is kept: another node pinned it"
    assert owner.budget.used() <= 2 * OBJECT


def test_eight_concurrent_uploads_stay_within_the_budget_plus_one_pack(
    make_tier: Tier, proxied_store: ProxiedStore
) -> None:
    url, proxy = proxied_store("s3")
    budget = 4 * OBJECT
    tier = make_tier(url, pack_target_bytes=0, budget_bytes=budget, request_timeout_s=10.0)
    (ready,) = keys(1, start=50)
    put_when_ready(tier, ready)  # the identity resolved before the uploads race
    batch = keys(8)
    proxy.set_mode(FaultMode.DELAY, delay_ms=300)  # every upload in flight together
    start = threading.Barrier(len(batch))

    def upload(key: ChunkKey) -> bool:
        start.wait(10)
        return tier.put(key, payload_for(key, CHUNK))

    with ThreadPoolExecutor(len(batch)) as pool:
        stored = list(pool.map(upload, batch))
    proxy.set_mode(FaultMode.PASS)
    sizes = chunk_objects(tier)
    assert sum(sizes.values()) <= budget + max(sizes.values())
    assert sum(sizes.values()) <= budget, "reserved: within the budget itself"
    counters = tier.stats().counters
    assert sum(stored) + counters["store_rejected"] == len(batch)
    assert tier.budget.reserved == 0
    assert tier.budget.used() == sum(sizes.values())


def test_an_index_full_of_learned_objects_forgets_them_to_record_an_upload(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("file")
    other = make_tier(url, pack_target_bytes=0)
    theirs = keys(30)
    for key in theirs:
        assert other.put(key, payload_for(key, CHUNK))
    small = make_tier(url, pack_target_bytes=0, index_map_bytes=64 << 10)  # ~20 objects
    counts = list(Catalog(small).rebuild_index())[-1]
    assert (counts.indexed, counts.failed) == (len(theirs), 0)
    mine = keys(5, start=100)
    for key in mine:
        assert small.put(key, payload_for(key, CHUNK))
        assert read(small, key) == payload_for(key, CHUNK)
    assert all(small.index.objects[small.object_name(k)].owned for k in mine)
    assert small.stats().counters["index_full"] == 0


def test_an_upload_the_index_cannot_record_is_removed_from_the_store(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("file")
    tier = make_tier(url, pack_target_bytes=0, index_map_bytes=64 << 10)  # ~20 objects
    batch = keys(30)
    stored = [tier.put(key, payload_for(key, CHUNK)) for key in batch]
    assert not all(stored), "the map is too small for them all"
    assert tier.stats().counters["index_full"] >= 1
    assert set(chunk_objects(tier)) == set(tier.index.objects), "no own object left unindexed"
    assert [tier.object_name(k) in tier.index.objects for k in batch] == stored


def _age(root: Path, name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(root / name, (then, then))


def test_gc_deletes_lone_companions_temporary_files_and_dead_nodes_pins_and_nothing_live(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("file")
    root = Path(url.removeprefix("file://"))
    tier, live = make_tier(url, pack_target_bytes=0), make_tier(url, pack_target_bytes=0)
    old_obj, new_obj, pinned_obj, dead_pinned = keys(4)
    for key in (old_obj, new_obj, pinned_obj, dead_pinned):
        assert tier.put(key, payload_for(key, CHUNK))
    assert live.probe(pinned_obj) is not None  # a node pins what it found
    live.pin([pinned_obj])
    assert live.backend.head(live.pins_name) is not None
    backend = tier.backend
    dead_doc = {
        "format": PINS_FORMAT,
        "node": "gone",
        "chunks": [dead_pinned.hex()],
        "objects": [tier.object_name(dead_pinned)],
    }
    backend.put(f"{PINS_DIR}/gone", json.dumps(dead_doc).encode(), {})
    lone_old, lone_new = (tier.object_name(k) + COMPANION_SUFFIX for k in keys(2, start=40))
    beside = tier.object_name(new_obj) + COMPANION_SUFFIX
    for name in (lone_old, lone_new, beside):
        backend.put(name, b"lineage", {})
    shard = root / Path(tier.object_name(old_obj)).parent
    (shard / ".tmp-crashed").write_bytes(b"part")
    (shard / ".tmp-in-flight").write_bytes(b"part")
    day = 86400.0
    for name in (
        tier.object_name(old_obj),
        tier.object_name(pinned_obj),
        tier.object_name(dead_pinned),
        f"{PINS_DIR}/gone",
        lone_old,
        beside,
    ):
        _age(root, name, day)
    _age(shard, ".tmp-crashed", day)

    counts = list(Catalog(tier).gc(3600.0))[-1]
    exists = {
        name: backend.head(name) is not None
        for name in (
            tier.object_name(old_obj),
            tier.object_name(new_obj),
            tier.object_name(pinned_obj),
            tier.object_name(dead_pinned),
            f"{PINS_DIR}/gone",
            live.pins_name,
            lone_old,
            lone_new,
            beside,
        )
    }
    assert exists == {
        tier.object_name(old_obj): False,
        tier.object_name(new_obj): True,
        tier.object_name(pinned_obj): True,  # a live node's pin holds
        tier.object_name(dead_pinned): False,  # a dead node's does not
        f"{PINS_DIR}/gone": False,
        live.pins_name: True,
        lone_old: False,
        lone_new: True,  # an upload between its two puts
        beside: True,  # its object is there
    }
    assert not (shard / ".tmp-crashed").exists()
    assert (shard / ".tmp-in-flight").exists(), "a put in flight"
    assert (counts.deleted, counts.pinned, counts.leftovers) == (2, 1, 3)


def test_a_node_holding_pins_rewrites_them_so_gc_never_takes_it_for_dead(
    make_tier: Tier, store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet_pins, "REFRESH_S", 0.2)  # an hour in production
    tier = make_tier(store_factory("file"))
    (key,) = keys(1)
    assert tier.put(key, payload_for(key, CHUNK))
    tier.pin([key])
    published = tier.backend.head(tier.pins_name)
    assert published is not None
    deadline = time.monotonic() + 10.0
    while (now := tier.backend.head(tier.pins_name)) is None or now.modified == published.modified:
        assert time.monotonic() < deadline, "the pins were not rewritten"
        time.sleep(0.05)
    assert key.hex() in tier.backend.get(tier.pins_name).decode()


def test_ownership_survives_a_restart(
    make_tier: Tier, store_factory: StoreFactory, tmp_path: Path
) -> None:
    url = store_factory("file")
    other = make_tier(url)
    theirs = keys(2, start=10)
    assert pack(other, theirs) == 2
    config = object_config(url, tmp_path / "restarted", pack_target_bytes=0)
    registry = PoolRegistry()
    registry.register(target_spec(), CHUNK)
    mine = keys(2)
    tier = ObjectTier(config, registry)
    try:
        for key in mine:
            assert tier.put(key, payload_for(key, CHUNK))
        assert tier.probe(theirs[0]) is not None
        used = tier.budget.used()
    finally:
        tier.close()
    tier = ObjectTier(config, registry)
    try:
        owned = {name for name, entry in tier.index.objects.items() if entry.owned}
        assert owned == {tier.object_name(key) for key in mine}
        assert other.object_name(theirs[0]) in tier.index.objects, "still known, not owned"
        assert tier.budget.used() == used == sum(chunk_objects(tier)[name] for name in owned)
    finally:
        tier.close()


def test_object_usage_counts_a_nodes_own_objects_and_the_learned_ones_apart(
    object_nodes: ObjectNodes, store_factory: StoreFactory
) -> None:
    """Two nodes on one bucket: the other node's objects, learned by warmup, are not counted in
    tier_used_bytes{tier="object"}, only in object_store_learned_bytes."""
    url = store_factory("s3")
    theirs_node, ours_node = object_nodes(url, "a"), object_nodes(url, "b")
    namespace = theirs_node.register_pool(target_spec(), NODE_CHUNK)
    ours_node.register_pool(target_spec(), NODE_CHUNK)
    theirs, ours = keys_for(namespace, 4), keys_for(namespace, 2, start=100)
    for node, batch in ((theirs_node, theirs), (ours_node, ours)):
        assert store(node, batch) == len(batch)
        uploaded(node, batch)
    list(ours_node.warmup(object_index=True))  # runs to its end: the index learns their objects
    assert ours_node.object is not None
    assert ours_node.object.contains(theirs) == [True] * len(theirs)  # learned
    assert ours_node.object.index.owned_bytes() > 0

    def gauges(node: TierManager) -> dict[tuple[str, str], float]:
        text = generate_latest(build_registry(node, lambda: (0, 0, 0))).decode()
        return {
            (s.name, s.labels.get("tier", "")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("pool") == "target"
        }

    def length(node: TierManager, batch: Sequence[ChunkKey]) -> int:
        assert node.object is not None
        return sum(loc.length for key in batch if (loc := node.object.index.get(key)))

    own = gauges(ours_node)
    assert own["kvtier_tier_chunks", "object"] == len(ours)
    assert own["kvtier_tier_used_bytes", "object"] == length(ours_node, ours)
    assert own["kvtier_object_store_learned_bytes", ""] == length(ours_node, theirs) > 0
    other = gauges(theirs_node)
    assert other["kvtier_tier_used_bytes", "object"] == length(theirs_node, theirs)
    assert other["kvtier_object_store_learned_bytes", ""] == 0
