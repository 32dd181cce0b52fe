"""Hits leased in lmdb (`kvtier.core.protocol.in_lmdb`), read by the worker from lmdb's map.

An arena smaller than what the engines load at once would otherwise cap the hits held below it:
each one needs an arena slot to be promoted into before it loads. Here a chunk lmdb holds is
read, verified and decoded (for a coded lmdb) into a buffer of its own, which the worker copies
into vLLM's pages as it would an arena slot. A chunk gone from lmdb or failing verification is a
load error: vLLM recomputes it, and nothing wrong is served; a corrupt one is reported to the
tiers (`kvtier.core.protocol.TierClient.report_failed`), which check it and drop it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvtier.client import LmdbReader, failure_of, reader_at, release_reader
from kvtier.core.errors import TierUnavailableError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk, TierClient, TierCode
from kvtier_vllm.kv.metadata import ChunkCopy

log = logging.getLogger(__name__)


def readable_lmdb(client: TierClient, wanted: bool) -> str:
    """lmdb's path, where loads may be leased there: ``wanted`` (``lmdb_loads``), the tiers have
    lmdb, and it opens here (else why not is logged, and hits below the arena are promoted)."""
    path = client.lmdb_path
    if not wanted or path is None:
        return ""
    try:
        reader_at(path)
    except TierUnavailableError as exc:
        log.warning(
            "kvtier: %s; hits held there are promoted into the arena before they load (mount "
            "it here to load them straight from it)",
            exc,
        )
        return ""
    release_reader(path)  # the workers open their own
    return str(path)


class LmdbStaging:
    """The worker's reads of chunks leased in lmdb."""

    def __init__(self) -> None:
        self._reader: LmdbReader | None = None
        self._path = ""
        self.failed: list[FailedChunk] = []

    def read_ahead(self, path: str, jobs: list[ChunkCopy]) -> None:
        """A step's chunks read from disk at once, not one fault after another."""
        reader = self._open(path) if jobs else None
        if reader is not None:
            reader.read_ahead([ChunkKey(job.key) for job in jobs])

    def stage(self, path: str, job: ChunkCopy, nbytes: int) -> torch.Tensor | None:
        """The job's chunk, verified and decoded, as ``nbytes`` bytes of their own; None (a
        load error) where lmdb cannot be read here, no longer holds it, or it is corrupt."""
        reader = self._open(path)
        if reader is None:
            return None
        chunk = torch.empty(nbytes, dtype=torch.uint8)
        outcome = reader.read_into(ChunkKey(job.key), chunk.numpy().data)
        if outcome is True:
            return chunk
        if outcome is not False:  # never served; reported, so the tiers drop it
            log.error(
                "kvtier: chunk %s in lmdb failed verification (%s): recomputed, and reported",
                job.key.hex(),
                outcome,
            )
            self.failed.append(FailedChunk(ChunkKey(job.key), TierCode.LMDB, failure_of(outcome)))
        return None

    def take_failed(self) -> list[FailedChunk]:
        """The chunks found failing verification since the last call, to report."""
        failed, self.failed = self.failed, []
        return failed

    def close(self) -> None:
        """Give the reader back (the engine shuts down): the last user in this process closes
        lmdb's environment and its reader slots, so the process can open it again."""
        if self._reader is not None:
            release_reader(self._path)
        self._reader = None
        self._path = ""

    def _open(self, path: str) -> LmdbReader | None:
        """The reader of ``path``, opened once: a path that fails to open is not tried again."""
        if path != self._path:
            self.close()
            self._path = path
            try:
                self._reader = reader_at(Path(path)) if path else None
            except TierUnavailableError as exc:
                log.error("kvtier: %s; its loads are recomputed", exc)
        return self._reader
