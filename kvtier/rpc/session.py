"""A session with kvtierd: registering pools (and registering them again in a new session when
the daemon restarted or the session expired, the one place a lost session is handled), and the
heartbeat thread, which carries what `reports.Reports` holds and brings back the daemon's draft
pools, quarantines and measured costs; with a breaker, it is also the probe that closes it."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc

from kvtier.api.v1 import tier_pb2
from kvtier.core.codec import costs_from, drafts_from, spec_to
from kvtier.core.costs import CostSnapshot
from kvtier.core.errors import KVTierError, SessionNotFoundError
from kvtier.core.keys import NamespaceSpec
from kvtier.core.peers import TICKET_METADATA, peer_socket_path
from kvtier.core.protocol import DraftState
from kvtier.rpc.arena_view import ArenaView
from kvtier.rpc.channel import DaemonChannel
from kvtier.rpc.reports import Reports

# the client's logger, which operators filter on
log = logging.getLogger("kvtier.rpc.tier_client")

R = TypeVar("R")
_MAX_TICKET_LINE = 256
_ENDING_TIMEOUT_S = 1.0  # a daemon gone already: the session then ends at its timeout


def read_ticket(path: Path, timeout_s: float) -> str:
    """A ticket from kvtierd's peer socket at ``path``, standing for this process's credentials;
    "" when none comes (kvtierd down, or this user outside its group): the registration then
    fails as the call itself says."""
    answer = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(str(path))
            while b"\n" not in answer and len(answer) < _MAX_TICKET_LINE:
                part = conn.recv(_MAX_TICKET_LINE)
                if not part:
                    break
                answer += part
    except OSError as exc:
        log.debug("no peer ticket from %s: %s", path, exc)
    line, newline, _ = answer.partition(b"\n")
    return line.decode(errors="replace").strip() if newline else ""


class DaemonSession:
    """This client's session over ``channel``, as replica ``replica`` (with the engine's
    ``identity``: engine id, tensor- and pipeline-parallel rank). Each registration points
    ``arena`` at the session's arena; each heartbeat carries what ``reports`` hold, and one
    answered sends the hits an idle engine left."""

    def __init__(
        self,
        channel: DaemonChannel,
        socket_path: Path,
        replica: str,
        identity: tuple[str, int, int],
        reports: Reports,
        arena: ArenaView,
    ) -> None:
        self._channel = channel
        self._peer_socket = peer_socket_path(socket_path)
        self.replica = replica
        self._identity = identity
        self._reports = reports
        self._arena = arena
        self.id = ""
        self._pools: list[tier_pb2.PoolRegistration] = []
        self._reopen_lock = threading.Lock()
        self.arena_path: Path | None = None
        self.arena_inode = 0
        """The arena file's inode as the registration found it (0: none found)."""
        self.lmdb_path: Path | None = None
        self.object_tier = True
        """Whether the daemon may have an object store (until its registration says)."""
        self.drafts: dict[bytes, DraftState] = {}
        self.quarantined: frozenset[bytes] = frozenset()
        self.costs: CostSnapshot | None = None
        """kvtierd's measured costs, as its registration's or last heartbeat's reply carried
        them."""
        self.coded: dict[bytes, float] = {}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._heard_at = 0.0
        self._fresh_s = 0.0
        """How long after kvtierd last answered the session cannot have expired unheard: two
        heartbeats, at most half the session's timeout."""

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        """Add a pool to this session (opening one if needed); returns its namespace."""
        registration = tier_pb2.PoolRegistration(spec=spec_to(spec), chunk_bytes=chunk_bytes)
        self._channel.check()  # a draft revision registered mid-run waits for kvtierd too
        try:
            response = self._register([registration], self.id)
        except SessionNotFoundError:
            self._reopen()
            response = self._register([registration], self.id)
        self._pools.append(registration)
        return bytes(response.namespaces[0])

    def _register(
        self, pools: list[tier_pb2.PoolRegistration], session_id: str
    ) -> tier_pb2.RegisterSessionResponse:
        engine_id, tp_rank, pp_rank = self._identity
        request = tier_pb2.RegisterSessionRequest(
            replica_id=self.replica,
            engine_id=engine_id,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            pools=pools,
            session_id=session_id,
        )
        channel = self._channel
        ticket = "" if session_id else read_ticket(self._peer_socket, channel.register_s)
        metadata = ((TICKET_METADATA, ticket),) if ticket else ()
        # the breaker does not stop a registration: the probe's own is one
        response = channel.call_past_breaker(
            channel.stub.RegisterSession, request, channel.register_s, metadata=metadata
        )
        self.id = response.session_id
        self._heard_at = time.monotonic()
        self._fresh_s = min(2 * response.heartbeat_interval_ms, response.session_timeout_ms / 2)
        self._fresh_s /= 1000
        self.arena_path = Path(response.arena_path)
        try:  # read here, not in a step: a system call there waits out the engine's threads
            self.arena_inode = os.stat(self.arena_path).st_ino  # a restarted kvtierd's is new
        except OSError:
            self.arena_inode = 0
        self.lmdb_path = Path(response.lmdb_path) if response.lmdb_path else None
        self.object_tier = not response.no_object_tier
        self._arena.follow(self.arena_path)
        self._follow(response)
        self.coded = {bytes(c.namespace): c.error_bound for c in response.coded}
        if self._heartbeat is None:
            interval = response.heartbeat_interval_ms / 1000
            if channel.deadlines is not None:
                interval = min(interval, channel.deadlines.probe_every_s)
            self._heartbeat = threading.Thread(
                target=self._beat, args=(interval,), name="kvtier-heartbeat", daemon=True
            )
            self._heartbeat.start()
        return response

    def _reopen(self) -> tier_pb2.RegisterSessionResponse:
        """A new session with every pool registered so far: after the daemon restarted, or
        after this client's session expired. Leases and reservations of the old one are gone."""
        log.warning("session %s is gone at %s; opening a new one", self.id, self._channel.target)
        with self._reopen_lock:
            return self._register(list(self._pools), "")

    def _lost(self) -> None:
        """The session is gone: open a new one now, or (with a breaker) leave that to the
        probe, since registering takes longer than any call may wait."""
        if self._channel.breaker is None:
            self._reopen()
        else:
            self._channel.breaker.trip("its session is gone")

    def in_session(self, call: Callable[[], R]) -> R:
        """``call()``, made again in a new session if this one is gone (with a breaker, that
        waits for the probe: `DaemonStalledError` now)."""
        try:
            return call()
        except SessionNotFoundError:
            self._lost()
            self._channel.check()
            return call()

    def with_old_refs(self, call: Callable[[], R]) -> R | None:
        """``call()`` on refs of this session; None if it is gone, since they went with it."""
        try:
            return call()
        except SessionNotFoundError:
            self._lost()
            return None

    def _beat(self, interval: float) -> None:
        """Heartbeats; with a breaker, also its probe: a heartbeat that fails opens it, one
        answered while it is open closes it."""
        channel = self._channel
        while not self._stop.wait(interval):
            breaker, deadlines = channel.breaker, channel.deadlines
            if breaker is None or deadlines is None:
                try:
                    self.heartbeat()
                except KVTierError as exc:
                    log.warning("heartbeat to %s failed: %s", channel.target, exc)
                else:
                    self._report_idle()
                continue
            timeout = deadlines.probe_s if breaker.why else channel.register_s
            try:
                self._probe(timeout)
            except KVTierError as exc:
                breaker.trip(f"missed a heartbeat ({exc})")
                continue
            breaker.reset()
            self._report_idle()

    def _report_idle(self) -> None:
        """What the last steps of an engine gone idle left to report goes now, not with its
        next request."""
        try:
            self._reports.send_hits()
        except KVTierError as exc:
            log.debug("hit report to %s failed: %s", self._channel.target, exc)

    def heartbeat(self) -> None:
        """A heartbeat asked for in a step, counted by the breaker."""
        request = self._reports.heartbeat(self.id)
        response = self._channel.call(self._channel.stub.Heartbeat, request)
        if self._answered(response):
            return
        self._lost()  # expired, or the daemon restarted: carry on in a new session
        self._channel.check()

    def _probe(self, timeout: float) -> None:
        """The heartbeat thread's own, past the breaker: this call is the one that may close
        it, in a new session if need be."""
        request = self._reports.heartbeat(self.id)
        response = self._channel.call_past_breaker(self._channel.stub.Heartbeat, request, timeout)
        if not self._answered(response):
            self._reopen()

    def _answered(self, response: tier_pb2.HeartbeatResponse) -> bool:
        """Takes what a heartbeat brought back; False if the session is gone."""
        self._follow(response)
        if response.alive:
            self._heard_at = time.monotonic()
        return response.alive

    def mark(self) -> tuple[str, int] | None:
        """The session, and the arena file, that a reservation made now is held in, while
        kvtierd answered recently enough that it cannot have ended the session unheard; None
        otherwise. A reservation made under one mark is held while the mark stays the same."""
        if not self.arena_inode or time.monotonic() - self._heard_at > self._fresh_s:
            return None
        return self.id, self.arena_inode

    def _follow(
        self, response: tier_pb2.RegisterSessionResponse | tier_pb2.HeartbeatResponse
    ) -> None:
        """The drafts, quarantines and costs a registration's or a heartbeat's reply carried."""
        self.drafts = drafts_from(response.drafts)
        self.quarantined = frozenset(response.quarantined)
        if response.HasField("costs"):
            self.costs = costs_from(response.costs)

    def stop_heartbeats(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()

    def end(self) -> None:
        """kvtierd gives back what the session holds now, not at its timeout."""
        if self.id:
            ending = tier_pb2.HeartbeatRequest(session_id=self.id, ending=True)
            with contextlib.suppress(grpc.RpcError):
                self._channel.stub.Heartbeat(ending, timeout=_ENDING_TIMEOUT_S)
