"""The connector's worker side: copies between vLLM's KV blocks and arena slots.

The worker maps the arena by path. Loads run in ``start_load_kv`` before the forward; stores run
in ``wait_for_save``, after the forward (and the draft's) wrote the blocks. A load copied from a
slot that was reused meanwhile (its generation moved) is reported as a load error, so vLLM
recomputes those blocks instead of using them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.client import ArenaMemory
from kvtier.errors import KVTierError
from kvtier_vllm.config import ConnectorConfig
from kvtier_vllm.layout import PoolPlan, plan_pools
from kvtier_vllm.metadata import ChunkCopy, KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.stats import KVTierStats

log = logging.getLogger(__name__)


def _pages(tensor: torch.Tensor) -> torch.Tensor:
    """A layer's cache as [blocks, page bytes]; blocks are dim 0 in every layout vLLM hands out
    to connectors on the CPU, and each block's page is contiguous there."""
    return tensor.view(tensor.shape[0], -1).view(torch.uint8)


class KVTierWorker:
    def __init__(self, vllm_config: Any, cfg: ConnectorConfig) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.plans: dict[str, PoolPlan] = {}
        self.pages: dict[str, list[torch.Tensor]] = {}
        self._arena: ArenaMemory | None = None
        self._arena_bytes: torch.Tensor | None = None
        self._arena_inode = 0
        self._stored: list[tuple[int, int]] = []
        self._failed: list[tuple[int, int]] = []
        self._load_errors: set[int] = set()
        self.stats = KVTierStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for plan in plan_pools(self.vllm_config, kv_caches, self.cfg):
            pages = [_pages(kv_caches[name]) for name in plan.layer_names]
            actual = {p.shape[1] for p in pages}
            if actual != {plan.page_bytes}:
                log.error(
                    "kvtier: %s pool pages are %s bytes, expected %d; not offloading this pool",
                    plan.pool,
                    sorted(actual),
                    plan.page_bytes,
                )
                continue
            self.plans[str(plan.pool)] = plan
            self.pages[str(plan.pool)] = pages

    def _slots(self, arena_path: str) -> torch.Tensor | None:
        """The arena as bytes; mapped again when the file at the path is a new one (a restarted
        daemon), so nothing is ever copied into an arena nobody reads."""
        try:
            inode = os.stat(arena_path).st_ino
        except OSError:
            return None
        if self._arena is None or self._arena_inode != inode:
            self.shutdown()
            try:
                self._arena = ArenaMemory.attach(Path(arena_path))
            except KVTierError as exc:
                log.error("kvtier: cannot map the arena at %s: %s", arena_path, exc)
                return None
            self._arena_inode = inode
            self._arena_bytes = torch.frombuffer(
                self._arena.view(0, self._arena.size), dtype=torch.uint8
            )
        return self._arena_bytes

    def _copy(self, job: ChunkCopy, slots: torch.Tensor, into_arena: bool) -> bool:
        plan = self.plans.get(job.pool)
        if plan is None:
            return False
        for layer, pages in enumerate(self.pages[job.pool]):
            for i, block in enumerate(job.block_ids):
                start = job.offset + plan.layer_offset(layer, job.first_block + i)
                slot = slots[start : start + plan.page_bytes]
                if into_arena:
                    slot.copy_(pages[block])
                else:
                    pages[block].copy_(slot)
        return True

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        if not meta.loads and not meta.zero:
            return
        slots = self._slots(meta.arena_path)
        if slots is None or self._arena is None:
            for job in meta.loads:
                self._load_errors.update(job.block_ids)
            return
        for job in meta.loads:
            started = time.perf_counter()
            copied = self._copy(job, slots, into_arena=False)
            ok = copied and self._arena.is_current(job.slot, job.generation)
            if not ok:
                self._load_errors.update(job.block_ids)
            self._record("load", job, started, ok)
        for pool, blocks in meta.zero.items():
            for pages in self.pages.get(pool, []):
                pages[blocks] = 0

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if not meta.stores:
            return
        slots = self._slots(meta.arena_path)
        if slots is None:
            self._failed.extend((job.slot, job.generation) for job in meta.stores)
            return
        for job in meta.stores:
            started = time.perf_counter()
            ok = self._copy(job, slots, into_arena=True)
            (self._stored if ok else self._failed).append((job.slot, job.generation))
            self._record("store", job, started, ok)

    def _record(self, direction: str, job: ChunkCopy, started: float, ok: bool) -> None:
        plan = self.plans.get(job.pool)
        nbytes = plan.page_bytes * len(plan.layer_names) * len(job.block_ids) if plan else 0
        self.stats.record(direction, job.pool, nbytes, time.perf_counter() - started, ok)

    def take_stats(self) -> KVTierStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVTierStats()
        return stats

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KVTierWorkerMetadata | None:
        if not self._stored and not self._failed:
            return None
        meta = KVTierWorkerMetadata(self._stored, self._failed)
        self._stored, self._failed = [], []
        return meta

    def shutdown(self) -> None:
        self._arena_bytes = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
