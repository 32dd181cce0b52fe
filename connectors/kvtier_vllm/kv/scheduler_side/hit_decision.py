"""A request's hit decision (`HitDecision`, one per request): the tokens of its prompt the tiers
hold past vLLM's own prefix cache and the load that brings them in, 0 for a miss, or "ask again
next step" while an answer or a promotion is on its way. A request asked again while it waits
for room is answered from what it was told, with no call.

A hit is the longest prefix every target plan holds; the load chooser may take a shorter prefix
of it. Its chunks must all be in the arena to be loaded (or in lmdb, with ``in_lmdb``: the
worker reads those from lmdb's map): the others are promoted in the background and the request
is asked again next step, for up to ``wait_s`` (or a share of what recomputing the hit takes,
where longer); past that the hit shrinks to what the arena holds. No lookup made in the
engine's step waits for a probe of the object store: its answer says a probe runs, and the
request is asked again in the background, as for a promotion. The draft pool's chunks come
with their target's, or the draft pages are filled. What every request's decision shares is a
`HitSetup`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey
from kvtier.core.load_choice import LoadChoice
from kvtier.core.protocol import Answer, LookupResult, SlotRef, TierCode, in_lmdb
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.hit_setup import CPU, HitSetup
from kvtier_vllm.kv.scheduler_side.leases import Offered
from kvtier_vllm.kv.scheduler_side.load_chooser import chosen_chunks, tier_runs
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.prompt_keys import Needed, PromptKeys, plan_span
from kvtier_vllm.kv.scheduler_side.verify import Sampled
from kvtier_vllm.layout.plans import PoolPlan

OBJECT = int(TierCode.OBJECT)
_WINDOW_TRIES = 4  # sliding-window checks of one lookup, each with a shorter hit
PROMOTE_WAIT_ASKS = 3
"""Asks a request may wait for its promotions however long its steps take: where a step
outlasts ``promote_wait_ms`` (a long prefill beside it), waiting only by time would give up at
the first ask after queuing them, before the daemon had room to hold them."""
STORE_WAIT_ASKS = 1
"""Asks a request may wait for the object store however long its steps take: one, to see the
answer of the probe its first ask started (that ask never waits for it); past that only its
share of recomputing the hit, which several steps of a busy engine would far outlast."""


def hit_limit(request: Any, chunk_tokens: int, blocks_per_chunk: int, drop_last: bool) -> int:
    """The most chunks a lookup may find: at least one prompt token is always computed, to
    produce the first output (with ``drop_last``, the chunk dropped from the hit ensures it)."""
    prompt = len(request.prompt_token_ids or ())
    hashed = len(request.block_hashes) // blocks_per_chunk
    readable = prompt if drop_last else prompt - 1
    return int(min(readable // chunk_tokens, hashed))


Items = TypeVar("Items", bytes, list[SlotRef | None])
"""What a call answers per key, in the keys' order: tier codes or leases."""


def _by_plan(needed: Needed, items: Items) -> dict[str, tuple[int, Items]]:
    """Per plan key, the first chunk of its span and its part of ``items`` (answered for
    ``needed.keys``, span after span)."""
    out = {}
    offset = 0
    for plan, span in needed.spans:
        out[plan.key] = (span.start, items[offset : offset + len(span)])
        offset += len(span)
    return out


def _wait_s(setup: HitSetup, chunks: int, from_store: bool = False) -> float:
    """How long a hit of ``chunks`` chunks may be waited for. What comes ``from_store`` (a
    probe, a download) waits only its share of recomputing it once the engine measured that:
    a slow store costs at most that much more than recomputing, however long ``wait_s``."""
    recompute = setup.recompute_wait
    worth = recompute(chunks * setup.chunk_tokens) if recompute else 0.0
    if from_store and worth > 0:
        return worth
    return max(setup.wait_s, worth)


@dataclass
class HitFound:
    """What every target plan holds, before the hit is leased."""

    chunks: int
    tiers: dict[str, tuple[int, bytes]]
    """Per plan key, the first chunk looked up and the tier code of each found from there."""
    pending: bool
    leases: Offered | None = None
    """The leases the lookup took, when it took them."""


@dataclass
class HitDecision:
    """One request's hit decision over ``setup``: what its asks learned, and the load answered
    to its last ask while the request waits for room to take it."""

    setup: HitSetup
    request: Any
    needed: Needed | None = None
    """What its last lookup needed: asked again with the same span, it needs the same."""
    plan: LoadPlan | None = None
    """The load answered to the last ask, while the request waits for room to take it."""
    plan_revision: str | None = None
    """The draft revision in use when it was made."""
    missed: tuple[int, str | None] | None = None
    """(tokens vLLM held, draft revision) of the last ask, when it found no hit."""
    local_hit: int = 0
    """Tokens vLLM's own prefix cache held at the last ask."""
    sampled: Sampled | None = None
    """Its hit, served as a miss to be compared with what vLLM computes."""
    drawn: bool = False
    """The sampler drew for it, before its first lookup (`verify` holds the outcome): a
    request asked again while it waits is not drawn again."""
    verify: bool = False
    """Sampled for verification: what its lookups find is counted as verified, not hits."""
    had_hit: bool = False
    """A lookup found it a hit: its draw is counted among the draws of requests with a hit."""
    waiting_since: float | None = None
    """When it was first asked again."""
    looked: bool = False
    """Whether it was looked up already: lookups asked again are not counted again."""
    planned: int = 0
    """Times a load was planned for it (`plan_load`)."""
    first_tiers: dict[int, int] = field(default_factory=dict)
    """Per chunk, where it was when first asked for (promoted ones came from lmdb)."""
    behind: tuple[list[ChunkKey], Answer[LookupResult]] | None = None
    """A lookup asked in the background, and its keys: the plan takes its answer."""
    choice: tuple[bytes, LoadChoice] | None = None
    """The chooser's choice, and the tiers of the hit it was made for: asked again for the
    same hit (waiting for its promotions), the request keeps it."""
    counted: bool = False
    """Its choice was counted, when a plan was final: a request is counted once."""
    probing: bool = False
    """Its last lookup found a probe of the object store running past the hit (a lookup in the
    step starts one and does not wait for it): the next is asked in the background, since the
    tiers hold a lookup up to their probe budget and the engine's step would wait that long."""

    @cached_property
    def keys(self) -> PromptKeys:
        """Its chunks' keys, made once."""
        return PromptKeys(self.request.block_hashes, self.setup.blocks_per_chunk)

    def ask(self, computed: int, step: int, stats: KVTierStats) -> int | None:
        """The tokens of the request's hit past the ``computed`` ones vLLM holds (0: a miss),
        or None: ask again next step."""
        setup = self.setup
        if self.sampled is not None:
            return 0  # vLLM computes it: the hit is compared with what it computes
        if setup.verifier.refuses(setup.namespaces.values(), setup.client.quarantined()):
            return 0  # a chunk of these pools was wrong: none is trusted
        self.local_hit = computed
        if setup.draft_pool is not None:
            setup.draft_pool.follow_once(step)
        if setup.session is not None:
            setup.session.touch(True)
        limit = hit_limit(self.request, setup.chunk_tokens, setup.blocks_per_chunk, setup.drop_last)
        draft = setup.draft
        revision = draft.revision if draft is not None else None
        if self.plan is not None:
            if self._still_held(computed, revision, limit):
                return self.plan.tokens(setup.chunk_tokens)  # asked again: no call
            setup.calls.release(self.drop_plan())
        elif self._still_missing(computed, revision):
            return 0
        if draft is not None and draft.awaiting and self.may_wait(setup.wait_s):
            return None  # one step: the workers fingerprint the draft weights in it
        first = computed // setup.chunk_tokens
        if limit <= first:
            return 0
        if not self.drawn:
            # once per request, before its first lookup, however often vLLM asks: the realized
            # rate is the rate, and kvtierd counts what a sampled request finds as verified
            self.drawn = True
            self.verify = setup.verifier.sample(step)
        try:
            if self.answered(first, limit, setup.lookup_wait_s):
                plan = self.plan_load(first, limit)
            elif self._nothing_else_to_find(first, limit):
                # not waited for: kvtierd still counts the lookup, and its probe may bring the
                # prompt into lmdb for a later request
                self.behind = None
                plan = LoadPlan(first, 0, {}, [])
            else:
                assert self.behind is not None  # asked in the background
                setup.unanswered.append(self.behind[1])
                return None  # kvtierd's answer is on its way: ask again next step
        except KVTierError as exc:
            setup.calls.failed("lookup", exc)
            return 0
        setup.calls.answered()
        if plan is None:
            return None  # chunks are on their way into the arena: ask again
        return self._answer(plan, computed, revision, stats)

    def _answer(
        self, plan: LoadPlan, computed: int, revision: str | None, stats: KVTierStats
    ) -> int:
        if plan.chunks == 0:
            self.missed = (computed, revision)
            return 0
        self.missed = None
        if not self.had_hit:
            self.had_hit = True
            stats.drawn(self.verify)
        if self.verify:
            self.sampled = Sampled(plan)
            return 0
        plan.computed = computed
        self.plan = plan
        self.plan_revision = revision
        return plan.tokens(self.setup.chunk_tokens)

    def take_plan(self) -> LoadPlan | None:
        """The load answered last time, which vLLM granted: no longer this decision's."""
        plan, self.plan = self.plan, None
        return plan

    def drop_plan(self) -> list[SlotRef]:
        """Forget the load answered last time; returns its leases, to give back."""
        plan = self.take_plan()
        return plan.refs() if plan is not None else []

    def may_wait(self, wait_s: float, planned: int = 0) -> bool:
        """Whether the request may still be asked again next step: for ``wait_s``, and until
        more than ``planned`` loads were planned for it; never with no wait."""
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        return wait_s > 0 and (now - self.waiting_since < wait_s or self.planned <= planned)

    def _still_held(self, computed: int, revision: str | None, limit: int) -> bool:
        """Whether the load answered last time stands: vLLM holds what it held then, the draft
        revision is the same and the arena still holds the plan (and no longer hit)."""
        plan = self.plan
        if plan is None or plan.computed != computed or self.plan_revision != revision:
            return False
        return self.still_holds(plan, limit)

    def _still_missing(self, computed: int, revision: str | None) -> bool:
        """Whether the miss answered last time stands: nothing it rests on changed and the
        arena holds no chunk where its hit would start."""
        if self.missed != (computed, revision):
            return False
        return not self.may_have_appeared(computed // self.setup.chunk_tokens)

    def may_have_appeared(self, first: int) -> bool:
        """Whether a hit from chunk ``first`` could be there now, where an earlier ask found
        none: the arena holds that chunk, read without a call (True where it cannot be read so:
        asking is no dearer then)."""
        found = self.setup.client.in_arena(self._keys(self.setup.anchor, [first]))
        return found is None or bool(found)

    def still_holds(self, plan: LoadPlan, limit: int) -> bool:
        """Whether a plan made at an earlier ask still stands, read from the arena without a
        call: every chunk it leased is in the same slot, and the arena holds no chunk past its
        hit (a lookup now would find a longer one). False where the arena cannot be read so."""
        refs = [r for _, leased in plan.leases.values() for r in leased if not in_lmdb(r)]
        end = plan.first_chunk + plan.chunks
        past = self._keys(self.setup.anchor, [end]) if end < limit else []
        found = self.setup.client.in_arena([r.key for r in refs] + past)
        if found is None or len(found) != len(refs):
            return False
        return all(
            f.slot == r.slot and f.generation == r.generation
            for f, r in zip(found, refs, strict=True)
        )

    def _keys(self, plan: PoolPlan, chunks: list[int]) -> list[ChunkKey]:
        return self.keys.of(self.setup.namespaces[plan.key], chunks)

    def _needed(self, first: int, end: int) -> Needed:
        """What a hit from chunk ``first`` up to ``end`` needs of every target plan (anchor
        first): derived once for each span it is asked with."""
        needed = self.needed
        if needed is None or (needed.first, needed.end) != (first, end):
            setup = self.setup
            needed = self.keys.needed(
                setup.targets, setup.namespaces, first, end, setup.chunk_tokens
            )
            self.needed = needed
        return needed

    def answered(self, first: int, limit: int, wait_s: float | None) -> bool:
        """Whether `plan_load` may run now, having waited at most ``wait_s`` (None: as long as
        the call may take). A first lookup whose first chunk neither the arena's index nor
        lmdb's map (where hits load from it) holds (most likely a miss), and one asked again
        while a probe of the object store runs, are asked in the background: until it is
        answered, ask again."""
        if self.behind is None:
            if self.looked and not self.probing:
                return True
            client = self.setup.client
            keys = self._needed(first, limit).keys
            if not self.probing:
                held = client.in_arena(keys[:1])
                if not keys or held is None or held or self.setup.in_lmdb(keys[0]) is not False:
                    # the index or lmdb's map answers, or neither could be read: a lookup here
                    # is no dearer than a check, and only a check that read both makes a miss
                    return True
            self.behind = keys, client.lookup_behind(keys, again=self.looked, verify=self.verify)
            self.looked = True
        return self.behind[1].wait(wait_s)

    def plan_load(self, first: int, limit: int) -> LoadPlan | None:
        """The load of the hit from chunk ``first`` (vLLM holds the ones before) up to
        ``limit``, with its leases taken; an empty plan (no chunk) for no hit, or None: ask
        again next step, chunks are on their way into the arena. The first plan made counts
        the chooser's choice."""
        plan = self._plan_load(first, limit)
        if plan is not None and self.choice is not None and not self.counted:
            self.counted = True
            self.setup.chooser.count(self.choice[1])
        return plan

    def _chosen(self, first: int, chunks: int) -> int:
        """The chunks of the hit from ``first`` up to ``chunks`` the chooser loads, chosen once
        for each hit the request is asked with."""
        tiers = self._tiers(first, chunks)
        if self.choice is None or self.choice[0] != tiers:
            runs = tier_runs(tiers)
            self.choice = tiers, self.setup.chooser.choose(runs, self.setup.chunk_tokens)
        return chosen_chunks(self.choice[1], tiers, self.setup.chunk_tokens)

    def _nothing_else_to_find(self, first: int, limit: int) -> bool:
        """Whether a first lookup asked in the background can find nothing worth waiting for:
        the arena's index and lmdb's map both lack the first chunk (read here, with no call),
        and the tiers have no object store, or the costs say loading from it would take
        longer than recomputing."""
        if self.probing or not self.setup.reads_lmdb:
            return False
        if not self.setup.client.object_tier:
            return True
        return not self._store_may_win(first, first, limit)

    def _store_may_win(self, first: int, held: int, limit: int) -> bool:
        """Whether the chunks past the ``held`` ones, up to ``limit``, which a probe of the
        object store may still find, are worth waiting for: the chooser would load some of them
        from the store after the ``held`` ones (so too where no cost is measured, and for one
        hit in `REMEASURE_EVERY` of those cut short, as loads are re-measured)."""
        tiers = self._tiers(first, held) + bytes([OBJECT]) * (limit - held)
        choice = self.setup.chooser.choose(tier_runs(tiers), self.setup.chunk_tokens)
        return choice.tokens > (held - first) * self.setup.chunk_tokens

    def _plan_load(self, first: int, limit: int) -> LoadPlan | None:
        setup = self.setup
        self.planned += 1
        try:
            found = self._find(first, limit)
        finally:
            self.looked = True
        chunks = found.chunks
        if setup.drop_last and chunks > first:
            chunks -= 1
        anchor_start, anchor_codes = found.tiers[setup.anchor.key]
        for chunk, code in enumerate(anchor_codes, anchor_start):
            self.first_tiers.setdefault(chunk, code)
        if found.pending and not self._store_may_win(first, found.chunks, limit):
            found.pending = False  # what the probe finds could not beat recomputing it
        self.probing = found.pending
        if chunks > first:
            # the chooser may take a shorter prefix: only that is promoted and leased
            chunks = first + self._chosen(first, chunks)
        # per plan, the chunks of the hit to bring up first
        below = {
            plan.key: [
                c
                for c, code in enumerate(codes[: chunks - start], start)
                if code not in setup.loadable
            ]
            for plan in setup.targets
            for start, codes in (found.tiers[plan.key],)
        }
        if any(below.values()) or found.pending:
            setup.leases.give_back(found.leases)
            # a probe still running may find the rest of the prompt
            worth = (limit if found.pending else chunks) - first
            from_store = found.pending or any(
                OBJECT in codes[: chunks - start] for start, codes in found.tiers.values()
            )
            asks = STORE_WAIT_ASKS if from_store else PROMOTE_WAIT_ASKS
            if self.may_wait(_wait_s(setup, worth, from_store), asks):
                self._promote(below)
                return None
            if setup.windowed and any(below.values()):
                return LoadPlan(first, 0, {}, [])  # a shorter hit would need other windows
            chunks = min([chunks, *(c[0] for c in below.values() if c)])
            found.leases = None
        draft = setup.draft_plan
        if chunks <= first or (
            draft is not None
            and draft.key in setup.namespaces
            and self._draft_on_its_way(draft, range(first, chunks))
        ):
            setup.leases.give_back(found.leases)
            return None if chunks > first else LoadPlan(first, 0, {}, [])
        needed = self._needed(first, chunks)
        got = found.leases
        if got is None or any(
            got[plan.key][0] != span.start or len(got[plan.key][1]) < len(span)
            for plan, span in needed.spans
        ):
            setup.leases.give_back(got)
            got = _by_plan(needed, setup.leases.lease(setup.client, needed.keys))
        plan = setup.leases.load(setup.client, needed, self.keys, got, self._tiers(first, chunks))
        if plan.chunks == 0 and self.may_wait(_wait_s(setup, chunks - first)):
            return None
        return plan

    def _tiers(self, first: int, end: int) -> bytes:
        return bytes(self.first_tiers.get(c, CPU) for c in range(first, end))

    def _find(self, first: int, limit: int) -> HitFound:
        """The longest hit every target plan holds, in chunks: per plan, the first chunk it
        needs (from ``first``: vLLM holds the ones before) and the tier of each chunk from there.

        Full-attention plans need every chunk of the hit. A sliding-window plan needs only the
        window before the hit's end, which moves when the hit gets shorter: its check repeats,
        a few times at most. The first lookup also leases what the arena holds (or reads it from
        the arena's index, with no call), so that a whole hit from the arena takes one step;
        one asked in the background (see `answered`) leased nothing."""
        setup = self.setup
        needed = self._needed(first, limit)
        spans, keys = needed.spans, needed.keys
        behind, self.behind = self.behind, None
        early: Offered | None = None
        if behind is not None and behind[0] == keys and behind[1].done():
            result = behind[1].result()
        else:
            result, leased = setup.leases.lookup(
                setup.client, keys, again=self.looked, verify=self.verify
            )
            early = _by_plan(needed, leased)
        found = _by_plan(needed, result.tier_codes)
        if len(spans) == 1 or result.hits == len(keys):
            chunks = spans[0][1].start + result.hits if len(spans) == 1 else limit
            return HitFound(chunks, found, result.pending, early)
        setup.leases.give_back(early)
        chunks, pending = limit, result.pending
        found = {}
        for _ in range(_WINDOW_TRIES):
            settled = True
            for plan in setup.targets:
                span = plan_span(plan, first, chunks, setup.chunk_tokens)
                if plan.window or plan.key not in found:
                    # the first lookup counted these keys: the window checks are asked again
                    result = setup.client.lookup(
                        self._keys(plan, list(span)), again=True, probe_wait=False
                    )
                    pending |= result.pending
                    found[plan.key] = (span.start, result.tier_codes)
                have = span.start + len(found[plan.key][1])
                if have < chunks:
                    if plan.window and setup.checkpoint:
                        # windows are kept before each checkpoint: the last one below
                        have = min(have, (chunks - 1) // setup.checkpoint * setup.checkpoint)
                    chunks = have
                    settled = settled and not plan.window
            if settled:
                return HitFound(chunks, found, pending)
        return HitFound(first, found, pending)

    def _promote(self, below: dict[str, list[int]]) -> None:
        """Bring a hit's chunks (``below``, per plan) up into the arena, the draft's with their
        target's."""
        setup = self.setup
        span: set[int] = set()
        for plan in setup.targets:
            chunks = below.get(plan.key, [])
            if chunks:
                setup.client.promote(self._keys(plan, chunks))
                span.update(chunks)
        if not span or setup.draft_plan is None:
            return
        namespaces = [setup.namespaces.get(setup.draft_plan.key)]
        namespaces += setup.draft.fill_sources() if setup.draft is not None else []
        for namespace in namespaces:
            if namespace is not None:
                setup.client.promote(self.keys.of(namespace, sorted(span)))

    def _draft_on_its_way(self, draft: PoolPlan, hit: range) -> bool:
        """Whether draft chunks of the hit are still coming up into the arena (then ask again,
        within the wait): loading them now would find them mid-promotion and zero them."""
        setup = self.setup
        keys = self._keys(draft, list(plan_span(draft, hit.start, hit.stop, setup.chunk_tokens)))
        again = self.waiting_since is not None
        found = setup.client.lookup(keys, again=again, verify=self.verify, probe_wait=False)
        below = [k for k, c in zip(keys, found.tier_codes, strict=False) if c != CPU]
        if not below and not found.pending:
            return False
        if not self.may_wait(_wait_s(setup, len(hit))):
            return False
        if below:
            setup.client.promote(below)
        return True
