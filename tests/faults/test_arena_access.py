"""Who may map the arena: a client in the socket's group stores and loads through it, one outside
is refused at the socket, and an arena closed to the group is refused with the reason.

kvtierd runs as root here; each client drops to another uid after its imports (the interpreter
lives where other uids cannot read), so the socket and the arena are checked as that uid."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.daemon_harness import (
    CLIENT_TIMEOUT_S,
    ROOT,
    Processes,
    clean_env,
    write_config,
)

GROUP = 47321  # the engines' group; no entry in /etc/group is needed
MEMBER: tuple[int, int, list[int]] = (47322, 47322, [GROUP])
OUTSIDER: tuple[int, int, list[int]] = (47323, 47323, [])

_AS_USER = """
import json, os, sys
import tests.integration.daemon_harness as harness
uid, gid, groups = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
harness.main(sys.argv[4:])
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts clients as other uids")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    # pytest's tmp_path is closed to other uids; the socket's directory must not be
    path = Path(tempfile.mkdtemp(prefix="kvt-access-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _client_as(
    who: tuple[int, int, list[int]], socket: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    uid, gid, groups = who
    argv = [sys.executable, "-c", _AS_USER, str(uid), str(gid), repr(groups)]
    argv += ["client", "--socket", str(socket), "--replica", f"uid{uid}", *args]
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        check=False,
    )


def _start(procs: Processes, directory: Path, arena: Path, **arena_keys: Any) -> Path:
    files = write_config(directory, arena, {"server": {"group": GROUP}, "arena": arena_keys})
    procs.start_daemon(files)
    return files.socket


def test_a_client_in_the_group_stores_and_loads_through_the_arena(
    procs: Processes, shared_dir: Path, shm_path: Path
) -> None:
    socket = _start(procs, shared_dir, shm_path)
    for path in (socket, shm_path):
        st = os.stat(path)
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (GROUP, 0o660), path
    done = _client_as(MEMBER, socket, "--store", "0:4", "--load", "0:4")
    assert done.returncode == 0, done.stderr
    result = done.stdout.splitlines()[-1]
    assert '"stored": [0, 1, 2, 3]' in result, result
    assert '"loaded": [true, true, true, true]' in result, result


def test_a_client_outside_the_group_is_refused_at_the_socket(
    procs: Processes, shared_dir: Path, shm_path: Path
) -> None:
    socket = _start(procs, shared_dir, shm_path)
    done = _client_as(OUTSIDER, socket, "--store", "0:1")
    assert done.returncode != 0
    assert "no access to the socket" in done.stderr, done.stderr
    assert "server.group" in done.stderr, done.stderr
    assert "stored" not in done.stdout


def test_an_arena_closed_to_the_group_is_refused_with_the_reason(
    procs: Processes, shared_dir: Path, shm_path: Path
) -> None:
    socket = _start(procs, shared_dir, shm_path, file_mode=0o600)
    done = _client_as(MEMBER, socket, "--store", "0:1")
    assert done.returncode != 0
    assert f"cannot map the arena {shm_path}: permission denied (mode 0600" in done.stderr
    assert "server.group" in done.stderr, done.stderr
