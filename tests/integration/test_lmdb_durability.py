"""`lmdb.durability` sets what LMDB flushes at each commit, and every setting stores and reads;
an environment that cannot be moved (a mount point) has its file kept aside instead."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import keys_for, lmdb_config, payload_for, target_spec

CHUNK = 256 << 10
FLAGS = {
    "fast": {"sync": False, "metasync": False},
    "consistent": {"sync": True, "metasync": False},
    "full": {"sync": True, "metasync": True},
}


@pytest.mark.parametrize("durability", sorted(FLAGS))
def test_durability_sets_lmdb_flags(tmp_path: Path, durability: str) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    keys = keys_for(ns, 4)
    config = lmdb_config(tmp_path / "lmdb", durability=durability)
    tier = LmdbTier(config, registry)
    try:
        flags = tier.env.flags()
        assert {k: flags[k] for k in ("sync", "metasync")} == FLAGS[durability]
        assert tier.put_many([(k, payload_for(k, CHUNK)) for k in keys]) == [True] * 4
    finally:
        tier.close()
    tier = LmdbTier(config, registry)
    try:
        assert tier.set_aside is None
        dst = bytearray(CHUNK)
        for key in keys:
            assert tier.read_into(key, memoryview(dst))
            assert bytes(dst) == payload_for(key, CHUNK)
    finally:
        tier.close()


@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Path]:
    """A directory that is a (bind) mount point, as a volume mounted at lmdb.path is."""
    source, target = tmp_path / "volume", tmp_path / "lmdb"
    source.mkdir()
    target.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"bind mounts need CAP_SYS_ADMIN: {done.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_an_unreadable_environment_at_a_mount_point_is_kept_beside_it(mount_point: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    keys = keys_for(ns, 4)
    config = lmdb_config(mount_point)
    tier = LmdbTier(config, registry)
    assert tier.put_many([(k, payload_for(k, CHUNK)) for k in keys]) == [True] * 4
    tier.close()
    data = mount_point / "data.mdb"
    with data.open("r+b") as f:
        f.write(b"\xa5" * 8192)  # both meta pages
    tier = LmdbTier(config, registry)
    try:
        assert tier.set_aside is not None
        assert tier.set_aside.parent == mount_point  # the directory cannot move
        assert tier.set_aside.name.startswith("data.mdb.unreadable-")
        assert tier.set_aside.read_bytes()[:8192] == b"\xa5" * 8192
        assert tier.contains(keys) == [False] * 4
        assert tier.put_many([(k, payload_for(k, CHUNK)) for k in keys]) == [True] * 4
    finally:
        tier.close()
