"""Hit planning over the in-process client: a real TierManager, a small arena in /dev/shm and
LMDB under tmp_path, with no engine. Each test stores chunks, then asks a request's hit
decision what it would load."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lmdb
import pytest
from kvtier_vllm.drafts.swaps import DraftTracker, Fill
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.hit_decision import PROMOTE_WAIT_ASKS, HitDecision
from kvtier_vllm.kv.scheduler_side.hit_setup import HitSetup
from kvtier_vllm.kv.scheduler_side.load_chooser import WholeHit
from kvtier_vllm.kv.scheduler_side.load_decisions import LoadDecisions
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.prompt_keys import keys_in
from kvtier_vllm.kv.scheduler_side.timings import StepTimings
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.settings import LoadPolicy

from kvtier.client import InProcessClient, LmdbReader
from kvtier.core.costs import CostSnapshot, EngineTimings, LoadFit, StepFit, TierCost
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.load_choice import LoadChoice
from kvtier.core.protocol import LookupResult, TierCode
from kvtier.rpc.calls import Pending
from kvtier.tiering.manager import TierManager
from tests.support import draft_spec, manager_config, target_spec

BPC = 4  # blocks per chunk, as in tests.support's layout
CHUNK_TOKENS = 16 * BPC
CPU, LMDB = int(TierCode.CPU), int(TierCode.LMDB)
PER_CHUNK_S = 8.3e-3
"""A GPU node's recompute of a chunk: its object store's first byte and chunks cost more."""
GPU_COSTS = CostSnapshot(
    {
        "cpu": TierCost(0.52e-3, 0, 0, 0, 9, LoadFit(0.0, 0.52e-3)),
        "lmdb": TierCost(6.4e-3, 0, 0, 0, 9, LoadFit(0.0, 6.4e-3)),
        "object": TierCost(9.1e-3, 0, 0, 0, 9, LoadFit(30e-3, 9.1e-3)),
    },
    PER_CHUNK_S / CHUNK_TOKENS,
    0.0,
    9,
    StepFit(0.01, PER_CHUNK_S / CHUNK_TOKENS),
)
HASHES = [i.to_bytes(32, "big") for i in range(8 * BPC)]  # one per block: 8 chunks
# 256 KiB chunks, the arena's smallest slot class; no worker checks the pages here
TARGET = PoolPlan(Pool.TARGET, ("t0", "t1"), 32 << 10, target_spec(), BPC, "target")
DRAFT = PoolPlan(Pool.DRAFT, ("d0",), 64 << 10, draft_spec(), BPC, "draft")


@pytest.fixture
def client(shm_path: Path, tmp_path: Path) -> Iterator[InProcessClient]:
    c = InProcessClient(TierManager(manager_config(shm_path, tmp_path)), "r0")
    yield c
    c.close()


def register(client: InProcessClient, *plans: PoolPlan) -> dict[str, bytes]:
    return {p.key: client.register_pool(p.spec, p.chunk_bytes) for p in plans}


def keys(namespace: bytes, chunks: range) -> list[ChunkKey]:
    return keys_in(namespace, HASHES, chunks, BPC)


def store(client: InProcessClient, keys: list[ChunkKey]) -> None:
    refs = [r for r in client.reserve(keys) if r is not None]
    assert len(refs) == len(keys)
    assert client.commit(refs) == len(keys)


def to_lmdb_only(client: InProcessClient, namespace: bytes) -> None:
    assert client.flush()
    client.manager.evict("cpu", namespace=namespace)


def four_in_lmdb(client: InProcessClient) -> tuple[dict[str, bytes], list[ChunkKey]]:
    """A target pool whose chunks 0-3 are in lmdb only: its namespaces and their keys."""
    ns = register(client, TARGET)
    hit = keys(ns["target"], range(4))
    store(client, hit)
    to_lmdb_only(client, ns["target"])
    return ns, hit


def in_arena(client: InProcessClient, keys: list[ChunkKey]) -> None:
    """Wait for a promotion to land, with no lookup: nothing is counted."""
    deadline = time.monotonic() + 10
    while not all(client.manager.cpu.contains(keys)):
        assert time.monotonic() < deadline, "the promotion never landed"
        time.sleep(0.01)


def shared(
    client: InProcessClient,
    namespaces: dict[str, bytes],
    wait_s: float = 0.0,
    draft: DraftTracker | None = None,
) -> HitSetup:
    """What the decisions of requests over ``client`` share."""
    plans = [TARGET, DRAFT] if draft is not None else [TARGET]
    return HitSetup(
        client,
        plans,
        namespaces,
        chunk_tokens=CHUNK_TOKENS,
        blocks_per_chunk=BPC,
        wait_s=wait_s,
        draft=draft,
    )


def reading_lmdb(later: AnsweredLater, ns: dict[str, bytes], client: InProcessClient) -> HitSetup:
    """A target pool's hit setup over ``later``, reading ``client``'s lmdb map in the step."""
    assert client.lmdb_path is not None
    return HitSetup(
        later,  # type: ignore[arg-type]
        [TARGET],
        ns,
        chunk_tokens=CHUNK_TOKENS,
        blocks_per_chunk=BPC,
        lmdb_path=str(client.lmdb_path),
    )


def ask(setup: HitSetup) -> HitDecision:
    """The decision of a request of ``HASHES`` not asked about yet."""
    return HitDecision(setup, SimpleNamespace(block_hashes=HASHES))


def leased(plan: LoadPlan, key: str) -> tuple[int, list[ChunkKey]]:
    start, refs = plan.leases[key]
    return start, [r.key for r in refs]


def test_a_hit_in_the_arena_is_leased_in_one_ask(client: InProcessClient) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(4)))
    p = shared(client, ns)
    plan = ask(p).plan_load(0, 6)
    assert plan is not None
    assert (plan.first_chunk, plan.chunks) == (0, 4)  # chunks 4 and 5 are nowhere
    assert leased(plan, "target") == (0, keys(ns["target"], range(4)))
    assert plan.tiers == bytes([CPU] * 4)
    assert plan.zero_plans == []
    assert plan.fill is Fill.NONE
    # vLLM holds the first chunk: only the rest is leased
    later = ask(p).plan_load(1, 6)
    assert later is not None
    assert (later.first_chunk, later.chunks) == (1, 3)
    client.release(plan.refs() + later.refs())
    assert len(p.calls.unreturned) == 0


class FirstChunks(WholeHit):
    """A load chooser that loads the hit's first ``chunks`` chunks at most; keeps the runs it
    was asked about."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.asked: list[list[tuple[str, int]]] = []

    def choose(self, runs: Sequence[tuple[str, int]], chunk_tokens: int) -> LoadChoice:
        self.asked.append(list(runs))
        return LoadChoice(min(self.chunks, sum(n for _, n in runs)) * chunk_tokens, ())


def test_a_chooser_that_loads_a_shorter_prefix_leases_only_its_chunks(
    client: InProcessClient,
) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(4)))
    chooser = FirstChunks(2)
    p = HitSetup(
        client, [TARGET], ns, chunk_tokens=CHUNK_TOKENS, blocks_per_chunk=BPC, chooser=chooser
    )
    plan = ask(p).plan_load(0, 6)
    assert plan is not None
    assert chooser.asked == [[("cpu", 4)]]
    assert (plan.first_chunk, plan.chunks, plan.tiers) == (0, 2, bytes([CPU] * 2))
    assert leased(plan, "target") == (0, keys(ns["target"], range(2)))
    # the lookup leased all four: the two past the prefix went back at once
    assert client.manager.evict("cpu", namespace=ns["target"]) == {"cpu": 2}
    client.release(plan.refs())
    assert client.manager.evict("cpu", namespace=ns["target"]) == {"cpu": 2}


def test_chunks_in_lmdb_are_promoted_and_asked_again(client: InProcessClient) -> None:
    ns, hit = four_in_lmdb(client)
    assert client.lookup(hit).tier_codes == bytes([LMDB] * 4)
    p = shared(client, ns, wait_s=30)
    asked = ask(p)
    assert asked.plan_load(0, 4) is None  # on their way into the arena: ask again
    in_arena(client, hit)
    plan = asked.plan_load(0, 4)
    assert plan is not None
    assert plan.chunks == 4
    assert plan.tiers == bytes([LMDB] * 4)  # where they were when first asked for
    client.release(plan.refs())


def test_past_the_wait_a_hit_shrinks_to_the_arenas_prefix(client: InProcessClient) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(2, 4)))
    to_lmdb_only(client, ns["target"])
    store(client, keys(ns["target"], range(2)))  # chunks 0-1 in the arena, 2-3 in lmdb
    p = shared(client, ns, wait_s=0)
    plan = ask(p).plan_load(0, 4)
    assert plan is not None
    assert (plan.first_chunk, plan.chunks) == (0, 2)
    assert plan.tiers == bytes([CPU] * 2)
    client.release(plan.refs())
    # nothing of the hit in the arena: no hit at all
    assert ask(p).plan_load(2, 4) == LoadPlan(2, 0, {}, [])


def test_a_request_waits_some_asks_for_promotions_however_long_its_steps(
    client: InProcessClient,
) -> None:
    """A step longer than the wait (a long prefill beside it) does not end the wait at the
    first ask after the promotions were queued."""
    ns, _ = four_in_lmdb(client)
    client.promote = lambda keys: 0  # type: ignore[method-assign]  # the daemon has no room
    p = shared(client, ns, wait_s=1e-9)  # every ask comes after the wait
    asked = ask(p)
    for _ in range(PROMOTE_WAIT_ASKS):
        assert asked.plan_load(0, 4) is None
    assert asked.plan_load(0, 4) == LoadPlan(0, 0, {}, [])  # then it gives up


def slow_engine_setup(
    client: InProcessClient, namespaces: dict[str, bytes], timings: StepTimings
) -> HitSetup:
    """A setup whose ``wait_s`` is over at once, beside an engine that measured a second a
    prefilled token."""
    timings.prefill.observe(1.0, 100)
    return HitSetup(
        client,
        [TARGET],
        namespaces,
        chunk_tokens=CHUNK_TOKENS,
        blocks_per_chunk=BPC,
        wait_s=1e-9,
        recompute_wait=timings.recompute_wait,
    )


def test_a_hit_is_waited_for_a_share_of_what_recomputing_it_takes(
    client: InProcessClient,
) -> None:
    """Where the engine's measured prefill makes the hit worth more than ``wait_s``, the
    request waits up to ``recompute_wait_share`` of its recompute time, then gives up."""
    ns, _ = four_in_lmdb(client)
    client.promote = lambda keys: 0  # type: ignore[method-assign]  # they never arrive
    timings = StepTimings(wait_share=0.5)
    assert timings.recompute_wait(1000) == 0.0, "nothing measured yet: no longer wait"
    p = slow_engine_setup(client, ns, timings)  # a second a token: 4 chunks are worth minutes
    worth = timings.recompute_wait(4 * CHUNK_TOKENS)
    assert worth == pytest.approx(0.5 * 4 * CHUNK_TOKENS)
    asked = ask(p)
    for _ in range(PROMOTE_WAIT_ASKS + 3):
        assert asked.plan_load(0, 4) is None
    assert asked.waiting_since is not None
    asked.waiting_since -= worth  # as if that long had passed
    assert asked.plan_load(0, 4) == LoadPlan(0, 0, {}, [])


def test_a_probe_of_the_store_is_waited_for_a_share_of_recomputing_the_rest(
    client: InProcessClient,
) -> None:
    ns = register(client, TARGET)  # nothing held: kvtierd probes the object store, unanswered
    lookup = client.lookup

    def probing(keys: list[ChunkKey], **kwargs: Any) -> Any:
        found = lookup(keys, **kwargs)
        if isinstance(found, tuple):
            return replace(found[0], pending=True), found[1]
        return replace(found, pending=True)

    client.lookup = probing  # type: ignore[method-assign,assignment]
    timings = StepTimings(wait_share=0.5)
    p = slow_engine_setup(client, ns, timings)
    asked = ask(p)
    for _ in range(PROMOTE_WAIT_ASKS + 3):
        assert asked.plan_load(0, 6) is None
    assert asked.waiting_since is not None
    # as if what the whole prompt is worth had passed
    asked.waiting_since -= timings.recompute_wait(6 * CHUNK_TOKENS)
    assert asked.plan_load(0, 6) == LoadPlan(0, 0, {}, [])


def always_probing(client: InProcessClient) -> None:
    """Every lookup of ``client`` says a probe of the object store runs past its hit."""
    lookup = client.lookup

    def probing(keys: list[ChunkKey], **kwargs: Any) -> Any:
        found, leased = lookup(keys, **kwargs)
        return replace(found, pending=True), leased

    client.lookup = probing  # type: ignore[method-assign,assignment]


def test_a_probe_waits_one_ask_then_no_longer_than_its_share_of_recomputing_however_long_wait_s(
    client: InProcessClient,
) -> None:
    """A hit cheap to recompute is not held back for ``wait_s`` (promote_wait_ms, a second by
    default) while kvtierd probes the object store: only its share of recomputing it."""
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(2)))
    always_probing(client)
    timings = StepTimings(wait_share=0.5)
    timings.prefill.observe(1e-6, 100)  # a microsecond a token: 6 chunks are worth 0.2 ms
    p = HitSetup(
        client,
        [TARGET],
        ns,
        chunk_tokens=CHUNK_TOKENS,
        blocks_per_chunk=BPC,
        wait_s=30,
        recompute_wait=timings.recompute_wait,
    )
    asked = ask(p)
    assert asked.plan_load(0, 6) is None  # asked once more, to see the probe's answer
    assert asked.waiting_since is not None
    # as if 10 ms had passed: far past the share, far short of 30 s, and a step's time at
    # most, not the several steps that promotions from lmdb may wait
    asked.waiting_since -= 0.01
    plan = asked.plan_load(0, 6)
    assert plan is not None, "still waiting for the probe"
    assert (plan.chunks, plan.tiers) == (2, bytes([CPU] * 2))
    client.release(plan.refs())


def test_a_probe_is_not_waited_for_where_the_costs_say_the_store_cannot_beat_recomputing(
    client: InProcessClient,
) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(2)))
    always_probing(client)
    for costs, waits in ((GPU_COSTS, False), (None, True)):
        chooser = LoadDecisions(LoadPolicy.MEASURED, lambda c=costs: c)  # type: ignore[misc]
        p = HitSetup(
            client,
            [TARGET],
            ns,
            chunk_tokens=CHUNK_TOKENS,
            blocks_per_chunk=BPC,
            wait_s=30,
            chooser=chooser,
        )
        asked = ask(p)
        plan = asked.plan_load(0, 6)
        if waits:  # costs not measured: the probe may find a hit worth loading
            assert plan is None
            assert asked.probing
            continue
        assert plan is not None, "waited for a probe whose chunks would be recomputed"
        assert (plan.chunks, plan.tiers) == (2, bytes([CPU] * 2))
        assert not asked.probing
        client.release(plan.refs())


def test_the_last_chunk_is_dropped_for_eagle_style_drafters(client: InProcessClient) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(3)))
    p = HitSetup(
        client, [TARGET], ns, chunk_tokens=CHUNK_TOKENS, blocks_per_chunk=BPC, drop_last=True
    )
    plan = ask(p).plan_load(0, 3)
    assert plan is not None
    assert plan.chunks == 2
    client.release(plan.refs())
    assert ask(p).plan_load(2, 3) == LoadPlan(2, 0, {}, [])


def tracker(client: InProcessClient, namespaces: dict[str, bytes]) -> DraftTracker:
    t = DraftTracker(DRAFT.spec, lambda spec: client.register_pool(spec, DRAFT.chunk_bytes))
    t.namespace = namespaces["draft"]
    return t


def test_a_draft_pool_loads_with_its_target_or_is_zeroed(client: InProcessClient) -> None:
    ns = register(client, TARGET, DRAFT)
    store(client, keys(ns["target"], range(4)))
    store(client, keys(ns["draft"], range(2)))
    p = shared(client, ns, draft=tracker(client, ns))
    # the draft holds two chunks of a four-chunk hit: its pages are zeroed, never half loaded
    plan = ask(p).plan_load(0, 4)
    assert plan is not None
    assert plan.chunks == 4
    assert set(plan.leases) == {"target"}
    assert plan.zero_plans == ["draft"]
    assert plan.fill is Fill.ZEROS
    client.release(plan.refs())
    # a hit the draft holds whole loads both pools
    plan = ask(p).plan_load(0, 2)
    assert plan is not None
    assert plan.chunks == 2
    assert leased(plan, "draft") == (0, keys(ns["draft"], range(2)))
    assert plan.zero_plans == []
    assert plan.fill is Fill.NONE
    client.release(plan.refs())


def test_draft_chunks_on_their_way_hold_the_hit_back(client: InProcessClient) -> None:
    ns = register(client, TARGET, DRAFT)
    drafts = keys(ns["draft"], range(3))
    store(client, drafts)
    to_lmdb_only(client, ns["draft"])
    store(client, keys(ns["target"], range(3)))
    p = shared(client, ns, wait_s=30, draft=tracker(client, ns))
    asked = ask(p)
    assert asked.plan_load(0, 3) is None  # the draft's chunks are promoted first
    in_arena(client, drafts)
    plan = asked.plan_load(0, 3)
    assert plan is not None
    assert plan.chunks == 3
    assert set(plan.leases) == {"target", "draft"}
    assert plan.fill is Fill.NONE
    client.release(plan.refs())


def test_asking_again_while_a_promotion_lands_counts_the_lookup_once(
    client: InProcessClient,
) -> None:
    ns, hit = four_in_lmdb(client)
    counted = client.manager.stats().counters
    p = shared(client, ns, wait_s=30)
    asked = ask(p)
    assert asked.plan_load(0, 4) is None
    in_arena(client, hit)
    plan = asked.plan_load(0, 4)
    assert plan is not None
    now = client.manager.stats().counters
    # two asks of one request: one lookup of 4 chunks counted, found in lmdb
    assert now["lookups"] - counted["lookups"] == 1
    assert now["lookup_chunks"] - counted["lookup_chunks"] == 4
    assert now["hit_chunks_lmdb"] - counted["hit_chunks_lmdb"] == 4
    assert now["hit_chunks_cpu"] - counted["hit_chunks_cpu"] == 0
    client.release(plan.refs())


class ArenaReading:
    """The in-process client, with the arena read as a sidecar client reads its key index."""

    def __init__(self, client: InProcessClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def in_arena(self, keys: list[ChunkKey]) -> list[object]:
        arena = self._client.manager.cpu  # the arena alone: a read promotes nothing
        found = []
        for key in keys:
            (ref,) = arena.lease([key])
            if ref is None:
                break
            arena.release([ref])
            found.append(ref)
        return found


def test_a_plan_still_holds_until_its_slots_change_or_the_hit_could_be_longer(
    client: InProcessClient,
) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(3)))
    p = shared(client, ns)
    plan = ask(p).plan_load(0, 6)
    assert plan is not None
    assert plan.chunks == 3
    reading = shared(ArenaReading(client), ns)  # type: ignore[arg-type]
    assert ask(reading).still_holds(plan, 6)
    assert not ask(p).still_holds(plan, 6)  # this client cannot read the arena so
    store(client, keys(ns["target"], range(3, 4)))  # a longer hit is there now
    assert not ask(reading).still_holds(plan, 6)
    assert ask(reading).still_holds(plan, 3)  # ...unless the hit may be no longer
    client.release(plan.refs())
    client.manager.evict("cpu", namespace=ns["target"])  # its slots go
    assert not ask(reading).still_holds(plan, 3)


def test_a_miss_is_asked_again_only_once_its_first_chunk_is_in_the_arena(
    client: InProcessClient,
) -> None:
    ns = register(client, TARGET)
    reading = shared(ArenaReading(client), ns)  # type: ignore[arg-type]
    plan = ask(reading).plan_load(1, 4)
    assert plan is not None
    assert plan.chunks == 0
    assert not ask(reading).may_have_appeared(1)
    store(client, keys(ns["target"], range(1, 2)))
    assert ask(reading).may_have_appeared(1)
    assert not ask(reading).may_have_appeared(2)
    assert ask(shared(client, ns)).may_have_appeared(2)  # cannot read the arena: ask


class AnsweredLater(ArenaReading):
    """An arena-reading client whose background lookups are answered once ``gate`` is set,
    on a thread of their own, as kvtierd's are; counts the lookups the caller waits on."""

    def __init__(self, client: InProcessClient) -> None:
        super().__init__(client)
        self.gate = threading.Event()
        self.behind: list[list[ChunkKey]] = []
        self.waited_on = 0
        self.object_tier = client.object_tier
        self._calls = ThreadPoolExecutor(1)

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        self.waited_on += 1
        return self._client.lookup(*args, **kwargs)

    def lookup_behind(
        self, keys: list[ChunkKey], again: bool = False, verify: bool = False
    ) -> Pending[LookupResult]:
        self.behind.append(keys)

        def answer() -> LookupResult:
            self.gate.wait()
            return self._client.lookup(keys, again=again, verify=verify)

        return Pending(self._calls.submit(answer), lambda r: r, "test")

    def close(self) -> None:
        self.gate.set()
        self._calls.shutdown()


@pytest.fixture
def later(client: InProcessClient) -> Iterator[AnsweredLater]:
    c = AnsweredLater(client)
    yield c
    c.close()


def test_a_miss_is_asked_in_the_background_and_planned_with_no_call_once_answered(
    client: InProcessClient, later: AnsweredLater
) -> None:
    ns = register(client, TARGET)
    counted = client.manager.stats().counters
    p = shared(later, ns)  # type: ignore[arg-type]
    asked = ask(p)
    # nothing in the arena's index: kvtierd is asked without waiting, once
    assert not asked.answered(0, 6, 0.0)
    assert not asked.answered(0, 6, 0.01)
    assert later.behind == [keys(ns["target"], range(6))]
    assert later.waited_on == 0
    later.gate.set()
    assert asked.answered(0, 6, None)
    assert asked.plan_load(0, 6) == LoadPlan(0, 0, {}, [])
    assert later.waited_on == 0  # the plan took the answer
    now = client.manager.stats().counters
    assert now["lookups"] - counted["lookups"] == 1
    assert now["lookup_chunks"] - counted["lookup_chunks"] == 6


def test_a_hit_answered_in_the_background_from_lmdb_is_promoted_then_leased(
    client: InProcessClient, later: AnsweredLater
) -> None:
    ns, hit = four_in_lmdb(client)
    counted = client.manager.stats().counters
    p = shared(later, ns, wait_s=30)  # type: ignore[arg-type]
    asked = ask(p)
    later.gate.set()
    assert asked.answered(0, 4, None)
    assert asked.plan_load(0, 4) is None  # promoted: ask again
    assert later.waited_on == 0
    in_arena(client, hit)
    assert asked.answered(0, 4, 0.0)  # asked already: planned as before
    plan = asked.plan_load(0, 4)
    assert plan is not None
    assert (plan.chunks, plan.tiers) == (4, bytes([LMDB] * 4))
    now = client.manager.stats().counters
    assert now["lookups"] - counted["lookups"] == 1  # the background ask, counted once
    assert now["hit_chunks_lmdb"] - counted["hit_chunks_lmdb"] == 4
    client.release(plan.refs())


def test_a_first_chunk_in_lmdbs_map_is_looked_up_in_the_step_where_hits_load_from_there(
    client: InProcessClient, later: AnsweredLater
) -> None:
    ns, _ = four_in_lmdb(client)
    assert client.lmdb_path is not None
    p = reading_lmdb(later, ns, client)
    try:
        asked = ask(p)
        # not in the arena's index, but in lmdb's map: a hit, planned in this step, no wait
        assert asked.answered(0, 4, 0.0)
        assert later.behind == []
        plan = asked.plan_load(0, 4)
        assert plan is not None
        assert (plan.chunks, plan.tiers) == (4, bytes([LMDB] * 4))
        client.release(plan.refs())
        # a prompt neither holds is still asked in the background
        other = HitDecision(p, SimpleNamespace(block_hashes=[b"x" * 32] * (6 * BPC)))
        assert not other.answered(0, 6, 0.0)
        assert len(later.behind) == 1
    finally:
        p.close()


def test_a_first_ask_where_lmdbs_map_cannot_be_read_is_looked_up_in_the_step_never_missed(
    client: InProcessClient, later: AnsweredLater, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, _ = four_in_lmdb(client)
    assert client.lmdb_path is not None
    assert not client.object_tier

    def readers_full(self: LmdbReader) -> None:
        raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")

    # the engine's own reads of the map fail; kvtierd's (the tiers') do not
    monkeypatch.setattr(LmdbReader, "begin", readers_full)
    p = reading_lmdb(later, ns, client)
    try:
        # a map that cannot be read says nothing: neither a hit nor a miss at once
        assert p.in_lmdb(keys(ns["target"], [0])[0]) is None
        asked = ask(p)
        assert asked.answered(0, 4, 0.0)
        assert later.behind == []
        plan = asked.plan_load(0, 4)
        assert plan is not None
        assert plan.chunks == 4
        client.release(plan.refs())
    finally:
        p.close()


def test_a_prompt_only_the_store_may_hold_is_a_miss_at_once_where_it_cannot_beat_recomputing(
    client: InProcessClient, later: AnsweredLater
) -> None:
    ns = register(client, TARGET)
    lmdb = client.lmdb_path
    assert lmdb is not None
    later.object_tier = True  # as if the tiers had an object store
    request = SimpleNamespace(
        block_hashes=HASHES, prompt_token_ids=[0] * (len(HASHES) * BPC * 4 + 1)
    )
    for costs, waits in ((GPU_COSTS, False), (None, True)):
        p = HitSetup(
            later,  # type: ignore[arg-type]
            [TARGET],
            ns,
            chunk_tokens=CHUNK_TOKENS,
            blocks_per_chunk=BPC,
            lmdb_path=str(lmdb),
            chooser=LoadDecisions(LoadPolicy.MEASURED, lambda c=costs: c),  # type: ignore[misc]
        )
        try:
            asked = HitDecision(p, request)
            # neither the arena's index nor lmdb's map holds chunk 0: kvtierd is asked in the
            # background either way, and only unmeasured costs wait for its answer
            tokens = asked.ask(0, 1, KVTierStats())
            assert later.behind[-1] == keys(ns["target"], range(len(HASHES) // BPC))
            assert tokens == (None if waits else 0)
            assert len(p.unanswered) == int(waits)
        finally:
            p.close()
    assert later.waited_on == 0


def test_with_no_object_store_a_prompt_neither_index_holds_is_a_miss_at_its_first_ask(
    client: InProcessClient, later: AnsweredLater
) -> None:
    ns = register(client, TARGET)
    lmdb = client.lmdb_path
    assert lmdb is not None
    assert not client.object_tier  # these tiers: an arena and lmdb
    request = SimpleNamespace(
        block_hashes=HASHES, prompt_token_ids=[0] * (len(HASHES) * BPC * 4 + 1)
    )
    for lmdb_path, waits in ((str(lmdb), False), ("", True)):
        p = HitSetup(
            later,  # type: ignore[arg-type]
            [TARGET],
            ns,
            chunk_tokens=CHUNK_TOKENS,
            blocks_per_chunk=BPC,
            lmdb_path=lmdb_path,
        )
        try:
            # kvtierd is still asked in the background, to count it; where lmdb's map is not
            # read here, lmdb may hold the prompt, and its answer is waited for
            tokens = HitDecision(p, request).ask(0, 1, KVTierStats())
            assert later.behind[-1] == keys(ns["target"], range(len(HASHES) // BPC))
            assert tokens == (None if waits else 0)
        finally:
            p.close()
    assert later.waited_on == 0


def test_a_lookup_that_found_a_probe_running_is_asked_again_in_the_background(
    client: InProcessClient, later: AnsweredLater
) -> None:
    """kvtierd holds a lookup up to its probe budget while it probes the object store past the
    hit: asked again on the engine's step, every step would wait that long."""
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(2)))  # a probe runs past chunks 0-1
    probes = [True]
    lookup = later.lookup

    def probing_once(keys: list[ChunkKey], **kwargs: Any) -> Any:
        found, leased = lookup(keys, **kwargs)
        return (replace(found, pending=True) if probes and probes.pop() else found), leased

    later.lookup = probing_once  # type: ignore[method-assign]
    counted = client.manager.stats().counters
    asked = ask(shared(later, ns, wait_s=30))  # type: ignore[arg-type]
    assert asked.answered(0, 6, 0.0)  # chunk 0 in the arena: a hit, asked at once
    assert asked.plan_load(0, 6) is None  # the probe may find more: ask again
    assert later.waited_on == 1
    assert not asked.answered(0, 6, 0.0)  # the engine's step goes on without the answer
    assert later.behind == [keys(ns["target"], range(6))]
    later.gate.set()
    assert asked.answered(0, 6, None)
    plan = asked.plan_load(0, 6)
    assert plan is not None
    assert (plan.chunks, plan.tiers) == (2, bytes([CPU] * 2))
    assert later.waited_on == 1  # the plan took the background answer
    now = client.manager.stats().counters
    assert now["lookups"] - counted["lookups"] == 1  # asked again: not counted again
    client.release(plan.refs())


def test_a_first_chunk_in_the_arena_or_a_client_without_its_index_plans_at_once(
    client: InProcessClient, later: AnsweredLater
) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(2)))
    reading = shared(later, ns)  # type: ignore[arg-type]
    assert ask(reading).answered(0, 6, 0.0)  # a hit, most likely: no wait
    assert ask(shared(client, ns)).answered(2, 6, 0.0)  # a call is no dearer
    assert later.behind == []
    asked = ask(reading)
    assert not asked.answered(2, 6, 0.0)
    assert later.behind == [keys(ns["target"], range(2, 6))]


def slow_arena(client: InProcessClient) -> None:
    """Costs under which the arena's loads take far longer than recomputing: a 0.5 s fixed
    part per load, against a microsecond a prefilled token."""
    timings = EngineTimings()
    for chunks, tokens in [(1, 64), (4, 256), (2, 128)] * 2:
        timings.loaded("cpu", chunks, chunks << 20, 0.5 + 0.01 * chunks)
        timings.prefilled(tokens, 0.001 + 1e-6 * tokens)
    client.report_timings(timings)


def test_measured_costs_recompute_a_hit_slower_to_load(client: InProcessClient) -> None:
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(4)))
    slow_arena(client)
    decide = LoadDecisions(LoadPolicy.MEASURED, client.costs)
    p = with_chooser(shared(client, ns), decide)
    none = ask(p).plan_load(0, 6)
    assert none is not None
    assert (none.chunks, none.leases) == (0, {})
    assert len(p.calls.unreturned) == 0
    # always: the same hit, loaded whole as before costs were asked
    p = with_chooser(shared(client, ns), LoadDecisions(LoadPolicy.ALWAYS, client.costs))
    plan = ask(p).plan_load(0, 6)
    assert plan is not None
    assert plan.chunks == 4
    client.release(plan.refs())


def test_a_slow_tier_past_a_cheap_prefix_is_recomputed_not_waited_for(
    client: InProcessClient,
) -> None:
    """Chunks 0-1 in the arena, 2-3 in lmdb, whose loads are measured to cost more than their
    recompute: the arena's two load at the first ask, with no promotion waited for."""
    ns = register(client, TARGET)
    store(client, keys(ns["target"], range(2, 4)))
    to_lmdb_only(client, ns["target"])
    store(client, keys(ns["target"], range(2)))
    timings = EngineTimings()
    for chunks, tokens in [(1, 64), (4, 256)] * 2:
        timings.loaded("cpu", chunks, chunks << 20, 1e-6 * chunks)
        timings.loaded("lmdb", chunks, chunks << 20, 0.5 * chunks)
        timings.prefilled(tokens, 0.001 + 1e-4 * tokens)
    client.report_timings(timings)
    p = with_chooser(
        shared(client, ns, wait_s=30), LoadDecisions(LoadPolicy.MEASURED, client.costs)
    )
    plan = ask(p).plan_load(0, 4)
    assert plan is not None, "nothing to wait for: the lmdb chunks are recomputed"
    assert (plan.first_chunk, plan.chunks) == (0, 2)
    assert plan.tiers == bytes([CPU] * 2)
    client.release(plan.refs())


def with_chooser(p: HitSetup, decisions: LoadDecisions) -> HitSetup:
    p.chooser = decisions
    return p


def test_a_request_waiting_for_its_promotions_is_counted_once(client: InProcessClient) -> None:
    """Asked again while its lmdb chunks come up into the arena, the request's decision is
    counted when its plan is final, not at each ask."""
    ns, hit = four_in_lmdb(client)
    timings = EngineTimings()
    for chunks, tokens in [(1, 64), (4, 256)] * 2:
        timings.loaded("lmdb", chunks, chunks << 20, 1e-6 * chunks)
        timings.prefilled(tokens, 0.001 + 1e-4 * tokens)
    client.report_timings(timings)
    decide = LoadDecisions(LoadPolicy.MEASURED, client.costs)
    asked = ask(with_chooser(shared(client, ns, wait_s=30), decide))
    assert asked.plan_load(0, 4) is None  # promoted: ask again
    in_arena(client, hit)
    plan = asked.plan_load(0, 4)
    assert plan is not None
    assert plan.chunks == 4
    stats = KVTierStats()
    decide.report(stats)
    assert stats.data["decided|lmdb|load"] == 1
    assert stats.data["saved|load"] == pytest.approx(4 * (64 * 1e-4 - 1e-6), rel=0.05)
    client.release(plan.refs())
