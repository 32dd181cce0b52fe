"""The fleet model's rules, on fleets small enough to work out by hand: where each turn's tokens
come from, and which engine each router picks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from benchmarks.fleet_costs import NodeCosts, gpu_node
from benchmarks.fleet_sim import Fleet, Shape, Workload, simulate

ONE_SESSION = Workload(
    doc_tokens=1024,
    question_tokens=128,
    answer_tokens=128,
    turns=4,
    think_s=10.0,
    arrivals=(0.0,),
)


def costs(upload_delay_s: float = 0.0) -> NodeCosts:
    base = gpu_node(chunk_tokens=256)
    return NodeCosts(
        chunk_tokens=256,
        chunk_bytes=base.chunk_bytes,
        prefill_s_per_token=1e-4,
        load_s_per_chunk={"cpu": 1e-3, "lmdb": 5e-3, "object": 2e-2},
        load_latency_s={"object": 0.05},
        decode_s_per_token=1e-3,
        upload_delay_s=upload_delay_s,
    )


def one_session(shape: Shape, router: str) -> dict[str, int]:
    totals = simulate(shape, costs(), router, ONE_SESSION)
    assert totals.requests == ONE_SESSION.turns
    return totals.tokens


def test_one_engine_holds_a_sessions_history_on_its_gpu() -> None:
    tokens = one_session(Shape(nodes=1, engines=1), "gpu_prefix")
    # turns hold 1152, 1408, 1664, 1920 tokens; the history before each turn (the prompt and the
    # answer, whose last token has no KV) holds 1279, 1535, 1791: full chunks 4, 5, 6
    assert tokens["gpu"] == (4 + 5 + 6) * 256
    assert tokens["recompute"] == 1152 + 1408 + 1664 + 1920 - tokens["gpu"]
    assert tokens["cpu"] == tokens["lmdb"] == tokens["object"] == 0


def test_round_robin_sends_each_turn_elsewhere_and_it_loads_from_the_object_store() -> None:
    tokens = one_session(Shape(nodes=4, engines=1), "round_robin")
    assert tokens["gpu"] == tokens["cpu"] == tokens["lmdb"] == 0
    assert tokens["object"] == (4 + 5 + 6) * 256


def test_a_tier_aware_router_keeps_the_session_near_its_history() -> None:
    for router in ("fixed_weights", "kvtier_cost"):
        tokens = one_session(Shape(nodes=4, engines=2), router)
        assert tokens["gpu"] == (4 + 5 + 6) * 256, router
        assert tokens["object"] == 0, router


@pytest.mark.parametrize(("queue_s", "expected"), [(0.0, "busy"), (5.0, "idle")])
def test_measured_costs_weigh_a_queue_against_a_load_from_the_store(
    queue_s: float, expected: str
) -> None:
    fleet = Fleet(Shape(nodes=2, engines=1), costs(), "kvtier_cost", random.Random(0))
    busy, idle = fleet.engines
    fleet.store(busy, session=7, tokens=8 * 256, now=0.0)  # on busy's GPU, in the store at once
    busy.free_at = 1.0 + queue_s
    # from the store, idle needs 0.05 + 8 x 0.02 s; busy waits for its queue
    chosen = fleet.choose(session=7, tokens=2100, now=1.0)
    assert chosen is (busy if expected == "busy" else idle)
    fixed = Fleet(Shape(nodes=2, engines=1), costs(), "fixed_weights", random.Random(0))
    busy, idle = fixed.engines
    fixed.store(busy, session=7, tokens=8 * 256, now=0.0)
    busy.free_at = 1.0 + queue_s
    assert fixed.choose(session=7, tokens=2100, now=1.0) is busy  # weights only


def test_users_start_their_next_session_after_the_last_one_ends() -> None:
    workload = replace(ONE_SESSION, turns=2, arrivals=(), users=1, sessions=3)
    totals = simulate(Shape(nodes=1, engines=1), costs(), "sticky", workload)
    assert totals.requests == 6
    # one user: no request waits for another, and each first turn computes its whole prompt
    assert totals.first_ttft == pytest.approx([1152 * 1e-4] * 3)
    assert totals.tokens["gpu"] == 3 * 4 * 256


def test_sticky_keeps_each_session_on_its_engine() -> None:
    workload = replace(ONE_SESSION, arrivals=(), users=2, sessions=2)
    tokens = simulate(Shape(nodes=2, engines=1), costs(), "sticky", workload).tokens
    assert tokens["gpu"] == 2 * (4 + 5 + 6) * 256
    assert tokens["object"] == 0


def test_the_gpu_hits_whole_blocks_and_the_tiers_whole_chunks() -> None:
    gpu = one_session(Shape(nodes=1, engines=1, block_tokens=64), "gpu_prefix")
    # the histories of 1279, 1535, 1791 tokens hold 19, 23, 27 full blocks of 64
    assert gpu["gpu"] == (19 + 23 + 27) * 64
    store = one_session(Shape(nodes=4, engines=1, block_tokens=64), "round_robin")
    assert store["object"] == (4 + 5 + 6) * 256  # another node's: whole chunks only


def test_every_request_pays_the_latency_past_its_prefill_and_the_engine_does_not() -> None:
    slow = replace(costs(), request_latency_s=0.5)
    workload = replace(ONE_SESSION, turns=1, arrivals=(0.0, 0.0))
    totals = simulate(Shape(nodes=1, engines=1), slow, "sticky", workload)
    # the second prompt waits for the first's prefill, not for its latency
    assert sorted(totals.first_ttft) == pytest.approx([1152e-4 + 0.5, 2 * 1152e-4 + 0.5])


def test_a_prompt_past_what_the_tiers_hold_waits_for_the_probe_to_miss() -> None:
    probing = replace(costs(), probe_miss_s=0.3)
    # answers of 128 leave the history 1279 tokens, short of the next prompt's fifth full chunk
    # (it ends at 1280): probed; answers of 129 fill it (1280), and the tiers hold it
    for answer, later_probe in ((128, 0.3), (129, 0.0)):
        workload = replace(ONE_SESSION, turns=2, answer_tokens=answer)
        plain = simulate(Shape(nodes=1, engines=1), costs(), "sticky", workload)
        probed = simulate(Shape(nodes=1, engines=1), probing, "sticky", workload)
        assert probed.first_ttft == pytest.approx([t + 0.3 for t in plain.first_ttft])
        assert probed.later_ttft == pytest.approx([t + later_probe for t in plain.later_ttft])
