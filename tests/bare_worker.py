"""The connector's worker over a real arena, without vLLM: a target and a draft plan whose KV
pages are plain tensors (on the CPU or a GPU), and chunks to load into them."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from kvtier_vllm.kv.metadata import ChunkCopy, KVTierMetadata
from kvtier_vllm.kv.worker_side.pages import stacked
from kvtier_vllm.kv.worker_side.worker import KVTierWorker
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.settings import ConnectorConfig

from kvtier.core.keys import Pool
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import SlotRef
from kvtier.tiers.cpu import CpuTier
from tests.support import MiB, arena_config, draft_spec, keys_for, target_spec

LAYERS, BLOCKS, BLOCKS_PER_CHUNK, PAGE = 2, 16, 2, 4096
CHUNK = LAYERS * BLOCKS_PER_CHUNK * PAGE
POOLS = {
    "target": (Pool.TARGET, target_spec(), "model.layers.{}.self_attn.attn"),
    "draft": (Pool.DRAFT, draft_spec(), "draft_model.model.layers.{}.self_attn.attn"),
}


@dataclass
class BareWorker:
    worker: KVTierWorker
    tier: CpuTier
    pages: dict[str, torch.Tensor]
    """Per plan, its layers' pages: [layers, blocks, page bytes]."""
    namespaces: dict[str, bytes]
    arena_path: Path
    stored: int = 0

    def store(self, plan: str = "target") -> SlotRef:
        """A new chunk of ``plan`` committed in the arena, with bytes of its own."""
        (key,) = keys_for(self.namespaces[plan], 1, start=self.stored)
        self.stored += 1
        (ref,) = self.tier.reserve([key])
        assert ref is not None
        self.tier.view(ref)[:] = os.urandom(ref.nbytes)
        assert self.tier.commit([ref]) == 1
        return ref

    def rewrite(self, ref: SlotRef) -> SlotRef:
        """Evict the chunk at ``ref`` and store another in the slot it leaves."""
        assert self.tier.delete([ref.key]) == 1
        again = self.store(self.plan_of(ref))
        assert again.slot == ref.slot
        assert again.generation != ref.generation
        return again

    def plan_of(self, ref: SlotRef) -> str:
        return next(k for k, ns in self.namespaces.items() if ref.key.startswith(ns))

    def slot(self, ref: SlotRef) -> torch.Tensor:
        """The slot's bytes now, as a chunk lays them out: [layers, blocks, page bytes]."""
        data = torch.frombuffer(bytearray(self.tier.view(ref)), dtype=torch.uint8)
        return data.view(LAYERS, BLOCKS_PER_CHUNK, PAGE)

    def blocks(self, plan: str, block_ids: Sequence[int]) -> torch.Tensor:
        return self.pages[plan][:, list(block_ids)].cpu()

    def load(self, ref: SlotRef, block_ids: tuple[int, ...], request: str = "") -> ChunkCopy:
        plan = self.plan_of(ref)
        fill = "previous" if plan == "draft" else ""  # a fill is copied like any chunk
        return ChunkCopy(
            plan,
            ref.slot,
            ref.offset,
            ref.generation,
            block_ids,
            fill=fill,
            request=request,
            chunk=bytes(ref.key),
        )

    def meta(
        self, loads: list[ChunkCopy], receiving: Sequence[str] = (), block_errors: bool = False
    ) -> KVTierMetadata:
        return KVTierMetadata(
            str(self.arena_path), loads=loads, receiving=list(receiving), block_errors=block_errors
        )

    def finished_loads(self, timeout_s: float = 30.0) -> tuple[set[str], set[str]]:
        """The worker's first report of asynchronous loads finished (and failed), once its
        loading thread issued them: asked until one comes, for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            done, failed = self.worker.finished_loads()
            if done or failed or time.monotonic() > deadline:
                return done, failed
            time.sleep(0.01)

    def close(self) -> None:
        self.worker.shutdown()
        self.tier.close()


def bare_worker(shm_path: Path, device: torch.device) -> BareWorker:
    registry = PoolRegistry()
    tier = CpuTier(arena_config(shm_path, 16 * MiB, min_slot_bytes=4096), registry)
    worker = KVTierWorker(None, ConnectorConfig())
    pages, namespaces = {}, {}
    for key, (pool, spec, name) in POOLS.items():
        namespaces[key] = registry.register(spec, CHUNK).namespace
        buffer = torch.zeros((LAYERS, BLOCKS, PAGE), dtype=torch.uint8, device=device)
        names = tuple(name.format(i) for i in range(LAYERS))
        worker.plans[key] = PoolPlan(pool, names, PAGE, spec, BLOCKS_PER_CHUNK, key)
        worker.pages[key] = [buffer[i] for i in range(LAYERS)]
        stack = stacked(worker.pages[key])
        assert stack is not None
        worker.stacks[key] = stack
        pages[key] = buffer
    return BareWorker(worker, tier, pages, namespaces, shm_path)
