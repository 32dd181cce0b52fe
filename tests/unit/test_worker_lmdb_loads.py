"""The worker's loads of chunks leased in lmdb, over a real lmdb and a real arena (no engine).

On the CPU a chunk stored as it is is verified in lmdb's map and copied from there into the
pages: no staging buffer is allocated, and a corrupt chunk is neither copied nor served but
reported. Where copies land later (a device's timing), chunks go through staging buffers that
are reused once their copies landed, not allocated per chunk. A read transaction held for a
step's loads is begun again once held its bound, so a writer's deletes become visible."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier_vllm.kv import lmdb_staging
from kvtier_vllm.kv.metadata import ChunkCopy, KVTierMetadata
from kvtier_vllm.shared.copies import DeferredCopies

from kvtier.client import reader_at
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import FailedChunk, Failure, TierCode
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.bare_worker import BLOCKS_PER_CHUNK, CHUNK, LAYERS, PAGE, BareWorker, bare_worker
from tests.support import MiB, keys_for, lmdb_config, target_spec


class CountingTorch:
    """torch, as `lmdb_staging` sees it, counting the buffers it allocates."""

    def __init__(self) -> None:
        self.allocated = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.allocated += 1
        return torch.empty(*args, **kwargs)


class Stored:
    """Chunks of the bare worker's target pool written to a real lmdb, with their bytes."""

    def __init__(self, path: Path) -> None:
        self.registry = PoolRegistry()
        namespace = self.registry.register(target_spec(), CHUNK).namespace
        self.tier = LmdbTier(lmdb_config(path, 8 * MiB), self.registry)
        self.path = str(path)
        self.keys = keys_for(namespace, 6)
        self.payloads = {key: os.urandom(CHUNK) for key in self.keys}
        for key, payload in self.payloads.items():
            assert self.tier.put(key, payload)

    def flip_last_byte(self, key: ChunkKey) -> None:
        """A disk's flipped bit in the chunk's payload."""
        with self.tier.store.env.begin(write=True, db=self.tier.store.chunks) as txn:
            value = bytearray(txn.get(key))
            value[-1] ^= 0x40
            txn.put(key, bytes(value))

    def open_reads(self) -> list[str]:
        """lmdb's reader slots in a read transaction now (pinning the pages it sees)."""
        rows = self.tier.store.env.readers().splitlines()[1:]
        return [row for row in rows if row.split()[-1] != "-"]

    def expected(self, key: ChunkKey) -> torch.Tensor:
        data = torch.frombuffer(bytearray(self.payloads[key]), dtype=torch.uint8)
        return data.view(LAYERS, BLOCKS_PER_CHUNK, PAGE)


@pytest.fixture
def bare(shm_path: Path) -> Iterator[BareWorker]:
    bare = bare_worker(shm_path, torch.device("cpu"))
    yield bare
    bare.close()


@pytest.fixture
def stored(tmp_path: Path, bare: BareWorker) -> Iterator[Stored]:
    stored = Stored(tmp_path / "lmdb")
    yield stored
    bare.worker.shutdown()  # gives lmdb's reader back before its tier closes
    stored.tier.close()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> CountingTorch:
    counting = CountingTorch()
    monkeypatch.setattr(lmdb_staging, "torch", counting)
    return counting


def _blocks(i: int) -> tuple[int, ...]:
    return (1 + 2 * i, 2 + 2 * i)


def _load(bare: BareWorker, stored: Stored, keys: list[ChunkKey], request: str = "") -> None:
    """One step's loads of ``keys`` from lmdb, each into two blocks of its own."""
    jobs = [
        ChunkCopy("target", 0, 0, 0, _blocks(i), request=request, key=bytes(key))
        for i, key in enumerate(keys)
    ]
    meta = KVTierMetadata(str(bare.arena_path), loads=jobs, lmdb_path=stored.path)
    if request:
        meta.receiving = [request]
    bare.worker.start_load_kv(meta)


@pytest.mark.parametrize("request_id", ["", "r1"], ids=["sync", "async"])
def test_a_plain_chunk_is_copied_from_lmdbs_map_into_the_pages_with_no_staging_buffer(
    bare: BareWorker, stored: Stored, counted: CountingTorch, request_id: str
) -> None:
    keys = stored.keys[:3]
    _load(bare, stored, keys, request_id)
    if request_id:
        assert bare.finished_loads() == ({request_id}, set())
    else:
        assert bare.worker.block_ids_with_load_errors() == set()
    for i, key in enumerate(keys):
        assert torch.equal(bare.blocks("target", _blocks(i)), stored.expected(key))
    assert counted.allocated == 0  # verified and copied in lmdb's map
    assert stored.open_reads() == []  # no read transaction outlives the step's loads
    assert bare.worker.worker_meta() is not None  # the loads' timings, no corrupt chunk
    assert bare.worker.staging.take_failed() == []


def test_a_corrupt_plain_chunk_is_not_copied_into_the_pages_and_is_reported(
    bare: BareWorker, stored: Stored, counted: CountingTorch
) -> None:
    keys = stored.keys[:3]
    stored.flip_last_byte(keys[1])
    _load(bare, stored, keys)
    assert bare.worker.block_ids_with_load_errors() == set(_blocks(1))
    assert not bare.blocks("target", _blocks(1)).any()  # the pages as they were: zeros
    for i in (0, 2):
        assert torch.equal(bare.blocks("target", _blocks(i)), stored.expected(keys[i]))
    reported = bare.worker.worker_meta()
    assert reported is not None
    assert reported.failed_chunks == [FailedChunk(keys[1], TierCode.LMDB, Failure.PAYLOAD)]
    assert counted.allocated == 0


def test_copies_landing_later_stage_through_buffers_reused_once_they_landed(
    bare: BareWorker, stored: Stored, counted: CountingTorch
) -> None:
    bare.worker.copies = DeferredCopies()  # a device's timing: a copy reads its source later
    for step in range(2):
        keys = stored.keys[3 * step : 3 * step + 3]
        _load(bare, stored, keys)
        assert bare.worker.block_ids_with_load_errors() == set()
        for i, key in enumerate(keys):
            assert torch.equal(bare.blocks("target", _blocks(i)), stored.expected(key))
    assert counted.allocated == 3  # one a chunk of a step, the second step's reused


def test_a_snapshot_sees_a_writers_delete_once_held_past_its_bound(stored: Stored) -> None:
    reader = reader_at(stored.path)
    key = stored.keys[0]

    def buffer() -> memoryview:
        raise AssertionError("a plain chunk read in place needs no buffer")

    for hold_s, still_seen in ((3600.0, True), (0.0, False)):
        assert stored.tier.put(key, stored.payloads[key])
        with reader.snapshot(hold_s) as snapshot:
            view = snapshot.read(key, CHUNK, buffer, in_place=True)
            assert isinstance(view, memoryview)
            assert bytes(view) == stored.payloads[key]
            assert stored.tier.delete([key]) == 1
            again = snapshot.read(key, CHUNK, buffer, in_place=True)
            assert isinstance(again, memoryview) is still_seen, hold_s


def test_the_read_transaction_of_a_steps_loads_ends_with_them(
    bare: BareWorker, stored: Stored
) -> None:
    staging, copies = bare.worker.staging, bare.worker.copies
    job = ChunkCopy("target", 0, 0, 0, _blocks(0), key=bytes(stored.keys[0]))
    with staging.holding(copies):
        assert stored.open_reads() == []  # begun at the first read only
        assert staging.stage(stored.path, job, CHUNK, copies) is not None
        assert staging.stage(stored.path, job, CHUNK, copies) is not None
        assert len(stored.open_reads()) == 1  # one, shared by the step's reads
    assert stored.open_reads() == []
