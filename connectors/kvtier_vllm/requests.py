"""What the scheduler keeps per request: its blocks, what it stored, and the answer to its last
ask, which stands while the request waits for room and nothing it rests on changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier_vllm.draft import Fill
from kvtier_vllm.planner import Asked, HitPlanner, LoadPlan
from kvtier_vllm.verify import Sampled


@dataclass
class RequestState:
    request: Any
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV-cache group, the request's blocks by position (0: vLLM's null block)."""
    stored_chunks: int = 0
    asked: Asked = field(default_factory=Asked)
    plan: LoadPlan | None = None
    """The load answered to the last ask, while the request waits for room to take it."""
    plan_revision: str | None = None
    """The draft revision in use when it was made."""
    missed: tuple[int, str | None] | None = None
    """(tokens vLLM held, draft revision) of the last ask, when it found no hit."""
    hit: LoadPlan | None = None
    """The load granted, for its hit sources."""
    local_tokens: int = 0
    local_hit: int = 0
    """Tokens vLLM's own prefix cache held when the request was first scheduled."""
    fill: Fill = Fill.NONE
    sampled: Sampled | None = None
    """Its hit, served as a miss to be compared with what vLLM computes."""
    drawn: bool = False
    """The sampler drew for it, before its first lookup (`asked.verify` holds the outcome): a
    request asked again while it waits is not drawn again."""
    had_hit: bool = False
    """A lookup found it a hit: its draw is counted among the draws of requests with a hit."""
    tail_stored: bool = False
    """Its prompt's hidden-state tail was reserved (captured hidden states)."""

    def held_tokens(
        self, planner: HitPlanner, computed: int, revision: str | None, limit: int
    ) -> int | None:
        """The tokens of the load answered last time, when vLLM holds what it held then, the
        draft revision is the same and the arena still holds the plan (and no longer hit)."""
        plan = self.plan
        if plan is None or self.local_tokens != computed or self.plan_revision != revision:
            return None
        if not planner.still_holds(plan, self.request.block_hashes, limit):
            return None
        return (plan.first_chunk + plan.chunks) * planner.chunk_tokens - computed

    def still_missing(self, planner: HitPlanner, computed: int, revision: str | None) -> bool:
        """Whether the miss answered last time stands: nothing it rests on changed and the
        arena holds no chunk where its hit would start."""
        if self.missed != (computed, revision):
            return False
        first = computed // planner.chunk_tokens
        return not planner.may_have_appeared(self.request.block_hashes, first)
