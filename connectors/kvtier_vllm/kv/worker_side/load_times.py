"""A request's load timed whole: its chunks from one tier are one load, whose fixed part is paid
once and whose part per chunk is paid by each. Timed one chunk at a time, every load would be one
chunk long, and kvtierd's fit of a load as fixed part plus part per chunk could not tell the two
parts apart."""

from __future__ import annotations

from kvtier.core.costs import CPU, LMDB, EngineTimings, Tally
from kvtier_vllm.kv.metadata import ChunkCopy


class RequestLoads:
    """The loads of one issued batch that landed, summed per request and tier (a batch's
    synchronous loads, which name no request, as one load per tier)."""

    def __init__(self, shared_s: dict[str, float] | None = None) -> None:
        self._loads: dict[tuple[str, str], Tally] = {}
        self._shared_s = shared_s or {}
        """Per tier, seconds the batch spent for all its loads of that tier at once (reading
        lmdb's pages ahead): shared among them."""

    def add(self, job: ChunkCopy, nbytes: int, seconds: float) -> None:
        """``job``'s chunk, of ``nbytes`` on this rank, landed after ``seconds`` of work."""
        tally = self._loads.setdefault((job.request, LMDB if job.key else CPU), Tally())
        tally.chunks += 1
        tally.nbytes += nbytes
        tally.seconds += seconds

    def report(self, timings: EngineTimings) -> None:
        """Each request's load per tier into ``timings``: one load of its chunks."""
        per_tier: dict[str, int] = {}
        for _, tier in self._loads:
            per_tier[tier] = per_tier.get(tier, 0) + 1
        for (_, tier), tally in self._loads.items():
            shared = self._shared_s.get(tier, 0.0) / per_tier[tier]
            timings.loaded(tier, tally.chunks, tally.nbytes, tally.seconds + shared)
        self._loads.clear()
