"""Protobuf <-> domain conversions, in pairs (``x_to`` encodes, ``x_from`` decodes), shared by the
gRPC client and kvtierd's servicers. Checks of what a caller may ask are the servicers' own
(`kvtier.server.validate`); the key-carrying requests are encoded by `kvtier.core.wire`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.api.v1 import admin_pb2, tier_pb2
from kvtier.core.costs import TIERS, CostSnapshot, EngineTimings, LoadFit, StepFit, Tally, TierCost
from kvtier.core.errors import InvalidRequestError
from kvtier.core.journal import ChunkEvent, ChunkEvents
from kvtier.core.keys import ChunkKey, NamespaceSpec, PageLayout, Pool
from kvtier.core.protocol import (
    DraftRevision,
    DraftState,
    FailedChunk,
    Failure,
    LookupResult,
    SlotRef,
    TierCode,
    TierStats,
    UsageStats,
)

_POOLS = {
    tier_pb2.POOL_TARGET: Pool.TARGET,
    tier_pb2.POOL_DRAFT: Pool.DRAFT,
    tier_pb2.POOL_HIDDEN: Pool.HIDDEN,
    tier_pb2.POOL_ENCODER: Pool.ENCODER,
    tier_pb2.POOL_STATE: Pool.STATE,
}
_POOL_CODES = {pool: code for code, pool in _POOLS.items()}
_TIER_CODES = {code.tier: tier_pb2.Tier.ValueType(code) for code in TierCode}
_TIER_NAMES = {int(code): code.tier for code in TierCode}
_FAILURES = {int(failure) for failure in Failure}


def spec_to(spec: NamespaceSpec) -> tier_pb2.NamespaceSpec:
    layout = spec.layout
    return tier_pb2.NamespaceSpec(
        model=spec.model,
        model_revision=spec.model_revision,
        pool=_POOL_CODES[spec.pool],
        kv_dtype=spec.kv_dtype,
        layout=tier_pb2.PageLayout(
            tokens_per_block=layout.tokens_per_block,
            blocks_per_chunk=layout.blocks_per_chunk,
            num_kv_heads=layout.num_kv_heads,
            head_sizes=list(layout.head_sizes),
            layer_names=list(layout.layer_names),
            kv_order=layout.kv_order,
        ),
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        pp_rank=spec.pp_rank,
        pp_size=spec.pp_size,
        hash_algo=spec.hash_algo,
        tenant=spec.tenant,
        draft_model=spec.draft_model or "",
        draft_revision=spec.draft_revision or "",
        attention=spec.attention,
    )


def spec_from(pb: tier_pb2.NamespaceSpec) -> NamespaceSpec:
    """Raises `InvalidRequestError`, naming the field, for a spec `NamespaceSpec` refuses."""
    if pb.pool not in _POOLS:
        raise InvalidRequestError(
            "pool must be POOL_TARGET, POOL_DRAFT, POOL_HIDDEN or POOL_ENCODER"
        )
    layout = pb.layout
    try:
        return NamespaceSpec(
            model=pb.model,
            model_revision=pb.model_revision,
            pool=_POOLS[pb.pool],
            kv_dtype=pb.kv_dtype,
            layout=PageLayout(
                tokens_per_block=layout.tokens_per_block,
                blocks_per_chunk=layout.blocks_per_chunk,
                num_kv_heads=layout.num_kv_heads,
                head_sizes=tuple(layout.head_sizes),
                layer_names=tuple(layout.layer_names),
                kv_order=layout.kv_order or "default",
            ),
            tp_rank=pb.tp_rank,
            tp_size=pb.tp_size or 1,
            pp_rank=pb.pp_rank,
            pp_size=pb.pp_size or 1,
            hash_algo=pb.hash_algo or "sha256",
            tenant=pb.tenant or "default",
            attention=pb.attention or "full",
            draft_model=pb.draft_model or None,
            draft_revision=pb.draft_revision or None,
        )
    except ValueError as exc:
        raise InvalidRequestError(f"invalid namespace spec: {exc}") from None


def ref_to(ref: SlotRef) -> tier_pb2.SlotRef:
    return tier_pb2.SlotRef(
        key=ref.key,
        slot=ref.slot,
        offset=ref.offset,
        nbytes=ref.nbytes,
        generation=ref.generation,
        lease=ref.lease,
    )


def ref_from(pb: tier_pb2.SlotRef) -> SlotRef:
    return SlotRef(ChunkKey(pb.key), pb.slot, pb.offset, pb.nbytes, pb.generation, pb.lease)


def grants_to(refs: Sequence[SlotRef | None]) -> list[tier_pb2.SlotGrant]:
    return [
        tier_pb2.SlotGrant(granted=True, ref=ref_to(r)) if r is not None else tier_pb2.SlotGrant()
        for r in refs
    ]


def grants_from(grants: Iterable[tier_pb2.SlotGrant]) -> list[SlotRef | None]:
    # `ref_from` inlined: grants come thousands to a call
    return [
        SlotRef(
            ChunkKey(g.ref.key),
            g.ref.slot,
            g.ref.offset,
            g.ref.nbytes,
            g.ref.generation,
            g.ref.lease,
        )
        if g.granted
        else None
        for g in grants
    ]


def lookup_to(result: LookupResult) -> tier_pb2.LookupResponse:
    """The answer without leases, which the servicer adds."""
    return tier_pb2.LookupResponse(
        hits=result.hits, tiers=result.tier_codes, pending=result.pending
    )


def lookup_from(pb: tier_pb2.LookupResponse) -> LookupResult:
    return LookupResult(pb.hits, pb.tiers, pb.pending)


def chunk_events_to(found: ChunkEvents) -> tier_pb2.ChunkEventsResponse:
    return tier_pb2.ChunkEventsResponse(
        events=[
            tier_pb2.ChunkEvent(stored=e.stored, tier=_TIER_CODES[e.tier], key=e.key)
            for e in found.events
        ],
        cursor=found.cursor,
        lost=found.lost,
    )


def chunk_events_from(pb: tier_pb2.ChunkEventsResponse) -> ChunkEvents:
    events = [ChunkEvent(e.stored, _TIER_NAMES[e.tier], ChunkKey(e.key)) for e in pb.events]
    return ChunkEvents(events, pb.cursor, pb.lost)


def drafts_to(states: dict[bytes, DraftState]) -> list[tier_pb2.DraftState]:
    return [
        tier_pb2.DraftState(
            lineage=lineage, revision=s.revision, swapping=s.swapping, epoch=s.epoch
        )
        for lineage, s in states.items()
    ]


def drafts_from(raw: Iterable[tier_pb2.DraftState]) -> dict[bytes, DraftState]:
    return {bytes(d.lineage): DraftState(d.revision, d.swapping, d.epoch) for d in raw}


# Admin answers: the admin client hands these messages on as they are (the CLI prints them),
# so they are encoded only.


def _usage(u: UsageStats) -> admin_pb2.Usage:
    return admin_pb2.Usage(
        used_bytes=u.used_bytes, chunks=u.chunks, capacity_bytes=u.capacity_bytes
    )


def tier_stats_to(stats: TierStats) -> admin_pb2.TierStats:
    return admin_pb2.TierStats(
        tier=stats.tier,
        usage=admin_pb2.Usage(
            used_bytes=stats.used_bytes, chunks=stats.chunks, capacity_bytes=stats.capacity_bytes
        ),
        pools=[admin_pb2.PoolUsage(pool=p, usage=_usage(u)) for p, u in stats.pools.items()],
        replicas=[
            admin_pb2.ReplicaUsage(replica=r, pool=p, usage=_usage(u))
            for (r, p), u in stats.replicas.items()
        ],
        counters={k: max(0, v) for k, v in stats.counters.items()},
    )


def draft_revisions_to(revisions: Iterable[DraftRevision]) -> list[admin_pb2.DraftRevisionStats]:
    return [
        admin_pb2.DraftRevisionStats(
            model=r.model,
            draft_model=r.draft_model,
            revision=r.revision,
            current=r.current,
            chunks=r.chunks,
        )
        for r in revisions
    ]


def heartbeat_to(
    session_id: str, busy: bool, timings: EngineTimings, failed: Sequence[FailedChunk] = ()
) -> tier_pb2.HeartbeatRequest:
    """A heartbeat carrying what the engine timed since the last one, and the chunks it found
    failing verification."""
    return tier_pb2.HeartbeatRequest(
        failed_verification=[
            tier_pb2.FailedChunk(
                key=c.key, tier=_TIER_CODES[c.tier.tier], what=tier_pb2.Failure.ValueType(c.what)
            )
            for c in failed
        ],
        session_id=session_id,
        busy=busy,
        loads=[
            tier_pb2.LoadTiming(
                tier=tier,
                chunks=t.chunks,
                bytes=t.nbytes,
                seconds=t.seconds,
                loads=t.loads,
                chunks_squared=t.chunks_squared,
                chunk_seconds=t.chunk_seconds,
            )
            for tier, t in timings.loads.items()
        ],
        prefill_tokens=timings.prefill_tokens,
        prefill_seconds=timings.prefill_seconds,
        prefill_steps=timings.prefill_steps,
        prefill_tokens_squared=timings.prefill_tokens_squared,
        prefill_token_seconds=timings.prefill_token_seconds,
    )


def timings_from(request: tier_pb2.HeartbeatRequest) -> EngineTimings:
    """An engine's report; tiers it names that kvtierd does not know are left out."""
    timings = EngineTimings(
        prefill_tokens=request.prefill_tokens,
        prefill_seconds=request.prefill_seconds,
        prefill_steps=request.prefill_steps,
        prefill_tokens_squared=request.prefill_tokens_squared,
        prefill_token_seconds=request.prefill_token_seconds,
    )
    for load in request.loads:
        if load.tier in TIERS:
            tally = Tally(
                load.chunks,
                load.bytes,
                load.seconds,
                load.loads,
                load.chunks_squared,
                load.chunk_seconds,
            )
            timings.loads.setdefault(load.tier, Tally()).merge(tally)
    return timings


def failed_from(request: tier_pb2.HeartbeatRequest) -> list[FailedChunk]:
    """The chunks a heartbeat reports failing verification; a tier or failure this build does
    not know is refused (`InvalidRequestError`)."""
    failed = []
    for chunk in request.failed_verification:
        if chunk.tier not in _TIER_NAMES or chunk.what not in _FAILURES:
            raise InvalidRequestError(f"unknown tier {chunk.tier} or failure {chunk.what}")
        failed.append(FailedChunk(ChunkKey(chunk.key), TierCode(chunk.tier), Failure(chunk.what)))
    return failed


def costs_to(costs: CostSnapshot) -> admin_pb2.Costs:
    return admin_pb2.Costs(
        tiers=[
            admin_pb2.TierCost(
                tier=tier,
                seconds_per_chunk=c.seconds_per_chunk,
                seconds_per_chunk_spread=c.seconds_per_chunk_spread,
                seconds_per_byte=c.seconds_per_byte,
                seconds_per_byte_spread=c.seconds_per_byte_spread,
                samples=c.samples,
                load_fit=(
                    admin_pb2.LoadFit(per_load=line.per_load, per_chunk=line.per_chunk)
                    if (line := c.load_fit) is not None
                    else None
                ),
            )
            for tier, c in costs.tiers.items()
        ],
        prefill_seconds_per_token=costs.prefill_seconds_per_token,
        prefill_spread=costs.prefill_spread,
        prefill_samples=costs.prefill_samples,
        prefill_fit=(
            admin_pb2.PrefillFit(per_step=fit.per_step, per_token=fit.per_token)
            if (fit := costs.prefill_fit) is not None
            else None
        ),
    )


def costs_from(costs: admin_pb2.Costs) -> CostSnapshot:
    """kvtierd's costs as a heartbeat or `Locate` carries them; tiers this build does not know
    are left out."""
    return CostSnapshot(
        {
            c.tier: TierCost(
                c.seconds_per_chunk,
                c.seconds_per_chunk_spread,
                c.seconds_per_byte,
                c.seconds_per_byte_spread,
                c.samples,
                LoadFit(c.load_fit.per_load, c.load_fit.per_chunk)
                if c.HasField("load_fit")
                else None,
            )
            for c in costs.tiers
            if c.tier in TIERS
        },
        costs.prefill_seconds_per_token,
        costs.prefill_spread,
        costs.prefill_samples,
        StepFit(costs.prefill_fit.per_step, costs.prefill_fit.per_token)
        if costs.HasField("prefill_fit")
        else None,
    )
