"""The loads a new one would queue behind: asynchronous loads granted and not yet reported.

Every worker issues its asynchronous loads on one thread, a step's batch after another's
(`kvtier_vllm.kv.worker_side.background_loads`), so a load granted now starts once those ahead
of it are done. Under load that wait can be several times the load's own time (four users'
hits read from a throttled disk at once), and a hit worth loading alone is then slower than
recomputing it: the load decision counts the wait against loading (`LoadDecisions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class LoadBacklog:
    """Asynchronous loads out, each with its expected seconds and when it was granted: the
    worker's thread is taken to work through them one after another from the oldest's grant."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._out: dict[str, tuple[float, float]] = {}
        """Per request: when its load was granted, and its expected seconds."""

    def granted(self, req_id: str, expected_s: float | None) -> None:
        """``req_id``'s asynchronous load goes out; ``expected_s`` None where no cost is
        measured (it counts as nothing ahead)."""
        self._out[req_id] = (self._clock(), expected_s or 0.0)

    def landed(self, req_ids: Iterable[str]) -> None:
        """The workers reported these loads done or failed (or their requests ended)."""
        for req_id in req_ids:
            self._out.pop(req_id, None)

    def seconds_ahead(self) -> float:
        """The expected seconds of the loads out, less the time since the oldest of them was
        granted (the thread has been working on them since): what a load granted now waits."""
        if not self._out:
            return 0.0
        oldest = min(granted for granted, _ in self._out.values())
        total = sum(seconds for _, seconds in self._out.values())
        return max(0.0, total - (self._clock() - oldest))

    def __len__(self) -> int:
        return len(self._out)
