"""Hits leased in lmdb (`kvtier.core.protocol.in_lmdb`), read by the worker from lmdb's map.

An arena smaller than what the engines load at once would otherwise cap the hits held below it:
each one needs an arena slot to be promoted into before it loads. Here a chunk lmdb holds is
read, verified and decoded (for a coded lmdb) into a buffer of its own
(`kvtier_vllm.shared.lmdb_reads`), which the worker copies into vLLM's pages as it would an
arena slot. A chunk gone from lmdb or failing verification is a load error: vLLM recomputes it,
and nothing wrong is served; a corrupt one is reported to the tiers, which check it and drop it.
"""

from __future__ import annotations

import time

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.shared.lmdb_reads import LmdbReads, readable_lmdb

__all__ = ["LmdbStaging", "readable_lmdb"]


class LmdbStaging:
    """The worker's reads of chunks leased in lmdb."""

    def __init__(self) -> None:
        self.reads = LmdbReads()

    def read_ahead(self, path: str, jobs: list[ChunkCopy]) -> float:
        """A step's chunks read from disk at once, not one fault after another; returns the
        seconds it took (part of their loads)."""
        started = time.perf_counter()
        self.reads.read_ahead(path, [ChunkKey(job.key) for job in jobs])
        return time.perf_counter() - started

    def stage(self, path: str, job: ChunkCopy, nbytes: int) -> torch.Tensor | None:
        """The job's chunk, verified and decoded, as ``nbytes`` bytes of their own; None (a
        load error) where lmdb cannot be read here, no longer holds it, or it is corrupt."""
        chunk = torch.empty(nbytes, dtype=torch.uint8)
        return chunk if self.reads.read_into(path, ChunkKey(job.key), chunk.numpy().data) else None

    @property
    def failed(self) -> list[FailedChunk]:
        return self.reads.failed

    def take_failed(self) -> list[FailedChunk]:
        """The chunks found failing verification since the last call, to report."""
        return self.reads.take_failed()

    def close(self) -> None:
        """Give the reader back (the engine shuts down)."""
        self.reads.close()
