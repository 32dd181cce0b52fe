"""Stores: the chunks a step fills, reserved in the arena and committed once written.

The reservation must not hold up the step: it is asked for without waiting, while the forward
that fills the chunks runs, and its answer is read when the next step is planned. The workers
copy the chunks at the start of that next step (`KVTierWorker.copy_stores`), before anything
can write the blocks again: vLLM reuses a freed block only in a later forward, and zeroes fresh
ones only after that hook. A chunk is committed once every rank that writes a part of it has
reported it written; the commit goes with the next reservation. A part any rank failed to write
aborts the chunk, and so does a reservation no worker confirmed within a few steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KVTierError
from kvtier.keys import ChunkKey, Pool
from kvtier.protocol import Answer, SlotRef, TierClient
from kvtier_vllm.draft import DraftTracker
from kvtier_vllm.events import KVEventFeed
from kvtier_vllm.layout import PoolPlan
from kvtier_vllm.metadata import ChunkCopy, KVTierMetadata
from kvtier_vllm.planner import keys_in, targets_of
from kvtier_vllm.stats import KVTierStats
from kvtier_vllm.unreturned import Return, Unreturned

log = logging.getLogger(__name__)

STORE_STEPS = 8  # a reservation no worker confirmed by then is given back


@dataclass
class _PendingStore:
    """A reserved slot the workers are writing: committed once ``waiting`` parts arrived."""

    ref: SlotRef
    step: int
    waiting: int


@dataclass
class _Chunk:
    """A full chunk asked for: where vLLM holds it, and what its KV event says."""

    index: int
    blocks: tuple[int, ...]
    event: tuple[list[bytes], bytes | None, list[int]] | None
    """The anchor plan's: (block hashes, parent hash, tokens)."""


@dataclass
class _Asked:
    """One reservation on its way: a run of one request's chunks in one plan."""

    answer: Answer[tuple[int, list[SlotRef | None]]]
    plan: PoolPlan
    keys: list[ChunkKey]
    chunks: list[_Chunk]
    commits: list[SlotRef] = field(default_factory=list)
    """Written slots committed by the same call."""
    draft_namespace: bytes | None = None
    """The draft's namespace when it was asked: a swap since voids a draft run."""


class Stores:
    """Reservations over ``client`` for every plan with a namespace (``namespaces``, read at
    each call), and their commits. The anchor plan's chunks stand for their blocks in KV events.
    A commit or abort that fails is kept in ``unreturned`` and reported to ``on_error``."""

    def __init__(
        self,
        client: TierClient,
        plans: Sequence[PoolPlan],
        namespaces: dict[str, bytes],
        events: KVEventFeed,
        unreturned: Unreturned,
        on_error: Callable[[str, KVTierError], None],
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
        self.unreturned = unreturned
        self.on_error = on_error
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.checkpoint = checkpoint
        self.draft = draft
        targets = targets_of(plans)
        self.anchor = targets[0] if targets else None
        self._asked: list[_Asked] = []
        self._pending: dict[tuple[int, int], _PendingStore] = {}
        self._written: list[SlotRef] = []
        """Slots every writer reported: committed with the next call."""
        self._committing: list[_Asked] = []
        """Commits sent alone (`flush`) not answered yet."""

    @property
    def busy(self) -> bool:
        """Whether a step would move a store on: answers to hand out, or commits to send."""
        return bool(self._asked or self._written)

    def storing(self, key: ChunkKey) -> bool:
        """Whether ``key`` is on its way into the arena from this engine: a lookup finds it
        soon, where it would find nothing now."""
        self._settle()
        calls = self._asked + self._committing
        return (
            any(key in a.keys or any(r.key == key for r in a.commits) for a in calls)
            or any(p.ref.key == key for p in self._pending.values())
            or any(r.key == key for r in self._written)
        )

    def _settle(self) -> None:
        """Read the answers to commits sent alone: a failed one is tried again later."""
        waiting = []
        for call in self._committing:
            if not call.answer.done():
                waiting.append(call)
                continue
            try:
                call.answer.result()
            except KVTierError as exc:
                self._failed_call(call.commits, exc)
        self._committing = waiting

    def reserve(
        self,
        request: Any,
        block_ids: list[list[int]],
        chunks: range,
        end: int,
        local_hit: int,
        stats: KVTierStats,
    ) -> None:
        """Ask for the request's newly full ``chunks`` in every plan that keeps them (a hit
        ending at chunk ``end`` reads them), without waiting: `hand_out` gives them to the
        workers. ``local_hit``: tokens vLLM's own prefix cache held when the request was first
        scheduled."""
        bpc = self.blocks_per_chunk
        for plan in self.plans:
            if plan.key not in self.namespaces:
                continue
            span = [c for c in chunks if plan.keeps(c, end, self.checkpoint, self.chunk_tokens)]
            if len(span) < len(chunks):
                stats.window_skipped(str(plan.pool), (len(chunks) - len(span)) * plan.chunk_bytes)
            draft_namespace = None
            if plan.pool is Pool.DRAFT and self.draft is not None:
                if not self.draft.active:
                    continue  # the draft's weights may be in flux: its KV is no revision's
                if self.draft.local_cache_stale:
                    # vLLM's own cache may hold an older revision's draft KV: never store it
                    local = -(-local_hit // self.chunk_tokens)
                    span = [c for c in span if c >= local]
                draft_namespace = self.namespaces[plan.key]
            ids = block_ids[plan.group]
            # blocks vLLM already let go of (null) cannot be stored
            span_blocks = {c: tuple(ids[c * bpc : (c + 1) * bpc]) for c in span}
            storable = [c for c in span if all(span_blocks[c])]
            if not storable:
                continue
            keys = keys_in(self.namespaces[plan.key], request.block_hashes, storable, bpc)
            run = [
                _Chunk(c, span_blocks[c], self._event(request, c) if plan is self.anchor else None)
                for c in storable
            ]
            commits, self._written = self._written, []
            try:
                answer = self.client.reserve_async(keys, commit=commits)
            except KVTierError as exc:
                self._failed_call(commits, exc)
                return
            self._asked.append(_Asked(answer, plan, keys, run, commits, draft_namespace))

    def _event(self, request: Any, chunk: int) -> tuple[list[bytes], bytes | None, list[int]]:
        bpc = self.blocks_per_chunk
        hashes = list(request.block_hashes[chunk * bpc : (chunk + 1) * bpc])
        parent = request.block_hashes[chunk * bpc - 1] if chunk else None
        tokens = request.all_token_ids[chunk * self.chunk_tokens : (chunk + 1) * self.chunk_tokens]
        return hashes, parent, list(tokens)

    def hand_out(self, meta: KVTierMetadata, step: int) -> None:
        """The copies of every reservation asked for before this step, into ``meta``; waits
        for an answer still on its way (the client's deadline bounds it)."""
        self._settle()
        asked, self._asked = self._asked, []
        for call in asked:
            try:
                _, refs = call.answer.result()
            except KVTierError as exc:
                self._failed_call(call.commits, exc)
                continue
            voided = (
                call.draft_namespace is not None
                and self.namespaces.get(call.plan.key) != call.draft_namespace
            )
            granted = [(c, r) for c, r in zip(call.chunks, refs, strict=True) if r is not None]
            if voided:  # the draft swapped since: its KV in these blocks is no revision's now
                self._abort([r for _, r in granted])
                continue
            for chunk, ref in granted:
                handle = (ref.slot, ref.generation)
                if chunk.event is not None:
                    self.events.store_planned(handle, ref.key, *chunk.event)
                meta.stores.append(
                    ChunkCopy(call.plan.key, ref.slot, ref.offset, ref.generation, chunk.blocks)
                )
                self._pending[handle] = _PendingStore(ref, step, call.plan.shard.writers)

    def flush(self) -> None:
        """Send the commits no reservation of this step took along."""
        if not self._written:
            return
        commits, self._written = self._written, []
        try:
            answer = self.client.reserve_async([], commit=commits)
        except KVTierError as exc:
            self._failed_call(commits, exc)
            return
        self._committing.append(_Asked(answer, self.plans[0], [], [], commits))

    def expire(self, step: int) -> None:
        """Abort what no worker confirmed within `STORE_STEPS` steps."""
        stale = [h for h, s in self._pending.items() if step - s.step > STORE_STEPS]
        if stale:
            for handle in stale:
                self.events.store_dropped(handle)
            self._abort([self._pending.pop(h).ref for h in stale])

    def reported(
        self, stored: Iterable[tuple[int, int]], failed: Iterable[tuple[int, int]]
    ) -> None:
        """The workers' reports: the chunks every writing rank wrote are committed with the next
        call, the ones any rank failed to write are aborted."""
        failed = list(failed)
        # a part any rank failed to write spoils the chunk, whatever the others wrote
        spoiled = [self._pending.pop(h).ref for h in failed if h in self._pending]
        for handle in failed:
            self.events.store_dropped(handle)
        for handle in stored:
            pending = self._pending.get(handle)
            if pending is None:
                continue
            pending.waiting -= 1
            if pending.waiting <= 0:  # every rank that writes a part has written it
                self._written.append(self._pending.pop(handle).ref)
                self.events.store_done(handle)
        self._abort(spoiled)

    def _failed_call(self, commits: list[SlotRef], exc: KVTierError) -> None:
        """A reservation that failed: its commits are tried again, its chunks not stored."""
        self.unreturned.keep(Return.COMMIT, commits)
        self.on_error("reserve", exc)

    def abort_all(self) -> None:
        """At shutdown: commit what was written, give back every other reservation."""
        asked, self._asked = self._asked, []
        granted: list[SlotRef] = []
        for call in asked:
            try:
                _, refs = call.answer.result()
            except KVTierError as exc:
                self._failed_call(call.commits, exc)
                continue
            granted.extend(r for r in refs if r is not None)
        written, self._written = self._written, []
        if written:
            try:
                self.client.commit(written)
            except KVTierError as exc:
                self.unreturned.keep(Return.COMMIT, written)
                self.on_error("commit", exc)
        self._abort(granted + [pending.ref for pending in self._pending.values()])
        self._pending.clear()

    def _abort(self, refs: list[SlotRef]) -> None:
        if not refs:
            return
        try:
            self.client.abort(refs)
        except KVTierError as exc:
            self.unreturned.keep(Return.ABORT, refs)
            self.on_error("abort", exc)
