"""The data-plane servicer: protobuf in, TierManager and sessions, protobuf out. Nothing else."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import grpc

from kvtier.api.v1 import tier_pb2, tier_pb2_grpc
from kvtier.core.codec import (
    chunk_events_to,
    costs_to,
    drafts_to,
    failed_from,
    grants_to,
    lookup_to,
    ref_from,
    spec_from,
    timings_from,
)
from kvtier.core.config import ServerConfig
from kvtier.core.errors import InvalidRequestError, NamespaceAccessError, PermissionDeniedError
from kvtier.core.journal import ChunkEvents
from kvtier.core.keys import ChunkKey, NamespaceSpec, namespace_of
from kvtier.core.peers import TICKET_METADATA
from kvtier.core.protocol import SlotRef, leasable_hit
from kvtier.observability.telemetry import telemetry_of
from kvtier.server.peers import Peer, TenantPolicy, TicketOffice
from kvtier.server.sessions import Session, SessionRegistry
from kvtier.server.validate import (
    batch_namespaces,
    check_batch,
    check_chunk_bytes,
    keys_from,
    namespace_from,
    unpack_keys,
)
from kvtier.tiering.manager import TierManager

_REPLICA_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_MAX_POOLS = 16
_MAX_REASON = 500  # characters of a quarantine's reason kept
T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[["TierServicer", Req, grpc.ServicerContext], Resp]


def _timed(op: str) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    """Count the call and observe its duration under ``op``, errors included."""

    def wrap(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
        @functools.wraps(fn)
        def timed(self: TierServicer, request: Req, context: grpc.ServicerContext) -> Resp:
            with self.telemetry.timed(op):
                return fn(self, request, context)

        return timed

    return wrap


def _ticket(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == TICKET_METADATA:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


class TierServicer(tier_pb2_grpc.TierServiceServicer):
    def __init__(
        self,
        manager: TierManager,
        sessions: SessionRegistry,
        config: ServerConfig,
        *,
        tickets: TicketOffice,
        tenants: TenantPolicy,
    ):
        self.manager = manager
        self.sessions = sessions
        self.config = config
        self.tickets = tickets
        self.tenants = tenants
        self.telemetry = telemetry_of(manager)
        manager.registry.limit_namespaces(config.max_namespaces)

    def _session(self, session_id: str, busy: bool = False) -> Session:
        """``busy``: the call shows its engine running a request (a lookup or reserve), so
        idle write-back stops now rather than at the session's next heartbeat."""
        session = self.sessions.live(session_id)  # any call proves the client alive
        if busy:
            session.busy = True
        return session

    def _batch(self, items: Sequence[T]) -> Sequence[T]:
        check_batch(items, self.config.max_batch_keys)
        return items

    def _own(self, session: Session, namespaces: Iterable[bytes]) -> None:
        """Refuse a namespace the session did not register: one set probe per namespace."""
        for namespace in namespaces:
            if namespace not in session.namespaces:
                self.manager.registry.resolve(namespace)  # nobody's pool: register it first
                raise NamespaceAccessError(
                    f"namespace {namespace.hex()} is not one of this session's pools; "
                    "register the pool in this session to use it"
                )

    def _own_keys(self, session: Session, batch: tier_pb2.KeyBatch) -> list[ChunkKey]:
        keys = unpack_keys(batch, self.config.max_batch_keys)
        self._own(session, batch_namespaces(batch))
        return keys

    def _refs(self, session: Session, refs: Sequence[tier_pb2.SlotRef]) -> list[SlotRef]:
        keys_from(r.key for r in self._batch(refs))  # refuses a key of the wrong length
        found = [ref_from(r) for r in refs]
        self._own(session, {namespace_of(ref.key) for ref in found})
        return found

    def RegisterSession(
        self, request: tier_pb2.RegisterSessionRequest, context: grpc.ServicerContext
    ) -> tier_pb2.RegisterSessionResponse:
        check_batch(request.pools, _MAX_POOLS, "pools")
        specs = [spec_from(p.spec) for p in request.pools]  # a refused spec opens no session
        for spec, pool in zip(specs, request.pools, strict=True):
            check_chunk_bytes(spec, pool.chunk_bytes)
        opened = not request.session_id
        if not opened:
            session = self._session(request.session_id)
            self._admit(session.peer, specs)
        else:
            replica = request.replica_id or "default"
            if not _REPLICA_ID.fullmatch(replica):
                raise InvalidRequestError("replica_id must be 1-64 of [A-Za-z0-9_.:-]")
            peer = self.tickets.redeem(_ticket(context))
            self._admit(peer, specs)
            session = self.sessions.open(
                replica, request.engine_id, request.tp_rank, request.pp_rank, peer
            )
        try:
            namespaces = [
                self.manager.register_pool(spec, p.chunk_bytes)
                for spec, p in zip(specs, request.pools, strict=True)
            ]
        except BaseException:
            if opened:  # a refused registration leaves no session behind either
                self.sessions.discard(session)
            raise
        for spec in specs:
            self.telemetry.registered(spec)
        session.namespaces.update(namespaces)
        return tier_pb2.RegisterSessionResponse(
            session_id=session.id,
            arena_path=str(self.manager.cpu.memory.path),
            namespaces=namespaces,
            heartbeat_interval_ms=int(self.config.heartbeat_interval_s * 1000),
            session_timeout_ms=int(self.config.session_timeout_s * 1000),
            drafts=drafts_to(self.manager.draft_states()),
            quarantined=self.manager.quarantines.namespaces,
            coded=[
                tier_pb2.CodedNamespace(namespace=namespace, error_bound=bound)
                for namespace, bound in self.manager.registry.coded(
                    self.manager.config.lower_codecs
                ).items()
            ],
            lmdb_path=str(lmdb.config.path) if (lmdb := self.manager.lmdb) is not None else "",
            costs=costs_to(self.manager.costs.snapshot()),
            no_object_tier=self.manager.object is None,
        )

    def _admit(self, peer: Peer | None, specs: Sequence[NamespaceSpec]) -> None:
        """Refuse a pool of a tenant the session's credentials do not open."""
        if peer is None:
            raise PermissionDeniedError("this session was opened without a peer ticket")
        for spec in specs:
            self.tenants.check(peer, spec.tenant)

    @_timed("lookup")
    def Lookup(
        self, request: tier_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> tier_pb2.LookupResponse:
        # a report of served hits comes from an idle engine too
        session = self._session(request.session_id, busy=not request.served)
        # check everything first: a bad call changes nothing
        keys = self._own_keys(session, request.keys)
        release = self._refs(session, request.release)
        if release:
            self.sessions.release(session, release)
        result = self.manager.lookup(
            keys,
            again=request.again,
            verify=request.verify,
            probe_wait=not request.no_probe_wait,
        )
        if not request.again or result.from_store:
            self.telemetry.looked_up(
                session.replica,
                request.keys.packed,
                request.keys.key_bytes,
                result,
                verify=request.verify,
                again=request.again,
            )
        response = lookup_to(result)
        if request.served:
            self._lease(session, keys[: leasable_hit(result)], hold=False)
        elif request.lease:
            in_lmdb = request.lease_in_lmdb
            leased = self._lease(session, keys[: leasable_hit(result, in_lmdb)], in_lmdb=in_lmdb)
            response.leases.extend(grants_to(leased))
        return response

    @_timed("reserve")
    def Reserve(
        self, request: tier_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> tier_pb2.ReserveResponse:
        session = self._session(request.session_id, busy=True)
        # check everything first: a bad call changes nothing
        keys = self._own_keys(session, request.keys)
        refs = self._refs(session, request.commit)
        started = time.perf_counter()
        committed = self.sessions.commit(session, refs)
        self.telemetry.moved("store", refs, committed, time.perf_counter() - started)
        grants = grants_to(self.sessions.reserve(session, keys))
        return tier_pb2.ReserveResponse(grants=grants, committed=committed)

    @_timed("commit")
    def Commit(
        self, request: tier_pb2.CommitRequest, context: grpc.ServicerContext
    ) -> tier_pb2.CommitResponse:
        session = self._session(request.session_id)
        refs = self._refs(session, request.refs)
        started = time.perf_counter()
        committed = self.sessions.commit(session, refs, request.lineage)
        self.telemetry.moved("store", refs, committed, time.perf_counter() - started)
        return tier_pb2.CommitResponse(committed=committed)

    @_timed("abort")
    def Abort(
        self, request: tier_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> tier_pb2.AbortResponse:
        session = self._session(request.session_id)
        self.sessions.abort(session, self._refs(session, request.refs))
        return tier_pb2.AbortResponse()

    @_timed("prefetch")
    def Prefetch(
        self, request: tier_pb2.PrefetchRequest, context: grpc.ServicerContext
    ) -> tier_pb2.PrefetchResponse:
        session = self._session(request.session_id)
        # check everything first: a bad call changes nothing
        keys = self._own_keys(session, request.keys)
        self.sessions.release(session, self._refs(session, request.release))
        leases = self._lease(session, keys, in_lmdb=request.in_lmdb)
        return tier_pb2.PrefetchResponse(leases=grants_to(leases))

    def _lease(
        self, session: Session, keys: list[ChunkKey], hold: bool = True, in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        """Lease the keys' chunks for a load; without ``hold``, end the leases at once (the
        client loaded them already: the lease only moves them up the eviction order)."""
        started = time.perf_counter()
        leases = self.sessions.lease(session, keys, in_lmdb)
        held = [lease for lease in leases if lease is not None]
        if not hold:
            self.sessions.release(session, held)
        self.telemetry.moved("load", held, len(held), time.perf_counter() - started)
        return leases

    @_timed("release")
    def Release(
        self, request: tier_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> tier_pb2.ReleaseResponse:
        session = self._session(request.session_id)
        self.sessions.release(session, self._refs(session, request.refs))
        return tier_pb2.ReleaseResponse()

    @_timed("promote")
    def Promote(
        self, request: tier_pb2.PromoteRequest, context: grpc.ServicerContext
    ) -> tier_pb2.PromoteResponse:
        session = self._session(request.session_id)
        keys = self._own_keys(session, request.keys)
        return tier_pb2.PromoteResponse(queued=self.manager.promote(keys, session.replica))

    @_timed("chunk_events")
    def ChunkEvents(
        self, request: tier_pb2.ChunkEventsRequest, context: grpc.ServicerContext
    ) -> tier_pb2.ChunkEventsResponse:
        session = self._session(request.session_id)
        limit = min(request.limit or self.config.max_batch_keys, self.config.max_batch_keys)
        found = self.manager.chunk_events(request.cursor, limit)
        mine = [e for e in found.events if namespace_of(e.key) in session.namespaces]
        return chunk_events_to(ChunkEvents(mine, found.cursor, found.lost))

    def Heartbeat(
        self, request: tier_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> tier_pb2.HeartbeatResponse:
        self.manager.costs.reported(timings_from(request))
        alive = self.sessions.heartbeat(request.session_id, request.busy)
        if alive and request.failed_verification:
            self._failed(self.sessions.live(request.session_id), request)
        if request.ending:
            self.sessions.end(request.session_id)
            return tier_pb2.HeartbeatResponse(alive=False)
        return tier_pb2.HeartbeatResponse(
            alive=alive,
            drafts=drafts_to(self.manager.draft_states()),
            quarantined=self.manager.quarantines.namespaces,
            costs=costs_to(self.manager.costs.snapshot()),
        )

    def _failed(self, session: Session, request: tier_pb2.HeartbeatRequest) -> None:
        """Chunks the engine found failing verification: checked and dropped where they fail,
        only those of the session's own pools (so of its tenants); the rest counted, untouched."""
        failed = failed_from(request)
        keys_from(c.key for c in self._batch(failed))  # refuses a key of the wrong length
        source = f"replica {session.replica}, engine {session.engine_id}"
        mine = [c for c in failed if namespace_of(c.key) in session.namespaces]
        foreign = [c for c in failed if namespace_of(c.key) not in session.namespaces]
        self.manager.integrity.refused(foreign, source)
        self.manager.integrity.submit(mine, source)

    def QuarantineNamespace(
        self, request: tier_pb2.QuarantineNamespaceRequest, context: grpc.ServicerContext
    ) -> tier_pb2.QuarantineNamespaceResponse:
        session = self._session(request.session_id)
        namespace = namespace_from(request.namespace)
        if namespace is None:
            raise InvalidRequestError("name the namespace to quarantine")
        self._own(session, [namespace])  # an engine speaks only for its own pools
        source = f"replica {session.replica}, engine {session.engine_id}"
        self.manager.quarantines.add(namespace, request.reason[:_MAX_REASON], source[:_MAX_REASON])
        return tier_pb2.QuarantineNamespaceResponse()
