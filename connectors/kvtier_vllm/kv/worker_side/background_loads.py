"""Asynchronous loads, issued off the engine's thread.

A request with a hit waits in vLLM while the running ones go on: its chunks are read (from arena
slots, or verified in lmdb's map) and copied into its blocks by one thread of the
worker's own, a step's loads after another's, and the worker reports the request finished once
they landed (`KVTierWorker.finished_loads`). The engine's thread never waits for one, except
before the arena is mapped again or the worker shuts down (`BackgroundLoads.drain`): no copy may
still read a mapping being closed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.client import ArenaMemory
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.shared.copies import Fence

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05
"""The longest a step that computes nothing waits for loads in flight (a chunk read from a cold
disk may take longer: it is reported at a later step)."""


@dataclass(slots=True)
class IssuedLoads:
    """Loads queued out of the arena or lmdb, checked once their fence passed."""

    fence: Fence
    arena: ArenaMemory | None
    """The mapping they were read from; a remapped arena fails them."""
    copies: list[tuple[ChunkCopy, float]]
    """Each load, with the seconds its copy took to issue."""
    failed: list[tuple[ChunkCopy, float]] = field(default_factory=list)
    """Loads that could not be issued (a chunk gone or corrupt, a slot reused), with the
    seconds spent on them."""
    zero_filled: int = 0
    """Draft chunks planned for other draft weights, whose pages were zeroed instead."""
    unverified: int = 0
    """Draft chunks loaded with no fingerprint of the draft weights taken in their step."""
    read_ahead_s: float = 0.0
    """Seconds spent reading lmdb's pages ahead for all its chunks from lmdb at once."""


@dataclass(slots=True)
class LoadBatch:
    """One step's asynchronous loads: the requests they are for, until every worker reported
    them finished (or failed)."""

    requests: set[str]
    failed: set[str] = field(default_factory=set)
    """Requests that failed whole."""
    block_errors: bool = False
    """Failed chunks are load errors of their blocks, not failures of their requests."""
    issued: IssuedLoads | None = None
    """Set once the batch was issued (on the loading thread)."""
    done: threading.Event = field(default_factory=threading.Event)


_Job = tuple[LoadBatch, Callable[[], IssuedLoads], Callable[[], Fence]]


class BackgroundLoads:
    """The worker's loading thread, started with the first batch: batches run in the order
    they were submitted; a batch whose issuing raised is issued as failed whole."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._submitted: list[LoadBatch] = []
        """Batches not yet issued, for `drain`."""
        self.idle = False
        """Nothing is computed in the engine's step (`KVTierMetadata.idle`)."""

    def submit(
        self, batch: LoadBatch, issue: Callable[[], IssuedLoads], fence: Callable[[], Fence]
    ) -> None:
        """Run ``issue`` for ``batch`` on the loading thread; ``batch.done`` is set after. Where
        it raises, the batch fails whole once what it issued landed (``fence``)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvtier-loads", daemon=True)
            self._thread.start()
        self._submitted = [b for b in self._submitted if not b.done.is_set()]
        self._submitted.append(batch)
        self._queue.put((batch, issue, fence))

    def drain(self) -> None:
        """Wait until every batch submitted was issued."""
        for batch in self._submitted:
            batch.done.wait()
        self._submitted = []

    @staticmethod
    def wait_landed(batches: list[LoadBatch], timeout_s: float | None = None) -> None:
        """Wait until each of ``batches`` was issued and its copies landed, or ``timeout_s``
        passed (None: however long it takes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for batch in batches:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not batch.done.wait(left):
                return
            if batch.issued is not None:
                batch.issued.fence.wait()

    def wait_if_idle(self, batches: list[LoadBatch]) -> None:
        """In a step that computes nothing, wait (up to ``IDLE_WAIT_S``) for ``batches`` to land
        before they are reported: nothing else runs, and the engine's thread, stepping idle,
        would otherwise hold the interpreter's lock against the loading thread at each of its
        copies (a lone request's arena hit took several times its copy time)."""
        if self.idle:
            self.wait_landed(batches, IDLE_WAIT_S)

    def close(self) -> None:
        """Drain, then end the thread."""
        self.drain()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batch, issue, fence = item
            try:
                batch.issued = issue()
            except Exception:  # a load never leaves its request waiting: it fails instead
                log.exception("kvtier: issuing asynchronous loads failed; they are recomputed")
                batch.failed |= batch.requests
                batch.issued = IssuedLoads(fence(), None, [])
            finally:
                batch.done.set()
