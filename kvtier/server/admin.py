"""The admin servicer: protobuf in, TierManager out. Authentication happens in interceptors."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from kvtier import __version__
from kvtier.api.v1 import admin_pb2, admin_pb2_grpc
from kvtier.core.codec import costs_to, draft_revisions_to, tier_stats_to
from kvtier.core.errors import InvalidRequestError
from kvtier.core.keys import MAX_CHUNK_HASH_BYTES, ChunkKey, check_revision
from kvtier.server.sessions import SessionRegistry
from kvtier.server.validate import check_batch, keys_from, namespace_from
from kvtier.tiering.maintenance import VerifyProgress, WarmupProgress
from kvtier.tiering.manager import TierManager
from kvtier.tiers.objstore.catalog import GcCounts

READ_ONLY_METHODS = frozenset({"Stats", "Locate"})
_MAX_PIN_KEYS = 1 << 20
_MAX_LOCATE_BLOCKS = 1 << 16


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, manager: TierManager, sessions: SessionRegistry) -> None:
        self.manager = manager
        self.sessions = sessions

    def Stats(
        self, request: admin_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.StatsResponse:
        stats = self.manager.stats()
        sessions, leases, _ = self.sessions.counts()
        return admin_pb2.StatsResponse(
            tiers=[tier_stats_to(t) for t in stats.tiers.values()],
            counters=dict(stats.counters),
            sessions=sessions,
            leases=leases,
            draft_revisions=draft_revisions_to(self.manager.draft_revisions()),
            version=__version__,
            costs=costs_to(self.manager.costs.snapshot()),
        )

    def Locate(
        self, request: admin_pb2.LocateRequest, context: grpc.ServicerContext
    ) -> admin_pb2.LocateResponse:
        if not request.model:
            raise InvalidRequestError("name the model")
        check_batch(request.block_hashes, _MAX_LOCATE_BLOCKS)
        if any(not 0 < len(h) <= MAX_CHUNK_HASH_BYTES for h in request.block_hashes):
            raise InvalidRequestError(f"block hashes are 1..{MAX_CHUNK_HASH_BYTES} bytes")
        found = self.manager.locate(
            request.model, list(request.block_hashes), request.tenant or "default"
        )
        return admin_pb2.LocateResponse(
            tokens=found.tokens,
            tiers=[
                admin_pb2.TierSpan(
                    tier=s.tier,
                    chunks=s.chunks,
                    tokens=s.tokens,
                    load_seconds=s.load_seconds or 0.0,
                    measured=s.load_seconds is not None,
                )
                for s in found.spans
            ],
            recompute_seconds=found.recompute_seconds or 0.0,
            recompute_measured=found.recompute_seconds is not None,
            costs=costs_to(found.costs),
        )

    def Evict(
        self, request: admin_pb2.EvictRequest, context: grpc.ServicerContext
    ) -> admin_pb2.EvictResponse:
        evicted = self.manager.evict(
            request.tier or None,
            pool=request.pool or None,
            namespace=namespace_from(request.namespace),
            replica=request.replica or None,
        )
        return admin_pb2.EvictResponse(evicted=evicted)

    def Pin(
        self, request: admin_pb2.PinRequest, context: grpc.ServicerContext
    ) -> admin_pb2.PinResponse:
        return self._pinning(request, self.manager.pin)

    def Unpin(
        self, request: admin_pb2.PinRequest, context: grpc.ServicerContext
    ) -> admin_pb2.PinResponse:
        return self._pinning(request, self.manager.unpin)

    def _pinning(
        self, request: admin_pb2.PinRequest, apply: Callable[[list[ChunkKey]], None]
    ) -> admin_pb2.PinResponse:
        check_batch(request.keys, _MAX_PIN_KEYS)
        keys = keys_from(request.keys)
        apply(keys)
        return admin_pb2.PinResponse(keys=len(keys))

    def SetQuota(
        self, request: admin_pb2.SetQuotaRequest, context: grpc.ServicerContext
    ) -> admin_pb2.SetQuotaResponse:
        if not request.replica or not request.pool:
            raise InvalidRequestError("replica and pool are required")
        if request.pool not in self.manager.config.arena.pools:
            raise InvalidRequestError(f"unknown pool {request.pool!r}")
        self.manager.set_quota(request.replica, request.pool, request.bytes or None)
        return admin_pb2.SetQuotaResponse()

    def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.ServicerContext
    ) -> admin_pb2.DrainResponse:
        result = self.manager.drain(request.timeout_s if request.timeout_s > 0 else 60.0)
        return admin_pb2.DrainResponse(complete=result.complete, pending=result.pending)

    def Verify(
        self, request: admin_pb2.VerifyRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.VerifyProgress]:
        for progress in self.manager.verify(request.tier):
            yield _verify_progress(progress)

    def Warmup(
        self, request: admin_pb2.WarmupRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.WarmupProgress]:
        stream = self.manager.warmup(
            namespace_from(request.namespace),
            max_chunks=request.max_chunks,
            object_index=request.object_index,
            fetch=request.fetch,
        )
        for progress in stream:
            yield _warmup_progress(progress)

    def Gc(
        self, request: admin_pb2.GcRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.GcProgress]:
        retention = request.retention_s if request.HasField("retention_s") else None
        for counts in self.manager.gc(retention, request.dry_run):
            yield _gc_progress(counts)

    def DraftSwapBegin(
        self, request: admin_pb2.DraftSwapBeginRequest, context: grpc.ServicerContext
    ) -> admin_pb2.DraftSwapBeginResponse:
        # refused here, not at the commit, which would fail with the swap half made
        check_revision("revision", request.revision)
        swap_id, previous = self.manager.begin_draft_swap(request.revision, request.draft_model)
        return admin_pb2.DraftSwapBeginResponse(swap_id=swap_id, previous_revision=previous)

    def DraftSwapCommit(
        self, request: admin_pb2.DraftSwapCommitRequest, context: grpc.ServicerContext
    ) -> admin_pb2.DraftSwapCommitResponse:
        return admin_pb2.DraftSwapCommitResponse(
            revision=self.manager.commit_draft_swap(request.swap_id)
        )

    def ListQuarantines(
        self, request: admin_pb2.ListQuarantinesRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListQuarantinesResponse:
        return admin_pb2.ListQuarantinesResponse(
            quarantined=[
                admin_pb2.QuarantinedNamespace(
                    namespace=q.namespace,
                    reason=q.reason,
                    since_unix_s=q.since_unix_s,
                    source=q.source,
                )
                for q in self.manager.quarantines.listed()
            ]
        )

    def LiftQuarantine(
        self, request: admin_pb2.LiftQuarantineRequest, context: grpc.ServicerContext
    ) -> admin_pb2.LiftQuarantineResponse:
        namespace = namespace_from(request.namespace)
        if namespace is None:
            raise InvalidRequestError("name the namespace whose quarantine to lift")
        return admin_pb2.LiftQuarantineResponse(lifted=self.manager.quarantines.lift(namespace))


def _verify_progress(progress: VerifyProgress) -> admin_pb2.VerifyProgress:
    return admin_pb2.VerifyProgress(
        checked=progress.checked,
        total=progress.total,
        corrupt=progress.corrupt,
        done=progress.done,
    )


def _warmup_progress(progress: WarmupProgress) -> admin_pb2.WarmupProgress:
    counts = progress.objects
    return admin_pb2.WarmupProgress(
        promoted=progress.promoted,
        total=progress.total,
        done=progress.done,
        phase=counts.phase,
        objects_listed=counts.listed,
        objects_checked=counts.checked,
        objects_total=counts.total,
        objects_indexed=counts.indexed,
        chunks_indexed=counts.chunks_indexed,
        objects_corrupt=counts.corrupt,
        objects_failed=counts.failed,
        objects_fetched=counts.fetched,
        chunks_fetched=counts.chunks_fetched,
    )


def _gc_progress(counts: GcCounts) -> admin_pb2.GcProgress:
    return admin_pb2.GcProgress(
        listed=counts.listed,
        checked=counts.checked,
        total=counts.total,
        deleted=counts.deleted,
        deleted_bytes=counts.deleted_bytes,
        pinned=counts.pinned,
        failed=counts.failed,
        dry_run=counts.dry_run,
        retention_s=counts.retention_s,
        done=counts.done,
    )
