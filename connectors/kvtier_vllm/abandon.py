"""Loads vLLM granted but kvtier could not plan: the scheduler's side of a failed step. Their
blocks are reported as load errors (a request waiting for an asynchronous load: failed), never
left as if they held the prefix, and their leases go back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvtier.core.protocol import SlotRef
from kvtier_vllm.config import ConnectorConfig
from kvtier_vllm.metadata import KVTierMetadata
from kvtier_vllm.planner import LoadPlan
from kvtier_vllm.requests import RequestState


class AbandonedLoads(ABC):
    """The scheduler's failure path, over the bookkeeping it keeps of granted loads."""

    cfg: ConnectorConfig
    block_size: int
    async_loads: bool
    arena_path: str
    _requests: dict[str, RequestState]
    _ready_loads: dict[str, LoadPlan]
    _queued: KVTierMetadata
    _queued_leases: list[SlotRef]

    @abstractmethod
    def _release(self, refs: list[SlotRef]) -> None:
        """Hand leases back to the tiers (the scheduler's, guarded)."""

    def abandon_load(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Planning a granted load failed: the blocks vLLM allocated for it are reported as
        load errors (a request waiting for an asynchronous load: failed), never left as if
        they held the prefix."""
        req_id = request.request_id
        self._ready_loads.pop(req_id, None)
        state = self._requests.get(req_id)
        local = state.local_hit if state is not None else 0
        first = local // self.block_size
        end = (local + num_external_tokens + self.block_size - 1) // self.block_size
        if self.async_loads:
            self._queued.failed_requests.append(req_id)
            return
        for ids in blocks.get_block_ids():
            self._queued.invalid_blocks.extend(b for b in ids[first:end] if b)

    def abandon_step(self, scheduler_output: Any) -> KVTierMetadata:
        """The metadata of a step whose planning failed: every load granted for it is
        reported failed, and nothing is stored."""
        meta, self._queued = self._queued, KVTierMetadata()
        failed = KVTierMetadata(
            arena_path=self.arena_path,
            invalid_blocks=meta.invalid_blocks,
            failed_requests=meta.failed_requests + meta.receiving,
            sending=meta.sending,  # their tails are not stored: their blocks may go
        )
        self._release(self._queued_leases)
        self._queued_leases = []
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._ready_loads.pop(new.req_id, None)
            state = self._requests.get(new.req_id)
            if plan is None or state is None:
                continue
            first = state.local_tokens // self.block_size
            end = (plan.first_chunk + plan.chunks) * self.cfg.blocks_per_chunk
            for ids in new.block_ids:
                failed.invalid_blocks.extend(b for b in ids[first:end] if b)
            self._release(plan.refs())
        return failed
