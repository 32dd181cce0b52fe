"""kvtierd writes the arena to lmdb while no engine is busy, and beside a busy one only what the
clean reserve needs, so that writing takes no CPU from a forward. Real daemon; busy and idle are
said by the client's heartbeats, and a lookup or reserve says busy at once."""

from __future__ import annotations

import time
from contextlib import closing

from tests.integration.daemon_harness import (
    ArenaClient,
    DaemonFiles,
    Processes,
    wait_for,
)

HELD_S = 1.5  # three write-back wakes and five heartbeats: long enough to see nothing written


def test_write_back_waits_for_a_busy_engine_and_runs_once_it_is_idle(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with closing(ArenaClient(files.socket, "dp0")) as client:
        client.rpc.set_busy(True)
        # 16 chunks of 256 KiB: a quarter of the 32 MiB arena, far inside its clean reserve
        assert client.store(range(16)) == list(range(16))
        time.sleep(HELD_S)
        assert daemon.chunks_moved("demote") == 0, "written to lmdb beside a busy engine"
        client.rpc.set_busy(False)
        wait_for(lambda: daemon.chunks_moved("demote") == 16, 20.0, "every chunk written once idle")

        # a reserve says busy before any heartbeat does; the client says so first as well, or
        # a heartbeat sent between the reserve and set_busy would say idle again
        client.rpc.set_busy(True)
        assert client.store(range(16, 32)) == list(range(16, 32))
        time.sleep(HELD_S)
        assert daemon.chunks_moved("demote") == 16, "written to lmdb beside a busy engine"
        client.rpc.set_busy(False)
        wait_for(lambda: daemon.chunks_moved("demote") == 32, 20.0, "every chunk written once idle")


def test_a_busy_engine_still_gets_the_clean_slots_its_stores_need(
    procs: Processes, files: DaemonFiles
) -> None:
    """Stores past what the arena holds, all from a busy engine: the reserve's write-back runs
    beside it, so the stores find clean slots to take."""
    daemon = procs.start_daemon(files)
    chunks = 3 * (32 << 20) // (256 << 10)  # three arenas' worth
    with closing(ArenaClient(files.socket, "dp0")) as client:
        client.rpc.set_busy(True)
        for start in range(0, chunks, 8):
            wanted = set(range(start, start + 8))
            deadline = time.monotonic() + 5.0
            while wanted:  # a store never waits for the writer: it is offered again
                wanted -= set(client.store(sorted(wanted)))
                assert time.monotonic() < deadline, f"no slot for {sorted(wanted)}"
                if wanted:
                    time.sleep(0.02)
        assert daemon.chunks_moved("demote") >= chunks - (32 << 20) // (256 << 10)
        verdicts, _ = client.load(range(chunks - 8, chunks), keep=False)
        assert verdicts == [True] * 8
