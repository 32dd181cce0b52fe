"""TierManager with an object store shared by two nodes (two managers, each with its own arena
and lmdb) on a file:// bucket: uploads, probes, promotion, restart, corruption."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.core.keys import ChunkKey
from kvtier.tiering.manager import TierManager
from kvtier.tiers.objstore.tier import ObjectTier
from tests.objstore.fixtures import ObjectNodes
from tests.support import keys_for, payload_for, target_spec

CHUNK = 256 << 10
Node = Callable[..., TierManager]


SETTINGS: dict[str, object] = {
    "pack_target_bytes": 4 * CHUNK,
    "pack_linger_ms": 20,
    "lookup_budget_ms": 2000,
    "retries": 1,
    "backoff_s": 0.01,
}


@pytest.fixture
def bucket(tmp_path: Path) -> str:
    return f"file://{tmp_path}/bucket"


@pytest.fixture
def node(object_nodes: ObjectNodes, bucket: str) -> Node:
    def make(name: str = "a", **object_overrides: object) -> TierManager:
        return object_nodes(bucket, name, **{**SETTINGS, **object_overrides})

    return make


def store(m: TierManager, keys: list[ChunkKey]) -> int:
    refs = [r for r in m.reserve(keys, "r0") if r is not None]
    for ref in refs:
        m.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    return m.commit(refs)


def load_bytes(m: TierManager, keys: list[ChunkKey]) -> list[bytes | None]:
    leases = m.lease(keys, "r0")
    out = [bytes(m.cpu.view(ref)) if ref is not None else None for ref in leases]
    m.release([r for r in leases if r is not None])
    return out


def uploaded(m: TierManager, keys: list[ChunkKey]) -> None:
    assert m.flush()
    assert m.flush_uploads(10.0)
    assert m.object is not None
    assert m.object.contains(keys) == [True] * len(keys)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_chunks_are_uploaded_in_packs_and_another_node_finds_them(node: Node) -> None:
    a, b = node("a"), node("b")
    ns = a.register_pool(target_spec(), CHUNK)
    b.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 8)
    assert store(a, keys) == 8
    uploaded(a, keys)
    assert a.object is not None
    assert len(a.object.index.objects) == 2, "8 chunks in packs of 4"

    result = b.lookup(keys)  # b never saw them: found by probes, kept in b's lmdb
    assert result.hits == 8
    assert not result.pending
    assert set(result.tiers) == {"lmdb"}
    assert load_bytes(b, keys) == [payload_for(k, CHUNK) for k in keys]
    assert b.stats().tiers["object"].counters["probes"] == 2
    hits = b.stats().counters  # what the probes brought are the object tier's hits, once
    assert (hits["hit_chunks_object"], hits["hit_chunks_lmdb"]) == (8, 0)
    assert hits["probe_misses"] == 0, "the prompt ends with the store's chunks: nothing missed"
    b.lookup(keys)  # loaded since: the arena's hits now
    hits = b.stats().counters
    assert (hits["hit_chunks_object"], hits["hit_chunks_cpu"]) == (8, 8)


def test_chunks_a_probe_brings_after_the_budget_count_as_object_hits_on_the_re_ask(
    node: Node,
) -> None:
    a, b = node("a"), node("b", lookup_budget_ms=0)
    ns = a.register_pool(target_spec(), CHUNK)
    b.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 8)
    store(a, keys)
    uploaded(a, keys)
    first = b.lookup(keys)  # no time to wait: the probe goes on, the caller asks again
    assert first.pending
    assert first.hits < 8
    result = first
    deadline = time.monotonic() + 10
    while result.hits < 8 or result.pending:
        assert time.monotonic() < deadline, "the probes never finished"
        time.sleep(0.01)
        result = b.lookup(keys, again=True)
    hits = b.stats().counters
    assert hits["lookups"] == 1, "a re-ask is not another lookup"
    assert (hits["hit_chunks_object"], hits["hit_chunks_lmdb"], hits["hit_chunks_cpu"]) == (8, 0, 0)


def test_a_missing_prefix_is_probed_once_then_remembered(node: Node) -> None:
    a = node("a")
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 3)
    assert a.lookup(keys).hits == 0
    # a loaded machine can hold the probe past the lookup's budget: wait for its answer
    wait_for(lambda: a.stats().counters["probe_misses"] == 1, timeout=60.0)
    again = a.lookup(keys)
    assert (again.hits, again.pending) == (0, False), "the remembered miss was not answered"
    assert a.stats().tiers["object"].counters["probes"] == 1
    counted = a.stats().counters  # the miss, and how long the lookup waited to hear of it
    assert counted["probe_misses"] == 1
    assert counted["probe_miss_us"] > 0


def test_object_chunks_are_promoted_after_lmdb_is_wiped(node: Node, tmp_path: Path) -> None:
    a = node("a")
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 4)
    store(a, keys)
    uploaded(a, keys)
    a.evict()  # arena and lmdb empty; the store keeps them
    a.evict("object", pool="draft")  # a filter matching nothing leaves the store alone
    result = a.lookup(keys)
    assert result.tiers == ["object"] * 4
    assert a.promote(keys, "r0") == 4
    wait_for(lambda: a.lookup(keys).tiers == ["cpu"] * 4)
    assert load_bytes(a, keys) == [payload_for(k, CHUNK) for k in keys]


def test_a_hit_found_in_the_index_is_not_the_stores_again_when_a_probe_brings_it(
    node: Node,
) -> None:
    a = node("a")
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 4)
    store(a, keys)
    uploaded(a, keys)
    a.evict()
    assert a.lookup(keys).tiers == ["object"] * 4  # the store's hits, counted here
    assert a.fetcher is not None  # a probe for another request brings the same object
    assert not a.fetcher.probe_past(keys, [], lambda: None)
    assert a.lookup(keys).tiers == ["lmdb"] * 4
    hits = a.stats().counters
    assert (hits["hit_chunks_object"], hits["hit_chunks_lmdb"]) == (4, 4)


def test_the_index_survives_a_restart_so_nothing_is_uploaded_twice(node: Node) -> None:
    a = node("a")
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 4)
    store(a, keys)
    uploaded(a, keys)
    uploads = a.stats().tiers["object"].counters["objects_uploaded"]
    assert uploads == 1
    a.close()
    a.config.arena.path.unlink(missing_ok=True)
    again = TierManager(a.config)
    try:
        again.register_pool(target_spec(), CHUNK)
        assert again.object is not None
        assert again.object.contains(keys) == [True] * 4
        assert again.uploader is not None
        assert again.uploader.offer(keys, "r0") == 0
        assert again.stats().tiers["object"].counters["objects_uploaded"] == 0
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_corrupt_object_is_never_served(node: Node, tmp_path: Path, damage: str) -> None:
    a, b = node("a"), node("b")
    ns = a.register_pool(target_spec(), CHUNK)
    b.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 8)
    store(a, keys)
    uploaded(a, keys)
    assert a.object is not None
    first, second = (a.object.object_name(keys[0]), a.object.object_name(keys[4]))
    path = tmp_path / "bucket" / first
    body = bytearray(path.read_bytes())
    if damage == "flip":
        body[len(body) // 2] ^= 0x10
    elif damage == "truncate":
        del body[-100:]
    else:  # another pack's bytes under this name
        body = bytearray((tmp_path / "bucket" / second).read_bytes())
    path.write_bytes(bytes(body))

    result = b.lookup(keys)
    assert result.hits == 0, "a corrupt pack must not be served"
    assert b.object is not None
    assert b.object.stats().counters["corrupt"] == 1
    assert not path.exists(), "the corrupt object is deleted"


def test_admission_by_hits_uploads_only_chunks_hit_often_enough(node: Node) -> None:
    a = node("a", admission="hits", admission_min_hits=2)
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 4)
    store(a, keys)
    assert a.flush()
    load_bytes(a, keys[:2])
    load_bytes(a, keys[:1])
    assert a.flush_uploads(10.0)
    assert a.object is not None
    assert a.object.contains(keys) == [True, False, False, False]


def test_a_full_upload_queue_drops_work_and_counts_it(node: Node) -> None:
    a = node("a", upload_queue_chunks=2, pack_target_bytes=0, upload_concurrency=1)
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 40)
    for i in range(0, 40, 8):
        store(a, keys[i : i + 8])
    assert a.flush()
    assert a.flush_uploads(10.0)
    counters = a.stats().tiers["object"].counters
    assert counters["uploads_dropped"] > 0
    assert a.object is not None
    assert sum(a.object.contains(keys)) == 40 - counters["uploads_dropped"]


def test_object_names_follow_the_documented_layout(node: Node) -> None:
    a = node("a")
    ns = a.register_pool(target_spec(tenant="acme"), CHUNK)
    (key,) = keys_for(ns, 1)
    assert a.object is not None
    digest = key[16:].hex()
    assert a.object.object_name(key) == f"acme/{ns.hex()}/{digest[:2]}/{digest}"
    assert ObjectTier.key_of(a.object.object_name(key)) == key


def test_a_chunk_corrupted_in_lmdb_is_never_uploaded(node: Node) -> None:
    a = node("a", admission="hits", admission_min_hits=99)  # nothing uploads by itself
    ns = a.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 3)
    store(a, keys)
    assert a.flush()
    assert a.lmdb is not None
    with a.lmdb.env.begin(write=True, db=a.lmdb.store.chunks) as txn:
        value = bytearray(txn.get(keys[1]))
        value[-1] ^= 0x01
        txn.put(keys[1], bytes(value))
    assert a.uploader is not None
    assert a.uploader.offer(keys, "r0") == 3
    assert a.flush_uploads(10.0)
    assert a.object is not None
    assert a.object.contains(keys) == [True, False, True]
    assert a.lmdb.stats().counters["corrupt"] == 1
    assert a.lmdb.contains(keys) == [True, False, True]
