"""What an embedded arena leaves in its directory: nothing once closed. An owner SIGKILLed
leaves its arena and commit checksums, which its restart at that path takes over; a ledger
whose arena file was removed (by a script that knew only the arena's name) is removed by the
next owner of any arena there, never one a live owner holds. Real processes, real arenas in a
directory of their own in /dev/shm, lmdb on disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiering.manager import TierManager
from kvtier.tiers.commit_checksums import ledger_path
from tests.support import keys_for, manager_config, new_arena_path, payload_for, target_spec

CHUNK = 256 << 10

OWNER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.integration.test_arena_leftovers import open_and_store

    m = open_and_store(Path(sys.argv[1]), Path(sys.argv[2]))
    print("ready", flush=True)
    time.sleep(600)
    """
)


def open_and_store(arena: Path, tmp: Path) -> TierManager:
    """An embedded arena holding one committed chunk, its checksum on file."""
    m = TierManager(manager_config(arena, tmp, arena_mib=6))
    ns = m.register_pool(target_spec(), CHUNK)
    (key,) = keys_for(ns, 1)
    (ref,) = m.cpu.reserve([key])
    assert ref is not None
    m.cpu.view(ref)[:] = payload_for(key, CHUNK)
    assert m.cpu.commit([ref]) == 1
    # a thread of its own takes the commit's checksum: taken now if it has not yet, so that it
    # is on file before the owner says ready
    assert m.cpu.slots.commit_checksum(ref, take_now=True) is not None
    return m


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory of this test's own: what other tests' arenas leave is not its to judge."""
    path = new_arena_path()
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def owners() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for owner in started:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def _owner(arena: Path, tmp: Path, started: list[subprocess.Popen[str]]) -> int:
    """Start a process owning an embedded arena at ``arena``; its pid, once it stored."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(arena), str(tmp)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(owner)
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "ready"
    return owner.pid


def _kill(started: list[subprocess.Popen[str]], pid: int) -> None:
    (owner,) = [o for o in started if o.pid == pid]
    owner.send_signal(signal.SIGKILL)
    assert owner.wait(30) == -signal.SIGKILL


def test_a_closed_embedded_arena_leaves_nothing(shm_dir: Path, tmp_path: Path) -> None:
    m = open_and_store(shm_dir / "arena", tmp_path)
    assert sorted(os.listdir(shm_dir)) == ["arena", "arena.checksums"]
    m.close()
    assert os.listdir(shm_dir) == []


def test_a_killed_owners_leftovers_go_and_a_live_owners_stay(
    shm_dir: Path, tmp_path: Path, owners: list[subprocess.Popen[str]]
) -> None:
    killed, removed, live = shm_dir / "killed", shm_dir / "removed", shm_dir / "live"
    _kill(owners, _owner(killed, tmp_path / "killed", owners))
    _kill(owners, _owner(removed, tmp_path / "removed", owners))
    _owner(live, tmp_path / "live", owners)
    removed.unlink()  # what a cleanup that knew only the arena's name did
    live.unlink()  # its owner lives on, its ledger in use
    assert ledger_path(removed).exists()
    assert ledger_path(live).exists()
    # the killed owner restarts: it takes over its own arena and ledger, and removes the
    # ledger left without an arena by a dead owner
    m = TierManager(manager_config(killed, tmp_path / "killed", arena_mib=6))
    try:
        assert m.stale is not None, "the killed owner's arena was not read"
        assert sorted(os.listdir(shm_dir)) == ["killed", "killed.checksums", "live.checksums"]
    finally:
        m.close()
    assert os.listdir(shm_dir) == ["live.checksums"]
