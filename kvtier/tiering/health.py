"""Which stored tiers kvtierd reads and writes now.

A stored tier (lmdb, the object store) whose chunks fail verification past
``manager.integrity_unhealthy_failures`` within ``manager.integrity_window_s``
(`kvtier.tiering.integrity.IntegrityReports.unhealthy`) is left alone while that lasts: lookups
miss its chunks, nothing is promoted from it or leased in it (so no engine reads lmdb's map),
and nothing is written back into it. Engines recompute those chunks and store them in the arena,
which keeps them as a cache of its own. The tier serves again by itself once the window holds
fewer failures than that.

The object store's chunks reach the arena through lmdb (downloaded into it, promoted from it), so
while lmdb is unhealthy they miss too. The arena is never left out: its failures are chunks
changed after their commit, each dropped as it is found, and nothing would serve in its place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.core.costs import LMDB, OBJECT

__all__ = ["TierHealth"]

log = logging.getLogger(__name__)

_STORED = frozenset((LMDB, OBJECT))


class TierHealth:
    def __init__(self, unhealthy: Callable[[], set[str]]) -> None:
        """``unhealthy``: the tiers whose failures within the window reach the threshold."""
        self._unhealthy = unhealthy
        self._lock = threading.Lock()
        self._shunned: frozenset[str] = frozenset()

    def shunned(self) -> frozenset[str]:
        """The stored tiers left alone now; each change is logged once, as it is seen."""
        now = frozenset(self._unhealthy() & _STORED)
        if now == self._shunned:
            return now
        with self._lock:
            before, self._shunned = self._shunned, now
        for tier in sorted(now - before):
            log.error(
                "%s is unhealthy (too many chunks failing verification): its chunks are "
                "neither read nor written until the window holds fewer failures",
                tier,
            )
        for tier in sorted(before - now):
            log.warning("%s is healthy again: its chunks are read and written again", tier)
        return now

    def serves(self, tier: str) -> bool:
        """Whether ``tier``'s chunks are found, promoted, leased and written now."""
        shunned = self.shunned()
        return tier not in shunned and not (tier == OBJECT and LMDB in shunned)
