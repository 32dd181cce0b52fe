"""Loads vLLM granted, until the step whose metadata carries their copies to the workers; and the
scheduler's side of a failed step: loads it could not plan are reported as load errors (a
request waiting for an asynchronous load: failed), never left as if their blocks held the
prefix, and their leases go back."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kvtier.core.protocol import SlotRef
from kvtier_vllm.drafts.swaps import Fill
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.metadata import KVTierMetadata
from kvtier_vllm.kv.scheduler_side.load_backlog import LoadBacklog
from kvtier_vllm.kv.scheduler_side.load_waits import LoadWaits
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.requests import RequestState
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.layout.plans import PoolPlan

log = logging.getLogger(__name__)


class PendingLoads:
    """Granted loads: a synchronous one waits for its request's first scheduled step, an
    asynchronous one goes out with the next step's metadata (``queued``); which one a request's
    is, its state says (``load_async``)."""

    def __init__(
        self,
        calls: TierCalls,
        by_key: Mapping[str, PoolPlan],
        *,
        block_size: int,
        blocks_per_chunk: int,
        block_errors: bool = False,
    ) -> None:
        self.calls = calls
        self.by_key = by_key
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_errors = block_errors
        """One KV-cache group: an asynchronous load fails per block, not per request."""
        self.queued = KVTierMetadata()
        """Asynchronous loads planned since the last step, for the next step's metadata."""
        self._queued_leases: list[SlotRef] = []
        self._ready: dict[str, LoadPlan] = {}
        self.waits = LoadWaits()
        """How long each request waited for its first load, into the stats."""
        self.backlog = LoadBacklog()
        """The asynchronous loads out, which a load granted now queues behind."""

    def grant(
        self,
        state: RequestState,
        plan: LoadPlan,
        blocks: Any,
        stats: KVTierStats,
        expected_s: float | None = None,
    ) -> None:
        """vLLM allocated ``blocks`` for the load of ``plan``, expected to take ``expected_s``
        (None: not measured)."""
        state.hit = plan
        if not state.load_async:
            self._ready[state.request.request_id] = plan
            return
        # the request waits for this load; its blocks are known now, the copies go out with
        # the next step's metadata and the workers report the request done or failed
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._queued_leases.extend(self.add_copies(self.queued, state, plan, stats))
        self.queued.receiving.append(state.request.request_id)
        self.queued.block_errors = self.block_errors
        self.waits.waiting(state)
        self.backlog.granted(state.request.request_id, expected_s)

    def take_queued(self) -> KVTierMetadata:
        """The next step's metadata, with the asynchronous loads queued for it."""
        meta, self.queued = self.queued, KVTierMetadata()
        return meta

    def take_queued_leases(self) -> list[SlotRef]:
        leases, self._queued_leases = self._queued_leases, []
        return leases

    def take_ready(self, req_id: str) -> LoadPlan | None:
        """The synchronous load granted to a request scheduled now, if any."""
        return self._ready.pop(req_id, None)

    def add_copies(
        self, meta: KVTierMetadata, state: RequestState, plan: LoadPlan, stats: KVTierStats
    ) -> list[SlotRef]:
        """The copies of a granted load into the request's blocks; returns its leases, to give
        back once the workers copied them."""
        plan.add_copies(
            meta,
            state.block_ids,
            self.by_key,
            skip=plan.computed // self.block_size,
            request=state.request.request_id if state.load_async else "",
            chunk_tokens=self.block_size * self.blocks_per_chunk,
            blocks_per_chunk=self.blocks_per_chunk,
        )
        state.fill = plan.fill
        if plan.fill is not Fill.NONE and plan.chunks:
            stats.fill(plan.fill, plan.chunks)
        state.stored_chunks = max(state.stored_chunks, plan.end)
        if not state.load_async:
            self.waits.handed_out(state, stats)
        return plan.refs()

    def reported(
        self,
        requests: Mapping[str, RequestState],
        finished: Iterable[str],
        failed: Iterable[str],
        stats: KVTierStats,
    ) -> None:
        """The workers finished these asynchronous loads, ``failed`` among them: those
        requests are recomputed without kvtier."""
        failed = set(failed)
        for req_id in failed:
            if (state := requests.get(req_id)) is not None:
                log.warning("kvtier: the load of request %s failed; vLLM recomputes it", req_id)
                state.load_failed = True
        finished = set(finished)
        self.waits.reported(finished - failed, failed, stats)
        self.backlog.landed(finished | failed)

    def forget(self, req_id: str) -> None:
        """The request finished: a load granted and not copied gives its leases back."""
        plan = self._ready.pop(req_id, None)
        if plan is not None:
            self.calls.release(plan.refs())
        self.waits.forget(req_id)
        self.backlog.landed([req_id])

    def abandon_load(
        self, req_id: str, state: RequestState | None, blocks: Any, num_external_tokens: int
    ) -> None:
        """Planning a granted load failed: the blocks vLLM allocated for it are reported as
        load errors (a request waiting for an asynchronous load: failed), never left as if
        they held the prefix."""
        self._ready.pop(req_id, None)
        local = state.local_hit if state is not None else 0
        first = local // self.block_size
        end = (local + num_external_tokens + self.block_size - 1) // self.block_size
        if state is None or state.load_async:
            self.queued.failed_requests.append(req_id)
            return
        for ids in blocks.get_block_ids():
            self.queued.invalid_blocks.extend(b for b in ids[first:end] if b)

    def abandon_step(
        self, scheduler_output: Any, requests: Mapping[str, RequestState], arena_path: str
    ) -> KVTierMetadata:
        """The metadata of a step whose planning failed: every load granted for it is
        reported failed, and nothing is stored."""
        meta = self.take_queued()
        failed = KVTierMetadata(
            arena_path=arena_path,
            invalid_blocks=meta.invalid_blocks,
            failed_requests=meta.failed_requests + meta.receiving,
            sending=meta.sending,  # their tails are not stored: their blocks may go
        )
        self.calls.release(self.take_queued_leases())
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._ready.pop(new.req_id, None)
            state = requests.get(new.req_id)
            if plan is None or state is None:
                continue
            first = plan.computed // self.block_size
            end = plan.end * self.blocks_per_chunk
            for ids in new.block_ids:
                failed.invalid_blocks.extend(b for b in ids[first:end] if b)
            self.calls.release(plan.refs())
        return failed
