"""Drain, verify, warmup and gc on a TierManager in process, as the admin API streams them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import InvalidRequestError, TierNotConfiguredError, UnknownTierError
from kvtier.core.keys import ChunkKey
from kvtier.tiering.maintenance import PROGRESS_EVERY, VerifyProgress
from kvtier.tiering.manager import TierManager
from tests.support import keys_for, manager_config, payload_for, target_spec

CHUNK = 64 << 10


@pytest.fixture
def manager(shm_path: Path, tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(manager_config(shm_path, tmp_path, arena_mib=32))
    yield m
    m.close()


def _store(m: TierManager, keys: list[ChunkKey]) -> None:
    refs = [r for r in m.reserve(keys, "r0") if r is not None]
    for ref in refs:
        m.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    assert m.commit(refs) == len(keys)


def test_drain_then_verify_then_warmup(manager: TierManager) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, PROGRESS_EVERY + 10)
    _store(manager, keys)

    # drain: every arena chunk reaches lmdb
    drained = manager.drain(30.0)
    assert drained.complete
    assert drained.pending == 0

    # verify: one report per PROGRESS_EVERY chunks, then the last one, done
    reports = list(manager.verify())
    assert reports == [
        VerifyProgress(PROGRESS_EVERY, len(keys), 0),
        VerifyProgress(len(keys), len(keys), 0, done=True),
    ]

    # warmup: chunks only lmdb holds go back into the arena
    manager.evict("cpu", namespace=ns)
    assert not any(manager.cpu.contains(keys))
    *steps, last = manager.warmup(ns, max_chunks=20)
    assert not steps
    assert (last.promoted, last.total, last.done, last.objects.phase) == (20, 20, True, "promote")
    assert sum(manager.cpu.contains(keys)) == 20


def test_verify_takes_only_lmdb(manager: TierManager) -> None:
    with pytest.raises(InvalidRequestError, match="only the lmdb tier"):
        next(manager.verify("cpu"))


def test_object_store_operations_need_the_object_tier(manager: TierManager) -> None:
    with pytest.raises(TierNotConfiguredError, match="gc needs the object tier"):
        next(manager.gc())
    with pytest.raises(TierNotConfiguredError, match="warmup --object-index/--fetch"):
        next(manager.warmup(object_index=True))


def test_evicting_an_unknown_tier_names_the_known_ones(manager: TierManager) -> None:
    with pytest.raises(UnknownTierError, match=r"unknown tier 'gpu'; known: \['cpu', 'lmdb'\]"):
        manager.evict("gpu")
    with pytest.raises(ValueError, match="unknown tier"):  # as before, for embedded callers
        manager.evict("object")
