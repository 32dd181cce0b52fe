"""The admin servicer: protobuf in, TierManager out. Authentication happens in interceptors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import grpc

from kvtier.api.v1 import admin_pb2, admin_pb2_grpc
from kvtier.errors import (
    InvalidRequestError,
    TierNotConfiguredError,
    UnknownPoolError,
)
from kvtier.keys import NAMESPACE_BYTES, ChunkKey, check_revision
from kvtier.manager import TierManager
from kvtier.server.convert import (
    check_batch,
    draft_revisions_to,
    keys_from,
    namespace_from,
    tier_stats_to,
)
from kvtier.server.sessions import SessionRegistry
from kvtier.tiers.objstore.catalog import Catalog, GcCounts, WarmupCounts
from kvtier.tiers.objstore.tier import REMOTE_REPLICA, FetchedChunk

READ_ONLY_METHODS = frozenset({"Stats"})
_PROGRESS_EVERY = 256
_MAX_PIN_KEYS = 1 << 20


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
        timeout = request.timeout_s if request.timeout_s > 0 else 60.0
        complete = self.manager.flush(timeout)
        if self.manager.lmdb is not None:
            self.manager.lmdb.sync()
        return admin_pb2.DrainResponse(
            complete=complete, pending=self.manager.cpu.writeback_pending()
        )

    def Verify(
        self, request: admin_pb2.VerifyRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.VerifyProgress]:
        if request.tier not in ("", "lmdb"):
            raise InvalidRequestError("only the lmdb tier stores checksummed chunks to verify")
        lmdb = self.manager.lmdb
        keys = list(lmdb.keys()) if lmdb is not None else []
        corrupt = 0
        for i, key in enumerate(keys, 1):
            assert lmdb is not None
            if lmdb.verify_chunk(key) is False:
                corrupt += 1
            if i % _PROGRESS_EVERY == 0 and i < len(keys):
                yield admin_pb2.VerifyProgress(checked=i, total=len(keys), corrupt=corrupt)
        yield admin_pb2.VerifyProgress(
            checked=len(keys), total=len(keys), corrupt=corrupt, done=True
        )

    def Warmup(
        self, request: admin_pb2.WarmupRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.WarmupProgress]:
        namespace = namespace_from(request.namespace)
        objects = WarmupCounts()
        if request.object_index or request.fetch:
            catalog = self._catalog("warmup --object-index/--fetch")
            if request.fetch and namespace is not None and not self._known(namespace):
                # fetch would take a foreign namespace's objects for corrupt ones
                raise UnknownPoolError(
                    f"namespace {namespace.hex()} is not registered on this node; "
                    "start an engine that uses it before fetching its objects"
                )
            if request.object_index:
                for counts in catalog.rebuild_index(objects):
                    yield _warmup_progress(counts)
            if request.fetch:
                wanted = [namespace] if namespace is not None else self._registered()
                names = catalog.objects_of(wanted)
                for counts in catalog.fetch(names, self._keep_fetched, self._in_lmdb, objects):
                    yield _warmup_progress(counts)
        lmdb = self.manager.lmdb
        keys = [
            k
            for k in (lmdb.keys() if lmdb is not None else ())
            if namespace is None or k[:NAMESPACE_BYTES] == namespace
        ]
        if request.max_chunks:
            keys = keys[: request.max_chunks]
        promoted = 0
        objects.phase = "promote"
        for start in range(0, len(keys), _PROGRESS_EVERY):
            batch = [k for k in keys[start : start + _PROGRESS_EVERY] if self._known(k)]
            leases = self.manager.load(batch, "warmup")
            self.manager.release([lease for lease in leases if lease is not None])
            promoted += sum(lease is not None for lease in leases)
            if start + _PROGRESS_EVERY < len(keys):
                yield _warmup_progress(objects, promoted=promoted, total=len(keys))
        yield _warmup_progress(objects, promoted=promoted, total=len(keys), done=True)

    def Gc(
        self, request: admin_pb2.GcRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.GcProgress]:
        catalog = self._catalog("gc")
        retention = (
            request.retention_s
            if request.HasField("retention_s")
            else catalog.tier.config.retention_s
        )
        if not retention >= 0:  # also refuses NaN
            raise InvalidRequestError(f"retention_s must be >= 0, got {retention}")
        for counts in catalog.gc(retention, request.dry_run):
            yield _gc_progress(counts)

    def _catalog(self, what: str) -> Catalog:
        if self.manager.object is None:
            raise TierNotConfiguredError(
                f"{what} needs the object tier, and this daemon has none: set object.url"
            )
        return Catalog(self.manager.object)

    def _registered(self) -> list[bytes]:
        return [reg.namespace for reg in self.manager.registry.registrations()]

    def _keep_fetched(self, chunks: Sequence[FetchedChunk]) -> None:
        assert self.manager.lmdb is not None  # the object tier needs lmdb
        self.manager.lmdb.put_many([(c.key, c.payload) for c in chunks], REMOTE_REPLICA)

    def _in_lmdb(self, key: ChunkKey) -> bool:
        return self.manager.lmdb is not None and key in self.manager.lmdb

    def _known(self, key: bytes) -> bool:
        """Chunks of pools no engine registered since start cannot be placed in the arena."""
        return self.manager.registry.get(key[:NAMESPACE_BYTES]) is not None

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


def _warmup_progress(
    counts: WarmupCounts, promoted: int = 0, total: int = 0, done: bool = False
) -> admin_pb2.WarmupProgress:
    return admin_pb2.WarmupProgress(
        promoted=promoted,
        total=total,
        done=done,
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
