"""Chunks an engine reads from lmdb's map itself and finds corrupt are reported to the tiers,
which verify them again, count them, drop them, and mark lmdb unhealthy past a threshold.

With a real kvtierd: chunks are stored, kvtierd stops, a byte of some of them flips on disk,
kvtierd starts again, and engines (the connector's own lmdb reader, beside the data-plane
client) lease and read them. Embedded: the same with the tiers in this process.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import lmdb
import pytest
from kvtier_vllm.kv.lmdb_staging import LmdbStaging
from kvtier_vllm.kv.metadata import ChunkCopy

from kvtier.client import InProcessClient
from kvtier.core.encoder import PartLayout, encoder_spec, item_keys
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk, Failure, SlotRef, TierClient, TierCode, in_lmdb
from kvtier.rpc import GrpcTierClient
from kvtier.tiering.manager import TierManager
from kvtier.tiers.lmdb_reader import DATABASES
from tests.integration.daemon_harness import (
    CHUNK,
    ROOT,
    ArenaClient,
    DaemonFiles,
    Processes,
    RunningDaemon,
    clean_env,
    key_of,
    wait_for,
    write_config,
)
from tests.integration.test_manager import store
from tests.support import keys_for, target_spec

STORED = 6
CORRUPT = (0, 2, 4)
REPORT_S = 15.0  # reports travel with heartbeats (every 0.3 s here)


def _flip(env: lmdb.Environment, chunks: lmdb._Database, keys: Sequence[ChunkKey]) -> None:
    """Flip the last payload byte of each chunk, as a failing disk would."""
    with env.begin(write=True, db=chunks) as txn:
        for key in keys:
            stored = txn.get(key)
            assert stored is not None, key.hex()
            value = bytearray(stored)
            value[-1] ^= 0xFF
            txn.put(key, bytes(value))


def _corrupt(path: Path, keys: Sequence[ChunkKey]) -> None:
    """`_flip` on disk, kvtierd stopped."""
    env = lmdb.open(str(path), max_dbs=len(DATABASES), subdir=True)
    try:
        _flip(env, env.open_db(b"chunks", create=False), keys)
    finally:
        env.close()


def read_in_lmdb(
    client: TierClient, keys: Sequence[ChunkKey]
) -> tuple[list[bool], list[FailedChunk]]:
    """As an engine's worker loads them: leased in lmdb, read and verified from its map by the
    connector's reader; whether each was served, and what failed verification."""
    leases = client.lease(keys, in_lmdb=True)
    assert all(ref is not None and in_lmdb(ref) for ref in leases), leases
    staging = LmdbStaging()
    path = str(client.lmdb_path)
    try:
        served = [
            staging.stage(path, _copy(ref), CHUNK) is not None for ref in leases if ref is not None
        ]
        failed = staging.take_failed()
    finally:
        staging.close()
        client.release([ref for ref in leases if ref is not None])
    return served, failed


def _copy(ref: SlotRef) -> ChunkCopy:
    return ChunkCopy("target", ref.slot, ref.offset, ref.generation, (), key=bytes(ref.key))


def metric(daemon: RunningDaemon, name: str, **labels: str) -> float:
    return sum(
        value
        for found, have, value in daemon.metrics()
        if found == name and all(have.get(k) == v for k, v in labels.items())
    )


def lmdb_chunks(daemon: RunningDaemon) -> int:
    """lmdb's chunks and those found corrupt, as `kvtier stats` shows them; its chunk count."""
    token = daemon.files.config.parent / "admin.token"
    token.write_text(daemon.admin_token or "")
    token.chmod(0o600)
    stats = ["stats", "--address", daemon.admin_address, "--token-file", str(token)]
    shown = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *stats],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert shown[1].split() == ["tier", "used", "capacity", "chunks", "corrupt"], shown
    row = next(line.split() for line in shown[2:] if line.startswith("lmdb "))
    held = int(next(t for t in daemon.stats().tiers if t.tier == "lmdb").usage.chunks)
    corrupt = metric(daemon, "kvtier_integrity_failures_total", tier="lmdb")
    assert row[-2:] == [str(held), str(int(corrupt))], (row, held, corrupt)
    return held


def lmdb_health(daemon: RunningDaemon) -> int:
    """`kvtier health` of lmdb's service: 0 SERVING, 1 not."""
    health = ["health", "--address", daemon.admin_address, "--service", "kvtier.lmdb"]
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *health],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        timeout=60,
    ).returncode


@pytest.fixture
def corrupted(procs: Processes, tmp_path: Path, shm_path: Path) -> RunningDaemon:
    return corrupted_daemon(procs, tmp_path, shm_path)


def corrupted_daemon(
    procs: Processes, tmp_path: Path, shm_path: Path, window_s: float = 300.0
) -> RunningDaemon:
    """kvtierd restarted on an lmdb where the chunks `CORRUPT` of `STORED` had a byte flipped;
    three failures within ``window_s`` make lmdb unhealthy."""
    manager = {"integrity_unhealthy_failures": len(CORRUPT), "integrity_window_s": window_s}
    files: DaemonFiles = write_config(tmp_path, shm_path, {"manager": manager})
    daemon = procs.start_daemon(files)
    writer = ArenaClient(files.socket, "r0")
    try:
        assert writer.store(range(STORED)) == list(range(STORED))
    finally:
        writer.close()
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0  # the arena is written back first
    _corrupt(files.lmdb, [key_of(i) for i in CORRUPT])
    return procs.start_daemon(files)


def test_corrupt_chunks_an_engine_reads_are_reported_counted_and_dropped(
    corrupted: RunningDaemon,
) -> None:
    daemon = corrupted
    socket = daemon.files.socket
    keys = [key_of(i) for i in range(STORED)]
    # the operator's view before: nothing corrupt found, every chunk held, lmdb healthy
    assert metric(daemon, "kvtier_integrity_failures_total", tier="lmdb") == 0
    assert lmdb_chunks(daemon) == STORED
    assert metric(daemon, "kvtier_tier_healthy", tier="lmdb") == 1
    assert lmdb_health(daemon) == 0

    engine = GrpcTierClient(socket, "r1")
    try:
        engine.register_pool(target_spec(), CHUNK)
        served, failed = read_in_lmdb(engine, keys)
        assert served == [i not in CORRUPT for i in range(STORED)]  # nothing corrupt served
        assert [f.key for f in failed] == [keys[i] for i in CORRUPT]
        assert {(f.tier, f.what) for f in failed} == {(TierCode.LMDB, Failure.PAYLOAD)}
        engine.report_failed(failed)
        wait_for(
            lambda: metric(daemon, "kvtier_integrity_failures_total", tier="lmdb") == len(CORRUPT),
            REPORT_S,
            "kvtierd counts the reported chunks",
        )
    finally:
        engine.close()
    assert metric(daemon, "kvtier_integrity_reports_total", tier="lmdb", result="confirmed") == 3
    assert metric(daemon, "kvtier_integrity_failures_total", tier="lmdb", pool="target") == 3
    assert lmdb_chunks(daemon) == STORED - len(CORRUPT)  # dropped from lmdb and its index
    wait_for(lambda: lmdb_health(daemon) == 1, REPORT_S, "kvtier health names lmdb unhealthy")
    assert metric(daemon, "kvtier_tier_healthy", tier="lmdb") == 0

    # the next engine misses them, with no lease to read and nothing failing again (and, lmdb
    # unhealthy now, misses its sound chunks too: `test_unhealthy_tier`)
    after = GrpcTierClient(socket, "r2")
    try:
        after.register_pool(target_spec(), CHUNK)
        assert [after.lookup([keys[i]]).hits for i in CORRUPT] == [0] * len(CORRUPT)
        assert after.lease([keys[i] for i in CORRUPT], in_lmdb=True) == [None] * len(CORRUPT)
    finally:
        after.close()
    assert metric(daemon, "kvtier_integrity_failures_total", tier="lmdb") == len(CORRUPT)


def store_again_and_read_in_lmdb(daemon: RunningDaemon) -> None:
    """Good copies of the chunks `CORRUPT` stored, written back to lmdb and dropped from the
    arena: every chunk of `STORED` is then read from lmdb's map, sound."""
    writer = ArenaClient(daemon.files.socket, "r3")
    try:
        assert writer.store(CORRUPT) == list(CORRUPT)
    finally:
        writer.close()
    admin = daemon.admin()
    try:
        assert admin.drain().complete
        admin.evict(tier="cpu")
    finally:
        admin.close()
    assert lmdb_chunks(daemon) == STORED
    following = GrpcTierClient(daemon.files.socket, "r4")
    try:
        following.register_pool(target_spec(), CHUNK)
        keys = [key_of(i) for i in range(STORED)]
        assert read_in_lmdb(following, keys) == ([True] * STORED, [])
    finally:
        following.close()


def test_a_report_of_a_sound_chunk_a_reused_slot_or_another_pools_chunk_drops_nothing(
    corrupted: RunningDaemon,
) -> None:
    daemon = corrupted
    sound, corrupt = key_of(1), key_of(CORRUPT[0])
    engine = GrpcTierClient(daemon.files.socket, "r1")
    stranger = GrpcTierClient(daemon.files.socket, "r2")
    try:
        engine.register_pool(target_spec(), CHUNK)
        stranger.register_pool(target_spec(model="another-model"), CHUNK)
        engine.report_failed([FailedChunk(sound, TierCode.LMDB, Failure.PAYLOAD)])
        # an arena slot reused under a read: no chunk's fault (this arena holds none now)
        engine.report_failed([FailedChunk(key_of(3), TierCode.CPU, Failure.GENERATION)])
        # a client of other pools cannot have the corrupt chunk dropped either
        stranger.report_failed([FailedChunk(corrupt, TierCode.LMDB, Failure.HEADER)])
        wait_for(
            lambda: (
                metric(daemon, "kvtier_integrity_reports_total", result="refused") == 1
                and metric(daemon, "kvtier_integrity_reports_total", result="foreign") == 1
                and metric(daemon, "kvtier_integrity_reports_total", tier="cpu", result="gone") == 1
            ),
            REPORT_S,
            "kvtierd counts the three reports",
        )
    finally:
        engine.close()
        stranger.close()
    assert metric(daemon, "kvtier_integrity_failures_total") == 0
    assert metric(daemon, "kvtier_integrity_reports_total", result="confirmed") == 0
    assert lmdb_chunks(daemon) == STORED
    assert lmdb_health(daemon) == 0


def _checked(manager: TierManager, confirmed: int) -> None:
    """Until the reports' checks (on their own thread) confirmed ``confirmed`` chunks."""
    counts = manager.integrity.report_counts
    wait_for(lambda: counts()[("lmdb", "confirmed")] == confirmed, REPORT_S, "reports checked")


def _in_lmdb_only(m: TierManager, keys: list[ChunkKey]) -> None:
    assert store(m, keys) == len(keys)
    assert m.flush()
    m.evict("cpu")


def test_embedded_corrupt_chunks_are_reported_counted_dropped_and_stored_again(
    manager: TierManager,
) -> None:
    assert manager.lmdb is not None
    client = InProcessClient(manager, "r0")
    keys = keys_for(client.register_pool(target_spec(), CHUNK), STORED)
    _in_lmdb_only(manager, keys)
    _corrupt_in_process(manager, [keys[i] for i in CORRUPT])
    served, failed = read_in_lmdb(client, keys)
    assert served == [i not in CORRUPT for i in range(STORED)]
    client.report_failed(failed)
    _checked(manager, len(CORRUPT))
    assert manager.lmdb.stats().counters["corrupt"] == len(CORRUPT)
    assert manager.lmdb.contains(keys) == [i not in CORRUPT for i in range(STORED)]
    assert [client.lookup([keys[i]]).hits for i in CORRUPT] == [0] * len(CORRUPT)
    _in_lmdb_only(manager, [keys[i] for i in CORRUPT])  # good copies
    assert read_in_lmdb(client, keys) == ([True] * STORED, [])


def test_an_encoder_part_corrupted_in_lmdb_is_reported_counted_and_dropped(
    manager: TierManager,
) -> None:
    spec = encoder_spec(
        model="vlm",
        encoder_revision="fp-1",
        dtype="float16",
        width=2048,
        rows_per_part=64,
        processor="image:abc",
    )
    layout = PartLayout.of(spec)
    assert layout.part_bytes == CHUNK
    client = InProcessClient(manager, "r0")
    parts = item_keys(client.register_pool(spec, CHUNK), "item-1", 128, layout)
    _in_lmdb_only(manager, parts)
    _corrupt_in_process(manager, parts[1:])
    served, failed = read_in_lmdb(client, parts)
    assert served == [True, False]
    client.report_failed(failed)
    _checked(manager, 1)
    assert manager.lmdb is not None
    assert manager.lmdb.stats().counters["corrupt"] == 1
    assert manager.lmdb.stats().counters["corrupt:encoder"] == 1  # kvtier_integrity_failures_total
    assert manager.lmdb.contains(parts) == [True, False]


def _corrupt_in_process(manager: TierManager, keys: Sequence[ChunkKey]) -> None:
    """`_flip` through the tiers' own environment (LMDB opens one per file per process)."""
    assert manager.lmdb is not None
    _flip(manager.lmdb.env, manager.lmdb.store.chunks, keys)


def test_reading_and_checking_corrupt_chunks_keeps_no_reader_slot(manager: TierManager) -> None:
    """LMDB's reader table is shared by kvtierd and every engine: a failed verification that
    held its read transaction until the cycle collector ran filled it (MDB_READERS_FULL)."""
    assert manager.lmdb is not None
    client = InProcessClient(manager, "r0")
    keys = keys_for(client.register_pool(target_spec(), CHUNK), 40)
    for start in range(0, len(keys), 10):
        _in_lmdb_only(manager, keys[start : start + 10])
    _corrupt_in_process(manager, keys)
    gc.disable()  # what the collector would free at some later time is not counted as freed
    try:
        served, failed = read_in_lmdb(client, keys)
        assert served == [False] * len(keys)
        assert manager.integrity.reported(failed, "test") == {"confirmed": len(keys)}
        slots = manager.lmdb.env.readers().strip().splitlines()[1:]  # under the header
    finally:
        gc.enable()
    assert len(slots) <= 4, slots
