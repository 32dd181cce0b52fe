"""The encoder-cache connector's loads, over a real lmdb and a real arena (embedded tiers, no
engine): the scheduler side verifies an output's parts in lmdb's map before it leases them
there, and the worker verifies them again in the map and copies them out of it once, into the
output it hands vLLM; an output in the arena is copied out of its slots once, and checked by
their generations after.

Nothing is decoded into a buffer on the way (a decode would be a second copy), no read
transaction outlives the load, and a part that fails verification, before the lease or after
it, is never served: the output is a miss (the encoder runs), or its load fails and is
reported (its request fails rather than read it); the part is reported to the tiers, which
drop it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kvtier_vllm.encoder import item_search
from kvtier_vllm.encoder.item_search import ABSENT, LMDB, PROMOTING, Item, ItemLocator
from kvtier_vllm.encoder.metadata import ECReport, ECStepPlan, ItemSlots
from kvtier_vllm.encoder.settings import EncoderCacheConfig
from kvtier_vllm.encoder.worker import EncoderCacheWorker

from kvtier.client import InProcessClient
from kvtier.core import blockfmt
from kvtier.core.encoder import PartLayout, encoder_spec, item_keys
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk, Failure, TierCode, in_lmdb
from kvtier.tiering.manager import TierManager
from tests.integration.daemon_harness import wait_for

ROWS, WIDTH, ROWS_PER_PART = 40, 2048, 16
"""An output of three parts of 64 KiB (the arena's smallest slot), the last one holding 8 rows
and padding."""
IDENTIFIER = "image-1"
CHECKED_S = 15.0
LOOKUP_S = 10.0


class Stored:
    """One encoder output written by the worker into the arena, then held in lmdb only."""

    def __init__(self, manager: TierManager, worker: EncoderCacheWorker) -> None:
        spec = encoder_spec(
            model="vlm",
            encoder_revision="r1",
            dtype="float16",
            width=WIDTH,
            rows_per_part=ROWS_PER_PART,
            processor="image:p",
        )
        self.manager = manager
        self.layout = PartLayout.of(spec)
        self.client = InProcessClient(manager, "r0")
        namespace = self.client.register_pool(spec, self.layout.part_bytes)
        self.keys = item_keys(namespace, IDENTIFIER, ROWS, self.layout)
        self.output = torch.randn(ROWS, WIDTH).to(torch.float16)
        self.worker = worker
        refs = self.client.reserve(self.keys)
        slots = ItemSlots(IDENTIFIER, ROWS, self.layout, tuple(r for r in refs if r))
        assert len(slots.refs) == len(self.keys) == 3
        worker.bind(self.plan(stores=[slots]))
        worker.save({IDENTIFIER: self.output}, IDENTIFIER)
        assert worker.report().stored == {IDENTIFIER}
        assert self.client.commit(slots.refs) == len(self.keys)

    def in_lmdb_only(self) -> Stored:
        assert self.manager.flush()
        self.manager.evict("cpu")
        assert self.manager.lmdb is not None
        assert self.manager.lmdb.contains(self.keys) == [True] * len(self.keys)
        return self

    def plan(self, **lists: list[ItemSlots]) -> ECStepPlan:
        return ECStepPlan(
            arena_path=str(self.client.arena_path), lmdb_path=str(self.client.lmdb_path), **lists
        )

    def where(self, locator: ItemLocator) -> str:
        """Where the scheduler side finds the output, once the lookup behind the arena answered."""
        item = Item(IDENTIFIER, ROWS, self.keys, self.layout)
        deadline = time.monotonic() + LOOKUP_S
        while (found := locator.where(self.client, item)) == PROMOTING:
            assert time.monotonic() < deadline, "the lookup behind the arena never answered"
            time.sleep(0.01)
        return found

    def lease(self) -> ItemSlots:
        """The output's parts leased where they are: in lmdb, or in the arena."""
        leased = self.client.lease(self.keys, in_lmdb=True)
        assert all(ref is not None for ref in leased), leased
        return ItemSlots(IDENTIFIER, ROWS, self.layout, tuple(r for r in leased if r))

    def load(self, slots: ItemSlots | None = None) -> tuple[dict[str, torch.Tensor], ECReport]:
        """The worker's load of the output: of ``slots``, or of a lease of its own, released
        once read."""
        leased = slots or self.lease()
        cache: dict[str, torch.Tensor] = {}
        try:
            self.worker.bind(self.plan(loads=[leased]))
            self.worker.load(cache)
            return cache, self.worker.report()
        finally:
            if slots is None:
                self.client.release(leased.refs)

    def flip_last_byte(self, key: ChunkKey) -> None:
        """A disk's flipped bit in the part's payload (through the tiers' own environment)."""
        lmdb = self.manager.lmdb
        assert lmdb is not None
        with lmdb.env.begin(write=True, db=lmdb.store.chunks) as txn:
            value = bytearray(txn.get(key))
            value[-1] ^= 0x40
            txn.put(key, bytes(value))

    def open_reads(self) -> list[str]:
        """lmdb's reader slots in a read transaction now (pinning the pages it sees)."""
        assert self.manager.lmdb is not None
        rows = self.manager.lmdb.env.readers().splitlines()[1:]
        return [row for row in rows if row.split()[-1] != "-"]


@pytest.fixture
def in_arena(manager: TierManager) -> Iterator[Stored]:
    worker = EncoderCacheWorker(torch.device("cpu"), writes=True)
    try:
        yield Stored(manager, worker)
    finally:
        worker.close()


@pytest.fixture
def stored(in_arena: Stored) -> Stored:
    return in_arena.in_lmdb_only()


@pytest.fixture
def locator(stored: Stored) -> Iterator[ItemLocator]:
    found = ItemLocator(EncoderCacheConfig(), lambda item: False, lambda: None)
    found.connected(stored.client)
    assert found.lmdb_path
    yield found
    found.close()


@pytest.fixture
def nothing_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part stored as it is is verified where it lies in lmdb's map: decoding it into a buffer
    (a copy the load does not need) fails the test."""

    def decoded(*args: Any) -> Any:
        raise AssertionError("a part stored as it is was decoded into a buffer")

    monkeypatch.setattr(blockfmt, "decode_into", decoded)
    monkeypatch.setattr(item_search, "_scratch", decoded, raising=False)


def test_an_output_in_lmdb_is_verified_in_its_map_and_copied_out_of_it_once(
    stored: Stored, locator: ItemLocator, nothing_decoded: None
) -> None:
    assert stored.where(locator) == LMDB
    assert stored.open_reads() == []  # the check's read transaction ended with it
    slots = stored.lease()
    assert all(map(in_lmdb, slots.refs))
    cache, report = stored.load(slots)
    stored.client.release(slots.refs)
    assert report.loaded == {IDENTIFIER}
    assert report.load_failed == set()
    assert report.loaded_bytes == stored.output.numel() * stored.output.element_size()
    assert torch.equal(cache[IDENTIFIER], stored.output)
    assert cache[IDENTIFIER].dtype == torch.float16
    assert stored.open_reads() == []  # nor does the load's outlive it


def test_a_part_corrupted_after_the_check_fails_the_load_and_is_reported(
    stored: Stored, locator: ItemLocator
) -> None:
    assert stored.where(locator) == LMDB
    stored.flip_last_byte(stored.keys[1])
    cache, report = stored.load()
    assert report.load_failed == {IDENTIFIER}
    assert report.loaded == set()
    assert not cache[IDENTIFIER].any()  # zeros, never the bytes read
    assert report.failed_chunks == [FailedChunk(stored.keys[1], TierCode.LMDB, Failure.PAYLOAD)]
    assert stored.open_reads() == []


def test_a_corrupt_part_makes_the_output_a_miss_and_is_dropped(
    stored: Stored, locator: ItemLocator
) -> None:
    stored.flip_last_byte(stored.keys[2])
    assert stored.where(locator) == ABSENT  # the encoder runs
    counts = stored.manager.integrity.report_counts
    wait_for(lambda: counts()[("lmdb", "confirmed")] == 1, CHECKED_S, "the report checked")
    assert stored.manager.lmdb is not None
    assert stored.manager.lmdb.contains(stored.keys) == [True, True, False]
    assert stored.open_reads() == []


def test_an_output_in_the_arena_is_copied_out_of_its_slots_byte_exact(in_arena: Stored) -> None:
    slots = in_arena.lease()
    assert not any(map(in_lmdb, slots.refs))
    cache, report = in_arena.load(slots)
    in_arena.client.release(slots.refs)
    assert report.loaded == {IDENTIFIER}
    assert torch.equal(cache[IDENTIFIER], in_arena.output)


def test_an_output_whose_slots_were_reused_meanwhile_is_not_served(in_arena: Stored) -> None:
    slots = in_arena.lease()
    in_arena.client.release(slots.refs)
    in_arena.manager.evict("cpu")  # the slots freed: their generations move on
    cache, report = in_arena.load(slots)
    assert report.load_failed == {IDENTIFIER}
    assert not cache[IDENTIFIER].any()
