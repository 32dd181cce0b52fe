"""An lmdb marked unhealthy by chunks failing verification is neither read nor written while it
is: lookups miss its chunks, sound ones included, nothing is promoted or leased from it (so no
engine reads its map), and stores go to the arena only; it serves again once the window holds
fewer failures. A real kvtierd on a real lmdb, corrupted on disk and reported by an engine.
An object store unhealthy from corrupt objects is left out the same way: two nodes' tiers in
this process on a file:// bucket."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import TierCode
from kvtier.rpc import GrpcTierClient
from kvtier.tiering.manager import TierManager
from tests.integration.daemon_harness import (
    CHUNK,
    ArenaClient,
    Processes,
    RunningDaemon,
    key_of,
    wait_for,
)
from tests.integration.test_integrity_reports import (
    CORRUPT,
    REPORT_S,
    STORED,
    corrupted_daemon,
    lmdb_chunks,
    lmdb_health,
    metric,
    read_in_lmdb,
    store_again_and_read_in_lmdb,
)
from tests.integration.test_locate import BLOCKS_PER_CHUNK, prompt_hashes
from tests.integration.test_object_manager import store, uploaded
from tests.support import keys_for, target_spec
from tests.support import object_node_config as node_config

SOUND = [i for i in range(STORED) if i not in CORRUPT]
UNHEALTHY = "lmdb is unhealthy"
HEALTHY_AGAIN = "lmdb is healthy again"
READS = ("hits", "misses", "load_leases", "corrupt")
"""lmdb's counters of chunks it read, leased to be read, or found failing."""


def _report_corrupt(daemon: RunningDaemon) -> None:
    """An engine reads every chunk from lmdb's map and reports the corrupt ones; until
    kvtierd has confirmed and dropped them (three: lmdb is unhealthy from then on)."""
    engine = GrpcTierClient(daemon.files.socket, "r1")
    try:
        engine.register_pool(target_spec(), CHUNK)
        _, failed = read_in_lmdb(engine, [key_of(i) for i in range(STORED)])
        assert len(failed) == len(CORRUPT)
        engine.report_failed(failed)  # with the next heartbeat: the session stays open
        wait_for(
            lambda: metric(daemon, "kvtier_integrity_failures_total", tier="lmdb") == len(CORRUPT),
            REPORT_S,
            "kvtierd confirms the reports",
        )
    finally:
        engine.close()


def _reads(daemon: RunningDaemon) -> dict[str, Any]:
    """What lmdb read and stored, and what was promoted from it, so far."""
    stats = daemon.stats()
    lmdb = dict(next(t for t in stats.tiers if t.tier == "lmdb").counters)
    manager = dict(stats.counters)
    counted = {name: lmdb.get(name, 0) for name in (*READS, "stores")}
    counted.update({name: manager.get(name, 0) for name in ("promotions", "promotion_failed")})
    return counted


def _keys(indices: Sequence[int]) -> list[ChunkKey]:
    return [key_of(i) for i in indices]


def _lmdb_located(daemon: RunningDaemon) -> int:
    """The chunks `kvtier locate` says lmdb holds of a prompt whose one chunk is the sound
    chunk 1 (`tests.integration.test_locate.prompt_hashes`, shifted by one)."""
    hashes = prompt_hashes(2)[BLOCKS_PER_CHUNK:]
    admin = daemon.admin()
    try:
        spans = admin.locate(target_spec().model, hashes).tiers
    finally:
        admin.close()
    return next(s.chunks for s in spans if s.tier == "lmdb")


def test_an_unhealthy_lmdb_is_neither_read_nor_written_and_stores_go_to_the_arena(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    daemon = corrupted_daemon(procs, tmp_path, shm_path)
    _report_corrupt(daemon)
    wait_for(
        lambda: metric(daemon, "kvtier_tier_healthy", tier="lmdb") == 0,
        REPORT_S,
        "lmdb is unhealthy",
    )
    assert lmdb_chunks(daemon) == len(SOUND)  # the sound chunks are still there
    before = _reads(daemon)
    demoted = metric(daemon, "kvtier_transfer_chunks_total", direction="demote")

    engine = GrpcTierClient(daemon.files.socket, "r2")
    try:
        engine.register_pool(target_spec(), CHUNK)
        # dropped and sound chunks alike are clean misses: no tier code, no lease, no promotion
        for i in range(STORED):
            assert engine.lookup(_keys([i])).hits == 0, i
        assert engine.lookup(_keys(range(STORED))).hits == 0
        assert engine.lease(_keys(SOUND), in_lmdb=True) == [None] * len(SOUND)
        assert engine.lease(_keys(SOUND)) == [None] * len(SOUND)
        assert engine.promote(_keys(SOUND)) == 0
    finally:
        engine.close()
    assert _reads(daemon) == before  # nothing was read from lmdb, leased in it or promoted
    assert _lmdb_located(daemon) == 0  # nor does `kvtier locate` count on it

    # the engine recomputes them and stores every one, sound ones lmdb holds included, in the
    # arena; write-back leaves lmdb alone, and the arena answers for them
    writer = ArenaClient(daemon.files.socket, "r3")
    try:
        assert writer.store(range(STORED)) == list(range(STORED))
        admin = daemon.admin()
        try:
            assert admin.drain().complete
        finally:
            admin.close()
        found = writer.rpc.lookup(_keys(range(STORED)))
        assert found.hits == STORED
        assert set(found.tier_codes) == {int(TierCode.CPU)}
        verdicts, _ = writer.load(range(STORED), keep=False)
        assert verdicts == [True] * STORED
    finally:
        writer.close()
    assert _reads(daemon) == before  # nothing written into lmdb either
    assert lmdb_chunks(daemon) == len(SOUND)
    # nor claimed as demoted: write-back counts them as skipped
    assert metric(daemon, "kvtier_transfer_chunks_total", direction="demote") == demoted
    assert metric(daemon, "kvtier_writeback_skipped_chunks_total") == STORED
    assert metric(daemon, "kvtier_tier_healthy", tier="lmdb") == 0
    assert UNHEALTHY in daemon.log_text()  # said once, as it was seen
    assert HEALTHY_AGAIN not in daemon.log_text()


def test_an_unhealthy_lmdb_serves_again_once_the_window_holds_fewer_failures(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    daemon = corrupted_daemon(procs, tmp_path, shm_path, window_s=2.0)
    _report_corrupt(daemon)
    wait_for(lambda: UNHEALTHY in daemon.log_text(), REPORT_S, "kvtierd leaves lmdb alone")
    wait_for(lambda: HEALTHY_AGAIN in daemon.log_text(), REPORT_S, "the window passes")
    assert lmdb_health(daemon) == 0  # SERVING
    assert metric(daemon, "kvtier_tier_healthy", tier="lmdb") == 1

    engine = GrpcTierClient(daemon.files.socket, "r2")
    try:
        engine.register_pool(target_spec(), CHUNK)
        for i in SOUND:
            found = engine.lookup(_keys([i]))
            assert (found.hits, found.tier_codes) == (1, bytes([int(TierCode.LMDB)])), i
    finally:
        engine.close()
    assert _lmdb_located(daemon) == 1
    # stores reach lmdb again, and its chunks are read from its map
    store_again_and_read_in_lmdb(daemon)


def test_an_object_store_unhealthy_from_corrupt_objects_is_neither_probed_nor_fetched(
    tmp_path: Path,
) -> None:
    bucket = f"file://{tmp_path}/bucket"
    config = node_config(tmp_path / "b", bucket)
    manager = config.manager.model_copy(update={"integrity_unhealthy_failures": 1})
    writer = TierManager(node_config(tmp_path / "a", bucket))
    try:
        reader = TierManager(config.model_copy(update={"manager": manager}))
    except BaseException:
        writer.close()
        raise
    try:
        namespace = writer.register_pool(target_spec(), CHUNK)
        reader.register_pool(target_spec(), CHUNK)
        keys = keys_for(namespace, 8)  # two packs of four chunks
        assert store(writer, keys) == len(keys)
        uploaded(writer, keys)
        assert writer.object is not None
        assert reader.object is not None
        damaged = tmp_path / "bucket" / writer.object.object_name(keys[0])
        body = bytearray(damaged.read_bytes())
        body[-1] ^= 0xFF  # a payload byte: its headers still index it
        damaged.write_bytes(bytes(body))

        for _ in reader.warmup(object_index=True):  # both packs indexed, none fetched
            pass
        assert reader.lookup(keys).tiers == ["object"] * len(keys)
        assert reader.promote(keys[:4]) == 4  # fetched, found corrupt, deleted
        wait_for(lambda: reader.object.corrupt_chunks() == 1, REPORT_S, "the pack is fetched")
        wait_for(lambda: not reader.health.serves("object"), REPORT_S, "the store is unhealthy")
        fetched = reader.object.stats().counters
        # the sound pack, still indexed, is neither found nor fetched while the store is
        # unhealthy, nor probed for
        assert reader.lookup(keys[4:]).hits == 0
        assert reader.promote(keys[4:]) == 0
        assert reader.object.stats().counters == fetched
        assert reader.health.serves("lmdb")  # lmdb and the arena still serve
        assert store(reader, keys[4:5]) == 1
        assert reader.lookup(keys[4:5]).tiers == ["cpu"]
    finally:
        reader.close()
        writer.close()
        for m in (reader, writer):
            m.config.arena.path.unlink(missing_ok=True)
