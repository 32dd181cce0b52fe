"""The arena's shared key index: the owner keeps it equal to the committed chunks, through
collisions and deletions, and another process finds a chunk only while a READY slot holds it."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.pools import PoolRegistry
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.arena_index import ENTRY_BYTES, MAX_PROBES, ArenaIndex, _home, capacity_for
from kvtier.tiers.cpu import CpuTier
from tests.support import MiB, arena_config, keys_for, payload_for, target_spec

CHUNK = 256 << 10


def _table(capacity: int) -> tuple[ArenaIndex, memoryview, memoryview]:
    buffer = memoryview(bytearray(capacity * ENTRY_BYTES))
    state = memoryview(np.full(64, 2, np.uint32))  # every slot READY
    generation = memoryview(np.arange(64, dtype=np.uint64))
    return ArenaIndex(buffer, 0, capacity), state, generation


def test_the_index_tracks_inserts_and_removals_through_collisions() -> None:
    index, state, generation = _table(1024)
    rng = random.Random(7)
    # keys that share their home entry
    colliding = []
    while len(colliding) < 40:
        key = rng.randbytes(48)
        if _home(key, 1023) == 3:
            colliding.append(key)
    spread = [rng.randbytes(48) for _ in range(200)]
    live: dict[bytes, int] = {}
    for i, key in enumerate(colliding + spread):
        index.insert(key, i % 64)
        live[key] = i % 64
    for key in rng.sample(list(live), 150):  # deletions shift clusters back
        index.remove(key)
        del live[key]
    index.remove(b"never inserted")
    assert len(index) == len(live)
    for key in colliding + spread:
        found = index.find(key, state, generation)
        if key in live:
            assert found == (live[key], live[key])
        else:
            assert found is None
    index.insert(colliding[0], 5)  # again, and moved: the new slot wins
    assert index.find(colliding[0], state, generation) == (5, 5)


def test_keys_that_differ_in_a_few_bytes_spread_over_the_table() -> None:
    # sequential chunk hashes: a home taken from a few key bytes put them all in one cluster
    slots = 4096
    capacity = capacity_for(slots)
    index, _, _ = _table(capacity)
    keys = keys_for(target_spec().digest(), slots)
    for i, key in enumerate(keys):
        index.insert(key, i % 64)
    mask = capacity - 1
    probes = [(index._where[key] - _home(key, mask)) & mask for key in keys]
    assert max(probes) < 64, max(probes)


def test_a_slot_not_ready_is_not_found() -> None:
    index, state, generation = _table(1024)
    index.insert(b"k" * 24, 3)
    state[3] = 1  # WRITING: taken for another chunk
    assert index.find(b"k" * 24, state, generation) is None


def test_an_entry_being_written_reads_as_a_miss() -> None:
    index, state, generation = _table(1024)
    index.insert(b"k" * 24, 3)
    seq = np.frombuffer(index._seq.base, np.uint64)  # type: ignore[arg-type]
    seq[:] = seq | 1  # every entry mid-write
    assert index.find(b"k" * 24, state, generation) is None


def _colliding(count: int, home: int, mask: int) -> list[bytes]:
    rng = random.Random(home)
    keys: list[bytes] = []
    while len(keys) < count:
        key = rng.randbytes(48)
        if _home(key, mask) == home:
            keys.append(key)
    return keys


def test_the_owner_never_reads_back_words_another_process_scribbled() -> None:
    """Every entry made to look taken, and then zeroed: the owner's inserts and removals end
    and keep finding the right slot, since it probes its own copy of the table."""
    index, state, generation = _table(1024)
    keys = _colliding(6, 5, 1023)
    for slot, key in enumerate(keys):
        index.insert(key, slot)
    index._meta[:] = 1 << 32  # every entry a one-byte key in slot 0: endless probe chains
    index._seq[:] = 2
    index.insert(b"new" * 8, 9)  # ends, in the owner's first free entry
    index.remove(keys[1])  # the cluster shifts back by the owner's record, not the words
    index._meta[:] = 0
    index.insert(keys[1], 7)
    for slot, key in enumerate(keys):
        index.remove(key)
        index.insert(key, 20 + slot)  # rewritten whole: readable again
        assert index.find(key, state, generation) == (20 + slot, 20 + slot)
    assert len(index) == len(keys) + 1


def test_a_probe_never_runs_past_its_bound() -> None:
    """A key that would sit past MAX_PROBES from its home is kept out of the shared table (a
    reader misses it and asks kvtierd), so readers stop within MAX_PROBES entries."""
    index, state, generation = _table(1024)
    keys = _colliding(MAX_PROBES + 2, 9, 1023)
    for slot, key in enumerate(keys):
        index.insert(key, slot % 64)
    listed = [index.find(k, state, generation) is not None for k in keys]
    assert listed == [True] * MAX_PROBES + [False] * 2
    assert len(index) == len(keys)
    index.remove(keys[-1])  # kept out: removed from the owner's record only
    index.remove(keys[0])
    assert len(index) == len(keys) - 2
    assert all(index.find(k, state, generation) is not None for k in keys[1:MAX_PROBES])


def test_bad_keys_and_capacities_are_refused() -> None:
    index, _, _ = _table(1024)
    with pytest.raises(ValueError, match=r"1\.\.48 bytes"):
        index.insert(b"", 0)
    with pytest.raises(ValueError, match=r"1\.\.48 bytes"):
        index.insert(b"x" * 49, 0)
    with pytest.raises(ValueError, match="power of two"):
        ArenaIndex(memoryview(bytearray(1000 * ENTRY_BYTES)), 0, 1000)
    assert capacity_for(3000) == 8192


def test_another_process_finds_committed_chunks_until_their_slot_is_freed(
    shm_path: Path,
) -> None:
    registry = PoolRegistry()
    tier = CpuTier(arena_config(shm_path, 16 * MiB), registry)
    try:
        ns = registry.register(target_spec(), CHUNK).namespace
        kept, evicted, reserved = keys_for(ns, 3)
        for key in (kept, evicted):
            tier.put(key, payload_for(key, CHUNK))
        tier.reserve([reserved])  # written, never committed: invisible
        (lease,) = tier.lease([kept])
        assert lease is not None
        tier.release([lease])
        assert tier.delete([evicted]) == 1
        script = (
            "import sys; from pathlib import Path; from kvtier.tiers.arena import ArenaMemory;"
            "m = ArenaMemory.attach(Path(sys.argv[1]), populate=False);"
            "print([m.find(bytes.fromhex(k)) for k in sys.argv[2:]], m.epoch)"
        )
        argv = [sys.executable, "-c", script, str(shm_path)]
        out = subprocess.run(
            [*argv, kept.hex(), evicted.hex(), reserved.hex()],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        expected = [(lease.slot, lease.generation), None, None]
        assert out.stdout.split("]")[0] + "]" == str(expected)
        assert int(out.stdout.split()[-1]) == tier.memory.epoch != 0
    finally:
        tier.close()


def test_a_reference_into_an_earlier_arena_at_the_path_is_never_current(shm_path: Path) -> None:
    """A daemon restarted between a lookup and the copy: the new arena's slots must not pass
    the old reference's generation check, whatever they hold."""
    refs = []
    for _ in range(2):
        registry = PoolRegistry()
        tier = CpuTier(arena_config(shm_path, 16 * MiB), registry)
        (key,) = keys_for(registry.register(target_spec(), CHUNK).namespace, 1)
        tier.put(key, payload_for(key, CHUNK))
        (ref,) = tier.lease([key])
        assert ref is not None
        refs.append(ref)
        attached = ArenaMemory.attach(shm_path, populate=False)
        assert attached.epoch == tier.memory.epoch
        if len(refs) == 2:
            old, new = refs
            assert old.slot == new.slot  # the same slot of the same layout...
            assert not attached.is_current(old.slot, old.generation)  # ...never taken for it
            assert attached.is_current(new.slot, new.generation)
        attached.close()
        tier.release([ref])
        tier.close()
