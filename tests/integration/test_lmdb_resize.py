"""Another process grows the LMDB map; the tier adopts the new size instead of failing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import MiB, keys_for, lmdb_config, payload_for, target_spec

CHUNK = 256 << 10

GROW = """
import lmdb, sys
env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), max_dbs=8)
db = env.open_db(b"scratch")
with env.begin(write=True, db=db) as txn:
    for i in range(40):
        txn.put(b"%d" % i, b"x" * (2 << 20))
print(env.info()["map_size"])
"""


def test_map_resized_by_another_process_is_adopted(tmp_path: Path) -> None:
    registry = PoolRegistry()
    ns = registry.register(target_spec(), CHUNK).namespace
    tier = LmdbTier(lmdb_config(tmp_path / "lmdb", 8 * MiB), registry)
    try:
        before = tier.env.info()["map_size"]
        first, second = keys_for(ns, 2)
        assert tier.put(first, payload_for(first, CHUNK))
        grown = 4 * before
        out = subprocess.run(
            [sys.executable, "-c", GROW, str(tmp_path / "lmdb"), str(grown)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert int(out.stdout) == grown
        dst = memoryview(bytearray(CHUNK))
        assert tier.read_into(first, dst)  # read transactions see the resize first
        assert bytes(dst) == payload_for(first, CHUNK)
        assert tier.put(second, payload_for(second, CHUNK))
        assert tier.env.info()["map_size"] == grown
    finally:
        tier.close()
