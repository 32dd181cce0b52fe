"""Chunks promoted ahead of a load are held for it: in an arena smaller than what engines are
about to load, what one request promoted must not be evicted before its lease takes it. Real
tiers (an arena in /dev/shm, lmdb on disk), one TierManager."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.core.keys import ChunkKey
from kvtier.tiering.manager import TierManager
from tests.integration.test_manager import store
from tests.support import keys_for, manager_config, payload_for, target_spec

CHUNK = 256 << 10  # 16 slots: a 6 MiB arena has 2 extents of 2 MiB (the rest is its tables)


@pytest.fixture
def open_manager(shm_path: Path, tmp_path: Path) -> Iterator[Callable[..., TierManager]]:
    made: list[TierManager] = []

    def make(**manager: object) -> TierManager:
        m = TierManager(manager_config(shm_path, tmp_path, arena_mib=6, lmdb_mib=64, **manager))
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def in_lmdb_only(m: TierManager, keys: list[ChunkKey]) -> None:
    assert store(m, keys) == len(keys)
    assert m.flush()
    m.evict("cpu")


def promoted(m: TierManager, keys: list[ChunkKey]) -> None:
    """Promote and wait for the promoting thread to bring every key up."""
    m.promote(keys, "r0")
    deadline = time.monotonic() + 30
    while m.lookup(keys, again=True).tiers != ["cpu"] * len(keys):
        assert time.monotonic() < deadline, "the promotions never landed"
        time.sleep(0.005)


def promoted_then_stores(m: TierManager, held: int) -> list[ChunkKey]:
    """8 chunks promoted from lmdb (``held`` of them held), then 16 stores into the 16 slots:
    the 8 free ones, then whatever may be evicted. The 8 promoted keys."""
    ns = m.register_pool(target_spec(), CHUNK)
    asked, others = keys_for(ns, 8), keys_for(ns, 24)[8:]
    in_lmdb_only(m, asked)
    promoted(m, asked)
    assert m.promoter is not None
    assert m.promoter.held() == held
    store(m, others)
    return asked


def test_stores_do_not_evict_what_a_load_is_about_to_lease(
    open_manager: Callable[..., TierManager],
) -> None:
    m = open_manager()
    asked = promoted_then_stores(m, held=8)
    assert m.lookup(asked, again=True).tiers == ["cpu"] * 8, "a held chunk was evicted"
    leases = m.lease(asked, "r0")
    assert all(ref is not None for ref in leases)
    assert [bytes(m.cpu.view(r)) for r in leases if r is not None] == [
        payload_for(k, CHUNK) for k in asked
    ]
    assert m.promoter is not None
    assert m.promoter.held() == 0, "the lease did not take over the holds"
    m.release([r for r in leases if r is not None])
    assert int(m.cpu.memory.refcount.sum()) == 0


def test_without_holds_the_same_stores_evict_them(open_manager: Callable[..., TierManager]) -> None:
    m = open_manager(promote_hold_s=0)
    asked = promoted_then_stores(m, held=0)
    assert m.lookup(asked, again=True).tiers[0] != "cpu"


def test_holds_take_at_most_their_share_and_end_in_time(
    open_manager: Callable[..., TierManager],
) -> None:
    m = open_manager(promote_hold_share=0.5, promote_hold_s=30)
    ns = m.register_pool(target_spec(), CHUNK)
    asked = keys_for(ns, 12)
    in_lmdb_only(m, asked)
    m.promote(asked, "r0")
    deadline = time.monotonic() + 30
    counters = m.stats().counters
    while counters["promotions"] + counters["promotion_holds_deferred"] < 12:
        assert time.monotonic() < deadline, counters
        time.sleep(0.005)
        counters = m.stats().counters
    assert m.promoter is not None
    # half of 16 slots held; the other 4 left in lmdb, not promoted to be evicted
    assert m.promoter.held() == 8
    assert (counters["promotions"], counters["promotion_holds_deferred"]) == (8, 4)
    assert m.lookup(asked, again=True).tiers == ["cpu"] * 8 + ["lmdb"] * 4
    assert int(m.cpu.memory.refcount.sum()) == 8
    assert m.promoter.expire(time.monotonic()) == 0  # not yet
    assert m.promoter.expire(time.monotonic() + 31) == 8
    assert int(m.cpu.memory.refcount.sum()) == 0
    assert m.stats().counters["promotion_holds_expired"] == 8
    assert m.promoter.expire(math.inf) == 0


def test_write_back_keeps_its_clean_reserve_beside_the_holds(
    open_manager: Callable[..., TierManager],
) -> None:
    """Held slots can be neither evicted nor stored into: the chunks written back while an
    engine is busy are counted beside them, or stores and promotions find no room."""
    m = open_manager(clean_reserve=0.25)
    ns = m.register_pool(target_spec(), CHUNK)
    asked, fresh = keys_for(ns, 14)[:8], keys_for(ns, 14)[8:]
    in_lmdb_only(m, asked)
    promoted(m, asked)  # 8 of 16 slots held
    assert store(m, fresh) == 6
    # free or clean must stay at 4 of 16 (0.25) with 8 held: at most 4 dirty
    deadline = time.monotonic() + 30
    while m.cpu.writeback_pending() > 4:
        assert time.monotonic() < deadline, f"{m.cpu.writeback_pending()} dirty beside 8 held"
        time.sleep(0.005)
    assert m.lookup(asked, again=True).tiers == ["cpu"] * 8
