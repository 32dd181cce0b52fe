"""A session with kvtierd over its unix socket: the channel and its breaker, registering pools
(and registering them again in a new session when the daemon restarted or the session expired),
heartbeats that carry the daemon's draft pools and quarantines, and the client's own call thread.
`tier_client.GrpcTierClient` sends the data plane's calls in it."""

from __future__ import annotations

import functools
import logging
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from kvtier.api.v1 import tier_pb2, tier_pb2_grpc
from kvtier.core.codec import drafts_from, heartbeat_to, spec_to
from kvtier.core.costs import EngineTimings
from kvtier.core.errors import KVTierError, SessionNotFoundError
from kvtier.core.keys import ChunkKey, NamespaceSpec
from kvtier.core.memory import keep_freed_pages
from kvtier.core.peers import TICKET_METADATA, peer_socket_path
from kvtier.core.protocol import DraftState, FailedChunk, SlotRef
from kvtier.rpc.calls import (
    CHANNEL_OPTIONS,
    STALLED,
    Breaker,
    DaemonStalledError,
    Deadlines,
    Pending,
    call,
    translate,
)
from kvtier.tiers.arena import ArenaAtPath
from kvtier.tiers.arena_index import readable_here

# the client's logger, which operators filter on
log = logging.getLogger("kvtier.rpc.tier_client")

R = TypeVar("R")
_MAX_TICKET_LINE = 256
_TIER_SERVICE = tier_pb2.DESCRIPTOR.services_by_name["TierService"].full_name


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


class DaemonSession(ABC):
    """The session under `tier_client.GrpcTierClient`."""

    def __init__(
        self,
        socket_path: Path,
        replica: str,
        engine_id: str = "",
        tp_rank: int = 0,
        pp_rank: int = 0,
        timeout_s: float = 10.0,
        tune_memory: bool = True,
        deadlines: Deadlines | None = None,
    ) -> None:
        """``timeout_s`` bounds every call, unless ``deadlines`` are given (see there)."""
        if tune_memory:
            keep_freed_pages()  # see kvtier.core.memory: halves the cost of large batches here
        self.target = f"unix:{socket_path}"
        self._peer_socket = peer_socket_path(socket_path)
        self.replica = replica
        self._identity = (engine_id, tp_rank, pp_rank)
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = tier_pb2_grpc.TierServiceStub(self._channel)
        self.session_id = ""
        self._pools: list[tier_pb2.PoolRegistration] = []
        self._reopen_lock = threading.Lock()
        self._arena_path: Path | None = None
        self._lmdb_path: Path | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._drafts: dict[bytes, DraftState] = {}
        self._quarantined: frozenset[bytes] = frozenset()
        self._coded: dict[bytes, float] = {}
        self._caller: ThreadPoolExecutor | None = None
        self._arena: ArenaAtPath | None = None
        """The arena, mapped to read its key index (where `readable_here`)."""
        # key-carrying calls send requests encoded by kvtier.core.wire (see there for why)
        self._lookup = self._raw("Lookup", tier_pb2.LookupResponse)
        self._reserve = self._raw("Reserve", tier_pb2.ReserveResponse)
        self._prefetch = self._raw("Prefetch", tier_pb2.PrefetchResponse)
        self._promote = self._raw("Promote", tier_pb2.PromoteResponse)
        self._reporting = threading.Lock()
        """Guards what reports carry: the heartbeat thread sends one an idle engine left."""
        self._hits: dict[tuple[int, ...], list[ChunkKey]] = {}
        """Keys the index answered since the last `report_hits`, by how their lookups were
        counted (their flags: asked again, counted as loads only; sampled for verification,
        counted as verified)."""
        self._due: list[SlotRef] = []
        """Leases to end with the next report."""
        self._report: Pending[None] | None = None
        self._reported: list[SlotRef] = []
        """The leases the report in flight ends."""
        self._next_report = 0.0
        self._busy = False
        """Sent with each heartbeat (see `set_busy`)."""
        self._timings = EngineTimings()
        """Sent with the next heartbeat (`report_timings`)."""
        self._failed: list[FailedChunk] = []
        """Chunks found failing verification, sent with the next heartbeat (`report_failed`)."""
        self._timings_lock = threading.Lock()
        self._deadlines = deadlines
        self.breaker = (
            Breaker(self.target, deadlines.misses_to_open) if deadlines is not None else None
        )
        d = deadlines
        self._lookup_s = d.lookup_s if d is not None else timeout_s
        self._store_s = d.store_s if d is not None else timeout_s
        self._register_s = d.register_s if d is not None else timeout_s

    @property
    def serving(self) -> bool:
        """False while the breaker is open: every call would fail at once."""
        return self.breaker is None or not self.breaker.why

    def _rpc(self, method: Callable[..., R], request: Any, timeout: float | None = None) -> R:
        breaker = self.breaker
        if breaker is None:
            return call(self.target, method, request, timeout=timeout or self._timeout)
        breaker.check()
        try:
            answer = method(request, timeout=timeout or self._store_s)
        except grpc.RpcError as exc:
            if exc.code() not in STALLED:
                raise translate(self.target, exc) from None
            code = exc.code().name.lower()
            why = f"{code} after {timeout or self._store_s:.3f} s"
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                breaker.missed(why)
            else:  # unreachable: no use waiting out more deadlines
                breaker.trip(why)
            raise DaemonStalledError(f"{self.target}: {code} ({exc.details()})") from None
        breaker.answered()
        return answer

    def _raw(self, name: str, response: type[Message]) -> grpc.UnaryUnaryMultiCallable[bytes, Any]:
        return self._channel.unary_unary(
            f"/{_TIER_SERVICE}/{name}", response_deserializer=response.FromString
        )

    def _behind(
        self,
        method: Callable[..., Any],
        request: Any,
        convert: Callable[[Any], R] = lambda response: response,
    ) -> Pending[R]:
        """The call made on this client's own thread: grpc's ``future()`` starts a thread per
        call when none is spinning, which took longer here (0.9 ms) than the call itself."""
        if self.breaker is None:
            future = self._calls().submit(method, request, timeout=self._timeout)
        else:
            self.breaker.check()  # nothing queues behind a daemon that does not answer
            future = self._calls().submit(self._rpc, method, request, self._store_s)
        return Pending(future, convert, self.target)

    def _calls(self) -> ThreadPoolExecutor:
        if self._caller is None:
            self._caller = ThreadPoolExecutor(1, thread_name_prefix="kvtier-call")
        return self._caller

    @property
    def arena_path(self) -> Path:
        if self._arena_path is None:
            raise KVTierError("register a pool first: the arena path comes with the session")
        return self._arena_path

    @property
    def lmdb_path(self) -> Path | None:
        return self._lmdb_path

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        """Add a pool to this client's session (opening one if needed); returns its namespace."""
        registration = tier_pb2.PoolRegistration(spec=spec_to(spec), chunk_bytes=chunk_bytes)
        if self.breaker is not None:
            self.breaker.check()  # a draft revision registered mid-run waits for kvtierd too
        try:
            response = self._register([registration], self.session_id)
        except SessionNotFoundError:
            response = self._reopen()
            response = self._register([registration], self.session_id)
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
        ticket = "" if session_id else read_ticket(self._peer_socket, self._register_s)
        metadata = ((TICKET_METADATA, ticket),) if ticket else ()
        if self.breaker is None:
            response = self._rpc(
                functools.partial(self._stub.RegisterSession, metadata=metadata),
                request,
                self._register_s,
            )
        else:  # the breaker does not stop a registration: the probe's own is one
            try:
                response = self._stub.RegisterSession(
                    request, timeout=self._register_s, metadata=metadata
                )
            except grpc.RpcError as exc:
                raise translate(self.target, exc) from None
        self.session_id = response.session_id
        self._arena_path = Path(response.arena_path)
        self._lmdb_path = Path(response.lmdb_path) if response.lmdb_path else None
        if readable_here() and (self._arena is None or self._arena.path != self._arena_path):
            self._arena = ArenaAtPath(self._arena_path, populate=False)
        self._drafts = drafts_from(response.drafts)
        self._quarantined = frozenset(response.quarantined)
        self._coded = {bytes(c.namespace): c.error_bound for c in response.coded}
        if self._heartbeat is None:
            interval = response.heartbeat_interval_ms / 1000
            if self._deadlines is not None:
                interval = min(interval, self._deadlines.probe_every_s)
            self._heartbeat = threading.Thread(
                target=self._beat, args=(interval,), name="kvtier-heartbeat", daemon=True
            )
            self._heartbeat.start()
        return response

    def _reopen(self) -> tier_pb2.RegisterSessionResponse:
        """A new session with every pool registered so far: after the daemon restarted, or
        after this client's session expired. Leases and reservations of the old one are gone."""
        log.warning("session %s is gone at %s; opening a new one", self.session_id, self.target)
        with self._reopen_lock:
            return self._register(list(self._pools), "")

    def _in_session(self, call: Callable[[], R]) -> R:
        try:
            return call()
        except SessionNotFoundError:
            self._session_lost()
            return call()

    def _session_lost(self) -> None:
        """Open a new session now, or (with a breaker) leave that to the probe: registering
        takes longer than any call may wait."""
        if self.breaker is None:
            self._reopen()
            return
        self.breaker.trip("its session is gone")
        self.breaker.check()

    def _beat(self, interval: float) -> None:
        """Heartbeats; with a breaker, also its probe: a heartbeat that fails opens it, one
        answered while it is open closes it."""
        while not self._stop.wait(interval):
            breaker = self.breaker
            if breaker is None:
                try:
                    self._heartbeat_once()
                except KVTierError as exc:
                    log.warning("heartbeat to %s failed: %s", self.target, exc)
                else:
                    self._report_idle()
                continue
            probing = bool(breaker.why)
            assert self._deadlines is not None
            timeout = self._deadlines.probe_s if probing else self._register_s
            try:
                self._heartbeat_once(timeout, in_step=False)
            except KVTierError as exc:
                breaker.trip(f"missed a heartbeat ({exc})")
                continue
            breaker.reset()
            self._report_idle()

    def _report_idle(self) -> None:
        """What the last steps of an engine gone idle left to report goes now, not with its
        next request."""
        try:
            self.report_hits()
        except KVTierError as exc:
            log.debug("hit report to %s failed: %s", self.target, exc)

    def _heartbeat_once(self, timeout: float | None = None, in_step: bool = True) -> None:
        with self._timings_lock:
            timings, self._timings = self._timings, EngineTimings()
            failed, self._failed = self._failed, []
        request = heartbeat_to(self.session_id, self._busy, timings, failed)
        if in_step:
            response = self._rpc(self._stub.Heartbeat, request, timeout)
        else:  # past the breaker: this call is the one that may close it
            try:
                response = self._stub.Heartbeat(request, timeout=timeout)
            except grpc.RpcError as exc:
                raise translate(self.target, exc) from None
        self._drafts = drafts_from(response.drafts)
        self._quarantined = frozenset(response.quarantined)
        if not response.alive:  # expired, or the daemon restarted: carry on in a new session
            if in_step and self.breaker is not None:
                self._session_lost()
            self._reopen()

    def draft_states(self, refresh: bool = False) -> dict[bytes, DraftState]:
        """The daemon's draft pools, as of the last heartbeat; ``refresh`` asks now."""
        if refresh:
            self._heartbeat_once()
        return dict(self._drafts)

    @abstractmethod
    def report_hits(self, every_s: float = 0.0) -> None:
        """Send what the data plane has to report (the client's); the heartbeat thread sends
        what an idle engine left."""
