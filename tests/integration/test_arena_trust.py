"""kvtierd trusts only its own memory: what clients can write in the shared arena (its bytes, its
extent table, its key index, the file itself) is data to verify, never the daemon's bookkeeping.
Real kvtierd processes killed with SIGKILL, a real arena in /dev/shm, clients writing their own
mapping of it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from kvtier.rpc import GrpcTierClient
from kvtier.tiers.arena import ArenaMemory
from tests.integration.daemon_harness import (
    CHUNK,
    DaemonFiles,
    Processes,
    RunningDaemon,
    expected,
    key_of,
    wait_for,
)
from tests.support import target_spec

EXIT_TIMEOUT_S = 10.0
CALL_DEADLINE_S = 5.0  # generous: a call that answers at all answers far sooner
CHANGED = b"\xa5"


@contextmanager
def _client(socket: Path, timeout_s: float = 10.0) -> Iterator[tuple[GrpcTierClient, ArenaMemory]]:
    """A data-plane client and its own mapping of the arena, as an engine worker has."""
    client = GrpcTierClient(socket, "dp0", timeout_s=timeout_s)
    try:
        client.register_pool(target_spec(), CHUNK)
        arena = ArenaMemory.attach(client.arena_path)
        try:
            yield client, arena
        finally:
            arena.close()
    finally:
        client.close()


def _store(
    daemon: RunningDaemon, client: GrpcTierClient, arena: ArenaMemory, indices: range
) -> None:
    """Store chunks ``indices``, and wait until kvtierd took their commit checksums (a thread does,
    after the commit)."""

    def taken() -> int:
        cpu = next(t for t in daemon.stats().tiers if t.tier == "cpu")
        return int(cpu.counters["commit_checksums"])

    before = taken()
    refs = [ref for ref in client.reserve([key_of(i) for i in indices]) if ref is not None]
    assert len(refs) == len(indices)
    for ref in refs:
        arena.view(ref.offset, ref.nbytes)[:] = expected(ref.key)
    assert client.commit(refs) == len(refs)
    wait_for(lambda: taken() >= before + len(refs), 10.0, "commit checksums taken")


def _slot_of(arena: ArenaMemory, index: int) -> int:
    found = arena.find(key_of(index))
    assert found is not None, f"chunk {index} is not in the arena's index"
    return found[0]


def _kill(daemon: RunningDaemon) -> None:
    daemon.proc.send_signal(signal.SIGKILL)
    assert daemon.proc.wait(EXIT_TIMEOUT_S) == -signal.SIGKILL


def _arena_only(procs: Processes, files: DaemonFiles, n: int) -> tuple[RunningDaemon, list[int]]:
    """A daemon holding chunks 0..n-1 in its arena only (its client says busy, so nothing is
    written back), killed with SIGKILL; the slot of each chunk."""
    daemon = procs.start_daemon(files)
    with _client(files.socket) as (client, arena):
        client.set_busy(True)
        _store(daemon, client, arena, range(n))
        slots = [_slot_of(arena, i) for i in range(n)]
        _kill(daemon)
    return daemon, slots


def _restarted_holds(procs: Processes, files: DaemonFiles, n: int) -> list[int]:
    """Restart kvtierd; the chunks below ``n`` it serves, each checked byte for byte."""
    procs.start_daemon(files)
    found = procs.check(files.socket, end=n)  # registering the pool keeps what was salvaged
    assert found["mismatched"] == [], found
    assert found["not_leased"] == [], found
    return list(found["present"])


def test_salvage_refuses_a_chunk_a_client_rewrote_after_its_commit(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with _client(files.socket) as (client, arena):
        client.set_busy(True)
        _store(daemon, client, arena, range(8))
        victim = _slot_of(arena, 3)
        arena.view(arena.slot_offset(victim), CHUNK)[:] = CHANGED * CHUNK
        _kill(daemon)
    assert _restarted_holds(procs, files, 8) == [0, 1, 2, 4, 5, 6, 7]
    refused = [line for line in files.log.read_text().splitlines() if "refused chunks" in line]
    assert refused, "no refusal logged"
    assert "1 changed since their commit" in refused[-1], refused


def test_salvage_refuses_slots_whose_size_is_not_the_chunks(
    procs: Processes, files: DaemonFiles
) -> None:
    # 2 MiB extents of 256 KiB chunks: 12 chunks fill one extent and part of another
    _, slots = _arena_only(procs, files, 12)
    stale = ArenaMemory.attach(files.arena)
    try:
        extent = slots[0] // stale.max_slots_per_extent
        stale.extent_slot_bytes[extent] = 2 * CHUNK  # a client's word: slots twice the size
    finally:
        stale.close()
    elsewhere = [i for i, slot in enumerate(slots) if slot // stale.max_slots_per_extent != extent]
    assert elsewhere, slots
    assert _restarted_holds(procs, files, 12) == elsewhere


@pytest.mark.parametrize("planted", ["another owner", "a looser mode"])
def test_an_arena_file_that_is_not_kvtierds_own_is_not_adopted(
    procs: Processes, files: DaemonFiles, planted: str
) -> None:
    if planted == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    _arena_only(procs, files, 4)
    if planted == "another owner":
        os.chown(files.arena, os.geteuid() + 4242, -1)
    else:
        os.chmod(files.arena, 0o666)
    assert _restarted_holds(procs, files, 4) == []
    assert "is not adopted" in files.log.read_text()


def test_index_words_a_client_scribbled_never_hang_the_daemon(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with _client(files.socket, timeout_s=CALL_DEADLINE_S) as (client, arena):
        _store(daemon, client, arena, range(8))
        # every entry taken (a key of one byte in slot 0): every probe chain is endless, as the
        # shared words now say; each call below raises past CALL_DEADLINE_S
        arena.index._seq[:] = 2
        arena.index._meta[:] = 1 << 32
        refs = [r for r in client.reserve([key_of(i) for i in range(8, 16)]) if r is not None]
        assert len(refs) == 8
        for ref in refs:
            arena.view(ref.offset, ref.nbytes)[:] = expected(ref.key)
        assert client.commit(refs) == 8
        assert client.lookup([key_of(i) for i in range(16)]).hits == 16
        found = procs.check(files.socket, end=16)
        assert found == {"present": list(range(16)), "mismatched": [], "not_leased": []}
        with closing(daemon.admin()) as admin:  # every chunk leaves the index
            assert admin.evict(tier="cpu") == {"cpu": 16}
        _store(daemon, client, arena, range(16, 20))
        assert client.lookup([key_of(i) for i in range(16, 20)]).hits == 4
