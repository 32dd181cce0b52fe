"""Quarantined namespaces in the TierManager: no lookup finds their chunks and write-back skips
them, while the other namespaces are served as before; lifting it serves them again."""

from __future__ import annotations

from pathlib import Path

from kvtier.tiering.manager import TierManager
from tests.integration.test_draft_revisions import CHUNK, store
from tests.support import draft_spec, keys_for, manager_config, target_spec


def test_a_quarantined_namespace_is_neither_found_nor_written_back_until_lifted(
    shm_path: Path, tmp_path: Path
) -> None:
    m = TierManager(manager_config(shm_path, tmp_path))
    try:
        wrong = m.register_pool(target_spec(), CHUNK)
        fine = m.register_pool(draft_spec(), CHUNK)
        wrong_keys, fine_keys = keys_for(wrong, 4), keys_for(fine, 4)
        assert store(m, wrong_keys) == 4
        assert store(m, fine_keys) == 4
        assert m.quarantines.add(wrong, "a chunk differs from the recomputed KV")
        assert not m.quarantines.add(wrong, "again")  # listed once, with its first reason
        assert m.lookup(wrong_keys).hits == 0
        assert m.lookup(fine_keys).hits == 4
        assert m.lookup([*fine_keys[:2], *wrong_keys]).hits == 2  # a prefix stops at it
        assert m.flush()
        assert m.lmdb is not None
        assert m.lmdb.contains(wrong_keys) == [False] * 4
        assert m.lmdb.contains(fine_keys) == [True] * 4
        assert m.quarantines.lift(wrong)
        assert m.lookup(wrong_keys).hits == 4  # still in the arena: served again
    finally:
        m.close()


def test_quarantines_outlive_a_restart_until_lifted(shm_path: Path, tmp_path: Path) -> None:
    config = manager_config(shm_path, tmp_path)
    m = TierManager(config)
    try:
        wrong = m.register_pool(target_spec(), CHUNK)
        wrong_keys = keys_for(wrong, 4)
        assert store(m, wrong_keys) == 4
        assert m.flush()  # in lmdb before an engine found them wrong
        assert m.quarantines.add(wrong, "a chunk differs from the recomputed KV")
    finally:
        m.close()
    m = TierManager(config)  # a restart: a fresh arena, the same lmdb
    try:
        assert m.register_pool(target_spec(), CHUNK) == wrong
        [held] = m.quarantines.listed()
        assert (held.namespace, held.reason) == (wrong, "a chunk differs from the recomputed KV")
        assert m.lookup(wrong_keys).hits == 0
        assert m.quarantines.lift(wrong)
        assert m.lookup(wrong_keys).hits == 4  # from lmdb
    finally:
        m.close()
    m = TierManager(config)  # the lift was kept too
    try:
        m.register_pool(target_spec(), CHUNK)
        assert m.quarantines.listed() == []
        assert m.lookup(wrong_keys).hits == 4
    finally:
        m.close()
