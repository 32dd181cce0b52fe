"""A node deletes only what it wrote, and counts all it wrote, on moto's S3: a lineage companion
goes up only beside an object whose name the node won, a node deletes no companion it did not
write, an upload in flight when the node was SIGKILLed is found at the next start, and dropping
an object never uncounts another that shares a chunk with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.objstore.index import ChunkLocation, ObjectIndex
from kvtier.tiers.objstore.tier import COMPANION_SUFFIX, META_NODE, ObjectTier
from tests.contract.tier_contract import CHUNK
from tests.integration.daemon_harness import wait_for
from tests.objstore import test_object_tier
from tests.objstore.fixtures import StoreFactory
from tests.objstore.test_object_tier import Tier, keys, put_when_ready
from tests.objstore.test_ownership import chunk_objects
from tests.support import object_config, payload_for, target_spec

make_tier = test_object_tier.make_tier  # the same fixture, found by name here

LINEAGE = b"the lineage of the loser's chunks"


class Lineage:
    """Stands in for the fleet's announcements: every upload has a lineage to write beside it."""

    def companion(self, keys: Sequence[ChunkKey]) -> bytes | None:
        return LINEAGE

    def stored(self, companion: bytes) -> None:
        pass

    def removed(self, companion: bytes) -> None:
        pass


def test_a_node_losing_the_race_writes_no_lineage_beside_the_winners_object(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("s3")
    winner, loser = make_tier(url), make_tier(url)
    loser.events = Lineage()
    (key,) = keys(1)
    assert winner.put(key, payload_for(key, CHUNK))
    assert loser.put(key, payload_for(key, CHUNK))
    assert loser.stats().counters["upload_races_lost"] == 1
    name = winner.object_name(key)
    assert loser.backend.head(name + COMPANION_SUFFIX) is None, (
        "the winner would delete the loser's lineage with its own object"
    )
    (mine,) = keys(1, start=5)
    assert loser.put(mine, payload_for(mine, CHUNK))
    obj = loser.backend.head(loser.object_name(mine))
    companion = loser.backend.head(loser.object_name(mine) + COMPANION_SUFFIX)
    assert obj is not None
    assert companion is not None, "a won name has its lineage beside it"
    assert loser.budget.used() == obj.size + companion.size, "its lineage counted with it"


def test_a_node_deletes_no_lineage_it_did_not_write(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("s3")
    node = make_tier(url)  # announces nothing, so writes no lineage
    (key,) = keys(1)
    name = node.object_name(key)
    node.backend.put(name + COMPANION_SUFFIX, LINEAGE, {})  # another node's, left lone
    assert node.put(key, payload_for(key, CHUNK))
    assert node.delete([key]) == 1
    assert node.backend.head(name) is None, "its own object deleted"
    assert node.backend.head(name + COMPANION_SUFFIX) is not None, "the lineage left to gc"


_KILLED_MID_UPLOAD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from kvtier.core.pools import PoolRegistry
    from kvtier.tiers.objstore.tier import ObjectTier
    from tests.contract.tier_contract import CHUNK
    from tests.objstore.test_object_tier import keys
    from tests.support import object_config, payload_for, target_spec

    registry = PoolRegistry()
    registry.register(target_spec(), CHUNK)
    tier = ObjectTier(object_config(sys.argv[1], Path(sys.argv[2])), registry)
    tier.principal_resolved.wait(10)
    add = tier.index.add

    def killed_before_recording(name, size, locations, owned=False):
        if owned:  # the object is in the store; the index never hears of it
            os.kill(os.getpid(), signal.SIGKILL)
        add(name, size, locations, owned)

    tier.index.add = killed_before_recording
    (key,) = keys(1)
    tier.put(key, payload_for(key, CHUNK))
    """
)


def test_an_upload_in_flight_at_a_sigkill_is_counted_then_adopted_at_the_next_start(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    url = store_factory("s3")
    index = tmp_path / "index"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_UPLOAD, url, str(index)],
        env=env,
        timeout=60,
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    registry = PoolRegistry()
    registry.register(target_spec(), CHUNK)
    tier = ObjectTier(object_config(url, index), registry)
    try:
        (key,) = keys(1)
        name = tier.object_name(key)
        head = tier.backend.head(name)
        assert head is not None, "uploaded before the kill"
        assert head.metadata[META_NODE] == tier.node_id
        assert name not in tier.index.objects, "never recorded"
        assert tier.budget.used() >= head.size, "counted from the start, before it is found"
        wait_for(lambda: tier.stats().counters["orphans_adopted"] == 1, 20.0, "adopted")
        assert tier.index.objects[name].owned, "this node's upload: adopted as its own"
        assert not tier.index.intents.orphans
        assert tier.budget.used() == head.size, "counted once, as an object of its own"
        assert tier.backend.head(name) is not None, "kept: nothing the drain wrote is lost"
        out = bytearray(CHUNK)
        assert tier.read_into(key, memoryview(out)), "served from the adopted object"
        assert bytes(out) == payload_for(key, CHUNK)
        (other,) = keys(1, start=3)
        put_when_ready(tier, other)
        assert tier.budget.used() == sum(chunk_objects(tier).values())
    finally:
        tier.close()


def test_dropping_an_object_keeps_counting_a_later_one_sharing_its_chunk(tmp_path: Path) -> None:
    index = ObjectIndex(tmp_path / "index", 1 << 20)
    try:
        first, shared = keys(2)

        def at(name: str, key: ChunkKey) -> tuple[ChunkKey, ChunkLocation]:
            return key, ChunkLocation(name, 0, 10, "target", "default")

        index.add("learned", 20, [at("learned", first), at("learned", shared)])
        index.add("mine", 10, [at("mine", shared)], owned=True)  # uploaded while learning it
        index.drop_object("learned")  # e.g. deleted by its owner, found on a read
        assert "mine" in index.objects, "still in the store, still this node's"
        assert index.owned_bytes() == 10
        assert index.get(shared) == ChunkLocation("mine", 0, 10, "target", "default")
        assert index.get(first) is None
    finally:
        index.close()


def test_an_upload_whose_answer_was_lost_is_counted_when_its_retry_finds_it(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    tier = make_tier(store_factory("s3"))
    (key,) = keys(1)
    assert tier.put(key, payload_for(key, CHUNK))
    name = tier.object_name(key)
    tier.index.drop_object(name)  # as a put that landed after the node gave up on its answer
    assert tier.budget.used() == 0
    assert tier.put(key, payload_for(key, CHUNK)), "the retry loses the race to its own object"
    assert tier.index.objects[name].owned, "this node's upload: its own, not learned"
    assert tier.budget.used() == sum(chunk_objects(tier).values())
