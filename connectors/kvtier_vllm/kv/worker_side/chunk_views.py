"""A chunk's bytes seen two ways: as slices of its arena slot and as the pages of vLLM's KV
cache they copy to or from, per pool. These views are the worker's copy plans (one pair per run
of blocks, all layers at once where they sit at one stride), its fp8 codec for hidden states
(a step's chunks coded in one pass per pool), and its verification compare (the relative error
of a kept chunk against the KV vLLM computed in its place; a state's part by part)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvtier.client import ArenaMemory
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.kv.worker_side.pages import block_runs, page_dims
from kvtier_vllm.kv.worker_side.state_compare import StateCompare
from kvtier_vllm.layout import fp8
from kvtier_vllm.layout.fp8 import Fp8Layout
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.layout.states import StateShape


class ChunkViews:
    def __init__(self) -> None:
        self.plans: dict[str, PoolPlan] = {}
        self.pages: dict[str, list[torch.Tensor]] = {}
        """Per pool, each layer's cache as [blocks, page bytes] (`pages.pages_of`)."""
        self.dtypes: dict[str, torch.dtype] = {}
        """Each plan's KV dtype, to compare chunks in."""
        self.stacks: dict[str, torch.Tensor] = {}
        """Per pool whose layers sit at one stride: all of them as one view (`pages.stacked`)."""
        self.states: dict[str, StateCompare] = {}
        """Per state pool: its pages' parts, each compared in its own dtype."""
        self.arena: ArenaMemory | None = None
        """The arena mapped here, whose generations tell a slot still planned for."""

    def compares(self, plan: PoolPlan, dtype: torch.dtype, state: StateShape | None) -> None:
        """How chunks of ``plan`` are compared: in the cache's ``dtype``, or a state pool's
        page (``state``, which mixes dtypes) part by part."""
        if state is None:
            self.dtypes[plan.key] = dtype
        else:
            self.states[plan.key] = StateCompare(state)

    def coded(
        self, jobs: list[ChunkCopy], slots: torch.Tensor
    ) -> Iterator[tuple[str, PoolPlan, Fp8Layout, list[int]]]:
        """Per coded pool among ``jobs``: its key, plan, codec and the jobs (by index) whose
        slots are the ones planned for."""
        for key in sorted({job.plan for job in jobs}):
            plan = self.plans[key]
            assert plan.codec is not None
            mine = [i for i, job in enumerate(jobs) if job.plan == key]
            live = [i for i in mine if self.slot_current(jobs[i], plan, slots)]
            if live:
                yield key, plan, plan.codec, live

    def decode_loads(self, jobs: list[ChunkCopy], slots: torch.Tensor) -> list[bool]:
        """A step's loads of coded chunks (`PoolPlan.codec`): each chunk's rows gathered from
        its slot, then one decode per pool into the pages. Whether each was loaded."""
        loaded = [False] * len(jobs)
        for key, plan, codec, live in self.coded(jobs, slots):
            parts = []
            for i in live:
                job = jobs[i]
                values, scales = codec.split(slots[job.offset : job.offset + plan.chunk_bytes])
                at = slice(job.first_block, job.first_block + len(job.block_ids))
                parts.append((values[at], scales[at]))
                loaded[i] = True
            pages = self.pages[key][0]  # the hidden pool has one layer
            states = fp8.decode(
                torch.cat([v for v, _ in parts]).to(pages.device),
                torch.cat([c for _, c in parts]).to(pages.device),
                codec.page_shape,
                self.dtypes[key],
            )
            ids = torch.tensor([b for i in live for b in jobs[i].block_ids], device=pages.device)
            pages[ids] = states.reshape(len(ids), -1).view(torch.uint8)
        return loaded

    def encode_stores(self, jobs: list[ChunkCopy], slots: torch.Tensor) -> list[bool]:
        """A step's stores of coded chunks, encoded in one pass per pool (one gather, one
        encode: per chunk, the ops would cost more than their work), then each chunk's rows
        copied into its slot. Whether each was written."""
        written = [False] * len(jobs)
        for key, plan, codec, live in self.coded(jobs, slots):
            pages = self.pages[key][0]
            ids = torch.tensor([b for i in live for b in jobs[i].block_ids], device=pages.device)
            states = pages[ids].view(self.dtypes[key]).view(len(ids), *codec.page_shape)
            coded, scale = (t.cpu() for t in fp8.encode(states))
            row = 0
            for i in live:
                job, n = jobs[i], len(jobs[i].block_ids)
                values, scales = codec.split(slots[job.offset : job.offset + plan.chunk_bytes])
                at = slice(job.first_block, job.first_block + n)
                values[at], scales[at] = coded[row : row + n], scale[row : row + n]
                row += n
                written[i] = True
        return written

    def slot_current(self, job: ChunkCopy, plan: PoolPlan, slots: torch.Tensor) -> bool:
        """Whether the job's slot is the one planned for, in the arena mapped here (for a
        chunk read from lmdb, ``slots`` is that chunk)."""
        if job.key:
            return job.offset == 0 and slots.numel() == plan.chunk_bytes
        if not 0 <= job.offset <= slots.numel() - plan.chunk_bytes:
            return False  # a slot outside the mapping: an arena other than the one planned for
        mapped = self.arena
        # planned in another arena (a restarted daemon's, whose epoch differs) or reused
        # since: writing it would overwrite a chunk someone else holds
        return (
            mapped is not None
            and 0 <= job.slot < len(mapped.generation)
            and mapped.is_current(job.slot, job.generation)
        )

    def nbytes(self, job: ChunkCopy) -> int:
        """The bytes ``job`` moves on this rank (its part of a chunk); none for no plan."""
        plan = self.plans.get(job.plan)
        if plan is None:
            return 0
        blocks = sum(1 for b in job.block_ids if b)
        page = plan.page_bytes if plan.codec is None else plan.codec.page_bytes
        return page * len(plan.layer_names) * blocks

    def pairs(
        self, job: ChunkCopy, slots: torch.Tensor, per_layer: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(arena, pages) views of the job's chunk, all layers at once where they sit at one
        stride (unless ``per_layer``); None where the slot is not the one planned for."""
        plan = self.plans.get(job.plan)
        if plan is None or not self.slot_current(job, plan, slots):
            return None
        layers, bpc = len(plan.layer_names), plan.blocks_per_chunk
        # the slot as [layers, blocks of the chunk, page], as `PoolPlan.layer_offset` lays the
        # payload out; this rank's part of a page is its heads
        chunk = slots[job.offset : job.offset + plan.chunk_bytes]
        ours, whole, heads = page_dims(plan)
        chunk = chunk.view(layers, bpc, *whole)
        stack = None if per_layer else self.stacks.get(job.plan)
        pairs = []
        for index, block, n in block_runs(job.block_ids):
            part = chunk[:, job.first_block + index : job.first_block + index + n]
            part = part.narrow(2 + heads, plan.shard.first, plan.shard.count)
            if stack is not None:
                pairs.append((part, stack[:, block : block + n].view(layers, n, *ours)))
            else:
                pairs.extend(
                    (part[i], p[block : block + n].view(n, *ours))
                    for i, p in enumerate(self.pages[job.plan])
                )
        return pairs

    def compare(self, job: ChunkCopy, slots: torch.Tensor) -> float:
        """The chunk's largest relative error over its layers (the norm of the difference over
        the norm of vLLM's own KV); negative where the slot is not the one planned for."""
        pairs = self.pairs(job, slots, per_layer=True)
        if job.plan in self.states:
            return -1.0 if pairs is None else self.states[job.plan].error(pairs)
        dtype = self.dtypes.get(job.plan)
        if pairs is None or dtype is None:
            return -1.0
        layers = len(self.pages[job.plan])
        diff, norm = [0.0] * layers, [0.0] * layers
        for i, (arena, pages) in enumerate(pairs):
            kept = arena.to(pages.device).contiguous().view(dtype).float()
            computed = pages.contiguous().view(dtype).float()
            diff[i % layers] += float(torch.sum((kept - computed) ** 2))
            norm[i % layers] += float(torch.sum(computed**2))
        return max(
            (d / n) ** 0.5 if n else (0.0 if d == 0 else float("inf"))
            for d, n in zip(diff, norm, strict=True)
        )
