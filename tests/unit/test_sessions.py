"""Sessions against a real TierManager, with a hand-driven clock for expiry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.api.v1 import tier_pb2
from kvtier.core.config import ServerConfig
from kvtier.core.errors import SessionNotFoundError
from kvtier.server.dataplane import TierServicer
from kvtier.server.peers import TenantPolicy, TicketOffice
from kvtier.server.sessions import SessionRegistry
from kvtier.tiering.manager import TierManager
from tests.support import HandClock, keys_for, payload_for, target_spec

CHUNK = 256 << 10


def test_lapsed_session_gives_back_leases_and_reservations(manager: TierManager) -> None:
    clock = HandClock()
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


def test_a_lookup_or_reserve_says_busy_and_a_report_of_served_hits_does_not(
    manager: TierManager, tmp_path: Path
) -> None:
    """Idle write-back stops at an engine's first lookup or reserve, not at its next heartbeat;
    a report of hits answered from the arena's index is sent by idle engines too."""
    sessions = SessionRegistry(manager, timeout_s=5.0)
    config = ServerConfig(socket_path=tmp_path / "kvtierd.sock")
    tickets = TicketOffice(config.socket_path, None)  # not listening: nothing registers here
    servicer = TierServicer(
        manager, sessions, config, tickets=tickets, tenants=TenantPolicy.of(config, None)
    )
    ns = manager.register_pool(target_spec(), CHUNK)
    session = sessions.open("r0", "e0", 0, 0)
    session.namespaces.add(ns)
    keys = keys_for(ns, 2)
    batch = tier_pb2.KeyBatch(key_bytes=len(keys[0]), packed=b"".join(keys))
    context: Any = None
    beat = tier_pb2.HeartbeatRequest

    assert sessions.idle()
    servicer.Lookup(tier_pb2.LookupRequest(session_id=session.id, keys=batch), context)
    assert not sessions.idle()
    servicer.Heartbeat(beat(session_id=session.id, busy=False), context)
    assert sessions.idle()
    served = tier_pb2.LookupRequest(session_id=session.id, keys=batch, served=True)
    servicer.Lookup(served, context)
    assert sessions.idle()
    servicer.Reserve(tier_pb2.ReserveRequest(session_id=session.id, keys=batch), context)
    assert not sessions.idle()
    servicer.Heartbeat(beat(session_id=session.id, busy=False), context)
    servicer.Heartbeat(beat(session_id=session.id, busy=True), context)
    assert not sessions.idle()
    sessions.discard(session)
    assert sessions.idle(), "a closed session holds nothing back"
