"""Hit planning: how much of a prompt the tiers hold, and the leases that load it.

A hit is the longest prefix every target plan holds. Its chunks must all be in the arena to be
loaded (or in lmdb, with ``in_lmdb``: the worker reads those from lmdb's map): the others are
promoted in the background and the request is asked again next step, for up to ``wait_s`` (or a
share of what recomputing the hit takes, where longer); past that the hit shrinks to what the
arena holds. The draft pool's chunks come with their target's, or the draft pages are filled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.protocol import SlotRef, TierClient, TierCode, in_lmdb
from kvtier_vllm.drafts.swaps import DraftTracker, Fill, lease_draft
from kvtier_vllm.kv.layout import PoolPlan
from kvtier_vllm.kv.scheduler_side.leases import Leases
from kvtier_vllm.kv.scheduler_side.load_decisions import LoadDecisions, tier_runs
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.requests import RequestState
from kvtier_vllm.kv.scheduler_side.spans import Needed, PromptKeys, needed, targets_of
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls

R = TypeVar("R")

CPU = int(TierCode.CPU)
LMDB = int(TierCode.LMDB)
_WINDOW_TRIES = 4  # sliding-window checks of one lookup, each with a shorter hit
PROMOTE_WAIT_ASKS = 3
"""Asks a request may wait for its promotions however long its steps take: where a step
outlasts ``promote_wait_ms`` (a long prefill beside it), waiting only by time would give up at
the first ask after queuing them, before the daemon had room to hold them."""


@dataclass
class HitFound:
    """What `HitPlanner` found every target plan holds, before it leases the hit."""

    chunks: int
    tiers: dict[str, tuple[int, bytes]]
    """Per plan key, the first chunk looked up and the tier code of each found from there."""
    pending: bool
    leases: dict[str, tuple[int, list[SlotRef | None]]] | None = None
    """Per plan key, the first chunk and the leases the lookup took, when it took them."""


class HitPlanner:
    """Finds a request's hit over ``client`` and plans its load: the leases of every plan's
    chunks, the draft's fill, and promotions of what is not in the arena yet.

    ``namespaces`` (per plan key) is read at each call: the draft's follows its swaps, and a
    draft pool without one is not waited for. A release that fails is handed back later by
    ``calls``; any other failed call raises `KVTierError`, as from `plan`. What a request's
    lookups learned over its asks is kept in its `RequestState`."""

    def __init__(
        self,
        client: TierClient,
        plans: Sequence[PoolPlan],
        namespaces: dict[str, bytes],
        *,
        chunk_tokens: int,
        blocks_per_chunk: int,
        checkpoint: int = 0,
        drop_last: bool = False,
        wait_s: float = 0.0,
        draft: DraftTracker | None = None,
        leases: Leases | None = None,
        calls: TierCalls | None = None,
        in_lmdb: bool = False,
        recompute_wait: Callable[[int], float] | None = None,
        decisions: LoadDecisions | None = None,
    ) -> None:
        self.client = client
        self.in_lmdb = in_lmdb
        """Chunks lmdb holds load from there (`TierClient.lease`), with no promotion."""
        self.loadable = bytes([CPU, LMDB] if in_lmdb else [CPU])
        self.namespaces = namespaces
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.checkpoint = checkpoint
        """Chunks between the sliding windows kept for shorter prefixes (0: none)."""
        self.drop_last = drop_last
        """A hit's last chunk is recomputed (EAGLE-style drafters)."""
        self.wait_s = wait_s
        self.recompute_wait = recompute_wait
        """How long a hit of so many tokens may be waited for past ``wait_s`` (a share of what
        recomputing it takes: `StepTimings.recompute_wait`)."""
        self.decisions = decisions
        """How much of a hit is worth loading (None: all of it)."""
        self.targets = targets_of(plans)
        assert self.targets, "a hit needs a target plan"
        self.anchor = self.targets[0]
        self.windowed = any(p.window for p in self.targets)
        """A shorter hit moves the sliding windows' first chunks."""
        self.draft_plan = next((p for p in plans if p.pool is Pool.DRAFT), None)
        self.draft = draft
        self.leases = leases if leases is not None else Leases(2)
        self.calls = calls if calls is not None else TierCalls(client)

    def _wait_s(self, chunks: int) -> float:
        found = self.recompute_wait(chunks * self.chunk_tokens) if self.recompute_wait else 0.0
        return max(self.wait_s, found)

    def keys(self, plan: PoolPlan, prompt: PromptKeys, chunks: Iterable[int]) -> list[ChunkKey]:
        return prompt.of(self.namespaces[plan.key], chunks)

    def may_have_appeared(self, prompt: PromptKeys, first: int) -> bool:
        """Whether a hit from chunk ``first`` could be there now, where an earlier ask found
        none: the arena holds that chunk, read without a call (True where it cannot be read so:
        asking is no dearer then)."""
        found = self.client.in_arena(self.keys(self.anchor, prompt, [first]))
        return found is None or bool(found)

    def still_holds(self, plan: LoadPlan, prompt: PromptKeys, limit: int) -> bool:
        """Whether a plan made at an earlier ask still stands, read from the arena without a
        call: every chunk it leased is in the same slot, and the arena holds no chunk past its
        hit (a lookup now would find a longer one). False where the arena cannot be read so."""
        refs = [r for r in plan.refs() if not in_lmdb(r)]
        end = plan.end
        past = self.keys(self.anchor, prompt, [end]) if end < limit else []
        found = self.client.in_arena([r.key for r in refs] + past)
        if found is None or len(found) != len(refs):
            return False
        return all(
            f.slot == r.slot and f.generation == r.generation
            for f, r in zip(found, refs, strict=True)
        )

    def _needed(self, plan: PoolPlan, first: int, chunks: int) -> range:
        return needed(plan, first, chunks, self.chunk_tokens)

    def _needed_by(self, state: RequestState, first: int, limit: int) -> Needed:
        """What the request's lookup from chunk ``first`` up to ``limit`` needs of every target
        plan (anchor first): derived once for each span it is asked with."""
        needed = state.needed
        if needed is None or (needed.first, needed.end) != (first, limit):
            needed = state.keys.needed(
                self.targets, self.namespaces, first, limit, self.chunk_tokens
            )
            state.needed = needed
        return needed

    def answered(self, state: RequestState, first: int, limit: int, wait_s: float | None) -> bool:
        """Whether `plan` may run now, having waited at most ``wait_s`` (None: as long as the
        call may take). A first lookup whose first chunk the arena's index does not hold (most
        likely a miss) is asked in the background: until it is answered, ask again later."""
        if state.behind is None:
            if state.looked:
                return True
            keys = self._needed_by(state, first, limit).keys
            held = self.client.in_arena(keys[:1])
            if not keys or held is None or held:
                return True  # the index answers, or a lookup here is no dearer than a check
            state.behind = keys, self.client.lookup_behind(keys, verify=state.verify)
            state.looked = True
        return state.behind[1].wait(wait_s)

    @staticmethod
    def wait_for_answers(states: Iterable[RequestState], timeout_s: float) -> None:
        """Wait for the lookups these requests asked in the background, each at most
        ``timeout_s``: all were sent before, so the engine waits once for them all, not once
        per ask."""
        for state in states:
            if state.behind is not None:
                state.behind[1].wait(timeout_s)

    def plan(self, state: RequestState, first: int, limit: int) -> LoadPlan | None:
        """The load of the hit from chunk ``first`` (vLLM holds the ones before) up to
        ``limit``, with its leases taken; an empty plan (no chunk) for no hit, or None: ask
        again next step, chunks are on their way into the arena."""
        state.planned += 1
        try:
            found = self._find(state, first, limit)
        finally:
            state.looked = True
        chunks = found.chunks
        if self.drop_last and chunks > first:
            chunks -= 1
        anchor_start, anchor_codes = found.tiers[self.anchor.key]
        for chunk, code in enumerate(anchor_codes, anchor_start):
            state.first_tiers.setdefault(chunk, code)
        if self.decisions is not None and chunks > first:  # only what beats recomputing it
            runs = tier_runs(bytes(state.first_tiers.get(c, CPU) for c in range(first, chunks)))
            chunks = (
                first + self.decisions.tokens_to_load(runs, self.chunk_tokens) // self.chunk_tokens
            )
        # per plan, the chunks of the hit to bring up first
        loadable = self.loadable
        below = {
            plan.key: [
                c for c, code in enumerate(codes[: chunks - start], start) if code not in loadable
            ]
            for plan in self.targets
            for start, codes in (found.tiers[plan.key],)
        }
        if any(below.values()) or found.pending:
            self._give_back(found.leases)
            # a probe still running may find the rest of the prompt
            worth = (limit if found.pending else chunks) - first
            if state.may_wait(self._wait_s(worth), PROMOTE_WAIT_ASKS):
                self._promote(state.keys, below)
                return None
            if self.windowed and any(below.values()):
                return LoadPlan(first, 0, {}, [])  # a shorter hit would need other windows
            chunks = min([chunks, *(c[0] for c in below.values() if c)])
            found.leases = None
        draft = self.draft_plan
        if chunks <= first or (
            draft is not None
            and draft.key in self.namespaces
            and self._draft_on_its_way(draft, state, range(first, chunks))
        ):
            self._give_back(found.leases)
            return None if chunks > first else LoadPlan(first, 0, {}, [])
        return self._lease(state, first, chunks, found.leases)

    def _find(self, state: RequestState, first: int, limit: int) -> HitFound:
        """The longest hit every target plan holds, in chunks: per plan, the first chunk it
        needs (from ``first``: vLLM holds the ones before) and the tier of each chunk from there.

        Full-attention plans need every chunk of the hit. A sliding-window plan needs only the
        window before the hit's end, which moves when the hit gets shorter: its check repeats,
        a few times at most. The first lookup also leases what the arena holds (or reads it from
        the arena's index, with no call), so that a whole hit from the arena takes one step;
        one asked in the background (see `answered`) leased nothing."""
        client = self.client
        needed = self._needed_by(state, first, limit)
        spans, keys = needed.spans, needed.keys
        behind, state.behind = state.behind, None
        early: dict[str, tuple[int, list[SlotRef | None]]] | None = None
        if behind is not None and behind[0] == keys and behind[1].done():
            result = behind[1].result()
        else:
            result, leased = self._releasing_due(
                lambda due: client.lookup(
                    keys, release=due, lease=True, again=state.looked, verify=state.verify
                )
            )
            early = needed.by_plan(leased)
        found = needed.by_plan(result.tier_codes)
        if len(spans) == 1 or result.hits == len(keys):
            chunks = spans[0][1].start + result.hits if len(spans) == 1 else limit
            return HitFound(chunks, found, result.pending, early)
        self._give_back(early)
        chunks, pending = limit, result.pending
        found = {}
        for _ in range(_WINDOW_TRIES):
            settled = True
            for plan in self.targets:
                span = self._needed(plan, first, chunks)
                if plan.window or plan.key not in found:
                    # the first lookup counted these keys: the window checks are asked again
                    result = client.lookup(self.keys(plan, state.keys, span), again=True)
                    pending |= result.pending
                    found[plan.key] = (span.start, result.tier_codes)
                have = span.start + len(found[plan.key][1])
                if have < chunks:
                    if plan.window and self.checkpoint:
                        # windows are kept before each checkpoint: the last one below
                        have = min(have, (chunks - 1) // self.checkpoint * self.checkpoint)
                    chunks = have
                    settled = settled and not plan.window
            if settled:
                return HitFound(chunks, found, pending)
        return HitFound(first, found, pending)

    def _releasing_due(self, call: Callable[[list[SlotRef]], R]) -> R:
        """``call`` given the leases the next step would release: they go back with it (or
        later, when it fails)."""
        due = self.leases.take_due()
        try:
            return call(due)
        except KVTierError:
            self.calls.release_later(due)
            raise

    def _give_back(self, leases: dict[str, tuple[int, list[SlotRef | None]]] | None) -> None:
        for _, refs in (leases or {}).values():
            self.leases.give_back(r for r in refs if r is not None)

    def _promote(self, prompt: PromptKeys, below: dict[str, list[int]]) -> None:
        """Bring a hit's chunks up into the arena, the draft's with their target's."""
        client = self.client
        span: set[int] = set()
        for plan in self.targets:
            chunks = below.get(plan.key, [])
            if chunks:
                client.promote(self.keys(plan, prompt, chunks))
                span.update(chunks)
        if not span or self.draft_plan is None:
            return
        namespaces = [self.namespaces.get(self.draft_plan.key)]
        namespaces += self.draft.fill_sources() if self.draft is not None else []
        for namespace in namespaces:
            if namespace is not None:
                client.promote(prompt.of(namespace, sorted(span)))

    def _lease(
        self,
        state: RequestState,
        first: int,
        chunks: int,
        early: dict[str, tuple[int, list[SlotRef | None]]] | None,
    ) -> LoadPlan | None:
        """Lease every plan's chunks of the hit (``early``: those the lookup leased, when they
        cover the hit; the ones past it go back); the hit shrinks to what all of them got."""
        client = self.client
        needed = self._needed_by(state, first, chunks)
        spans = needed.spans
        if early is None or any(
            early[plan.key][0] != span.start or len(early[plan.key][1]) < len(span)
            for plan, span in spans
        ):
            self._give_back(early)
            # every plan's chunks in one call
            early = needed.by_plan(
                self._releasing_due(
                    lambda due: client.lease(needed.keys, release=due, in_lmdb=self.in_lmdb)
                )
            )
        offered: dict[str, tuple[int, list[SlotRef | None]]] = {}
        granted = chunks
        for plan, span in spans:
            start, refs = early[plan.key]
            offered[plan.key] = (start, refs)
            missing = next((i for i, r in enumerate(refs) if r is None), None)
            if missing is not None:
                # a shorter hit moves the sliding windows: with them, none
                granted = first if self.windowed else min(granted, span.start + missing)
        zero: list[str] = []
        fill = Fill.NONE
        unused: list[SlotRef] = []  # leases the hit does not use: ended in one call
        if self.draft is not None and self.draft_plan is not None:
            span = self._needed(self.draft_plan, first, chunks)
            chunk_hashes = [state.keys.hash_of(c) for c in span]
            draft, fill, back = lease_draft(client, self.draft, chunk_hashes)
            unused += back
            if draft is not None:
                offered[self.draft_plan.key] = (span.start, draft)
            else:  # never leave draft pages uninitialised
                zero.append(self.draft_plan.key)
        leases: dict[str, tuple[int, list[SlotRef]]] = {}
        for key, (start, refs) in offered.items():
            keep = max(0, granted - start)
            unused += [r for r in refs[keep:] if r is not None]
            leases[key] = (start, [r for r in refs[:keep] if r is not None])
        if granted <= first:
            unused += [r for _, refs in leases.values() for r in refs]
        self.calls.release(unused)
        if granted <= first:
            wait_s = self._wait_s(chunks - first)
            return None if state.may_wait(wait_s) else LoadPlan(first, 0, {}, [])
        tiers = bytes(state.first_tiers.get(c, CPU) for c in range(first, granted))
        return LoadPlan(first, granted - first, leases, zero, tiers, fill)

    def _draft_on_its_way(self, draft: PoolPlan, state: RequestState, hit: range) -> bool:
        """Whether draft chunks of the hit are still coming up into the arena (then ask again,
        within the wait): loading them now would find them mid-promotion and zero them."""
        client = self.client
        keys = self.keys(draft, state.keys, self._needed(draft, hit.start, hit.stop))
        again = state.waiting_since is not None
        found = client.lookup(keys, again=again, verify=state.verify)
        below = [k for k, c in zip(keys, found.tier_codes, strict=False) if c != CPU]
        if not below and not found.pending:
            return False
        if not state.may_wait(self._wait_s(len(hit))):
            return False
        if below:
            client.promote(below)
        return True
