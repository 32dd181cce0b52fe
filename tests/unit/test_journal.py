"""The tiers' journal of chunks entering and leaving them: its window and cursor, and what the
arena and lmdb tell it through a real TierManager (stores, write-back, eviction, deletion)."""

from __future__ import annotations

from pathlib import Path

from kvtier.core.journal import ChunkEvent, Journal
from kvtier.core.keys import ChunkKey
from kvtier.tiering.manager import TierManager
from tests.support import keys_for, manager_config, payload_for, target_spec

CHUNK = 256 << 10


def test_the_journal_answers_from_a_cursor_and_counts_what_left_its_window() -> None:
    journal = Journal(capacity=4)
    keys = [ChunkKey(bytes([i]) * 24) for i in range(6)]
    start = journal.since(-1, 10)
    assert (start.events, start.cursor, start.lost) == ([], 0, 0)
    journal.record(True, "cpu", keys[:3])
    first = journal.since(start.cursor, 2)
    assert first.events == [ChunkEvent(True, "cpu", k) for k in keys[:2]]
    assert (first.cursor, first.lost) == (2, 0)
    journal.record(False, "lmdb", keys[3:])  # 6 events in a window of 4: two fell out
    late = journal.since(0, 10)
    assert late.lost == 2
    assert late.events == [ChunkEvent(True, "cpu", keys[2])] + [
        ChunkEvent(False, "lmdb", k) for k in keys[3:]
    ]
    assert journal.since(late.cursor, 10) == ([], 6, 0)
    assert journal.since(-1, 10).cursor == 6  # "from now"


def test_the_tiers_tell_the_journal_what_entered_and_left_them(
    shm_path: Path, tmp_path: Path
) -> None:
    # an arena of 8 chunks, write-through, so every stored chunk also reaches lmdb
    manager = TierManager(
        manager_config(shm_path, tmp_path, arena_mib=4, lmdb_mib=64, demote_mode="write_through")
    )
    try:
        ns = manager.register_pool(target_spec(), CHUNK)
        cursor = manager.chunk_events(-1).cursor
        keys = keys_for(ns, 12)
        for key in keys:
            manager.flush()  # written back: clean, so the arena may evict it for the next
            assert manager.cpu.put(key, payload_for(key, CHUNK))
        assert manager.flush()
        assert manager.lmdb is not None
        assert manager.lmdb.delete(keys[:1]) == 1
        events = manager.chunk_events(cursor, 1000).events
        in_arena = manager.cpu.contains(keys)
    finally:
        manager.close()
    assert {e.key for e in events if e.tier == "cpu" and e.stored} == set(keys)
    assert {e.key for e in events if e.tier == "lmdb" and e.stored} == set(keys)
    assert [e for e in events if e.tier == "lmdb" and not e.stored] == [
        ChunkEvent(False, "lmdb", keys[0])
    ]
    # replaying the arena's events gives what it holds; it is smaller than what was stored
    held: set[ChunkKey] = set()
    for e in events:
        if e.tier == "cpu":
            assert e.stored != (e.key in held)  # in only when out, out only when in
            (held.add if e.stored else held.discard)(e.key)
    assert held == {k for k, present in zip(keys, in_arena, strict=True) if present}
    assert 0 < len(held) < len(keys)
