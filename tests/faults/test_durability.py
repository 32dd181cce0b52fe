"""What an OS crash can leave of lmdb: a daemon that finds its environment unreadable (the file
cut short, or garbled) keeps it aside, starts empty and serves."""

from __future__ import annotations

import hashlib
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from tests.integration.daemon_harness import Processes, write_config


def _used_bytes(data: Path) -> int:
    """What LMDB's pages take of the file (preallocated to the whole map, it is longer)."""
    env = lmdb.open(str(data.parent), readonly=True, lock=False)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def _truncate(data: Path) -> None:
    os.truncate(data, _used_bytes(data) // 2)


def _garble(start: int, end: int | None) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        rng = random.Random(7)
        stop = _used_bytes(data) if end is None else end
        with data.open("r+b") as f:
            f.seek(start)
            f.write(rng.randbytes(stop - start))

    return damage


DAMAGE = {
    "truncated": _truncate,  # an OS crash before the file's tail reached the disk
    "garbled-meta": _garble(0, 8192),  # both meta pages
    "garbled-pages": _garble(8192, None),  # every page in use but the meta pages
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_unreadable_lmdb_is_kept_aside_and_the_daemon_serves(
    procs: Processes, tmp_path: Path, shm_path: Path, damage: str
) -> None:
    files = write_config(tmp_path, shm_path)
    daemon = procs.start_daemon(files)
    assert procs.client(files.socket, "dp0", "--store", "0:8")["stored"] == list(range(8))
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0

    data = files.lmdb / "data.mdb"
    DAMAGE[damage](data)
    damaged = hashlib.sha256(data.read_bytes()).hexdigest()

    daemon = procs.start_daemon(files)
    try:
        aside = [p for p in tmp_path.iterdir() if p.name.startswith("lmdb.unreadable-")]
        assert len(aside) == 1, sorted(p.name for p in tmp_path.iterdir())
        kept = aside[0] / "data.mdb"
        assert hashlib.sha256(kept.read_bytes()).hexdigest() == damaged
        log = daemon.log_text()
        assert f"lmdb environment {files.lmdb} is unreadable" in log, log
        assert str(aside[0]) in log, log
        # what the damaged environment held is gone; everything else works
        assert procs.client(files.socket, "dp0", "--lookup", "0:8")["hits"] == 0
        assert procs.client(files.socket, "dp0", "--store", "20:24")["stored"] == list(
            range(20, 24)
        )
        found = procs.client(files.socket, "dp1", "--lookup", "20:24", "--load", "20:24")
        assert found["hits"] == 4
        assert found["loaded"] == [True] * 4
        stats = daemon.stats()
        lmdb = next(t for t in stats.tiers if t.tier == "lmdb")
        assert lmdb.counters["environments_set_aside"] == 1
    finally:
        assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
    # the fresh environment is sound: the next start keeps it
    daemon = procs.start_daemon(files)
    try:
        found = procs.client(files.socket, "dp0", "--lookup", "20:24", "--load", "20:24")
        assert found["loaded"] == [True] * 4
        assert len([p for p in tmp_path.iterdir() if ".unreadable-" in p.name]) == 1
    finally:
        assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
