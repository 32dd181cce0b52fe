"""The commit checksum ledger: what a killed owner recorded is read back whole or not at all, and
only from a file that is this user's own."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from kvtier.tiers.commit_checksums import (
    RECORD_BYTES,
    ChecksumLedger,
    CommittedChunk,
    ledger_path,
    read_ledger,
)

KEY = ChunkKey(bytes(range(48)))


def _ledger(arena: Path) -> ChecksumLedger:
    ledger = ChecksumLedger.create(arena, 8)
    assert ledger is not None
    for slot in (1, 4, 6):
        ref = SlotRef(KEY, slot, 0, 4096, 100 + slot)
        ledger.put(slot, ref, slot * 4096, 4096, bytes([slot]) * 16)
    ledger.clear(6)  # freed
    return ledger


def test_the_records_a_killed_owner_left_are_read_back(shm_path: Path) -> None:
    _ledger(shm_path)  # never closed: the owner was killed
    assert read_ledger(shm_path) == [
        CommittedChunk(KEY, slot, 100 + slot, slot * 4096, 4096, bytes([slot]) * 16)
        for slot in (1, 4)
    ]


def test_a_record_cut_short_is_skipped(shm_path: Path) -> None:
    _ledger(shm_path)
    with ledger_path(shm_path).open("r+b") as f:
        f.seek(4 * RECORD_BYTES + 20)
        f.write(b"\xff")  # the owner died inside this record's write
    assert [chunk.slot for chunk in read_ledger(shm_path) or []] == [1]


def test_a_ledger_that_is_not_this_users_own_is_not_read(shm_path: Path) -> None:
    _ledger(shm_path)
    os.chmod(ledger_path(shm_path), 0o660)
    assert read_ledger(shm_path) is None


def test_a_closed_ledger_is_gone(shm_path: Path) -> None:
    _ledger(shm_path).close()
    assert not ledger_path(shm_path).exists()
    assert read_ledger(shm_path) is None
