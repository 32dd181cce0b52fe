"""The verifier's choices and judgements, with no engine: which requests are sampled, which of
their chunks go to the workers and when, and what a comparison does."""

from __future__ import annotations

from kvtier_vllm.drafts.swaps import Fill
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.verify import Sampled, Verifier

from kvtier.core.keys import make_key
from kvtier.core.protocol import SlotRef
from tests.unit.test_planner import BPC, DRAFT, TARGET

BY_KEY = {TARGET.key: TARGET, DRAFT.key: DRAFT}
NS = {TARGET.key: b"\x01" * 16, DRAFT.key: b"\x02" * 16}
BLOCKS = [list(range(1, 4 * BPC + 1))]  # one group, 4 chunks


def ref(key: str, chunk: int) -> SlotRef:
    return SlotRef(make_key(NS[key], chunk.to_bytes(32, "big")), 10 * chunk + len(key), 0, 64, 1)


def sampled(fill: Fill = Fill.NONE) -> Sampled:
    leases = {key: (1, [ref(key, c) for c in (1, 2)]) for key in BY_KEY}
    return Sampled(LoadPlan(1, 2, leases, [], fill=fill))


def counts(stats: KVTierStats) -> dict[str, float]:
    return {k: v for k, v in stats.data.items() if k.startswith("verify|")}


def test_one_request_per_step_is_sampled_unless_every_hit_is() -> None:
    some = Verifier(0.5, 0.05, BY_KEY, seed=3)
    picks = [some.sample(step) for step in range(200) for _ in range(3)]
    assert all(sum(picks[i : i + 3]) <= 1 for i in range(0, len(picks), 3))  # one a step
    assert 0 < sum(picks) < 200
    once = [some.sample(step) for step in range(1000, 1400)]  # one ask a step: half sampled
    assert 160 < sum(once) < 240
    every = Verifier(1.0, 0.05, BY_KEY)
    assert all(every.sample(7) for _ in range(5))
    assert not any(Verifier(0.0, 0.05, BY_KEY).sample(s) for s in range(100))


def test_only_leased_chunks_go_to_the_workers_and_each_once() -> None:
    verifier = Verifier(1.0, 0.05, BY_KEY)
    request = sampled()
    verifier.computed(request, [BLOCKS[0], BLOCKS[0]], range(0, 2), BPC)  # chunks 0 and 1
    jobs, leases = verifier.hand_out()
    # chunk 0 was vLLM's own: only the leased chunk 1, of each pool
    assert sorted((j.plan, j.block_ids) for j in jobs) == [
        (DRAFT.key, (5, 6, 7, 8)),
        (TARGET.key, (5, 6, 7, 8)),
    ]
    assert sorted(r.slot for r in leases) == sorted(ref(k, 1).slot for k in BY_KEY)
    verifier.computed(request, [BLOCKS[0], BLOCKS[0]], range(1, 2), BPC)  # asked again
    assert verifier.hand_out() == ([], [])
    # what never got computed is given back when the request ends
    assert sorted(r.slot for r in request.unchecked()) == sorted(
        [ref(TARGET.key, 2).slot, ref(DRAFT.key, 2).slot]
    )


def test_a_filled_draft_chunk_is_not_compared() -> None:
    verifier = Verifier(1.0, 0.05, BY_KEY)
    verifier.computed(sampled(Fill.PREVIOUS), [BLOCKS[0], BLOCKS[0]], range(1, 3), BPC)
    jobs, _ = verifier.hand_out()
    assert {j.plan for j in jobs} == {TARGET.key}


def test_a_chunk_matches_only_if_every_part_does_and_a_mismatch_quarantines() -> None:
    verifier = Verifier(1.0, 0.05, BY_KEY)
    verifier.computed(sampled(), [BLOCKS[0], BLOCKS[0]], range(1, 3), BPC)
    jobs, _ = verifier.hand_out()
    target = [j for j in jobs if j.plan == TARGET.key]
    draft = [j for j in jobs if j.plan == DRAFT.key]
    stats = KVTierStats()
    reports = [(j.slot, j.generation, 0.001) for j in target]  # rank 0
    reports.append((target[0].slot, target[0].generation, 0.2))  # rank 1: off
    reports.append((draft[0].slot, draft[0].generation, -1.0))  # reused first
    reports.append((draft[1].slot, draft[1].generation, 0.01))
    verifier.reported(reports, stats)
    assert counts(stats) == {
        "verify|target|match": 1,
        "verify|target|mismatch": 1,
        "verify|draft|unchecked": 1,
        "verify|draft|match": 1,
    }
    assert list(verifier.quarantined) == [NS[TARGET.key]]
    assert "0.2" in verifier.quarantined[NS[TARGET.key]]
    assert verifier.refuses(NS.values())
    assert not verifier.refuses([NS[DRAFT.key]])
    verifier.reported(reports, stats)  # reported once: a repeat judges nothing
    assert sum(counts(stats).values()) == 4


def test_a_comparison_that_is_not_a_number_is_a_mismatch() -> None:
    # KV holding a NaN compares as NaN, which no bound or maximum would ever catch
    verifier = Verifier(1.0, 0.05, BY_KEY)
    verifier.computed(sampled(), [BLOCKS[0], BLOCKS[0]], range(1, 2), BPC)
    jobs, _ = verifier.hand_out()
    [target] = [j for j in jobs if j.plan == TARGET.key]
    stats = KVTierStats()
    verifier.reported([(target.slot, target.generation, float("nan"))], stats)
    assert counts(stats) == {"verify|target|mismatch": 1}
    assert list(verifier.quarantined) == [NS[TARGET.key]]


def test_quarantines_follow_the_tiers_list_and_its_lifting() -> None:
    verifier = Verifier(1.0, 0.05, BY_KEY)
    verifier.computed(sampled(), [BLOCKS[0], BLOCKS[0]], range(1, 2), BPC)
    jobs, _ = verifier.hand_out()
    verifier.reported([(j.slot, j.generation, 1.4) for j in jobs], KVTierStats())
    target, draft = NS[TARGET.key], NS[DRAFT.key]
    assert [ns for ns, _ in verifier.to_report] == [target, draft]
    # not yet in the tiers' list (the report is on its way): still refused here
    assert verifier.refuses([target], frozenset())
    assert verifier.refuses([target], frozenset({target, draft}))
    # gone from the tiers' list once it was there: an admin lifted it
    assert not verifier.refuses([target], frozenset({draft}))
    assert verifier.refuses([draft], frozenset({draft}))
    # another engine's quarantine, known only from the tiers, is refused too
    other = Verifier(0.0, 0.05, BY_KEY)
    assert other.refuses([target], frozenset({target}))
    assert not other.refuses([target], frozenset())
