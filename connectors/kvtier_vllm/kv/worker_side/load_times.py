"""A request's load timed whole: its chunks from one tier are one load, whose fixed part is paid
once and whose part per chunk is paid by each. Timed one chunk at a time, every load would be one
chunk long, and kvtierd's fit of a load as fixed part plus part per chunk could not tell the two
parts apart.

A load lasts until its copies landed: on the CPU when its copy returned, on a device (and with
`DeferredCopies`) once the copy stream passed the batch's fence, which `LandingFence` notes the
first time the host sees it passed (a query, or a wait)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.core.costs import CPU, LMDB, EngineTimings, Tally
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.shared.copies import CpuCopies, Fence


class LandingFence(Fence):
    """The fence of a batch of loads, which notes when the host first saw it passed: the
    seconds from the end of queuing its copies to then belong to its loads."""

    __slots__ = ("_clock", "_fence", "_landed_at", "_queued_at")

    def __init__(self, copies: CpuCopies, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self._fence = copies.fence()
        self._clock = clock
        self._queued_at = clock()
        self._landed_at = self._queued_at if copies.immediate else None

    def __call__(self) -> bool:
        if self._landed_at is None:
            if not self._fence():
                return False
            self._landed_at = self._clock()
        return True

    def wait(self) -> None:
        if self._landed_at is None:
            self._fence.wait()
            self._landed_at = self._clock()

    def shares(self, nbytes: list[int]) -> list[float]:
        """The seconds until landing, split over loads of ``nbytes`` each by their bytes (evenly
        where none has any); nothing while not seen landed."""
        waited = 0.0 if self._landed_at is None else max(0.0, self._landed_at - self._queued_at)
        total = sum(nbytes)
        if not total:
            return [waited / len(nbytes) for _ in nbytes]
        return [waited * n / total for n in nbytes]


def until_landed(
    fence: Fence, loads: list[tuple[ChunkCopy, float]], nbytes: Callable[[ChunkCopy], int]
) -> list[tuple[ChunkCopy, float]]:
    """``loads``, each with the seconds it took to issue, timed until ``fence`` was seen passed:
    each with its share (`LandingFence.shares`) of the wait, by its ``nbytes``."""
    if not isinstance(fence, LandingFence):  # loads that issued no copy
        return loads
    shares = fence.shares([nbytes(job) for job, _ in loads])
    return [(job, seconds + share) for (job, seconds), share in zip(loads, shares, strict=True)]


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
