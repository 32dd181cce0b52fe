"""The data-plane servicer: protobuf in, TierManager and sessions, protobuf out. Nothing else."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TypeVar

import grpc

from kvtier.api.v1 import tier_pb2, tier_pb2_grpc
from kvtier.config import ServerConfig
from kvtier.errors import InvalidRequestError
from kvtier.keys import NAMESPACE_BYTES, ChunkKey
from kvtier.manager import TierManager
from kvtier.server.convert import (
    check_batch,
    grants_to,
    ref_from,
    spec_from,
    unpack_keys,
)
from kvtier.server.sessions import Session, SessionRegistry
from kvtier.tiers.cpu import SlotRef

_REPLICA_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_MAX_POOLS = 16
T = TypeVar("T")


class TierServicer(tier_pb2_grpc.TierServiceServicer):
    def __init__(self, manager: TierManager, sessions: SessionRegistry, config: ServerConfig):
        self.manager = manager
        self.sessions = sessions
        self.config = config

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        self.sessions.heartbeat(session_id)  # any call proves the client alive
        return session

    def _batch(self, items: Sequence[T]) -> Sequence[T]:
        check_batch(items, self.config.max_batch_keys)
        return items

    def _known_keys(self, batch: tier_pb2.KeyBatch) -> list[ChunkKey]:
        keys = unpack_keys(batch, self.config.max_batch_keys)
        for namespace in {key[:NAMESPACE_BYTES] for key in keys}:
            self.manager.registry.resolve(namespace)
        return keys

    def _refs(self, refs: Sequence[tier_pb2.SlotRef]) -> list[SlotRef]:
        return [ref_from(r) for r in self._batch(refs)]

    def RegisterSession(
        self, request: tier_pb2.RegisterSessionRequest, context: grpc.ServicerContext
    ) -> tier_pb2.RegisterSessionResponse:
        check_batch(request.pools, _MAX_POOLS, "pools")
        if request.session_id:
            session = self._session(request.session_id)
        else:
            replica = request.replica_id or "default"
            if not _REPLICA_ID.fullmatch(replica):
                raise InvalidRequestError("replica_id must be 1-64 of [A-Za-z0-9_.:-]")
            session = self.sessions.open(
                replica, request.engine_id, request.tp_rank, request.pp_rank
            )
        namespaces = [
            self.manager.register_pool(spec_from(p.spec), p.chunk_bytes) for p in request.pools
        ]
        session.namespaces.update(namespaces)
        return tier_pb2.RegisterSessionResponse(
            session_id=session.id,
            arena_path=str(self.manager.cpu.memory.path),
            namespaces=namespaces,
            heartbeat_interval_ms=int(self.config.heartbeat_interval_s * 1000),
            session_timeout_ms=int(self.config.session_timeout_s * 1000),
        )

    def Lookup(
        self, request: tier_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> tier_pb2.LookupResponse:
        self._session(request.session_id)
        result = self.manager.lookup(unpack_keys(request.keys, self.config.max_batch_keys))
        return tier_pb2.LookupResponse(
            hits=result.hits, tiers=result.tier_codes, pending=result.pending
        )

    def Reserve(
        self, request: tier_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> tier_pb2.ReserveResponse:
        session = self._session(request.session_id)
        keys = self._known_keys(request.keys)  # check everything first: a bad call changes nothing
        refs = self._refs(request.commit)
        committed = self.sessions.commit(session, refs)
        grants = grants_to(self.sessions.reserve(session, keys))
        return tier_pb2.ReserveResponse(grants=grants, committed=committed)

    def Commit(
        self, request: tier_pb2.CommitRequest, context: grpc.ServicerContext
    ) -> tier_pb2.CommitResponse:
        session = self._session(request.session_id)
        committed = self.sessions.commit(session, self._refs(request.refs))
        return tier_pb2.CommitResponse(committed=committed)

    def Abort(
        self, request: tier_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> tier_pb2.AbortResponse:
        session = self._session(request.session_id)
        self.sessions.abort(session, self._refs(request.refs))
        return tier_pb2.AbortResponse()

    def Prefetch(
        self, request: tier_pb2.PrefetchRequest, context: grpc.ServicerContext
    ) -> tier_pb2.PrefetchResponse:
        session = self._session(request.session_id)
        keys = self._known_keys(request.keys)  # check everything first: a bad call changes nothing
        self.sessions.release(session, self._refs(request.release))
        return tier_pb2.PrefetchResponse(leases=grants_to(self.sessions.prefetch(session, keys)))

    def Release(
        self, request: tier_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> tier_pb2.ReleaseResponse:
        session = self._session(request.session_id)
        self.sessions.release(session, self._refs(request.refs))
        return tier_pb2.ReleaseResponse()

    def Promote(
        self, request: tier_pb2.PromoteRequest, context: grpc.ServicerContext
    ) -> tier_pb2.PromoteResponse:
        session = self._session(request.session_id)
        keys = self._known_keys(request.keys)
        return tier_pb2.PromoteResponse(queued=self.manager.promote(keys, session.replica))

    def Heartbeat(
        self, request: tier_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> tier_pb2.HeartbeatResponse:
        return tier_pb2.HeartbeatResponse(alive=self.sessions.heartbeat(request.session_id))
