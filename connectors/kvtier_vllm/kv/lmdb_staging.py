"""Hits leased in lmdb (`kvtier.core.protocol.in_lmdb`), read by the worker from lmdb's map.

An arena smaller than what the engines load at once would otherwise cap the hits held below it:
each one needs an arena slot to be promoted into before it loads. Here a chunk lmdb holds is
verified and copied into vLLM's pages as an arena slot would be, by one of two paths:

- copies done when issued (the CPU): a chunk stored as it is is verified in place in lmdb's map,
  within read transactions held for the step's loads (`LmdbStaging.holding`), and the pages are
  copied from the map itself; the bytes verified are the bytes copied, with no copy between;
- copies that land later (a device), or a coded lmdb: the chunk is verified and decoded into a
  staging buffer, reused once the copies from it landed, pinned for CUDA's (DMA reads only
  pinned memory), and the pages are copied from it.

A chunk gone from lmdb or failing verification is a load error: nothing of it is copied, vLLM
recomputes it, and a corrupt one is reported to the tiers, which check it and drop it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.shared.copies import CpuCopies, Fence
from kvtier_vllm.shared.lmdb_reads import LmdbReads, readable_lmdb

__all__ = ["LmdbStaging", "StagingBuffers", "readable_lmdb"]

KEPT_BUFFERS = 64
"""Free staging buffers kept per chunk size and kind; more are allocated while more chunks are
in flight, and dropped as they come back."""


class StagingBuffers:
    """Host buffers for chunks whose copies land after they were issued: taken per chunk,
    reused once the copies issued from them landed (`landing`)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._taken: list[tuple[torch.Tensor, bool]] = []
        self._landing: list[tuple[Fence, list[tuple[torch.Tensor, bool]]]] = []
        self.allocated = 0
        """Buffers allocated so far: each a chunk staged while none was free."""

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A buffer of ``nbytes``, pinned (page-locked, for CUDA's copies) with ``pinned``."""
        self._reclaim()
        free = self._free.get((nbytes, pinned))
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.allocated += 1
        self._taken.append((buffer, pinned))
        return buffer

    def untake(self) -> None:
        """The buffer taken last holds nothing to copy: free again."""
        self._keep(*self._taken.pop())

    def landing(self, fence: Fence) -> None:
        """The buffers taken since the last call are read by copies landed at ``fence``."""
        if self._taken:
            self._landing.append((fence, self._taken))
            self._taken = []

    def _reclaim(self) -> None:
        waiting = []
        for fence, buffers in self._landing:
            if fence():
                for buffer, pinned in buffers:
                    self._keep(buffer, pinned)
            else:
                waiting.append((fence, buffers))
        self._landing = waiting

    def _keep(self, buffer: torch.Tensor, pinned: bool) -> None:
        free = self._free.setdefault((buffer.numel(), pinned), [])
        if len(free) < KEPT_BUFFERS:
            free.append(buffer)


def _over_map(view: memoryview) -> torch.Tensor:
    """A tensor over lmdb's map (read-only, which torch tensors cannot say: this one is only
    read, by a copy that ends before the read transaction does)."""
    address = np.frombuffer(view, np.uint8).ctypes.data
    return torch.frombuffer((ctypes.c_ubyte * len(view)).from_address(address), dtype=torch.uint8)


class LmdbStaging:
    """The worker's reads of chunks leased in lmdb."""

    def __init__(self) -> None:
        self.reads = LmdbReads()
        self.buffers = StagingBuffers()

    def read_ahead(self, path: str, jobs: list[ChunkCopy]) -> float:
        """A step's chunks read from disk at once, not one fault after another; returns the
        seconds it took (part of their loads)."""
        started = time.perf_counter()
        self.reads.read_ahead(path, [ChunkKey(job.key) for job in jobs])
        return time.perf_counter() - started

    @contextmanager
    def holding(self, copies: CpuCopies) -> Iterator[None]:
        """A step's loads, copied by ``copies``: chunks staged in place in this block are read
        in read transactions held `kvtier_vllm.shared.lmdb_reads.HOLD_S` at most each, the
        last ended with the block; staging buffers taken in it are reused once the copies
        issued in it landed."""
        try:
            with self.reads.holding():
                yield
        finally:
            self.buffers.landing(copies.fence())

    def stage(
        self, path: str, job: ChunkCopy, nbytes: int, copies: CpuCopies | None = None
    ) -> torch.Tensor | None:
        """The job's chunk, verified and decoded, as ``nbytes`` bytes for ``copies`` to copy
        into the pages: where they are done once issued and lmdb stores the chunk as it is,
        lmdb's map itself (within `holding`; copy it before the next stage or the block's
        end); with other ``copies``, a staging buffer, reused once the copies issued in
        `holding` landed; with none, a buffer of its own. None (a load error) where lmdb
        cannot be read here, no longer holds it, or it is corrupt."""
        staged: list[torch.Tensor] = []

        def buffer() -> memoryview:
            if copies is None:
                staged.append(torch.empty(nbytes, dtype=torch.uint8))
            else:
                staged.append(self.buffers.take(nbytes, copies.device.type == "cuda"))
            return staged[0].numpy().data

        in_place = copies is not None and copies.immediate
        view = self.reads.read(path, ChunkKey(job.key), nbytes, buffer, in_place)
        if view is None:
            if staged and copies is not None:
                self.buffers.untake()
            return None
        return staged[0] if staged else _over_map(view)

    @property
    def failed(self) -> list[FailedChunk]:
        return self.reads.failed

    def take_failed(self) -> list[FailedChunk]:
        """The chunks found failing verification since the last call, to report."""
        return self.reads.take_failed()

    def close(self) -> None:
        """Give the reader back (the engine shuts down)."""
        self.reads.close()
