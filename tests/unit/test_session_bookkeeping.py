"""Sessions against a real TierManager: calls racing the reaper, a reaper that meets an error,
retried releases, and reservations and leases that outlive their timeouts. The interleavings
are forced by the test (a hand-driven clock, a manager call that reaps midway)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvtier.core.errors import CapacityError, SessionNotFoundError
from kvtier.core.keys import BLANK_HOLD_S, NAMESPACE_BYTES, ChunkKey, blank_key
from kvtier.server.sessions import (
    BLANK_EXPIRED_COUNTER,
    EXPIRED_COUNTER,
    EXPIRED_LEASES_COUNTER,
    SessionRegistry,
)
from kvtier.tiering.manager import TierManager
from kvtier.tiers.arena_room import BLANK_SHARE
from tests.support import HandClock, keys_for, payload_for, target_spec

CHUNK = 256 << 10


@pytest.fixture
def clock() -> HandClock:
    return HandClock()


@pytest.fixture
def sessions(manager: TierManager, clock: HandClock) -> SessionRegistry:
    return SessionRegistry(
        manager, timeout_s=5.0, clock=clock, reservation_timeout_s=30.0, lease_timeout_s=60.0
    )


@pytest.fixture
def ns(manager: TierManager) -> bytes:
    return manager.register_pool(target_spec(), CHUNK)


def _store(manager: TierManager, key: ChunkKey) -> None:
    (ref,) = manager.reserve([key])
    assert ref is not None
    manager.cpu.view(ref)[:] = payload_for(key, CHUNK)
    assert manager.commit([ref]) == 1


def _reaping_midway(
    monkeypatch: pytest.MonkeyPatch,
    manager: TierManager,
    name: str,
    clock: HandClock,
    sessions: SessionRegistry,
) -> list[int]:
    """``manager.name`` reaps every session right after it did its work, as if the reaper ran
    between the call's work and its bookkeeping."""
    real: Callable[..., Any] = getattr(manager, name)
    reaped: list[int] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        clock.now += 10
        reaped.append(sessions.reap())
        return out

    monkeypatch.setattr(manager, name, racing)
    return reaped


def test_a_lease_granted_while_the_reaper_ends_the_session_is_given_back(
    manager: TierManager,
    sessions: SessionRegistry,
    clock: HandClock,
    ns: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (key,) = keys_for(ns, 1)
    _store(manager, key)
    session = sessions.open("r0", "e0", 0, 0)
    reaped = _reaping_midway(monkeypatch, manager, "lease", clock, sessions)
    with pytest.raises(SessionNotFoundError, match="expired"):
        sessions.lease(session, [key])
    assert reaped == [1]
    assert sessions.counts() == (0, 0, 0)
    slot = manager.cpu.slots.slot_of(key)
    assert slot is not None
    assert manager.cpu.memory.refcount[slot] == 0, "a lease was left in a reaped session"


def test_a_reservation_made_while_the_reaper_ends_the_session_is_given_back(
    manager: TierManager,
    sessions: SessionRegistry,
    clock: HandClock,
    ns: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (key,) = keys_for(ns, 1)
    session = sessions.open("r0", "e0", 0, 0)
    _reaping_midway(monkeypatch, manager, "reserve", clock, sessions)
    with pytest.raises(SessionNotFoundError, match="expired"):
        sessions.reserve(session, [key])
    monkeypatch.undo()
    assert sessions.counts() == (0, 0, 0)
    assert manager.reserve([key])[0] is not None, "the key stayed reserved"


def test_a_reaped_session_answers_expired_and_takes_no_more_calls(
    sessions: SessionRegistry, clock: HandClock, ns: bytes
) -> None:
    session = sessions.open("r0", "e0", 0, 0)
    clock.now += 10
    assert sessions.reap() == 1
    with pytest.raises(SessionNotFoundError, match="expired"):
        sessions.live(session.id)
    with pytest.raises(SessionNotFoundError, match="unknown"):
        sessions.live("never-opened")
    with pytest.raises(SessionNotFoundError):
        sessions.reserve(session, keys_for(ns, 1))
    assert sessions.counts() == (0, 0, 0)


def test_the_reaper_survives_an_error_and_reaps_on_the_next_round(
    manager: TierManager,
    sessions: SessionRegistry,
    clock: HandClock,
    ns: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = keys_for(ns, 2)
    for key in (first, second):
        _store(manager, key)
    dying = sessions.open("r0", "e0", 0, 0)
    (lease,) = sessions.lease(dying, [first])
    assert lease is not None
    real = manager.release
    failures: list[int] = []

    def failing_once(refs: Any) -> None:
        if not failures:
            failures.append(len(refs))
            raise RuntimeError("broken by the test")
        real(refs)

    monkeypatch.setattr(manager, "release", failing_once)
    clock.now += 10
    assert sessions.reap() == 1  # logged, not raised
    assert failures == [1]
    later = sessions.open("r1", "e1", 0, 0)
    (other,) = sessions.lease(later, [second])
    assert other is not None
    clock.now += 10
    assert sessions.reap() == 1
    assert sessions.counts() == (0, 0, 0)
    assert manager.cpu.memory.refcount[other.slot] == 0


def test_a_retried_release_ends_its_own_lease_and_no_other(
    manager: TierManager, sessions: SessionRegistry, ns: bytes
) -> None:
    (key,) = keys_for(ns, 1)
    _store(manager, key)
    session = sessions.open("r0", "e0", 0, 0)
    (a,) = sessions.lease(session, [key])
    (b,) = sessions.lease(session, [key])  # two requests share the chunk
    assert a is not None
    assert b is not None
    assert (a.slot, a.generation) == (b.slot, b.generation)
    assert a.lease != b.lease
    assert sessions.release(session, [a]) == 1
    assert sessions.release(session, [a]) == 0  # its answer was lost: sent again
    assert manager.cpu.memory.refcount[a.slot] == 1, "the retry ended the other lease"
    assert sessions.release(session, [b]) == 1
    assert manager.cpu.memory.refcount[a.slot] == 0
    assert sessions.counts() == (1, 0, 0)


def test_a_retried_commit_or_abort_changes_nothing(
    manager: TierManager, sessions: SessionRegistry, ns: bytes
) -> None:
    kept, dropped = keys_for(ns, 2)
    session = sessions.open("r0", "e0", 0, 0)
    ref, gone = sessions.reserve(session, [kept, dropped])
    assert ref is not None
    assert gone is not None
    manager.cpu.view(ref)[:] = payload_for(kept, CHUNK)
    assert sessions.commit(session, [ref]) == 1
    assert sessions.commit(session, [ref]) == 0
    sessions.abort(session, [gone])
    sessions.abort(session, [gone])
    assert manager.lookup([kept]).hits == 1
    assert sessions.counts() == (1, 0, 0)
    assert manager.reserve([dropped])[0] is not None


def test_a_reservation_never_committed_is_aborted_after_its_timeout(
    manager: TierManager, sessions: SessionRegistry, clock: HandClock, ns: bytes
) -> None:
    stuck, fresh = keys_for(ns, 2)
    session = sessions.open("r0", "e0", 0, 0)
    (ref,) = sessions.reserve(session, [stuck])
    assert ref is not None
    for _ in range(7):  # the engine stays alive: only the reservation is old
        clock.now += 4
        sessions.heartbeat(session.id)
        sessions.reap()
    (young,) = sessions.reserve(session, [fresh])
    clock.now += 4
    assert sessions.reap() == 0
    assert sessions.counts() == (1, 0, 1)  # the fresh one is kept
    assert manager.cpu.stats().counters[EXPIRED_COUNTER] == 1
    assert sessions.commit(session, [ref]) == 0  # a commit that arrives late finds nothing
    (again,) = sessions.reserve(session, [stuck])
    assert again is not None, "the key stayed unstorable"
    assert young is not None


def test_a_blank_reservation_an_idle_engine_held_expires_apart_from_lost_commits(
    manager: TierManager, sessions: SessionRegistry, clock: HandClock, ns: bytes
) -> None:
    (key,) = keys_for(ns, 1)
    session = sessions.open("r0", "e0", 0, 0)
    blank, other = (blank_key(ns, i, len(key) - NAMESPACE_BYTES) for i in range(2))
    start = clock.now
    (held,) = sessions.reserve(session, [blank])
    assert held is not None
    assert sessions.reserve(session, keys_for(ns, 2)[1:]) != [None]
    clock.now += 1
    assert sessions.reserve(session, [other]) != [None]
    while clock.now + 4 < start + BLANK_HOLD_S:  # the engine stays alive, idle
        clock.now += 4
        sessions.heartbeat(session.id)
        sessions.reap()
        # past the reservation timeout only the keyed one goes: a client may write a blank
        # one until well before BLANK_HOLD_S
        if clock.now > start + 31:
            assert manager.cpu.stats().counters[EXPIRED_COUNTER] == 1
            assert len(session.reservations) == 2
    clock.now = start + BLANK_HOLD_S + 0.5  # the first blank one is past it, the second not
    sessions.reap()
    counters = manager.cpu.stats().counters
    assert counters[BLANK_EXPIRED_COUNTER] == 1
    assert len(session.reservations) == 1
    assert counters[EXPIRED_COUNTER] == 1, "counted as a lost commit"
    assert sessions.commit(session, [replace(held, key=key)]) == 0
    assert manager.lookup([key]).hits == 0


def test_a_lease_never_released_is_released_after_its_timeout(
    manager: TierManager, sessions: SessionRegistry, clock: HandClock, ns: bytes
) -> None:
    (key,) = keys_for(ns, 1)
    _store(manager, key)
    session = sessions.open("r0", "e0", 0, 0)
    (lease,) = sessions.lease(session, [key])
    assert lease is not None
    for _ in range(16):
        clock.now += 4
        sessions.heartbeat(session.id)
        sessions.reap()
    assert sessions.counts() == (1, 0, 0)
    assert manager.cpu.memory.refcount[lease.slot] == 0
    assert manager.cpu.stats().counters[EXPIRED_LEASES_COUNTER] == 1
    assert sessions.release(session, [lease]) == 0  # a release that arrives late ends nothing


def test_sessions_past_the_bound_are_refused_until_one_ends(manager: TierManager) -> None:
    sessions = SessionRegistry(manager, timeout_s=5.0, max_sessions=2)
    a = sessions.open("r0", "e0", 0, 0)
    sessions.open("r1", "e1", 0, 0)
    with pytest.raises(CapacityError, match=r"server\.max_sessions"):
        sessions.open("r2", "e2", 0, 0)
    sessions.discard(a)
    sessions.open("r2", "e2", 0, 0)
    assert sessions.counts()[0] == 2


def test_a_session_past_its_lease_bound_is_refused_until_it_releases(
    manager: TierManager, ns: bytes
) -> None:
    sessions = SessionRegistry(manager, timeout_s=5.0, max_session_leases=2)
    (key,) = keys_for(ns, 1)
    _store(manager, key)
    session = sessions.open("r0", "e0", 0, 0)
    (a,) = sessions.lease(session, [key])
    sessions.lease(session, [key])
    with pytest.raises(CapacityError, match=r"server\.max_session_leases"):
        sessions.lease(session, [key])
    assert a is not None
    assert manager.cpu.memory.refcount[a.slot] == 2  # the refused call took nothing
    sessions.release(session, [a])
    assert sessions.lease(session, [key])[0] is not None


def test_blank_reservations_hold_at_most_an_eighth_of_the_pool_and_stores_find_the_rest(
    manager: TierManager, sessions: SessionRegistry, ns: bytes
) -> None:
    keys = keys_for(ns, 64)
    hash_bytes = len(keys[0]) - NAMESPACE_BYTES
    session = sessions.open("r0", "e0", 0, 0)
    pool_slots = manager.cpu.pool_capacity_bytes("target") // CHUNK
    blanks = sessions.reserve(session, [blank_key(ns, i, hash_bytes) for i in range(pool_slots)])
    held = [ref for ref in blanks if ref is not None]
    assert len(held) == pool_slots // BLANK_SHARE
    assert manager.cpu.stats().counters["blank_refused"] == pool_slots - len(held)
    stores = sessions.reserve(session, keys[: pool_slots - len(held)])
    assert all(stores), "the slots held blank took room from the stores"
    # a blank slot named and committed, and another given back, let as many more be held
    sessions.abort(session, [ref for ref in stores[:2] if ref is not None])  # room for them
    manager.cpu.view(held[0])[:] = payload_for(keys[-1], CHUNK)
    assert sessions.commit(session, [replace(held[0], key=keys[-1])]) == 1
    sessions.abort(session, [replace(held[1], key=keys[-2])])
    more = sessions.reserve(session, [blank_key(ns, pool_slots + i, hash_bytes) for i in range(3)])
    assert [ref is not None for ref in more] == [True, True, False]
    assert manager.cpu.stats().counters["blank_refused"] == pool_slots - len(held) + 1


def test_a_slot_reserved_blank_is_freed_for_a_chunk_lmdb_keeps_as_a_keyed_one_is_refused(
    manager: TierManager, sessions: SessionRegistry, ns: bytes
) -> None:
    kept, fresh = keys_for(ns, 2)
    _store(manager, kept)
    assert manager.flush()
    manager.evict("cpu")
    session = sessions.open("r0", "e0", 0, 0)
    assert sessions.reserve(session, [kept]) == [None], "a keyed reservation is refused"
    hash_bytes = len(kept) - NAMESPACE_BYTES
    first, second = sessions.reserve(session, [blank_key(ns, i, hash_bytes) for i in range(2)])
    assert first is not None
    assert second is not None
    manager.cpu.view(second)[:] = payload_for(fresh, CHUNK)
    named = [replace(first, key=kept), replace(second, key=fresh)]
    assert sessions.commit(session, named) == 1
    assert manager.lookup([kept, fresh]).tiers == ["lmdb", "cpu"]
    assert manager.cpu.stats().counters["store_duplicate"] == 2
    assert manager.cpu.slots.reserved == 0, "the refused slot went back"
