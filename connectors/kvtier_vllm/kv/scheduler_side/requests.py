"""What the scheduler keeps per request: its blocks and what it stored, the load vLLM granted
it, and its hit decision."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvtier_vllm.drafts.swaps import Fill
from kvtier_vllm.kv.scheduler_side.hit_decision import HitDecision
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan


@dataclass
class RequestState:
    request: Any
    decision: HitDecision | None = None
    """Its hit decision, made at its first ask over the tiers."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV-cache group, the request's blocks by position (0: vLLM's null block)."""
    stored_chunks: int = 0
    hit: LoadPlan | None = None
    """The load granted, for its hit sources."""
    fill: Fill = Fill.NONE
    load_failed: bool = False
    """Its asynchronous load failed: vLLM recomputes it, without kvtier."""
    load_async: bool = True
    """Its hit, as last answered to vLLM, loads asynchronously (`load_modes`)."""
    tail_stored: bool = False
    """Its prompt's hidden-state tail was reserved (captured hidden states)."""
    asked_at: float | None = field(default_factory=time.perf_counter)
    """When it first asked for a hit (perf_counter); None once its first load landed."""

    @property
    def local_hit(self) -> int:
        """Tokens vLLM's own prefix cache held at its last ask (0: never asked)."""
        return self.decision.local_hit if self.decision is not None else 0
