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
STARTED = (
    "kvtier-writebac",  # the kernel keeps 15 bytes of a name
    "kvtier-promote",
    "kvtier-commit-h",
    "kvtier-lmdb-syn",
    "kvtier-object-c",
    "kvtier-packer",
    "kvtier-upload_",
    "kvtier-download",
    "kvtier-reaper",
)
"""The background threads this test's calls start (each a prefix of a thread's name)."""
BACKGROUND = (*STARTED, "kvtier-reuploa", "kvtier-integri", "kvtier-catalog", "kvtier-events")
"""And those that may be running too (the re-upload scan after a start ends at once here)."""


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
        # stores (hashed, written back, uploaded), loads, and lookups past them that probe
        # the store: every mover has started
        assert client.store(range(8)) == list(range(8))
        wait_for(lambda: daemon.chunks_moved("demote") == 8, 10.0, "the stores written back")
        verdicts, _ = client.load(range(8), keep=False)
        assert verdicts == [True] * 8
        absent = iter(range(8, 10_000))

        def started() -> bool:
            # a lookup past what is held probes the store, once its identity is resolved
            client.rpc.lookup_unleased([client.key(next(absent))], (), False, False)
            names = {name for name, _ in thread_nices(pid).values()}
            return all(any(n.startswith(b) for n in names) for b in STARTED)

        wait_for(started, 10.0, f"threads {STARTED} running")
        by_tid = thread_nices(pid)
    base = by_tid[pid][1]  # the main thread's: what the process was started with
    threads = list(by_tid.values())
    background = [(n, nice) for n, nice in threads if n.startswith(BACKGROUND)]
    others = [(n, nice) for n, nice in threads if not n.startswith(BACKGROUND)]
    assert {nice for _, nice in background} == {max(NICE, base)}, background
    assert any(n.startswith("kvtier-data") for n, _ in others), others  # it served the calls
    assert [(n, nice) for n, nice in others if nice != base] == []
