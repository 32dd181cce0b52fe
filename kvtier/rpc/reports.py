"""What a client tells kvtierd besides its calls: hits its arena view answered without a call
and leases to end with them (sent in a hit report), and whether its engine is busy, what the
engine measured and chunks found failing verification (sent with the next heartbeat)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.api.v1 import tier_pb2
from kvtier.core.codec import heartbeat_to
from kvtier.core.costs import EngineTimings
from kvtier.core.errors import KVTierError, SessionNotFoundError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk, SlotRef
from kvtier.rpc.calls import Pending

MAX_REPORT = 4096  # keys per report, under the daemon's batch limit
_LOOKUP_SERVED = tier_pb2.LookupRequest.SERVED_FIELD_NUMBER

SendHits = Callable[[Sequence[ChunkKey], Sequence[SlotRef], tuple[int, ...]], Pending[Any]]
"""Sends a hit report without waiting: its keys, the leases it ends and its lookup flags."""


class Reports:
    """What the next hit report and the next heartbeat carry; ``send_hits`` sends a report."""

    def __init__(self, send_hits: SendHits) -> None:
        self._send_hits = send_hits
        self._reporting = threading.Lock()
        """Guards what hit reports carry: the heartbeat thread sends one an idle engine left."""
        self._hits: dict[tuple[int, ...], list[ChunkKey]] = {}
        """Keys the index answered since the last `send_hits`, by how their lookups were
        counted (their flags: asked again, counted as loads only; sampled for verification,
        counted as verified)."""
        self._due: list[SlotRef] = []
        """Leases to end with the next report."""
        self._report: Pending[Any] | None = None
        self._reported: list[SlotRef] = []
        """The leases the report in flight ends."""
        self._next_report = 0.0
        self._busy = False
        self._heartbeat_lock = threading.Lock()
        self._timings = EngineTimings()
        self._failed: list[FailedChunk] = []

    def answered(
        self, flags: tuple[int, ...], keys: Sequence[ChunkKey], ending: Sequence[SlotRef] = ()
    ) -> None:
        """``keys`` were answered from the arena's index: they go with the next report, and
        so do the leases ``ending``."""
        with self._reporting:
            self._due += ending
            self._hits.setdefault(flags, []).extend(keys)

    def take_due(self) -> list[SlotRef]:
        """The leases to end, for a call that ends them now instead of the next report."""
        with self._reporting:
            due, self._due = self._due, []
            return due

    def due_again(self, leases: Sequence[SlotRef]) -> None:
        """``leases`` taken by `take_due` were not ended: they end with the next report."""
        with self._reporting:
            self._due = [*leases, *self._due]

    def send_hits(self, every_s: float = 0.0) -> None:
        """Send the hits answered since the last report, at most every ``every_s``, without
        waiting: kvtierd counts them, and leasing them and ending the leases at once refreshes
        their recency. Leases due end with it. Raises what the previous report met."""
        with self._reporting:
            self._send_held(every_s)

    def _send_held(self, every_s: float) -> None:
        now = time.monotonic()
        if now < self._next_report or (self._report is not None and not self._report.done()):
            return
        if self._report is not None:
            report, self._report = self._report, None
            try:
                report.result()
            except SessionNotFoundError:  # the next call opens a new one; its leases are gone
                pass
            except KVTierError:
                self._due = self._reported + self._due  # they end with the next report
                raise
        # one kind per report, first asked first: the others go with the next
        counting = next((kind for kind, held in self._hits.items() if held), ())
        held = self._hits.pop(counting, [])
        keys = held[:MAX_REPORT]
        if held[MAX_REPORT:]:
            self._hits[counting] = held[MAX_REPORT:]
        release, self._due = self._due, []
        if not keys and not release:
            return
        self._next_report = now + every_s
        try:
            self._report = self._send_hits(keys, release, (_LOOKUP_SERVED, *counting))
        except KVTierError:
            self._due = release + self._due
            raise
        self._reported = release

    def set_busy(self, busy: bool) -> None:
        self._busy = busy

    def add_timings(self, timings: EngineTimings) -> None:
        with self._heartbeat_lock:
            self._timings.merge(timings)

    def add_failed(self, chunks: Sequence[FailedChunk]) -> None:
        with self._heartbeat_lock:
            room = MAX_REPORT - len(self._failed)  # bounded while kvtierd is away
            self._failed.extend(chunks[: max(0, room)])

    def heartbeat(self, session_id: str) -> tier_pb2.HeartbeatRequest:
        """The next heartbeat, carrying what was added since the last one."""
        with self._heartbeat_lock:
            timings, self._timings = self._timings, EngineTimings()
            failed, self._failed = self._failed, []
        return heartbeat_to(session_id, self._busy, timings, failed)
