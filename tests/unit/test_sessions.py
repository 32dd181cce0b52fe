"""Sessions against a real TierManager, with a hand-driven clock for expiry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import SessionNotFoundError
from kvtier.manager import TierManager
from kvtier.server.sessions import SessionRegistry
from tests.support import keys_for, manager_config, payload_for, target_spec

CHUNK = 256 << 10


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def manager(shm_path: Path, tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(manager_config(shm_path, tmp_path))
    yield m
    m.close()


def test_lapsed_session_gives_back_leases_and_reservations(manager: TierManager) -> None:
    clock = FakeClock()
    sessions = SessionRegistry(manager, timeout_s=5.0, clock=clock)
    ns = manager.register_pool(target_spec(), CHUNK)
    stored, pending = keys_for(ns, 2)
    alive = sessions.open("r0", "e0", 0, 0)
    dying = sessions.open("r1", "e1", 0, 0)

    (ref,) = sessions.reserve(alive, [stored])
    assert ref is not None
    manager.cpu.view(ref)[:] = payload_for(stored, CHUNK)
    assert sessions.commit(alive, [ref]) == 1
    (lease,) = sessions.lease(dying, [stored])
    (held,) = sessions.reserve(dying, [pending])
    assert lease is not None
    assert held is not None
    assert sessions.counts() == (2, 1, 1)

    clock.now += 3
    assert sessions.heartbeat(alive.id)
    clock.now += 3  # `dying` missed its heartbeat; `alive` did not
    assert sessions.reap() == 1
    assert sessions.counts() == (1, 0, 0)
    assert manager.cpu.memory.refcount[lease.slot] == 0
    with pytest.raises(SessionNotFoundError):
        sessions.get(dying.id)
    assert sessions.reserve(alive, [pending])[0] is not None  # the slot was given back


def test_a_session_can_only_end_what_it_holds(manager: TierManager) -> None:
    sessions = SessionRegistry(manager, timeout_s=5.0)
    ns = manager.register_pool(target_spec(), CHUNK)
    (key,) = keys_for(ns, 1)
    owner = sessions.open("r0", "e0", 0, 0)
    other = sessions.open("r1", "e1", 0, 0)
    (ref,) = sessions.reserve(owner, [key])
    assert ref is not None
    assert sessions.commit(other, [ref]) == 0  # not other's reservation
    sessions.abort(other, [ref])
    assert sessions.commit(owner, [ref]) == 1
    (lease,) = sessions.lease(owner, [key])
    assert lease is not None
    assert sessions.release(other, [lease]) == 0
    assert manager.cpu.memory.refcount[lease.slot] == 1
    assert sessions.release(owner, [lease]) == 1
    assert manager.cpu.memory.refcount[lease.slot] == 0
