"""Sessions: what each connected engine worker holds, so that nothing leaks when it dies.

Every reservation and lease handed out over the data plane is recorded against the session that
asked. A session whose heartbeat lapses is reaped: its leases are released and its reservations
aborted. A session can commit, abort or release only what it holds itself.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.errors import SessionNotFoundError
from kvtier.keys import ChunkKey
from kvtier.manager import TierManager
from kvtier.tiers.cpu import SlotRef

log = logging.getLogger(__name__)

_Handle = tuple[int, int]  # (slot, generation)


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
    leases: dict[_Handle, list[SlotRef]] = field(default_factory=dict)
    reservations: dict[_Handle, SlotRef] = field(default_factory=dict)


class SessionRegistry:
    def __init__(
        self,
        manager: TierManager,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.timeout_s = timeout_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, replica: str, engine_id: str, tp_rank: int, pp_rank: int) -> Session:
        session = Session(
            id=uuid.uuid4().hex,
            replica=replica,
            engine_id=engine_id,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            deadline=self._clock() + self.timeout_s,
        )
        with self._lock:
            self._sessions[session.id] = session
        log.info("session %s opened: replica %s, engine %s", session.id, replica, engine_id)
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id!r} is unknown or expired")
        return session

    def heartbeat(self, session_id: str) -> bool:
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.deadline = self._clock() + self.timeout_s
        return True

    # -- data-plane operations, recorded per session --------------------------------------

    def reserve(self, session: Session, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        refs = self.manager.reserve(keys, session.replica)
        with self._lock:
            for ref in refs:
                if ref is not None:
                    session.reservations[_handle(ref)] = ref
        return refs

    def _take_reservations(self, session: Session, refs: Sequence[SlotRef]) -> list[SlotRef]:
        taken: list[SlotRef] = []
        with self._lock:
            for ref in refs:
                held = session.reservations.get(_handle(ref))
                if held is not None and held.key == ref.key:
                    del session.reservations[_handle(ref)]
                    taken.append(held)
        return taken

    def commit(self, session: Session, refs: Sequence[SlotRef]) -> int:
        return self.manager.commit(self._take_reservations(session, refs))

    def abort(self, session: Session, refs: Sequence[SlotRef]) -> None:
        self.manager.abort(self._take_reservations(session, refs))

    def prefetch(self, session: Session, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        leases = self.manager.load(keys, session.replica)
        with self._lock:
            for lease in leases:
                if lease is not None:
                    session.leases.setdefault(_handle(lease), []).append(lease)
        return leases

    def release(self, session: Session, refs: Sequence[SlotRef]) -> int:
        held: list[SlotRef] = []
        with self._lock:
            for ref in refs:
                stack = session.leases.get(_handle(ref))
                if stack and stack[-1].key == ref.key:
                    held.append(stack.pop())
                    if not stack:
                        del session.leases[_handle(ref)]
        self.manager.release(held)
        return len(held)

    # -- expiry ---------------------------------------------------------------------------

    def reap(self) -> int:
        """End every session whose heartbeat lapsed; returns how many."""
        now = self._clock()
        with self._lock:
            expired = [s for s in self._sessions.values() if s.deadline < now]
            for session in expired:
                del self._sessions[session.id]
        for session in expired:
            self._end(session)
            log.warning(
                "session %s (replica %s) expired: reclaimed its leases and reservations",
                session.id,
                session.replica,
            )
        return len(expired)

    def _end(self, session: Session) -> None:
        leases = [ref for stack in session.leases.values() for ref in stack]
        self.manager.release(leases)
        self.manager.abort(list(session.reservations.values()))
        session.leases.clear()
        session.reservations.clear()

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
                sum(len(stack) for s in sessions for stack in s.leases.values()),
                sum(len(s.reservations) for s in sessions),
            )
