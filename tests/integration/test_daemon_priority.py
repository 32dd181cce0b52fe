"""kvtierd's background threads at a lower CPU priority (`manager.background_nice`): write-back,
promotion, uploads, downloads and the sweeps take the configured nice value, while the threads
answering calls keep the process's. A real daemon with a file:// object store; each thread's
name and nice value are read from /proc."""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path

import pytest

from tests.integration.daemon_harness import (
    ArenaClient,
    DaemonFiles,
    Processes,
    wait_for,
    write_config,
)
from tests.support import MiB, thread_nices

NICE = 7  # not the default: the configured value is what reaches the threads
BACKGROUND = (
    "kvtier-writebac",  # the kernel keeps 15 bytes of a name
    "kvtier-promote",
    "kvtier-commit-h",
    "kvtier-lmdb-syn",
    "kvtier-object-c",
    "kvtier-packer",
    "kvtier-upload_0",
    "kvtier-download",
    "kvtier-reaper",
)


@pytest.fixture
def daemon_files(tmp_path: Path, shm_path: Path) -> DaemonFiles:
    store = {"url": f"file://{tmp_path}/bucket", "index_path": str(tmp_path / "objindex")}
    store["index_map_bytes"] = 64 * MiB
    return write_config(tmp_path, shm_path, {"manager": {"background_nice": NICE}, "object": store})


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
def test_background_threads_run_at_the_configured_nice_and_the_call_threads_at_the_processs(
    procs: Processes, daemon_files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(daemon_files)
    pid = daemon.proc.pid
    with closing(ArenaClient(daemon_files.socket, "dp0")) as client:
        # stores (hashed, written back, uploaded), loads, and a lookup past them that probes
        # the store: every mover has started
        assert client.store(range(8)) == list(range(8))
        wait_for(lambda: daemon.chunks_moved("demote") == 8, 10.0, "the stores written back")
        verdicts, _ = client.load(range(8), keep=False)
        assert verdicts == [True] * 8
        client.rpc.lookup_unleased([client.key(i) for i in range(8, 12)], (), False, False)

        def started() -> bool:
            names = {name for name, _ in thread_nices(pid).values()}
            return all(any(n.startswith(b) for n in names) for b in BACKGROUND)

        wait_for(started, 10.0, f"threads {BACKGROUND} running")
        by_tid = thread_nices(pid)
    base = by_tid[pid][1]  # the main thread's: what the process was started with
    threads = list(by_tid.values())
    background = [(n, nice) for n, nice in threads if n.startswith(BACKGROUND)]
    others = [(n, nice) for n, nice in threads if not n.startswith(BACKGROUND)]
    assert {nice for _, nice in background} == {max(NICE, base)}, background
    assert any(n.startswith("kvtier-data") for n, _ in others), others  # it served the calls
    assert [(n, nice) for n, nice in others if nice != base] == []
