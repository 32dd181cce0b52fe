"""Each message pair of `kvtier.core.codec` decodes what it encodes; tier codes are the wire's."""

from __future__ import annotations

from kvtier.api.v1 import tier_pb2
from kvtier.core import codec
from kvtier.core.costs import EngineTimings, LoadCosts
from kvtier.core.journal import ChunkEvent, ChunkEvents
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import DraftState, LookupResult, SlotRef, TierCode, leasable_hit
from tests.support import draft_spec, target_spec

KEY = ChunkKey(bytes(range(48)))


def test_tier_codes_are_the_wires_tier_enum() -> None:
    wire = {name.removeprefix("TIER_"): value for name, value in tier_pb2.Tier.items() if value}
    assert {code.name: int(code) for code in TierCode} == wire
    assert [code.tier for code in TierCode] == ["cpu", "lmdb", "object"]


def test_each_pair_decodes_what_it_encodes() -> None:
    for spec in (target_spec(), draft_spec()):
        assert codec.spec_from(codec.spec_to(spec)) == spec
    ref = SlotRef(KEY, 3, 4096, 1024, 7, lease=9)
    assert codec.ref_from(codec.ref_to(ref)) == ref
    assert codec.ref_from(codec.ref_to(ref)).lease == 9  # not part of equality
    assert codec.grants_from(codec.grants_to([ref, None])) == [ref, None]
    result = LookupResult(3, bytes([TierCode.CPU, TierCode.LMDB, TierCode.OBJECT]), pending=True)
    assert codec.lookup_from(codec.lookup_to(result)) == result
    assert result.tiers == ["cpu", "lmdb", "object"]
    events = ChunkEvents([ChunkEvent(True, "cpu", KEY), ChunkEvent(False, "lmdb", KEY)], 5, 1)
    assert codec.chunk_events_from(codec.chunk_events_to(events)) == events
    drafts = {b"lineage": DraftState("r2", swapping=True, epoch=4)}
    assert codec.drafts_from(codec.drafts_to(drafts)) == drafts


def test_a_hit_is_leased_only_when_the_arena_holds_every_chunk_or_lmdb_is_read() -> None:
    assert leasable_hit(LookupResult(2, bytes([TierCode.CPU] * 2))) == 2
    assert leasable_hit(LookupResult(2, bytes([TierCode.CPU, TierCode.LMDB]))) == 0
    both = LookupResult(2, bytes([TierCode.LMDB, TierCode.CPU]))
    assert leasable_hit(both, in_lmdb=True) == 2
    assert leasable_hit(LookupResult(2, bytes([TierCode.CPU, TierCode.OBJECT])), in_lmdb=True) == 0
    assert leasable_hit(LookupResult(0, b"")) == 0


def test_costs_and_load_timings_decode_what_they_encode() -> None:
    """A heartbeat carries its loads' count and fit sums; its reply carries kvtierd's costs,
    load fits included."""
    costs = LoadCosts()
    for chunks in (1, 4, 2):
        costs.loaded("object", chunks, chunks << 20, 0.03 + 0.009 * chunks)
    timings = EngineTimings()
    timings.loaded("cpu", 2, 2 << 20, 0.001)
    timings.loaded("cpu", 5, 5 << 20, 0.002)
    timings.prefilled(100, 0.1)
    timings.prefilled(300, 0.25)
    costs.reported(timings)
    decoded = codec.timings_from(codec.heartbeat_to("s", False, timings))
    assert decoded == timings
    snap = costs.snapshot()
    assert snap.tiers["object"].load_fit is not None
    assert snap.prefill_fit is not None
    assert codec.costs_from(codec.costs_to(snap)) == snap
