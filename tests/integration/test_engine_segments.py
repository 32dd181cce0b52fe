"""The engine fixtures remove the shared-memory segments a killed engine process created, and
only those: a segment this process maps (its own, or one it shares with the engine) stays.
Real processes and segments in /dev/shm, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from tests.fixtures.processes import (
    remove_segments,
    segments_of,
    spawn_group,
    stop_group,
    wait_exited,
)

ENGINE = textwrap.dedent(
    """
    import sys, time
    from multiprocessing import resource_tracker, shared_memory

    own = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(own._name, "shared_memory")  # as vLLM's: its own to unlink
    shared = shared_memory.SharedMemory(sys.argv[1])
    resource_tracker.unregister(shared._name, "shared_memory")  # attaching registers it too
    print(own.name, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def ours() -> Iterator[shared_memory.SharedMemory]:
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    yield segment
    segment.close()
    segment.unlink()


def test_a_killed_engines_own_segments_go_and_shared_ones_stay(
    ours: shared_memory.SharedMemory,
) -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, ours.name], stdout=subprocess.PIPE, text=True
    )
    try:
        assert engine.stdout is not None
        own = Path("/dev/shm", engine.stdout.readline().strip())
        segments = segments_of([engine.pid])
        assert segments == {own}, "a segment this process maps is not the engine's to leave"
        engine.send_signal(signal.SIGKILL)
        assert engine.wait(30) == -signal.SIGKILL
        wait_exited([engine.pid])
        assert own.exists(), "nothing unlinked what the killed engine created"
        remove_segments(segments)
        assert not own.exists()
        assert Path("/dev/shm", ours.name).exists()
    finally:
        engine.kill()
        engine.wait()
        if engine.stdout is not None:
            engine.stdout.close()


def test_a_stopped_servers_group_leaves_no_segment_of_its_own(
    ours: shared_memory.SharedMemory, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    server = spawn_group([sys.executable, "-c", ENGINE, ours.name], log, os.environ)
    try:
        deadline = time.monotonic() + 30.0
        while not log.read_text().strip():
            assert time.monotonic() < deadline, "the server made no segment"
            time.sleep(0.05)
        own = Path("/dev/shm", log.read_text().strip())
        assert own.exists()
        stop_group(server, grace_s=0.0)  # SIGTERM: a process that dies without unlinking
        assert not own.exists()
        assert Path("/dev/shm", ours.name).exists()
    finally:
        stop_group(server, grace_s=0.0)
