"""The object tier's KV events, as a router sees them: a TierManager on a file:// bucket with
`events.endpoint` set publishes each uploaded object's chunks and withdraws them when gc deletes
it; a router decoding with vLLM's own classes keeps an index equal to what the bucket holds,
across a restart (the sequence carries on, replay fills what it missed)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvtier.core.config import EventsConfig, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.lineage import BlockLineage, unpack
from kvtier.fleet.event_log import EventLog
from kvtier.fleet.kv_events import external_hash
from kvtier.tiering.manager import TierManager
from tests.integration.test_object_manager import CHUNK
from tests.router_index import RouterIndex
from tests.support import keys_for, payload_for, target_spec
from tests.support import object_node_config as node_config

BLOCKS = 4
BLOCK_SIZE = 16
MODEL = "tiny-llama"


def lineages(keys: list[ChunkKey], seed: str) -> list[BlockLineage]:
    """A prompt's chunks: each block's hash distinct, each chunk's parent the block before."""
    out = []
    parent = None
    for i in range(len(keys)):
        hashes = tuple(hashlib.sha256(f"{seed}/{i}/{b}".encode()).digest() for b in range(BLOCKS))
        tokens = tuple(range(i * BLOCKS * BLOCK_SIZE, (i + 1) * BLOCKS * BLOCK_SIZE))
        out.append(BlockLineage(hashes, parent, tokens, BLOCK_SIZE))
        parent = hashes[-1]
    return out


def config(root: Path, bucket: str, **object_overrides: object) -> KVTierConfig:
    base = node_config(root, bucket, pack_target_bytes=2 * CHUNK, **object_overrides)
    events = EventsConfig(
        endpoint=f"ipc://{root}/pub.sock",
        replay_endpoint=f"ipc://{root}/replay.sock",
        topic="kv@node-a@{model}",
    )
    return base.model_copy(update={"events": events})


class Node:
    def __init__(self, root: Path, bucket: str, **object_overrides: object) -> None:
        self.config = config(root, bucket, **object_overrides)
        self.manager = TierManager(self.config)
        self.namespace = self.manager.register_pool(target_spec(model=MODEL), CHUNK)

    def store(self, keys: list[ChunkKey], encoded: list[bytes]) -> None:
        m = self.manager
        refs = m.reserve(keys, "r0")
        assert all(r is not None for r in refs)
        for ref in refs:
            assert ref is not None
            m.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
        assert m.commit([r for r in refs if r is not None], encoded) == len(keys)
        assert m.flush()
        assert m.flush_uploads()

    @property
    def published_through(self) -> int:
        """The last sequence number published, once every queued batch is out."""
        events = self.manager.objects.events if self.manager.objects else None
        assert events is not None
        assert events.publisher.flush()
        return events.publisher.log.next_seq - 1

    def counters(self) -> dict[str, int]:
        assert self.manager.object is not None
        return dict(self.manager.object.counters.snapshot())

    def close(self) -> None:
        self.manager.close()
        self.manager.config.arena.path.unlink(missing_ok=True)


@pytest.fixture
def bucket(tmp_path: Path) -> str:
    return f"file://{tmp_path}/bucket"


@pytest.fixture
def node(tmp_path: Path, bucket: str) -> Iterator[Node]:
    made = Node(tmp_path / "a", bucket)
    yield made
    made.close()


@pytest.fixture
def router(node: Node) -> Iterator[RouterIndex]:
    events = node.config.events
    assert events.endpoint is not None
    assert events.replay_endpoint is not None
    index = RouterIndex(events.endpoint, events.replay_endpoint)
    yield index
    index.close()


def bucket_blocks(bucket: str) -> set[int | bytes]:
    """Every block hash the bucket's lineage companions name, as the events carry them."""
    root = Path(bucket.removeprefix("file://"))
    held: set[int | bytes] = set()
    for path in root.rglob("*.lineage"):
        assert path.with_suffix("").exists(), f"{path.name} outlived its object"
        for _, lineage in unpack(path.read_bytes())[1]:
            held.update(external_hash(h, True) for h in lineage.block_hashes)
    return held


def hashes_of(lins: list[BlockLineage]) -> list[int | bytes]:
    return [external_hash(h, True) for lin in lins for h in lin.block_hashes]


def test_uploads_and_gc_reach_a_router_exactly(
    node: Node, router: RouterIndex, bucket: str
) -> None:
    keys = keys_for(node.namespace, 6)
    lins = lineages(keys, "first")
    node.store(keys, [lin.encode() for lin in lins])
    router.catch_up(node.published_through)

    assert router.blocks[(MODEL, "object")] == set(hashes_of(lins)) == bucket_blocks(bucket)
    assert router.longest_prefix(MODEL, "object", hashes_of(lins)) == 6 * BLOCKS
    assert node.counters()["events_published"] == 6

    deleted = sum(c.deleted for c in node.manager.gc(retention_s=0))
    assert deleted > 0
    router.catch_up(node.published_through)
    assert router.blocks[(MODEL, "object")] == bucket_blocks(bucket) == set()
    assert not list(Path(bucket.removeprefix("file://")).rglob("*.lineage"))


def test_objects_the_stores_budget_evicts_are_withdrawn(tmp_path: Path, bucket: str) -> None:
    # two objects of two chunks; one upload at a time, so that each makes room for itself
    small = Node(tmp_path / "a", bucket, budget_bytes=5 * CHUNK, upload_concurrency=1)
    events = small.config.events
    assert events.endpoint is not None
    assert events.replay_endpoint is not None
    router = RouterIndex(events.endpoint, events.replay_endpoint)
    try:
        keys = keys_for(small.namespace, 8)
        lins = lineages(keys, "budget")
        small.store(keys, [lin.encode() for lin in lins])
        router.catch_up(small.published_through)
        assert small.counters()["evictions_capacity"] == 4
        held = bucket_blocks(bucket)
        assert router.blocks[(MODEL, "object")] == held == set(hashes_of(lins[4:]))
    finally:
        router.close()
        small.close()


def test_a_restart_carries_the_sequence_and_replay_fills_the_gap(
    tmp_path: Path, bucket: str
) -> None:
    first = Node(tmp_path / "a", bucket)
    events = first.config.events
    assert events.endpoint is not None
    assert events.replay_endpoint is not None
    keys = keys_for(first.namespace, 8)
    lins = lineages(keys, "restart")
    try:
        first.store(keys[:4], [lin.encode() for lin in lins[:4]])
        before = first.published_through
    finally:
        first.close()
    second = Node(tmp_path / "a", bucket)
    try:
        second.store(keys[4:], [lin.encode() for lin in lins[4:]])
        after = second.published_through
        assert after > before >= 0  # numbered on from where the first stopped
        # a router that connects only now misses every live batch: replay gives them all
        router = RouterIndex(events.endpoint, events.replay_endpoint)
        try:
            router.catch_up(after, live_wait_s=0)
            assert router.replayed == after + 1
            assert router.blocks[(MODEL, "object")] == set(hashes_of(lins)) == bucket_blocks(bucket)
        finally:
            router.close()
    finally:
        second.close()


def test_chunks_without_a_valid_lineage_are_uploaded_unannounced(
    node: Node, router: RouterIndex, bucket: str
) -> None:
    keys = keys_for(node.namespace, 3)
    lins = lineages(keys, "partial")
    node.store(keys, [lins[0].encode(), b"", b"not a lineage"])
    router.catch_up(node.published_through)

    assert router.blocks[(MODEL, "object")] == set(hashes_of(lins[:1]))
    counters = node.counters()
    assert counters["lineage_invalid"] == 1
    assert counters["chunks_unannounced"] == 2
    assert node.manager.object is not None
    assert all(node.manager.object.contains(keys))


def test_events_without_an_object_tier_or_with_a_taken_port_are_refused_at_start(
    tmp_path: Path, bucket: str
) -> None:
    alone = config(tmp_path / "b", bucket)
    alone = alone.model_copy(update={"object": alone.object.model_copy(update={"url": None})})
    with pytest.raises(ConfigError, match=r"events\.endpoint.*object\.url"):
        TierManager(alone)
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    try:
        taken.bind("tcp://*:*")
        clash = config(tmp_path / "c", bucket)
        port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        events = clash.events.model_copy(update={"endpoint": f"tcp://*:{port}"})
        with pytest.raises(ConfigError, match=r"events\.endpoint.*cannot open"):
            TierManager(clash.model_copy(update={"events": events}))
    finally:
        taken.close(linger=0)
        context.term()


def test_the_event_log_keeps_its_newest_batches_in_order_and_numbers_on(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "log", capacity_bytes=3 * 21)  # 3 of 8 + 2 + 1 + 10 bytes
    seqs = [log.append(b"t", bytes([i]) * 10) for i in range(5)]
    assert seqs == [0, 1, 2, 3, 4]
    assert [(s, p[0]) for s, _, p in log.since(0)] == [(2, 2), (3, 3), (4, 4)]
    log.close()
    again = EventLog(tmp_path / "log", capacity_bytes=3 * 21)
    assert again.append(b"t", b"x") == 5
    assert [s for s, _, _ in again.since(4)] == [4, 5]
    again.close()


def test_a_malformed_replay_request_is_ignored_and_the_next_answered(
    node: Node, router: RouterIndex
) -> None:
    keys = keys_for(node.namespace, 2)
    node.store(keys, [lin.encode() for lin in lineages(keys, "malformed")])
    through = node.published_through
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(router.replay_endpoint)
        dealer.send_multipart((b"", b"\x00\x01"))  # a start of 2 bytes, not 8
        router.replay(0)  # answered all the same
        assert router.last_seq == through
        assert not dealer.poll(100)  # nothing was sent to the malformed request
    finally:
        dealer.close(linger=0)
        context.term()
    assert node.counters()["event_replays"] == 1
