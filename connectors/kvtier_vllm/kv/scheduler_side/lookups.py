"""A request's lookup: how many of a new request's tokens the tiers hold past vLLM's own prefix
cache, or "ask again next step" while an answer or a promotion is on its way. A request asked
again while it waits for room is answered from what it was told, with no call."""

from __future__ import annotations

from typing import Any

from kvtier.core.errors import KVTierError
from kvtier_vllm.drafts.pool import DraftPool
from kvtier_vllm.drafts.swaps import DraftTracker
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.planner import HitPlanner
from kvtier_vllm.kv.scheduler_side.requests import RequestState
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.kv.scheduler_side.verify import Sampled, Verifier
from kvtier_vllm.shared.connection import Session
from kvtier_vllm.shared.settings import ConnectorConfig


def hit_limit(request: Any, chunk_tokens: int, blocks_per_chunk: int, drop_last: bool) -> int:
    """The most chunks a lookup may find: at least one prompt token is always computed, to
    produce the first output (with ``drop_last``, the chunk dropped from the hit ensures it)."""
    prompt = len(request.prompt_token_ids or ())
    hashed = len(request.block_hashes) // blocks_per_chunk
    readable = prompt if drop_last else prompt - 1
    return int(min(readable // chunk_tokens, hashed))


class HitLookup:
    """Answers vLLM's ask about a request over ``planner``'s client: the tokens of a hit past
    those vLLM holds, 0 for a miss, or None: ask again next step. What the request's asks
    learned is kept in its `RequestState`."""

    def __init__(
        self,
        planner: HitPlanner,
        calls: TierCalls,
        cfg: ConnectorConfig,
        session: Session,
        verifier: Verifier,
        draft_pool: DraftPool | None,
    ) -> None:
        self.planner = planner
        self.calls = calls
        self.cfg = cfg
        self.session = session
        self.verifier = verifier
        self.draft_pool = draft_pool
        self.draft: DraftTracker | None = planner.draft
        self.chunk_tokens = planner.chunk_tokens
        self._unanswered: list[RequestState] = []
        """Requests asked again next step, their lookups still with kvtierd."""

    def _limit(self, request: Any) -> int:
        return hit_limit(
            request, self.chunk_tokens, self.cfg.blocks_per_chunk, self.planner.drop_last
        )

    def next_step(self, wait_s: float | None) -> None:
        """A new step: the requests whose lookups were on their way are asked again in it;
        with ``wait_s`` (nothing else runs in it) their answers are waited for first."""
        unanswered, self._unanswered = self._unanswered, []
        if wait_s is not None:
            HitPlanner.wait_for_answers(unanswered, wait_s)

    def ask(self, state: RequestState, computed: int, step: int, stats: KVTierStats) -> int | None:
        """The tokens of the request's hit past the ``computed`` ones vLLM holds (0: a miss),
        or None: ask again next step."""
        if state.sampled is not None:
            return 0  # vLLM computes it: the hit is compared with what it computes
        client = self.planner.client
        if self.verifier.refuses(self.planner.namespaces.values(), client.quarantined()):
            return 0  # a chunk of these pools was wrong: none is trusted
        state.local_hit = computed
        if self.draft_pool is not None:
            self.draft_pool.follow_once(step)
        self.session.touch(True)
        limit = self._limit(state.request)
        revision = self._draft_revision()
        held = state.plan
        if held is not None and self._still_held(state, computed, revision, limit):
            return self._tokens(held, computed)  # asked again: no call
        if self._still_missing(state, computed, revision):
            return 0
        self.calls.release(state.drop_plan())
        wait_s = self.cfg.promote_wait_ms / 1000
        if self.draft is not None and self.draft.awaiting and state.may_wait(wait_s):
            return None  # one step: the workers fingerprint the draft weights in it
        first = computed // self.chunk_tokens
        if limit <= first:
            return 0
        if not state.drawn:
            # once per request, before its first lookup, however often vLLM asks: the realized
            # rate is the rate, and kvtierd counts what a sampled request finds as verified
            state.drawn = True
            state.verify = self.verifier.sample(step)
        try:
            if not self.planner.answered(state, first, limit, self.cfg.lookup_wait_ms / 1000):
                self._unanswered.append(state)
                return None  # kvtierd's answer is on its way: ask again next step
            plan = self.planner.plan(state, first, limit)
        except KVTierError as exc:
            self.calls.failed("lookup", exc)
            return 0
        self.calls.answered()
        if plan is None:
            return None  # chunks are on their way into the arena: ask again
        if plan.chunks == 0:
            state.missed = (computed, self._draft_revision())
            return 0
        state.missed = None
        if not state.had_hit:
            state.had_hit = True
            stats.drawn(state.verify)
        if state.verify:
            state.sampled = Sampled(plan)
            return 0
        state.plan = plan
        state.plan_revision = self._draft_revision()
        state.local_tokens = computed
        return self._tokens(plan, computed)

    def _tokens(self, plan: LoadPlan, computed: int) -> int:
        """The hit's tokens past the ``computed`` ones vLLM holds."""
        return (plan.first_chunk + plan.chunks) * self.chunk_tokens - computed

    def _draft_revision(self) -> str | None:
        return self.draft.revision if self.draft is not None else None

    def _still_held(
        self, state: RequestState, computed: int, revision: str | None, limit: int
    ) -> bool:
        """Whether the load answered last time stands: vLLM holds what it held then, the draft
        revision is the same and the arena still holds the plan (and no longer hit)."""
        plan = state.plan
        if plan is None or state.local_tokens != computed or state.plan_revision != revision:
            return False
        return self.planner.still_holds(plan, state.keys, limit)

    def _still_missing(self, state: RequestState, computed: int, revision: str | None) -> bool:
        """Whether the miss answered last time stands: nothing it rests on changed and the
        arena holds no chunk where its hit would start."""
        if state.missed != (computed, revision):
            return False
        return not self.planner.may_have_appeared(state.keys, computed // self.chunk_tokens)
