"""The scheduler's lookup hook: how many of a new request's tokens the tiers hold past vLLM's
own prefix cache, or "ask again next step" while an answer or a promotion is on its way. A request
asked again while it waits for room is answered from what it was told, with no call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvtier.core.errors import KVTierError
from kvtier_vllm.config import ConnectorConfig
from kvtier_vllm.draft import DraftTracker
from kvtier_vllm.draft_pool import DraftPool
from kvtier_vllm.planner import Asked, HitPlanner
from kvtier_vllm.requests import RequestState
from kvtier_vllm.session import Session
from kvtier_vllm.stats import KVTierStats
from kvtier_vllm.verify import Sampled, Verifier
from kvtier_vllm.weights import adapter_uncached


class Lookups(ABC):
    """`get_num_new_matched_tokens`, over the scheduler's requests and planner."""

    cfg: ConnectorConfig
    chunk_tokens: int
    drop_last: bool
    async_loads: bool
    session: Session
    verifier: Verifier
    stats: KVTierStats
    namespaces: dict[str, bytes]
    draft: DraftTracker | None
    draft_pool: DraftPool | None
    planner: HitPlanner | None
    _requests: dict[str, RequestState]
    _failed_loads: set[str]
    _unanswered: list[Asked]
    _failing: bool
    _step: int

    @abstractmethod
    def _connect(self, wait: bool = False) -> bool:
        """Whether the tiers are open (the scheduler's)."""

    @abstractmethod
    def _guard(self, what: str, error: KVTierError) -> None:
        """Note a failed call into kvtier (the scheduler's)."""

    @abstractmethod
    def _drop_plan(self, state: RequestState) -> None:
        """Give back the leases of a request's planned load (the scheduler's)."""

    def state(self, request: Any) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestState(request)
        return state

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._failed_loads or not self._connect():
            return 0, False  # a load that failed once is recomputed, not tried again
        if self.session.client is not None and not self.session.client.serving:
            return 0, False  # kvtierd does not answer in time: no call, no wait
        if adapter_uncached(request):
            return 0, False
        state = self.state(request)
        if state.sampled is not None:
            return 0, False  # vLLM computes it: the hit is compared with what it computes
        assert self.session.client is not None  # connected above
        if self.verifier.refuses(self.namespaces.values(), self.session.client.quarantined()):
            return 0, False  # a chunk of these pools was wrong: none is trusted
        state.local_hit = num_computed_tokens
        if self.draft_pool is not None:
            self.draft_pool.follow_once(self._step)
        self.session.touch(True)
        held = self._held_answer(state, request, num_computed_tokens)
        if held is not None:
            return held, self.async_loads  # asked again while it waits for room: no call
        if self._still_missing(state, request, num_computed_tokens):
            return 0, False
        self._drop_plan(state)
        wait_s = self.cfg.promote_wait_ms / 1000
        if self.draft is not None and self.draft.awaiting and state.asked.may_wait(wait_s):
            return None, False  # one step: the workers fingerprint the draft weights in it
        limit = self._hit_limit(request)
        first = num_computed_tokens // self.chunk_tokens
        if limit <= first:
            return 0, False
        if not state.drawn:
            # once per request, before its first lookup, however often vLLM asks: the realized
            # rate is the rate, and kvtierd counts what a sampled request finds as verified
            state.drawn = True
            state.asked.verify = self.verifier.sample(self._step)
        assert self.planner is not None  # made with the client
        wait_s = self.cfg.lookup_wait_ms / 1000
        try:
            if not self.planner.answered(state.asked, request.block_hashes, first, limit, wait_s):
                self._unanswered.append(state.asked)
                return None, False  # kvtierd's answer is on its way: ask again next step
            plan = self.planner.plan(state.asked, request.block_hashes, first, limit)
        except KVTierError as exc:
            self._guard("lookup", exc)
            return 0, False
        self._failing = False
        if plan is None:
            return None, False  # chunks are on their way into the arena: ask again
        if plan.chunks == 0:
            state.missed = (num_computed_tokens, self._draft_revision())
            return 0, False
        state.missed = None
        if not state.had_hit:
            state.had_hit = True
            self.stats.drawn(state.asked.verify)
        if state.asked.verify:
            state.sampled = Sampled(plan)
            return 0, False
        state.plan = plan
        state.plan_revision = self._draft_revision()
        state.local_tokens = num_computed_tokens
        tokens = (first + plan.chunks) * self.chunk_tokens - num_computed_tokens
        return tokens, self.async_loads

    def _draft_revision(self) -> str | None:
        return self.draft.revision if self.draft is not None else None

    def _held_answer(self, state: RequestState, request: Any, computed: int) -> int | None:
        """The tokens of the load answered last time, when nothing it rests on has changed."""
        assert self.planner is not None  # made with the client
        limit = self._hit_limit(request)
        return state.held_tokens(self.planner, computed, self._draft_revision(), limit)

    def _still_missing(self, state: RequestState, request: Any, computed: int) -> bool:
        assert self.planner is not None  # made with the client
        return state.still_missing(self.planner, computed, self._draft_revision())

    def _hit_limit(self, request: Any) -> int:
        """The most chunks a lookup may find: at least one prompt token is always computed, to
        produce the first output (with ``drop_last``, the chunk dropped from the hit ensures it)."""
        prompt = len(request.prompt_token_ids or ())
        hashed = len(request.block_hashes) // self.cfg.blocks_per_chunk
        readable = prompt if self.drop_last else prompt - 1
        return int(min(readable // self.chunk_tokens, hashed))
