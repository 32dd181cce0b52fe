"""What the scheduler keeps per request: its blocks and what it stored, and what its lookups
learned over the steps vLLM asks again, with the answer to its last ask, which stands while
the request waits for room and nothing it rests on changes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import Answer, LookupResult, SlotRef
from kvtier_vllm.drafts.swaps import Fill
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.spans import Needed, PromptKeys
from kvtier_vllm.kv.scheduler_side.verify import Sampled


@dataclass
class RequestState:
    request: Any
    keys: PromptKeys
    """Its chunks' keys, made once."""
    needed: Needed | None = None
    """What its last lookup needed: asked again with the same span, it needs the same."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV-cache group, the request's blocks by position (0: vLLM's null block)."""
    stored_chunks: int = 0
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
    """The sampler drew for it, before its first lookup (`verify` holds the outcome): a
    request asked again while it waits is not drawn again."""
    verify: bool = False
    """Sampled for verification: what its lookups find is counted as verified, not hits."""
    had_hit: bool = False
    """A lookup found it a hit: its draw is counted among the draws of requests with a hit."""
    load_failed: bool = False
    """Its asynchronous load failed: vLLM recomputes it, without kvtier."""
    tail_stored: bool = False
    """Its prompt's hidden-state tail was reserved (captured hidden states)."""
    waiting_since: float | None = None
    """When it was first asked again."""
    looked: bool = False
    """Whether it was looked up already: lookups asked again are not counted again."""
    planned: int = 0
    """Times a load was planned for it (`HitPlanner.plan`)."""
    first_tiers: dict[int, int] = field(default_factory=dict)
    """Per chunk, where it was when first asked for (promoted ones came from lmdb)."""
    behind: tuple[list[ChunkKey], Answer[LookupResult]] | None = None
    """The first lookup, asked in the background, and its keys: the plan takes its answer."""

    @classmethod
    def of(cls, request: Any, blocks_per_chunk: int) -> RequestState:
        return cls(request, PromptKeys(request.block_hashes, blocks_per_chunk))

    def may_wait(self, wait_s: float, planned: int = 0) -> bool:
        """Whether the request may still be asked again next step: for ``wait_s``, and until
        more than ``planned`` loads were planned for it; never with no wait."""
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        return wait_s > 0 and (now - self.waiting_since < wait_s or self.planned <= planned)

    def drop_plan(self) -> list[SlotRef]:
        """Forget the load answered last time; returns its leases, to give back."""
        plan, self.plan = self.plan, None
        return plan.refs() if plan is not None else []
