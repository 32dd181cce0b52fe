"""Stores: the chunks a step fills, reserved in the arena and committed once written.

A chunk is reserved per plan once it is full (every chunk a step fills, in one call), copied by
the workers after the forward, and committed once every rank that writes a part of it has
reported it written. A part any rank failed to write aborts the chunk, and so does a reservation
no worker confirmed within a few steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.lineage import BlockLineage, lineage_of
from kvtier.core.protocol import SlotRef, TierClient
from kvtier_vllm.drafts.swaps import DraftTracker
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.metadata import ChunkCopy, KVTierMetadata
from kvtier_vllm.kv.scheduler_side.events import KVEventFeed
from kvtier_vllm.kv.scheduler_side.prompt_keys import keys_in, targets_of
from kvtier_vllm.kv.scheduler_side.slot_stock import SlotStock
from kvtier_vllm.kv.scheduler_side.store_asks import StoreAsks
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.layout.plans import PoolPlan

log = logging.getLogger(__name__)

STORE_STEPS = 8  # a reservation no worker confirmed by then is given back


@dataclass
class _PendingStore:
    """A reserved slot the workers are writing: committed once ``waiting`` parts arrived."""

    ref: SlotRef
    step: int
    waiting: int
    lineage: bytes = b""
    """Encoded, for a chunk of the anchor plan: sent with its commit, for routers."""


@dataclass
class _Wanted:
    """A full chunk of a request to reserve with the step's others."""

    plan: PoolPlan
    request: Any
    chunk: int
    blocks: tuple[int, ...]


class Stores:
    """Reservations over ``client`` for every plan with a namespace (``namespaces``, read at
    each call), and their commits. The anchor plan's chunks stand for their blocks in KV events.
    A call that fails is reported to ``calls``, which commits or aborts later what it could not."""

    def __init__(
        self,
        client: TierClient,
        plans: Sequence[PoolPlan],
        namespaces: dict[str, bytes],
        events: KVEventFeed,
        calls: TierCalls,
        *,
        chunk_tokens: int,
        blocks_per_chunk: int,
        checkpoint: int = 0,
        draft: DraftTracker | None = None,
    ) -> None:
        self.client = client
        self.plans = list(plans)
        self.namespaces = namespaces
        self.events = events
        self.calls = calls
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.checkpoint = checkpoint
        self.draft = draft
        targets = targets_of(plans)
        self.anchor = targets[0] if targets else None
        self._pending: dict[tuple[int, int], _PendingStore] = {}
        self._wanted: dict[ChunkKey, _Wanted] = {}
        self.stock = SlotStock(client, calls)
        self.asks: StoreAsks[_Wanted] = StoreAsks(client, calls)

    def want(
        self,
        request: Any,
        block_ids: list[list[int]],
        chunks: range,
        end: int,
        local_hit: int,
        stats: KVTierStats,
    ) -> None:
        """The request's newly full ``chunks``, in every plan that keeps them (a hit ending at
        chunk ``end`` reads them), to reserve with the step's others (`reserve`).
        ``local_hit``: tokens vLLM's own prefix cache held when the request was first
        scheduled."""
        bpc = self.blocks_per_chunk
        for plan in self.plans:
            if plan.key not in self.namespaces:
                continue
            span = [c for c in chunks if plan.keeps(c, end, self.checkpoint, self.chunk_tokens)]
            if len(span) < len(chunks):
                stats.window_skipped(str(plan.pool), (len(chunks) - len(span)) * plan.chunk_bytes)
            if plan.pool is Pool.DRAFT and self.draft is not None:
                if not self.draft.active:
                    continue  # the draft's weights may be in flux: its KV is no revision's
                if self.draft.local_cache_stale:
                    # vLLM's own cache may hold an older revision's draft KV: never store it
                    local = -(-local_hit // self.chunk_tokens)
                    span = [c for c in span if c >= local]
            ids = block_ids[plan.group]
            # blocks vLLM already let go of (null) cannot be stored
            span_blocks = {c: tuple(ids[c * bpc : (c + 1) * bpc]) for c in span}
            storable = [c for c in span if all(span_blocks[c])]
            keys = keys_in(self.namespaces[plan.key], request.block_hashes, storable, bpc)
            for chunk, key in zip(storable, keys, strict=True):
                if key not in self._wanted:  # two requests computing one prefix store it once
                    self._wanted[key] = _Wanted(plan, request, chunk, span_blocks[chunk])

    def reserve(self, meta: KVTierMetadata, step: int, wait_s: float = 0.0) -> None:
        """Add to ``meta`` the copies of what the step's requests want that the stock holds a
        slot for, and ask for the rest without waiting (`StoreAsks`; where that cannot be done,
        reserve it in one call); then add the copies of what was asked for and is answered by
        now, waiting up to ``wait_s`` for it."""
        wanted, self._wanted = self._wanted, {}
        self.stock.collect()
        taken: dict[ChunkKey, SlotRef | None] = {}
        for key in wanted:
            if self.stock.off or not self._in_arena(key):  # no held slot for a stored chunk
                taken[key] = self.stock.take(key)
        self.stock.step(taken)
        asked = {key: wanted[key] for key, ref in taken.items() if ref is None}
        if asked and not self.asks.ask(asked):
            try:
                taken.update(zip(asked, self.client.reserve(list(asked)), strict=True))
            except KVTierError as exc:
                self.calls.failed("reserve", exc)
        for key, ref in taken.items():
            if ref is not None:  # None: asked for, present already, or no room right now
                self._queue_wanted(meta, ref, wanted[key], step)
        for ref, store in self.asks.answered(wait_s):
            self._queue_wanted(meta, ref, store, step)

    def _queue_wanted(self, meta: KVTierMetadata, ref: SlotRef, store: _Wanted, step: int) -> None:
        plan, request, chunk = store.plan, store.request, store.chunk
        lineage = self._lineage(request, chunk) if plan is self.anchor else None
        if lineage is not None and self.events.enabled:
            self.events.store_planned(
                (ref.slot, ref.generation),
                ref.key,
                list(lineage.block_hashes),
                lineage.parent,
                list(lineage.token_ids),
            )
        self._queue(meta, plan, ref, store.blocks, step, lineage)

    def _in_arena(self, key: ChunkKey) -> bool:
        """Whether the arena's index holds ``key`` (a hint: no slot is taken for it)."""
        return bool(self.client.in_arena([key]))

    def reserve_one(
        self,
        meta: KVTierMetadata,
        plan: PoolPlan,
        key: ChunkKey,
        blocks: tuple[int, ...],
        step: int,
    ) -> bool:
        """Reserve one chunk named by the caller, written from ``blocks`` (its first ones, where
        it has fewer tokens); whether its copy was added to ``meta`` (False: present already,
        no room, or the call failed)."""
        try:
            ref = self.client.reserve([key])[0]
        except KVTierError as exc:
            self.calls.failed("reserve", exc)
            return False
        if ref is not None:
            self._queue(meta, plan, ref, blocks, step)
        return ref is not None

    def _queue(
        self,
        meta: KVTierMetadata,
        plan: PoolPlan,
        ref: SlotRef,
        blocks: tuple[int, ...],
        step: int,
        lineage: BlockLineage | None = None,
    ) -> None:
        meta.stores.append(ChunkCopy(plan.key, ref.slot, ref.offset, ref.generation, blocks))
        encoded = lineage.encode() if lineage is not None else b""
        self._pending[(ref.slot, ref.generation)] = _PendingStore(
            ref, step, plan.shard.writers, encoded
        )

    def _lineage(self, request: Any, chunk: int) -> BlockLineage:
        tokens = request.all_token_ids[chunk * self.chunk_tokens : (chunk + 1) * self.chunk_tokens]
        return lineage_of(
            request.block_hashes,
            chunk,
            self.blocks_per_chunk,
            tokens,
            self.chunk_tokens // self.blocks_per_chunk,
        )

    def expire(self, step: int) -> None:
        """Abort what no worker confirmed within `STORE_STEPS` steps."""
        stale = [h for h, s in self._pending.items() if step - s.step > STORE_STEPS]
        if stale:
            for handle in stale:
                self.events.store_dropped(handle)
            self.calls.abort([self._pending.pop(h).ref for h in stale])

    def reported(
        self, stored: Iterable[tuple[int, int]], failed: Iterable[tuple[int, int]]
    ) -> None:
        """The workers' reports: commit the chunks every writing rank wrote, abort the ones any
        rank failed to write."""
        failed = list(failed)
        # a part any rank failed to write spoils the chunk, whatever the others wrote
        spoiled = [self._pending.pop(h).ref for h in failed if h in self._pending]
        for handle in failed:
            self.events.store_dropped(handle)
        done: list[SlotRef] = []
        lineages: list[bytes] = []
        for handle in stored:
            pending = self._pending.get(handle)
            if pending is None:
                continue
            pending.waiting -= 1
            if pending.waiting <= 0:  # every rank that writes a part has written it
                del self._pending[handle]
                done.append(pending.ref)
                lineages.append(pending.lineage)
                self.events.store_done(handle)
        self.calls.settle_behind(done, lineages if any(lineages) else (), abort=spoiled)

    def abort_all(self) -> None:
        self.calls.abort([pending.ref for pending in self._pending.values()])
        self.stock.give_back()
        self.asks.give_back()
