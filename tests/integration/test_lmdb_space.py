"""lmdb's environments keep writing: a reader killed inside its read (a real process, SIGKILL) does
not fill the map for good; a full disk (a real tmpfs of a few MiB) refuses writes, counted and
shown (the tier's counters, kvtierd's kvtier.lmdb health and metrics), until space returns; the
event log stays within its bytes and survives a map-full; the files are closed to other users."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest

from kvtier.cli.connect import Connection
from kvtier.cli.health import check
from kvtier.core.counters import Counters
from kvtier.core.lmdb_space import Space
from kvtier.core.pools import PoolRegistry
from kvtier.fleet.event_log import EventLog
from kvtier.server.daemon import LMDB_HEALTH_SERVICE
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.integration.daemon_harness import Processes, write_config
from tests.support import MiB, keys_for, lmdb_config, payload_for, target_spec

CHUNK = 1 * MiB

_READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=8)
txn = env.begin()
txn.cursor().first()
print("reading", flush=True)
time.sleep(600)
"""


def kill_inside_a_read(path: Path) -> None:
    """A process that opens the environment at ``path``, starts a read transaction, and is
    killed (SIGKILL) inside it: its reader slot is left behind."""
    with subprocess.Popen(
        [sys.executable, "-c", _READER, str(path)], stdout=subprocess.PIPE, text=True
    ) as reader:
        try:
            assert reader.stdout is not None
            assert reader.stdout.readline().strip() == "reading"
        finally:
            reader.send_signal(signal.SIGKILL)
            reader.wait(timeout=30)
    assert reader.returncode == -signal.SIGKILL


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def registry() -> PoolRegistry:
    registry = PoolRegistry()
    registry.register(target_spec(), CHUNK)
    return registry


def _namespace(registry: PoolRegistry) -> bytes:
    return registry.registrations()[0].namespace


def _write(tier: LmdbTier, registry: PoolRegistry, start: int, count: int) -> int:
    """Store ``count`` new chunks one by one; how many were stored."""
    keys = keys_for(_namespace(registry), count, start=start)
    return sum(tier.put(key, payload_for(key, CHUNK)) for key in keys)


# -- a reader killed inside its read ---------------------------------------------------------


def test_after_a_reader_is_killed_inside_its_read_lmdb_keeps_committing(
    tmp_path: Path, registry: PoolRegistry
) -> None:
    config = lmdb_config(tmp_path / "lmdb", 8 * MiB)  # reaped every 30 s: not in this test
    tier = LmdbTier(config, registry)
    try:
        assert _write(tier, registry, 0, 4) == 4
        kill_inside_a_read(config.path)
        # twice the map written: without the dead reader's slot cleared, no page is reused
        rounds = 2 * tier.env.info()["map_size"] // CHUNK
        stored = _write(tier, registry, 4, rounds)
        assert stored == rounds, f"{stored} of {rounds} stored: {tier.stats().counters}"
        counters = tier.stats().counters
        assert counters["stale_readers"] == 1
        assert counters["disk_full"] == 0
        assert tier.space.full == ""
    finally:
        tier.close()


def test_a_dead_readers_slot_is_cleared_every_interval(
    tmp_path: Path, registry: PoolRegistry
) -> None:
    config = lmdb_config(tmp_path / "lmdb", 8 * MiB, reader_check_interval_s=0.1)
    tier = LmdbTier(config, registry)
    try:
        assert _write(tier, registry, 0, 2) == 2
        kill_inside_a_read(config.path)
        wait_for(lambda: tier.stats().counters["stale_readers"] == 1)
        assert tier.stats().counters["map_full"] == 0  # cleared before any write needed it
    finally:
        tier.close()


# -- a full disk -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 24 MiB."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(path: Path) -> None:
    """Write ``path`` until the disk it is on has no space left."""
    with open(path, "wb", buffering=0) as f:
        for size in (64 << 10, 4096):  # then the last partial blocks
            try:
                while True:
                    f.write(b"\xa5" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def test_a_full_disk_refuses_writes_counted_and_shown_until_space_returns(
    small_disk: Path, registry: PoolRegistry
) -> None:
    config = lmdb_config(small_disk / "lmdb", budget_bytes=None, auto_fraction=0.5)
    tier = LmdbTier(config, registry)
    try:
        assert _write(tier, registry, 0, 2) == 2
        fill(small_disk / "ballast")
        refused = 6 - _write(tier, registry, 2, 6)
        assert refused > 0
        counters = tier.stats().counters
        assert counters["disk_full"] == refused
        assert "no space" in tier.space.full
        (small_disk / "ballast").unlink()  # space returns: no restart
        assert _write(tier, registry, 100, 6) == 6
        assert tier.space.full == ""
        assert tier.stats().counters["disk_full"] == refused
    finally:
        tier.close()


# -- the event log ---------------------------------------------------------------------------


def _kept_bytes(log: EventLog) -> int:
    return sum(8 + 2 + len(topic) + len(payload) for _, topic, payload in log.since(0))


def test_the_event_log_is_bounded_by_bytes_under_a_stream_of_batches(tmp_path: Path) -> None:
    capacity = 64 << 10
    log = EventLog(tmp_path / "events", capacity)
    try:
        for i in range(600):
            assert log.append(b"kv", os.urandom(100 + i * 37 % 1900)) == i
            assert _kept_bytes(log) <= capacity
        kept = [seq for seq, _, _ in log.since(0)]
        assert kept == list(range(kept[0], 600))  # the newest, in order
        assert len(kept) < 600
    finally:
        log.close()
    again = EventLog(tmp_path / "events", capacity)  # the bound holds across a restart
    try:
        assert again.append(b"kv", os.urandom(2000)) == 600
        assert _kept_bytes(again) <= capacity
    finally:
        again.close()


def test_the_event_log_keeps_every_batch_after_a_reader_is_killed_inside_its_read(
    tmp_path: Path,
) -> None:
    log = EventLog(tmp_path / "events", 1 * MiB)
    try:
        assert log.append(b"kv", b"first") == 0
        kill_inside_a_read(tmp_path / "events")
        batch = os.urandom(256 << 10)
        # three times the map: its freed pages are reusable only once the dead slot is cleared
        rounds = 3 * (2 * MiB + (16 << 20)) // len(batch)
        seqs = [log.append(b"kv", batch) for _ in range(rounds)]
        assert seqs == list(range(1, rounds + 1))
        assert _kept_bytes(log) <= 1 * MiB
        assert log.full == ""
    finally:
        log.close()


# -- who may read the files ------------------------------------------------------------------


def _modes(path: Path) -> tuple[int, int]:
    data, lock = (stat.S_IMODE(os.stat(path / name).st_mode) for name in ("data.mdb", "lock.mdb"))
    return data, lock


def test_environments_are_created_closed_to_other_users(
    tmp_path: Path, registry: PoolRegistry
) -> None:
    LmdbTier(lmdb_config(tmp_path / "lmdb"), registry).close()
    assert _modes(tmp_path / "lmdb") == (0o600, 0o600)
    EventLog(tmp_path / "events", 1 * MiB).close()
    assert _modes(tmp_path / "events") == (0o600, 0o600)
    # files an older kvtier left open are closed when opened
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(tmp_path / "lmdb" / name, 0o644)
    LmdbTier(lmdb_config(tmp_path / "lmdb"), registry).close()
    assert _modes(tmp_path / "lmdb") == (0o600, 0o600)


def test_with_a_group_the_group_may_read_lmdb_and_take_reader_slots(
    tmp_path: Path, registry: PoolRegistry
) -> None:
    gid = os.getgid()
    LmdbTier(lmdb_config(tmp_path / "lmdb", group=gid), registry).close()
    assert _modes(tmp_path / "lmdb") == (0o640, 0o660)
    assert os.stat(tmp_path / "lmdb" / "data.mdb").st_gid == gid


def test_kvtierd_shows_a_full_lmdb_disk_in_health_and_metrics_until_space_returns(
    procs: Processes, shm_path: Path, tmp_path: Path, small_disk: Path
) -> None:
    lmdb = {"path": str(small_disk / "lmdb"), "budget_bytes": None, "auto_fraction": 0.5}
    overrides = {"lmdb": lmdb, "manager": {"demote_mode": "write_through"}}
    files = write_config(tmp_path, shm_path, overrides)
    daemon = procs.start_daemon(files)

    def lmdb_serving() -> bool:
        return check(Connection(daemon.admin_address, None, None), LMDB_HEALTH_SERVICE, 5.0)[0]

    def disk_full_errors() -> float:
        return sum(
            value
            for name, labels, value in daemon.metrics()
            if name == "kvtier_disk_full_errors_total" and labels["store"] == "lmdb"
        )

    assert lmdb_serving()
    fill(small_disk / "ballast")
    procs.client(files.socket, "a", "--store", "0:16")  # written through to lmdb: refused
    wait_for(lambda: not lmdb_serving())
    assert disk_full_errors() > 0
    assert check(Connection(daemon.admin_address, None, None), "", 5.0)[
        0
    ]  # the daemon itself still serves
    (small_disk / "ballast").unlink()
    procs.client(files.socket, "a", "--store", "16:32")
    wait_for(lmdb_serving)  # no restart


def test_room_made_in_a_transaction_of_its_own_takes_a_write_the_full_map_refused(
    tmp_path: Path,
) -> None:
    env = lmdb.open(str(tmp_path / "env"), map_size=4 * MiB, max_dbs=1)
    try:
        db = env.open_db(b"d")
        small, big = b"\x5a" * (64 << 10), b"\xa5" * (512 << 10)

        def put(value: bytes, key: bytes) -> bool:
            with env.begin(write=True, db=db) as txn:
                return bool(txn.put(key, value))

        stored = 0
        while stored < 1000:  # fill the map with small values
            try:
                put(small, stored.to_bytes(8, "big"))
            except lmdb.MapFullError:
                break
            stored += 1
        assert stored < 1000

        def drop_oldest(txn: lmdb.Transaction, count: int) -> None:
            for i in range(count):
                txn.delete(i.to_bytes(8, "big"))

        def drop_and_put() -> None:
            with env.begin(write=True, db=db) as txn:
                drop_oldest(txn, stored // 2)  # pages freed here are reused only after it commits
                txn.put(b"big", big)

        with pytest.raises(lmdb.MapFullError):
            drop_and_put()

        def make_room(tries: int) -> None:  # more each time, as lmdb's tier and event log do
            with env.begin(write=True, db=db) as txn:
                drop_oldest(txn, tries * stored // 4)

        counters = Counters()
        assert Space(lambda: env, "test", counters).write(lambda: put(big, b"big"), make_room)
        assert counters.snapshot()["map_full"] >= 1
        assert counters.snapshot()["disk_full"] == 0
    finally:
        env.close()
