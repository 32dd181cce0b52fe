"""A process that owns the arena is killed (SIGKILL, no close): its successor at the same path
writes what was committed there to lmdb once the namespace registers again. Real processes, a
real arena in /dev/shm and lmdb on disk."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvtier.tiering.manager import TierManager
from kvtier.tiers.arena_salvage import StaleArena
from tests.support import keys_for, manager_config, payload_for, target_spec

CHUNK = 256 << 10
COMMITTED = 8
UNCOMMITTED = 2
ARGS = (str(COMMITTED), str(UNCOMMITTED))

OWNER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvtier.tiering.manager import TierManager
    from tests.support import keys_for, manager_config, payload_for, target_spec

    shm, tmp, chunk, committed, uncommitted = sys.argv[1:]
    chunk, committed, uncommitted = int(chunk), int(committed), int(uncommitted)
    # no clean reserve: nothing is written back, the chunks are in the arena only
    m = TierManager(manager_config(Path(shm), Path(tmp), arena_mib=6, clean_reserve=0.0))
    ns = m.register_pool(target_spec(), chunk)
    keys = keys_for(ns, committed + uncommitted)
    refs = [r for r in m.reserve(keys) if r is not None]
    for ref in refs:
        m.cpu.view(ref)[:] = payload_for(ref.key, chunk)
    assert m.commit(refs[:committed]) == committed
    # a chunk is kept only with its commit checksum, which a thread takes after the commit
    deadline = time.monotonic() + 30.0
    while m.cpu.stats().counters["commit_checksums"] < committed:
        assert time.monotonic() < deadline, "commit checksums not taken"
        time.sleep(0.01)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_what_a_killed_owner_committed_reaches_lmdb(shm_path: Path, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, *map(str, (shm_path, tmp_path, CHUNK)), *ARGS],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
        owner.send_signal(signal.SIGKILL)
        assert owner.wait(30) == -signal.SIGKILL
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    m = TierManager(manager_config(shm_path, tmp_path, arena_mib=6))
    try:
        assert m.stale is not None, "the dead owner's arena was not read"
        # nothing of it in lmdb yet: the killed process never wrote back
        assert m.lmdb is not None
        assert not m.lmdb.namespace_chunks()
        ns = m.register_pool(target_spec(), CHUNK)
        assert m.stale is None, "everything it held was kept: it is let go"
        keys = keys_for(ns, COMMITTED + UNCOMMITTED)
        found = m.lookup(keys)
        assert found.tiers == ["lmdb"] * COMMITTED, "committed chunks kept, written ones not"
        leases = m.lease(keys[:COMMITTED])
        assert all(ref is not None for ref in leases)
        for key, ref in zip(keys, leases, strict=False):
            assert ref is not None
            assert bytes(m.cpu.view(ref)) == payload_for(key, CHUNK)
        m.release([r for r in leases if r is not None])
    finally:
        m.close()


def test_an_arena_a_live_owner_holds_is_not_read(shm_path: Path, tmp_path: Path) -> None:
    first = TierManager(manager_config(shm_path, tmp_path / "a", arena_mib=6))
    try:
        ns = first.register_pool(target_spec(), CHUNK)
        refs = [r for r in first.reserve(keys_for(ns, 2)) if r is not None]
        first.commit(refs)
        assert StaleArena.at(first.config.arena) is None
    finally:
        first.close()
