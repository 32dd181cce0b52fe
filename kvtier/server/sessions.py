"""Sessions: what each connected engine worker holds, so that nothing leaks when it dies.

Every reservation and lease handed out over the data plane is recorded against the session that
asked. A session whose heartbeat lapses is reaped: its leases are released and its reservations
aborted. A reservation neither committed nor aborted within `server.reservation_timeout_s` (its
commit was lost) is aborted too, so its key can be stored again; a lease held longer than
`server.lease_timeout_s` (its release, or the answer that granted it, was lost) is released.
A session can commit, abort or release only what it holds itself, and doing so twice (a
retried call) changes nothing: each lease has an id of its own.

A call that races the reaper never records anything in the session it reaped: the session is
marked closed under the registry's lock, what a call took for it meanwhile is given back, and
the call fails with `SessionNotFoundError` (the client then opens a new session).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.core.errors import CapacityError, SessionNotFoundError
from kvtier.core.keys import BLANK_HOLD_S, ChunkKey, is_blank, may_name
from kvtier.core.protocol import SlotRef
from kvtier.server.peers import Peer
from kvtier.tiering.manager import TierManager

log = logging.getLogger(__name__)

_Handle = tuple[int, int]  # (slot, generation)
_REMEMBER_EXPIRED = 4096  # ids of reaped sessions kept, to say "expired" rather than "unknown"
EXPIRED_COUNTER = "reservations_expired"
"""The cpu tier's event counter of reservations the daemon aborted for being too old."""
BLANK_EXPIRED_COUNTER = "blank_reservations_expired"
"""The same, of blank ones (`kvtier.core.keys.blank_key`): slots an engine held ahead of
stores that never came (it went idle), where no commit was lost."""
EXPIRED_LEASES_COUNTER = "leases_expired"
"""The cpu tier's event counter of leases the daemon released for being too old."""


def _handle(ref: SlotRef) -> _Handle:
    return ref.slot, ref.generation


@dataclass
class Session:
    id: str
    replica: str
    engine_id: str
    tp_rank: int
    pp_rank: int
    deadline: float
    namespaces: set[bytes] = field(default_factory=set)
    leases: dict[int, tuple[SlotRef, float]] = field(default_factory=dict)
    """By lease id, each with the time it was granted."""
    lease_ids: dict[_Handle, list[int]] = field(default_factory=dict)
    """The ids of the leases on each slot, for a release that names none."""
    reservations: dict[_Handle, tuple[SlotRef, float]] = field(default_factory=dict)
    """Each with the time it was made."""
    closed: bool = False
    """Reaped or closed: nothing is recorded in it any more."""
    busy: bool = False
    """Its engine holds requests: said by its heartbeats, and by a lookup or reserve."""
    peer: Peer | None = None
    """Who opened it, as the kernel said (`kvtier.server.peers`): its pools' tenants are theirs."""


class SessionRegistry:
    def __init__(
        self,
        manager: TierManager,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_sessions: int | None = None,
        reservation_timeout_s: float | None = None,
        lease_timeout_s: float | None = None,
        max_session_leases: int | None = None,
    ) -> None:
        server = manager.config.server
        self.manager = manager
        self.timeout_s = timeout_s
        self.max_sessions = server.max_sessions if max_sessions is None else max_sessions
        self.reservation_timeout_s = (
            server.reservation_timeout_s if reservation_timeout_s is None else reservation_timeout_s
        )
        self.lease_timeout_s = (
            server.lease_timeout_s if lease_timeout_s is None else lease_timeout_s
        )
        self.max_session_leases = (
            server.max_session_leases if max_session_leases is None else max_session_leases
        )
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._lease_ids = itertools.count(1)
        self._lock = threading.Lock()
        manager.registry.keep_while(self.namespaces_held)  # an open session's never expire

    def namespaces_held(self) -> set[bytes]:
        """The namespaces the open sessions registered."""
        with self._lock:
            return set().union(*(s.namespaces for s in self._sessions.values()))

    def open(
        self, replica: str, engine_id: str, tp_rank: int, pp_rank: int, peer: Peer | None = None
    ) -> Session:
        session = Session(
            id=uuid.uuid4().hex,
            replica=replica,
            engine_id=engine_id,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            deadline=self._clock() + self.timeout_s,
            peer=peer,
        )
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise CapacityError(
                    f"{len(self._sessions)} sessions are open, the most server.max_sessions "
                    "allows; raise it, or wait for idle sessions to expire"
                )
            self._sessions[session.id] = session
        log.info(
            "session %s opened: replica %s, engine %s, %s", session.id, replica, engine_id, peer
        )
        return session

    def _gone(self, session_id: str) -> SessionNotFoundError:
        if session_id in self._expired:
            return SessionNotFoundError(
                f"session {session_id!r} expired: its heartbeat lapsed, and its leases and "
                "reservations were given back; register again"
            )
        return SessionNotFoundError(f"session {session_id!r} is unknown or expired")

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise self._gone(session_id)
        return session

    def heartbeat(self, session_id: str, busy: bool = False) -> bool:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            session.deadline = self._clock() + self.timeout_s
            session.busy = busy
            return True

    def idle(self) -> bool:
        """No session's engine holds a request (or none is open)."""
        with self._lock:
            return not any(session.busy for session in self._sessions.values())

    def live(self, session_id: str) -> Session:
        """The session, its heartbeat refreshed (any call proves the client alive); raises
        `SessionNotFoundError` for one that is unknown, expired or closed."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise self._gone(session_id)
            session.deadline = self._clock() + self.timeout_s
            return session

    def end(self, session_id: str) -> None:
        """End a session its client closed; nothing for one unknown or ended already."""
        session = self._sessions.get(session_id)
        if session is not None:
            self.discard(session)

    def discard(self, session: Session) -> None:
        """End a session now, giving back what it holds (a registration that was refused)."""
        with self._lock:
            if self._sessions.get(session.id) is session:
                del self._sessions[session.id]
        self._end(session)

    # -- data-plane operations, recorded per session --------------------------------------

    def reserve(self, session: Session, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        refs = self.manager.reserve(keys, session.replica)
        taken = [ref for ref in refs if ref is not None]
        with self._lock:
            if not session.closed:
                now = self._clock()
                for ref in taken:
                    session.reservations[_handle(ref)] = (ref, now)
                return refs
        self.manager.abort(taken)  # reaped meanwhile: keep nothing for it
        raise self._gone(session.id)

    def _take_reservations(
        self, session: Session, refs: Sequence[SlotRef]
    ) -> list[tuple[SlotRef, ChunkKey]]:
        """The session's reservations ``refs`` name, no longer its own, each with the key the
        ref gives it: a slot reserved blank (`kvtier.core.keys.blank_key`) is named by the
        store that filled it, with a key of its namespace."""
        taken: list[tuple[SlotRef, ChunkKey]] = []
        with self._lock:
            if session.closed:
                raise self._gone(session.id)
            for ref in refs:
                held = session.reservations.get(_handle(ref))
                if held is None:
                    continue
                if may_name(held[0].key, ref.key):
                    del session.reservations[_handle(ref)]
                    taken.append((held[0], ref.key))
        return taken

    def commit(
        self, session: Session, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()
    ) -> int:
        pairs = self._take_reservations(session, refs)
        named = [replace(held, key=key) for held, key in pairs if held.key != key]
        kept = self.manager.refuse_kept(named)
        taken = [
            replace(held, key=key) for held, key in pairs if held.key == key or key not in kept
        ]
        if not lineages:
            return self.manager.commit(taken)
        by_key = {ref.key: lineage for ref, lineage in zip(refs, lineages, strict=False)}
        return self.manager.commit(taken, [by_key.get(ref.key, b"") for ref in taken])

    def abort(self, session: Session, refs: Sequence[SlotRef]) -> None:
        self.manager.abort([held for held, _ in self._take_reservations(session, refs)])

    def lease(
        self, session: Session, keys: Sequence[ChunkKey], in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        held = len(session.leases)
        if held + len(keys) > self.max_session_leases:
            raise CapacityError(
                f"this session holds {held} leases and asks for {len(keys)} more, past "
                f"server.max_session_leases ({self.max_session_leases}); release leases first"
            )
        leases = self.manager.lease(keys, session.replica, in_lmdb=in_lmdb)
        with self._lock:
            if not session.closed:
                now = self._clock()
                out: list[SlotRef | None] = []
                for lease in leases:
                    if lease is not None:
                        lease = replace(lease, lease=next(self._lease_ids))
                        session.leases[lease.lease] = (lease, now)
                        session.lease_ids.setdefault(_handle(lease), []).append(lease.lease)
                    out.append(lease)
                return out
        self.manager.release([lease for lease in leases if lease is not None])
        raise self._gone(session.id)

    def release(self, session: Session, refs: Sequence[SlotRef]) -> int:
        held: list[SlotRef] = []
        with self._lock:
            for ref in refs:
                lease = self._take_lease(session, ref)
                if lease is not None:
                    held.append(lease)
        self.manager.release(held)
        return len(held)

    @staticmethod
    def _take_lease(session: Session, ref: SlotRef) -> SlotRef | None:
        """The session's lease ``ref`` names (by id, else any on its slot), now no longer held;
        None when it holds no such lease (already released: a retried call)."""
        handle = _handle(ref)
        ids = session.lease_ids.get(handle)
        if not ids:
            return None
        lease_id = ref.lease if ref.lease else ids[-1]
        held = session.leases.get(lease_id)
        if held is None or _handle(held[0]) != handle or held[0].key != ref.key:
            return None
        lease = held[0]
        del session.leases[lease_id]
        ids.remove(lease_id)
        if not ids:
            del session.lease_ids[handle]
        return lease

    # -- expiry ---------------------------------------------------------------------------

    def reap(self) -> int:
        """End every session whose heartbeat lapsed, and abort reservations older than
        `reservation_timeout_s`; returns how many sessions ended. Never raises: a failure is
        logged and the next round tries again."""
        try:
            now = self._clock()
            with self._lock:
                expired = [s for s in self._sessions.values() if s.deadline < now]
                for session in expired:
                    del self._sessions[session.id]
                    session.closed = True
                    self._remember_expired(session.id)
                stale = self._take_stale(now)
                old_leases = self._take_old_leases(now - self.lease_timeout_s)
        except Exception:
            log.exception("reaping sessions failed; trying again next round")
            return 0
        for session in expired:
            try:
                self._end(session)
            except Exception:
                log.exception("reclaiming what session %s held failed", session.id)
                continue
            log.warning(
                "session %s (replica %s) expired: reclaimed its leases and reservations",
                session.id,
                session.replica,
            )
        if old_leases:
            try:
                self.manager.cpu.release(old_leases, counter=EXPIRED_LEASES_COUNTER)
            except Exception:
                log.exception("releasing %d expired leases failed", len(old_leases))
            else:
                log.warning(
                    "released %d leases held longer than %.0f s (server.lease_timeout_s)",
                    len(old_leases),
                    self.lease_timeout_s,
                )
        if blank := [ref for ref in stale if is_blank(ref.key)]:
            stale = [ref for ref in stale if not is_blank(ref.key)]
            try:
                self.manager.cpu.abort(blank, counter=BLANK_EXPIRED_COUNTER)
            except Exception:
                log.exception("aborting %d expired blank reservations failed", len(blank))
        if stale:
            try:
                aborted = self.manager.cpu.abort(stale, counter=EXPIRED_COUNTER)
            except Exception:
                log.exception("aborting %d expired reservations failed", len(stale))
            else:
                log.warning(
                    "aborted %d reservations not committed within %.0f s "
                    "(server.reservation_timeout_s)",
                    aborted,
                    self.reservation_timeout_s,
                )
        return len(expired)

    def _remember_expired(self, session_id: str) -> None:
        self._expired[session_id] = None
        while len(self._expired) > _REMEMBER_EXPIRED:
            self._expired.popitem(last=False)

    @staticmethod
    def _older(held: dict[Any, tuple[SlotRef, float]], before: float) -> list[Any]:
        """The keys of entries made before ``before``: the first ones, since entries are added
        in time order and never re-added, so the scan stops at the first young one."""
        old = []
        for key, (_ref, at) in held.items():
            if at >= before:
                break
            old.append(key)
        return old

    def _take_stale(self, now: float) -> list[SlotRef]:
        """Reservations past their timeout, taken out of their sessions (lock held); one
        reserved blank, past `BLANK_HOLD_S` at the least, as its client may write it until
        well before then."""
        before = now - self.reservation_timeout_s
        blank_before = now - max(self.reservation_timeout_s, BLANK_HOLD_S)
        stale: list[SlotRef] = []
        for session in self._sessions.values():
            for handle in self._older(session.reservations, before):
                ref, at = session.reservations[handle]
                if at < blank_before or not is_blank(ref.key):
                    stale.append(session.reservations.pop(handle)[0])
        return stale

    def _take_old_leases(self, before: float) -> list[SlotRef]:
        """Leases granted before ``before``, taken out of their sessions (lock held)."""
        old: list[SlotRef] = []
        for session in self._sessions.values():
            for lease_id in self._older(session.leases, before):
                lease = session.leases.pop(lease_id)[0]
                ids = session.lease_ids[_handle(lease)]
                ids.remove(lease_id)
                if not ids:
                    del session.lease_ids[_handle(lease)]
                old.append(lease)
        return old

    def _end(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            leases = [ref for ref, _at in session.leases.values()]
            reservations = [ref for ref, _at in session.reservations.values()]
            session.leases.clear()
            session.lease_ids.clear()
            session.reservations.clear()
        self.manager.release(leases)
        self.manager.abort(reservations)

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            self._end(session)

    def counts(self) -> tuple[int, int, int]:
        """(sessions, leases, reservations) currently held."""
        with self._lock:
            sessions = list(self._sessions.values())
            return (
                len(sessions),
                sum(len(s.leases) for s in sessions),
                sum(len(s.reservations) for s in sessions),
            )
