"""Chunks that engines found failing verification, and each tier's integrity over a window.

Engines read chunks from lmdb's map themselves, so kvtierd hears of a corrupt one only when the
engine reports it (`kvtier.core.protocol.TierClient.report_failed`). A report is a claim, not a
verdict: the chunk is verified here again, and dropped (deleted, counted as the tier's integrity
failure, gone from its index) only when it fails. A report of a sound chunk, or of one no longer
held, changes nothing and is counted by what became of it. Reports are checked on a thread of
their own, from a bounded queue: a heartbeat or an engine's step that brings them never waits on
the disk.

A tier whose chunks fail verification often (kvtierd's own checks and confirmed reports alike)
is unhealthy while ``manager.integrity_unhealthy_failures`` of them fall within
``manager.integrity_window_s``: a disk that corrupts many chunks shows in health and on the
dashboard, not only as slower requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence

from kvtier.core.config import ManagerConfig
from kvtier.core.counters import Counters
from kvtier.core.priority import enter_background
from kvtier.core.protocol import FailedChunk, TierCode
from kvtier.tiers.base import Tier
from kvtier.tiers.lmdb_tier import LmdbTier

__all__ = ["RESULTS", "IntegrityReports"]

log = logging.getLogger(__name__)

RESULTS = ("confirmed", "refused", "gone", "foreign", "unchecked")
"""What became of a report: the chunk failed verification here too and was dropped; it is
sound (nothing dropped); it is no longer held; the reporting client may not speak for it; it
found the queue of reports to check full (nothing dropped)."""

MAX_PENDING = 4096
"""Reports waiting to be checked, at most: each check reads a chunk from disk."""
_MIN_SAMPLE_S = 1.0  # health is read at most this often per tier's counts


class IntegrityReports:
    """Engines' reports of chunks failing verification, checked and acted on; per-tier health."""

    def __init__(
        self,
        tiers: Mapping[str, Tier],
        lmdb: LmdbTier | None,
        config: ManagerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tiers = dict(tiers)
        self._lmdb = lmdb
        self._window_s = config.integrity_window_s
        self._threshold = config.integrity_unhealthy_failures
        self._clock = clock
        self.counters = Counters()
        """``<tier>:<result>`` per report (`RESULTS`)."""
        self._samples: deque[tuple[float, Counter[str]]] = deque()
        """(time, failures so far per tier), oldest first, reaching back one window."""
        self._lock = threading.Lock()
        self._pending: deque[tuple[FailedChunk, str]] = deque()
        self._wake = threading.Condition()
        self._checker: threading.Thread | None = None
        self._closed = False

    def submit(self, chunks: Sequence[FailedChunk], source: str) -> None:
        """Queue reports to be checked (`reported`) on a thread of their own: the call that
        brought them (a heartbeat, an engine's step) never waits on the disk."""
        with self._wake:
            if self._closed:
                return
            room = max(0, MAX_PENDING - len(self._pending))
            self._pending.extend((chunk, source) for chunk in chunks[:room])
            for chunk in chunks[room:]:
                self.counters.add(f"{chunk.tier.tier}:unchecked")
            if self._checker is None:
                self._checker = threading.Thread(
                    target=self._check_pending, name="kvtier-integrity", daemon=True
                )
                self._checker.start()
            self._wake.notify()

    def _check_pending(self) -> None:
        enter_background()
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                chunk, source = self._pending.popleft()
            try:
                self.reported([chunk], source)
            except Exception:  # a tier closing, a disk failing: the next report may fare better
                log.exception("checking a report of chunk %s failed", chunk.key.hex())

    def close(self) -> None:
        """Stop checking (before the tiers close); reports still queued are let go."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            checker = self._checker
        if checker is not None:
            checker.join()

    def reported(self, chunks: Sequence[FailedChunk], source: str) -> Counter[str]:
        """Check each reported chunk where it is stored and drop it there if it fails, now;
        returns how many reports came to each result."""
        results: Counter[str] = Counter()
        for chunk in chunks:
            result = self._check(chunk)
            results[result] += 1
            self.counters.add(f"{chunk.tier.tier}:{result}")
            if result == "refused" and chunk.tier is not TierCode.CPU:  # a reused slot: no news
                log.warning(
                    "%s reported %s chunk %s as failing verification (%s); it verifies: kept",
                    source,
                    chunk.tier.tier,
                    chunk.key.hex(),
                    chunk.what.name.lower(),
                )
        return results

    def refused(self, chunks: Sequence[FailedChunk], source: str) -> None:
        """Reports of chunks the client may not speak for: counted, nothing checked."""
        for chunk in chunks:
            self.counters.add(f"{chunk.tier.tier}:foreign")
        if chunks:
            log.warning("%s reported %d chunks of pools it has not registered", source, len(chunks))

    def _check(self, chunk: FailedChunk) -> str:
        if chunk.tier is TierCode.CPU:
            # a slot whose generation moved under a read was reused: no fault of any chunk, so
            # nothing is dropped; the report says whether the arena still holds the chunk
            return "refused" if self._tiers["cpu"].contains([chunk.key])[0] else "gone"
        if chunk.tier is not TierCode.LMDB or self._lmdb is None:
            return "refused"  # engines read no other tier themselves
        found = self._lmdb.verify_chunk(chunk.key)  # a failing chunk is quarantined there
        return "gone" if found is None else "refused" if found else "confirmed"

    def report_counts(self) -> dict[tuple[str, str], int]:
        """Reports by (tier, result), every tier and result present (zero before the first)."""
        counted = self.counters.snapshot()
        return {
            (tier, result): counted[f"{tier}:{result}"]
            for tier in self._tiers
            for result in RESULTS
        }

    def unhealthy(self) -> set[str]:
        """Tiers with at least ``integrity_unhealthy_failures`` failures within the window."""
        now = self._clock()
        with self._lock:
            if not self._samples or now - self._samples[-1][0] >= _MIN_SAMPLE_S:
                counts = Counter({name: t.corrupt_chunks() for name, t in self._tiers.items()})
                self._samples.append((now, counts))
            # keep one sample at or before the window's start: the count it began with
            while len(self._samples) > 1 and self._samples[1][0] <= now - self._window_s:
                self._samples.popleft()
            first, last = self._samples[0][1], self._samples[-1][1]
        return {name for name in self._tiers if last[name] - first[name] >= self._threshold}
