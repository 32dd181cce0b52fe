"""The lmdb tier writes through LMDB's map only over a preallocated file; a file that cannot be
preallocated, or a disk that fills, gives errors, never SIGBUS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvtier.core.pools import PoolRegistry
from kvtier.tiers import lmdb_env
from kvtier.tiers.lmdb_env import DATA_FILE, allocated_bytes, preallocate
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import MiB, keys_for, lmdb_config, payload_for, target_spec

CHUNK = 256 << 10


def _tier(path: Path, budget: int = 8 * MiB) -> tuple[LmdbTier, bytes]:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    return LmdbTier(lmdb_config(path, budget, preallocate=True), registry), ns


def _used_bytes(env: lmdb.Environment) -> int:
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def test_writes_go_through_a_preallocated_map(tmp_path: Path) -> None:
    tier, ns = _tier(tmp_path / "lmdb")
    keys = keys_for(ns, 8)
    try:
        assert tier.env.flags()["writemap"]
        data = tmp_path / "lmdb" / DATA_FILE
        map_size = tier.env.info()["map_size"]
        assert allocated_bytes(data) >= map_size
        assert tier.put_many([(k, payload_for(k, CHUNK)) for k in keys]) == [True] * 8
        assert os.stat(data).st_size == map_size  # LMDB never grows it past the map
    finally:
        tier.close()
    tier, _ = _tier(tmp_path / "lmdb")
    try:
        assert tier.set_aside is None
        dst = memoryview(bytearray(CHUNK))
        for key in keys:
            assert tier.read_into(key, dst)
            assert bytes(dst) == payload_for(key, CHUNK)
    finally:
        tier.close()


def test_without_preallocation_writes_are_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lmdb_env, "_fallocate", None)
    tier, ns = _tier(tmp_path / "lmdb")
    try:
        assert not tier.env.flags()["writemap"]
        assert "cannot preallocate" in caplog.text
        key = keys_for(ns, 1)[0]
        assert tier.put(key, payload_for(key, CHUNK))
        dst = memoryview(bytearray(CHUNK))
        assert tier.read_into(key, dst)
        assert bytes(dst) == payload_for(key, CHUNK)
    finally:
        tier.close()


def test_a_file_cut_below_its_pages_is_still_set_aside(tmp_path: Path) -> None:
    tier, ns = _tier(tmp_path / "lmdb")
    keys = keys_for(ns, 8)
    try:
        assert tier.put_many([(k, payload_for(k, CHUNK)) for k in keys]) == [True] * 8
        used = _used_bytes(tier.env)
    finally:
        tier.close()
    os.truncate(tmp_path / "lmdb" / DATA_FILE, used // 2)
    tier, _ = _tier(tmp_path / "lmdb")
    try:
        assert tier.set_aside is not None
        assert tier.contains(keys) == [False] * 8
        assert tier.env.flags()["writemap"]
    finally:
        tier.close()


def test_allocated_bytes_leaves_out_holes(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse"
    with sparse.open("wb") as f:
        f.truncate(64 * MiB)
    assert allocated_bytes(sparse) < MiB
    assert preallocate(sparse, 64 * MiB) is None
    assert allocated_bytes(sparse) == 64 * MiB
    assert allocated_bytes(tmp_path / "absent") == 0


# A file size limit stands in for a full disk: past it, writes and fallocate fail (EFBIG) the way
# they fail with ENOSPC, where no tiny filesystem can be mounted without privileges.
_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import keys_for, lmdb_config, payload_for, target_spec

path, limit, before_open = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
registry = PoolRegistry()
chunk = 256 << 10
ns = registry.register(target_spec(), chunk).namespace
if before_open:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
tier = LmdbTier(lmdb_config(path, 32 << 20, sync_interval_s=0, preallocate=True), registry)
if not before_open:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
keys = keys_for(ns, 64)
stored = [tier.put(k, payload_for(k, chunk)) for k in keys]
dst = memoryview(bytearray(chunk))
readable = all(
    tier.read_into(k, dst) and bytes(dst) == payload_for(k, chunk)
    for k, ok in zip(keys, stored) if ok
)
counters = tier.stats().counters
writemap = tier.env.flags()["writemap"]
tier.close()
print(json.dumps({"writemap": writemap, "stored": stored, "readable": readable,
                  "failed": counters.get("store_failed", 0)}))
"""


def _fill(path: Path, limit: int, before_open: bool) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(path), str(limit), "1" if before_open else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr  # a SIGBUS would end it with -7
    result: dict[str, object] = json.loads(done.stdout)
    result["log"] = done.stderr
    return result


def test_a_disk_too_small_for_the_map_keeps_writes_staged_and_fails_them_cleanly(
    tmp_path: Path,
) -> None:
    result = _fill(tmp_path / "lmdb", 8 * MiB, before_open=True)
    assert result["writemap"] is False
    assert "cannot preallocate" in str(result["log"])
    stored = result["stored"]
    assert isinstance(stored, list)
    assert any(stored)
    assert not all(stored)
    assert result["failed"] > 0  # type: ignore[operator]
    assert "write failed" in str(result["log"])
    assert result["readable"] is True
    assert os.stat(tmp_path / "lmdb" / DATA_FILE).st_size <= 8 * MiB


def test_a_disk_full_after_open_does_not_stop_writes_through_the_map(tmp_path: Path) -> None:
    # the blocks were allocated at open: writes through the map need none, so the cache still
    # fills to its budget and evicts
    result = _fill(tmp_path / "lmdb", 1 * MiB, before_open=False)
    assert result["writemap"] is True
    assert result["stored"] == [True] * 64
    assert result["failed"] == 0
    assert result["readable"] is True


_GROW = """
import lmdb, sys
env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), max_dbs=8)
with env.begin(write=True, db=env.open_db(b"scratch")) as txn:
    for i in range(int(sys.argv[3])):  # past the tier's map: it must adopt the new one
        txn.put(b"%d" % i, b"x" * (1 << 20))
"""


def test_a_map_grown_by_another_process_is_preallocated_too(tmp_path: Path) -> None:
    tier, ns = _tier(tmp_path / "lmdb")
    try:
        before = tier.env.info()["map_size"]
        grown = 2 * before
        subprocess.run(
            [sys.executable, "-c", _GROW, str(tmp_path / "lmdb"), str(grown), str(before // MiB)],
            check=True,
            timeout=60,
        )
        first, second = keys_for(ns, 2)
        assert tier.put(first, payload_for(first, CHUNK))  # adopts the new size on the way
        assert tier.env.info()["map_size"] == grown
        assert tier.env.flags()["writemap"]
        assert allocated_bytes(tmp_path / "lmdb" / DATA_FILE) >= grown
        assert tier.put(second, payload_for(second, CHUNK))
    finally:
        tier.close()


def test_by_default_the_data_file_grows_with_its_pages(tmp_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    tier = LmdbTier(lmdb_config(tmp_path / "lmdb", 64 * MiB), registry)
    try:
        assert not tier.env.flags()["writemap"]
        for key in keys_for(ns, 4):
            assert tier.put(key, payload_for(key, CHUNK))
        tier.sync()
        # no map-sized allocation: the file holds its pages, not 64 MiB and more
        assert allocated_bytes(tmp_path / "lmdb" / DATA_FILE) < 8 * MiB
    finally:
        tier.close()
